"""The shipped units under a real systemd (a private PID 1, tests/systemd_harness.py): the hardened daemon starts,
says READY=1, serves /metrics, reads the live kernel log, is restarted by its watchdog when stalled and reloads on
`systemctl reload`; the boot preflight keeps a stand-in slurmd from starting on a faulty node and lets it start on a
healthy one; the hardened sweep runs its collectives through a real slurmctld (srun) and over hosts (mpirun) and
writes its verdicts. `systemd-analyze security --offline=true` rates the sweep's unit at most 2.5, as the daemon's,
every item still exposed justified in a comment of the unit.

Only ExecStart is changed (through drop-ins), to this checkout's program and a recorded node, and the environment
the test's stand-ins read; every other line, the hardening included, is the unit as shipped."""
import contextlib
import json
import shutil
import socket
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import systemd_harness
from conftest import ROOT, host_etc_gpuwarden
from gpuwarden.agent.core.scheduler import REASON_PREFIX
from slurm_cluster import SlurmCluster
from test_sweep_launch import RSH_AGENT
from test_systemd import _comment_text, _exposure_items, _needle, _units_with_program, needs_analyze

PROGRAM = Path(sys.executable).parent / "gpuwarden"
NODES = ROOT / "fixtures" / "nodes"
DAEMON = "gpuwarden.service"
PREFLIGHT = "gpuwarden-preflight.service"
SWEEP = "gpuwarden-sweep.service"
STAND_IN = "slurmd.service"  # the scheduler's node daemon, as the preflight's [Install] names it
STANDIN_ALL_REDUCE = ROOT / "tests" / "standin_all_reduce_perf.py"
MAX_SWEEP_EXPOSURE = 2.5  # the daemon's unit rates 2.5


def _interpreter_visible() -> str:
    """Drop-in lines that let the sandbox see this checkout's Python and the checkout itself, when they live under
    a home folder (pyenv in /root, a CI checkout in /home): ProtectHome= hides them there, where the package's
    /usr/bin/python3 and /opt/venvs would be seen. Home stays hidden (tmpfs); only these folders are bound in,
    read-only."""
    homes = ("/root", "/home", "/run/user")
    ours = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), ROOT.resolve()}
    in_home = sorted(p for p in ours if any(p.is_relative_to(h) for h in homes))
    # PrivateTmp= gives the unit a /tmp of its own: a checkout under /tmp (a CI clone) is bound in too.
    in_tmp = sorted(p for p in ours if p.is_relative_to("/tmp") or p.is_relative_to("/var/tmp"))
    lines = "ProtectHome=tmpfs\n" if in_home else ""
    return lines + "".join(f"BindReadOnlyPaths={p}\n" for p in [*in_home, *in_tmp])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def manager():
    if systemd_harness.missing() is not None:
        pytest.skip(str(systemd_harness.missing()))
    if not PROGRAM.exists():
        pytest.skip(f"{PROGRAM} not installed (pip install -e . in this interpreter's environment)")
    # A checkout or virtual environment under /tmp (a CI clone) stays visible: the namespace's /tmp is a tmpfs.
    keep = (ROOT, sys.prefix, sys.base_prefix)
    # The unit's ConfigurationDirectory= makes /etc/gpuwarden on the host's /etc, which the namespace shares: removed
    # again at the end when this module made it (and it stayed empty), and never while the package's test has it.
    etc = Path("/etc/gpuwarden")
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(host_etc_gpuwarden())
        made_etc = not etc.exists()
        if made_etc:
            cleanup.callback(lambda: etc.is_dir() and not any(etc.iterdir()) and etc.rmdir())
        m = cleanup.enter_context(systemd_harness.PrivateSystemd(keep=keep))
        for name in ("gpuwarden.slice", DAEMON, PREFLIGHT, SWEEP):
            m.install_unit(ROOT / "systemd" / name, reload=False)
        m.install_unit("[Unit]\nDescription=stand-in for the scheduler's node daemon\n\n"
                       "[Service]\nExecStart=/bin/sleep infinity\n", name=STAND_IN, reload=False, stand_in=True)
        m.daemon_reload()
        # What the package's postinst does: enable the preflight, so that slurmd requires it (here in /run).
        m.systemctl("enable", "--runtime", PREFLIGHT)
        yield m


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _sample(text: str, series: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def _forget_output(m, unit: str) -> None:
    log = m.root_path(f"{systemd_harness.LOG_DIR}/{unit}.log")
    if log.exists():
        log.unlink()


def _run_daemon(m, *args: str, extra: str = "") -> tuple[dict, int]:
    """(re)start the daemon with ExecStart swapped to this checkout's program and `args`; wait for READY=1."""
    port = _free_port()
    argv = [str(PROGRAM), "run", "--state-dir", "/var/lib/gpuwarden", "--listen", f"127.0.0.1:{port}", *args]
    m.drop_in(DAEMON, f"[Service]\nExecStart=\nExecStart={' '.join(argv)}\n{_interpreter_visible()}{extra}")
    m.systemctl("stop", DAEMON)
    m.systemctl("reset-failed", DAEMON, check=False)
    _forget_output(m, DAEMON)
    m.systemctl("start", DAEMON)  # Type=notify: returns once READY=1 came (or fails)
    return m.wait_active(DAEMON, timeout=60), port


def _wait_metric(m, port: int, predicate, what: str, timeout: float = 30.0) -> str:
    box = {}

    def scraped(_state):
        box["text"] = _metrics(port)
        return predicate(box["text"])
    try:
        m.wait_for(DAEMON, scraped, timeout=timeout, props=("ActiveState",))
    except TimeoutError as exc:
        raise AssertionError(f"{what} never seen on /metrics:\n{box.get('text', '')[-3000:]}") from exc
    return box["text"]


def test_hardened_daemon_reports_ready_and_serves_metrics(manager):
    state, port = _run_daemon(manager, "--root", str(NODES / "h100-hgx-healthy"))
    props = manager.show(DAEMON, "Type", "NotifyAccess", "Slice", "StatusText", "WatchdogUSec", "MainPID")
    assert props["Type"] == "notify" and props["NotifyAccess"] == "main"
    assert props["Slice"] == "gpuwarden.slice"
    assert props["StatusText"].startswith(("watching", "node "))  # the agent's own STATUS= reached systemd
    text = _wait_metric(manager, port, lambda t: _sample(t, 'gpuwarden_node_state{state="healthy"}') == 1.0,
                        "a healthy node state")
    assert _sample(text, 'gpuwarden_check_status{check="store",status="ok"}') == 1.0
    # StateDirectory= made the state folder (in the namespace's /var/lib), private to root, and the agent uses it.
    state_dir = manager.root_path("/var/lib/gpuwarden")
    assert (state_dir / "state.db").is_file()
    assert state_dir.stat().st_mode & 0o777 == 0o700
    # The sandbox is the one the unit asks for: no new privileges, only CAP_SYSLOG and CAP_SYS_ADMIN to bound.
    status = manager.nsenter("cat", f"/proc/{props['MainPID']}/status").stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["NoNewPrivs"].strip() == "1"
    assert int(fields["CapBnd"], 16) == (1 << 34) | (1 << 21)  # CAP_SYSLOG (34), CAP_SYS_ADMIN (21)
    cgroup = manager.nsenter("cat", f"/proc/{props['MainPID']}/cgroup").stdout
    assert "/gpuwarden.slice/gpuwarden.service" in cgroup
    limits = manager.show("gpuwarden.slice", "MemoryHigh", "MemoryMax", "TasksMax", "CPUWeight", "ActiveState")
    assert limits == {"MemoryHigh": str(256 << 20), "MemoryMax": str(512 << 20), "TasksMax": "128",
                      "CPUWeight": "20", "ActiveState": "active"}


def test_textfile_drop_in_as_documented(manager):
    """docs/daemon.md's drop-in for --textfile: the folder made writable, the file readable by node_exporter."""
    folder = "/run/gpuwarden-test/node-exporter"
    manager.root_path(folder).mkdir(parents=True, exist_ok=True)
    _run_daemon(manager, "--root", str(NODES / "h100-hgx-healthy"), "--textfile", f"{folder}/gpuwarden.prom",
                extra=f"ReadWritePaths={folder}\nUMask=0022\n")
    prom = manager.root_path(f"{folder}/gpuwarden.prom")
    manager.systemctl("reload", DAEMON)  # any signal wakes the main loop, which writes the file (else every 15 s)
    manager.wait_for(DAEMON, lambda _s: prom.exists(), timeout=60, props=("ActiveState",))
    assert prom.stat().st_mode & 0o777 == 0o644
    assert "gpuwarden_node_state{" in prom.read_text()


def test_reload_reaches_the_agent(manager):
    _run_daemon(manager, "--root", str(NODES / "h100-hgx-healthy"))
    manager.systemctl("reload", DAEMON)
    manager.wait_for(DAEMON, lambda _s: "config reloaded" in manager.output(DAEMON), timeout=30)
    assert manager.show(DAEMON, "ActiveState")["ActiveState"] == "active"


def test_watchdog_restarts_a_stalled_agent(manager):
    state, _port = _run_daemon(manager, "--root", str(NODES / "h100-hgx-healthy"),
                               extra="WatchdogSec=2\nRestartSec=100ms\n")
    first_pid, restarts = state["MainPID"], int(state["NRestarts"])
    manager.systemctl("kill", "--kill-who=main", "--signal=SIGSTOP", DAEMON)
    after = manager.wait_for(DAEMON, lambda s: int(s["NRestarts"]) > restarts and s["ActiveState"] == "active"
                             and s["MainPID"] not in ("0", first_pid), timeout=90)
    assert int(after["NRestarts"]) == restarts + 1
    _run_daemon(manager, "--root", str(NODES / "h100-hgx-healthy"))  # the shipped WatchdogSec again


def test_live_kernel_log_is_read_under_the_hardening(manager):
    """No --root: the real /dev/kmsg (kernel.dmesg_restrict=1 here: CAP_SYSLOG and DeviceAllow= let it through),
    the real /sys and udev netlink; no GPU on a test machine, so NVML is UNKNOWN, and the daemon stays up."""
    _state, port = _run_daemon(manager)
    text = _wait_metric(manager, port, lambda t: (_sample(t, "gpuwarden_kmsg_records_total") or 0) > 0
                        and _sample(t, 'gpuwarden_check_status{check="thermal",status="unknown"}') == 1.0,
                        "kernel-log records and NVML's UNKNOWN")
    assert _sample(text, 'gpuwarden_check_status{check="kmsg",status="ok"}') == 1.0
    assert _sample(text, 'gpuwarden_check_success{check="thermal"}') == 0.0
    output = manager.output(DAEMON)
    assert '"event": "running"' in output  # the agent's info lines are here ...
    assert "no device events" not in output  # ... and this one is not: the udev monitor (AF_NETLINK) was allowed
    assert "Traceback" not in output
    assert manager.show(DAEMON, "ActiveState", "NRestarts")["ActiveState"] == "active"


def _shipped_exec_start(unit: str) -> str:
    """The unit's ExecStart= as shipped (continuation lines joined)."""
    text = (ROOT / "systemd" / unit).read_text().replace("\\\n", "")
    return next(line for line in text.splitlines() if line.startswith("ExecStart="))


def _preflight_on(m, node: Path) -> None:
    """The shipped preflight, its program this checkout's, run on a recorded node; retried 0.1 s apart."""
    shipped = _shipped_exec_start(PREFLIGHT)
    assert "/usr/bin/gpuwarden preflight " in shipped
    exec_start = shipped.replace("/usr/bin/gpuwarden preflight ", f"{PROGRAM} preflight --root {node} ")
    m.systemctl("stop", STAND_IN, check=False)
    # Back to "not run this boot" whatever the last test left: the shipped unit refuses a stop, lifted for this.
    m.drop_in(PREFLIGHT, "[Unit]\nRefuseManualStop=no\n", name="40-test-reset.conf")
    m.systemctl("stop", PREFLIGHT, check=False)
    m.root_path(f"/run/systemd/system/{PREFLIGHT}.d/40-test-reset.conf").unlink()
    m.drop_in(PREFLIGHT, f"[Service]\nExecStart=\n{exec_start}\nEnvironment=GPUWARDEN_PREFLIGHT_RETRY_S=0.1\n"
                         f"{_interpreter_visible()}")
    m.systemctl("reset-failed", PREFLIGHT, STAND_IN, check=False)
    assert m.show(PREFLIGHT, "ActiveState")["ActiveState"] == "inactive"
    _forget_output(m, PREFLIGHT)


def test_a_faulty_node_keeps_slurmd_from_starting(manager):
    _preflight_on(manager, NODES / "gb200-nvl72-faulty")
    start = manager.systemctl("start", STAND_IN, check=False)
    assert start.returncode != 0
    assert "dependency" in start.stderr.lower()
    pre = manager.show(PREFLIGHT, "ActiveState", "Result", "ExecMainStatus")
    assert (pre["ActiveState"], pre["Result"], pre["ExecMainStatus"]) == ("failed", "exit-code", "1")
    output = manager.output(PREFLIGHT)
    assert output.count("verdict: FAULT") == 1 and "asking again" not in output  # a FAULT is not asked again
    slurmd = manager.show(STAND_IN, "ActiveState", "ExecMainPID")
    assert slurmd == {"ActiveState": "inactive", "ExecMainPID": "0"}  # never ran


def test_an_undecided_node_is_asked_again_then_kept_out(manager):
    """Exit 2 (a check could not look): asked again while slurmd waits; still undecided at the last try, the
    preflight fails and slurmd never starts."""
    node = manager.root_path("/run/gpuwarden-test/undecided")
    shutil.copytree(NODES / "h100-hgx-healthy", node)
    (node / "nvml.json").unlink()  # NVML cannot be read: UNKNOWN, exit 2
    _preflight_on(manager, Path("/run/gpuwarden-test/undecided"))
    start = manager.systemctl("start", STAND_IN, check=False)
    assert start.returncode != 0
    pre = manager.show(PREFLIGHT, "ActiveState", "ExecMainStatus", "Result")
    assert (pre["ActiveState"], pre["Result"], pre["ExecMainStatus"]) == ("failed", "exit-code", "2")
    output = manager.output(PREFLIGHT)
    assert output.count("verdict: UNDECIDED") == 4  # GPUWARDEN_PREFLIGHT_TRIES
    assert "undecided (try 3 of 4): asking again" in output
    assert manager.show(STAND_IN, "ExecMainPID")["ExecMainPID"] == "0"


def test_a_healthy_node_lets_slurmd_start(manager):
    _preflight_on(manager, NODES / "h100-hgx-healthy")
    manager.systemctl("start", STAND_IN)
    assert manager.wait_active(STAND_IN)["ActiveState"] == "active"
    pre = manager.show(PREFLIGHT, "ActiveState", "SubState", "ExecMainStatus")
    assert pre == {"ActiveState": "active", "SubState": "exited", "ExecMainStatus": "0"}  # RemainAfterExit
    order = manager.show(STAND_IN, "After", "Requires")
    assert PREFLIGHT in order["After"].split() and PREFLIGHT in order["Requires"].split()


def test_the_hardened_agent_drains_its_node_on_a_real_slurmctld(manager):
    """The scheduler under the sandbox: munge's socket (AF_UNIX), slurmctld over TCP, scontrol run by the agent.
    The faulty recorded node is cordoned: slurmctld drains n1 with the agent's reason. The cluster lives in
    /dev/shm, which the unit sees (the namespace hides the host's /tmp, the unit has a private one)."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-slurm-", dir="/dev/shm"))
    cluster = SlurmCluster(base, live=("n1",), dead=())
    try:
        cluster.start()
        config = manager.write("/run/gpuwarden-test/slurm.toml", f"""
[remediation]
mode = "act"
adapter = "slurm"
node_name = "n1"
retry_min_s = 0.2
retry_max_s = 1.0
[remediation.slurm]
slurm_conf = "{cluster.conf}"
[remediation.breaker]
cluster_share = 1.0
domain_share = 1.0
[remediation.spares]
swap = false
[remediation.ladder]
reset_gpu = false
reboot = false
reboot_command = ["true"]
step_after_s = 3600.0
[topology]
domain = "rackA"
""")
        _run_daemon(manager, "--root", str(NODES / "gb200-nvl72-faulty"), "--config",
                    "/run/gpuwarden-test/slurm.toml")
        assert config.exists()

        def drained(_state):
            node = cluster.scontrol("show", "node", "n1").stdout
            return "DRAIN" in node and f"Reason={REASON_PREFIX}" in node
        try:
            manager.wait_for(DAEMON, drained, timeout=60, props=("ActiveState",))
        except TimeoutError as exc:
            raise AssertionError(f"n1 not drained:\n{manager.output(DAEMON)[-3000:]}") from exc
        node = cluster.scontrol("show", "node", "n1").stdout
        reason = node.split("Reason=", 1)[1].splitlines()[0]
        assert reason.startswith(REASON_PREFIX) and "[root@" in reason  # the agent's reason, set as root
        assert "Traceback" not in manager.output(DAEMON)
    finally:
        manager.systemctl("stop", DAEMON, check=False)
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_stopping_the_preflight_never_stops_slurmd(manager):
    """What a package upgrade or removal does to its units (stop, restart) must not reach the node daemon through
    Requires=: the preflight refuses a manual stop."""
    _preflight_on(manager, NODES / "h100-hgx-healthy")
    manager.systemctl("start", STAND_IN)
    pid = manager.wait_active(STAND_IN)["MainPID"]
    for verb in ("stop", "restart", "try-restart"):
        refused = manager.systemctl(verb, PREFLIGHT, check=False)
        assert refused.returncode != 0 and "refused" in refused.stderr.lower(), (verb, refused.stderr)
    slurmd = manager.show(STAND_IN, "ActiveState", "MainPID")
    assert slurmd == {"ActiveState": "active", "MainPID": pid}
    assert manager.show(PREFLIGHT, "ActiveState")["ActiveState"] == "active"


# ------------------------------------------------------------------------------------ the sweep's unit


@needs_analyze
def test_sweep_exposure_is_at_most_the_daemons_and_each_remaining_item_is_justified(tmp_path):
    _units_with_program(tmp_path)
    overall, exposed = _exposure_items(str(tmp_path / SWEEP), tmp_path)
    assert overall is not None and overall <= MAX_SWEEP_EXPOSURE, (overall, exposed)
    comments = _comment_text(SWEEP)  # its own comments: the sweep's needs are not the daemon's
    unexplained = [item for item in exposed if _needle(item) not in comments]
    assert not unexplained, f"exposures without a comment saying why: {unexplained}"
    assert "User=" in [_needle(i) for i in exposed]  # the review ran and saw the unit (root is the one known)


def _run_sweep(m, args: str, environment: dict[str, str]) -> dict[str, str]:
    """The shipped sweep unit, its program this checkout's, started (Type=oneshot: returns when the sweep ended)."""
    shipped = _shipped_exec_start(SWEEP)
    assert shipped == "ExecStart=/usr/bin/gpuwarden sweep"
    env = "".join(f'Environment="{k}={v}"\n' for k, v in environment.items())
    m.drop_in(SWEEP, f"[Service]\nExecStart=\nExecStart={PROGRAM} sweep {args}\n{env}{_interpreter_visible()}")
    m.systemctl("reset-failed", SWEEP, check=False)
    _forget_output(m, SWEEP)
    m.systemctl("start", SWEEP, check=False, timeout=300)
    return m.show(SWEEP, "ActiveState", "Result", "ExecMainStatus")


def _sweep_config(m, folder: str, command: list[str], extra: str = "") -> str:
    shutil.rmtree(m.root_path(f"{folder}/results"), ignore_errors=True)  # only this run's report is read
    path = f"{folder}/gpuwarden.toml"
    m.write(path, f"""{extra}
[sweep]
command = {json.dumps(command)}
ranks_per_node = 1
group_nodes = 2
timeout_s = 60.0
start_timeout_s = 10.0
results_dir = "{folder}/results"
[sweep.baselines]
"any/2" = {{ latency_p95_us = 65.0, busbw_gbps = 460.0 }}
""")
    return path


def _sweep_passed(m, folder: str, nodes: list[str], launcher: str) -> None:
    """The sweep's report and verdicts, as it wrote them under the sandbox: every node tested and passed."""
    output = m.output(SWEEP)
    assert "Traceback" not in output, output[-3000:]
    results = m.root_path(f"{folder}/results")
    (report_path,) = (results / "reports").glob("*.json")
    report = json.loads(report_path.read_text())
    assert report["launcher"] == launcher and sorted(report["passed"]) == nodes, report
    assert sorted(n for t in report["tests"] for n in t["nodes"]) == nodes
    for node in nodes:
        verdict = json.loads((results / "nodes" / f"{node}.json").read_text())
        assert verdict["findings"] == []
    assert (results / "nodes" / f"{nodes[0]}.json").stat().st_mode & 0o777 == 0o644  # UMask=0022: nodes read it


def test_the_hardened_sweep_runs_its_collectives_through_a_real_slurmctld(manager):
    """srun under the sandbox: munge's socket (AF_UNIX), slurmctld and the tasks' I/O over TCP, its open-file limit
    raised (@resources). Each group is a job of the real cluster; the stand-in collective runs on its slurmd "nodes"
    (outside the unit, as on real nodes). The cluster lives in /dev/shm, which the unit sees."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-sweep-slurm-", dir="/dev/shm"))
    cluster = SlurmCluster(base, live=("n1", "n2"), dead=())
    folder = "/run/gpuwarden-test/sweep-srun"
    try:
        cluster.start()
        command = [sys.executable, str(STANDIN_ALL_REDUCE), "-b", "8", "-e", "2G", "-f", "2", "-g", "1", "-N", "5"]
        config = _sweep_config(manager, folder, command, f"""
[remediation]
adapter = "slurm"
[remediation.slurm]
slurm_conf = "{cluster.conf}"
""")
        state = _run_sweep(manager, f"--config {config} --json", {
            "SLURM_CONF": str(cluster.conf), "GW_SWEEP_STANDIN_LOG": str(base / "standin.log"),
            "GW_STANDIN_DIR": str(base / "rendezvous")})
        assert (state["Result"], state["ExecMainStatus"]) == ("success", "0"), (state, manager.output(SWEEP)[-3000:],
                                                                                 cluster.logs()[-3000:])
        _sweep_passed(manager, folder, ["n1", "n2"], "slurm")
        started = [json.loads(line) for line in (base / "standin.log").read_text().splitlines()]
        assert [sorted(e["nodes"]) for e in started if e["event"] == "start"] == [["n1", "n2"]]
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_the_hardened_sweep_runs_mpirun_over_its_hosts(manager):
    """mpirun under the sandbox (no scheduler): Open MPI's interface discovery (AF_NETLINK, /proc/net), hwloc, its
    daemons' TCP. Every "host" is this machine, named by an rsh agent in place of ssh, so the daemons and the ranks run
    here, inside the unit's sandbox too."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not installed (Debian package: openmpi-bin)", pytrace=False)
    folder = "/run/gpuwarden-test/sweep-mpirun"
    agent = manager.write(f"{folder}/rsh-agent", RSH_AGENT)
    agent.chmod(0o755)
    command = [sys.executable, str(STANDIN_ALL_REDUCE), "-b", "8", "-e", "2G", "-f", "2", "-g", "1", "-N", "5"]
    config = _sweep_config(manager, folder, command)
    state = _run_sweep(manager, f"--config {config} --hosts ha,hb --json", {
        "OMPI_MCA_plm_rsh_agent": f"{folder}/rsh-agent", "OMPI_MCA_rtc_hwloc_vmhole": "none",
        "GW_RSH_TMP": f"{folder}/hosts", "GW_SWEEP_STANDIN_LOG": f"{folder}/standin.log",
        "GW_STANDIN_DIR": f"{folder}/rendezvous"})
    assert (state["Result"], state["ExecMainStatus"]) == ("success", "0"), (state, manager.output(SWEEP)[-3000:])
    _sweep_passed(manager, folder, ["ha", "hb"], "mpirun")

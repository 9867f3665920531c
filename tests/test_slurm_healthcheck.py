"""`gpuwarden slurm healthcheck|prolog|epilog` wired into a real Slurm (tests/slurm_cluster.py): slurmd itself runs
the shipped scripts (packaging/slurm/slurm-*) as HealthCheckProgram, Prolog and Epilog, each running the real agent
on a recorded GB200 tray chosen per node and per script by the test (a symlink it switches between
fixtures/nodes/gb200-nvl72-healthy and gb200-nvl72-faulty). Everything is judged from Slurm's own state (sinfo,
scontrol, squeue) and its logs (slurmctld's record of each node update, slurmd's of each failed script); waits are
for events (a count of completed health-check runs), with generous deadlines."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NODES, ROOT
from slurm_cluster import SlurmCluster, poll

LIVE = ("n1", "n2", "n3")
MODES = ("healthcheck", "prolog", "epilog")
HEALTHY, FAULTY = NODES / "gb200-nvl72-healthy", NODES / "gb200-nvl72-faulty"
# The faulty tray's worst finding (REBOOT, first in the report): GPU 2 fell off the bus.
REASON = "gpuwarden: preflight: xid 79 GPU2 0018:01:00.0"
DEADLINE_S = 120.0  # two loaded cores: generous, and never a measurement
INTERVAL_S = 3  # HealthCheckInterval: short, so a test waits seconds for a round (slurmctld checks it each second)


class Wiring:
    """The scripts slurmd runs, and which recorded tray each node's health check, Prolog and Epilog judge."""

    def __init__(self, base: Path):
        self.base = base
        self.roots = {mode: base / "roots" / mode for mode in MODES}
        self.runs = base / "runs"
        self.switched = False  # a script judged another tray than the healthy one since the last reset
        for path in (*self.roots.values(), self.runs):
            path.mkdir(parents=True, exist_ok=True)
        (base / "gw.toml").write_text("")  # the defaults, whatever /etc/gpuwarden holds on this host
        gw = base / "gw"  # the agent of this checkout, as the scripts' $GPUWARDEN
        gw.write_text(f"#!/bin/sh\nexec {sys.executable} -m gpuwarden.agent.cli \"$@\"\n")
        gw.chmod(0o755)

    def script(self, mode: str, conf: Path) -> Path:
        """The program slurm.conf names for `mode`: slurmd gives it no PATH and no SLURM_CONF (only
        SLURMD_NODENAME, plus the job's variables for a Prolog/Epilog), so it says where this cluster and this
        checkout are, then runs the shipped script and counts the run."""
        defaults = self.base / f"defaults-{mode}"
        defaults.write_text(f'GPUWARDEN_SLURM_OPTS="--root {self.roots[mode]}/$SLURMD_NODENAME '
                            f'--config {self.base / "gw.toml"} --log-level error"\n')
        path = self.base / f"{mode}.sh"
        path.write_text(f"""#!/bin/sh
export SLURM_CONF={conf} GPUWARDEN={self.base / 'gw'} GPUWARDEN_SLURM_DEFAULTS={defaults}
{ROOT / 'packaging' / 'slurm' / f'slurm-{mode}'}
rc=$?
echo "$rc" >> {self.runs}/{mode}-$SLURMD_NODENAME
exit $rc
""")
        path.chmod(0o755)
        return path

    def judge(self, mode: str, node: str, tray: Path) -> None:
        """From now on `node`'s `mode` judges `tray` (an atomic switch: a run reads the old or the new one)."""
        link, tmp = self.roots[mode] / node, self.roots[mode] / f".{node}.new"
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(tray)
        os.replace(tmp, link)
        self.switched |= tray != HEALTHY

    def count(self, mode: str, node: str) -> list[str]:
        path = self.runs / f"{mode}-{node}"
        return path.read_text().split() if path.exists() else []

    def rounds(self, *nodes: str, more: int = 2) -> None:
        """Waits until each node's health check completed `more` runs from now: with two, one started after now."""
        start = {n: len(self.count("healthcheck", n)) for n in nodes}
        poll(lambda: all(len(self.count("healthcheck", n)) >= start[n] + more for n in nodes),
             f"{more} more health-check runs on {', '.join(nodes)}")


def example_conf() -> dict[str, str]:
    """The settings of packaging/slurm/slurm.conf.example (its lines that are not comments)."""
    lines = (ROOT / "packaging" / "slurm" / "slurm.conf.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def wired(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm-hc")
    wiring = Wiring(base / "wiring")
    for mode in MODES:
        for node in LIVE:
            wiring.judge(mode, node, HEALTHY)
    cluster = SlurmCluster(base / "cluster", live=LIVE, dead=())
    example = example_conf()
    # The example's lines, but the programs wrapped (this cluster, this checkout) and the interval short (seconds for
    # a test; HealthCheckNodeState without CYCLE, so each node runs every interval).
    cluster.settings = {"HealthCheckProgram": str(wiring.script("healthcheck", cluster.conf)),
                        "HealthCheckInterval": str(INTERVAL_S), "HealthCheckNodeState": "ANY",
                        "Prolog": str(wiring.script("prolog", cluster.conf)),
                        "Epilog": str(wiring.script("epilog", cluster.conf)),
                        "PrologFlags": example["PrologFlags"], "PrologEpilogTimeout": example["PrologEpilogTimeout"]}
    try:
        cluster.start()
        yield cluster, wiring
    finally:
        cluster.stop()


@pytest.fixture
def slurm(wired):
    """The module's cluster as it started, before each test: every script judging the healthy tray (after a switch
    back, two rounds, so no run judging the faulty one is left), no job, every node idle with no reason."""
    cluster, wiring = wired
    if wiring.switched:
        for mode in MODES:
            for node in LIVE:
                wiring.judge(mode, node, HEALTHY)
        wiring.rounds(*LIVE)
        wiring.switched = False
    cluster.reset(deadline_s=DEADLINE_S)
    return cluster, wiring


def nodes(cluster) -> dict[str, tuple[str, str]]:
    """node -> (sinfo's state, reason) (`idle`, `drained`, `draining` ...; "" for no reason)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], env=cluster.env, capture_output=True, text=True,
                         timeout=30).stdout
    rows = {}
    for line in out.splitlines():
        name, state, reason = (line.split("|", 2) + ["", ""])[:3]
        rows[name] = (state, "" if reason == "none" else reason)
    return rows


def log_of(cluster, name: str) -> str:
    path = cluster.base / "log" / name
    return path.read_text(errors="replace") if path.exists() else ""


def ctld_mark(cluster) -> int:
    """Where slurmctld's log ends now: what a test reads from (the module's earlier tests wrote before it)."""
    return len(log_of(cluster, "slurmctld.log"))


def reasons_set(cluster, node: str, reason: str, since: int) -> int:
    """How many times slurmctld set `reason` on `node` since `since` (its log line for each update)."""
    return log_of(cluster, "slurmctld.log")[since:].count(f"update_node: node {node} reason set to: {reason}\n")


def job(cluster, job_id: str) -> dict[str, str]:
    text = cluster.scontrol("show", "job", job_id, "-o").stdout
    return dict(m.groups() for m in re.finditer(r"(?:^| )(JobState|Reason|Restarts|NodeList|BatchHost)=(\S*)", text))


def sbatch(cluster, node: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-w", node, "-o", "/dev/null", "--wrap", "true"],
                         env=cluster.env, capture_output=True, text=True, timeout=60, check=True).stdout
    return out.strip().split(";")[0]


def test_slurm_health_check_drains_a_failing_node_with_a_readable_reason_and_resumes_it_once_it_passes(slurm):
    cluster, wiring = slurm
    mark = ctld_mark(cluster)
    wiring.judge("healthcheck", "n2", FAULTY)
    poll(lambda: nodes(cluster)["n2"] == ("drained", REASON), f"n2 drained by its health check with {REASON!r}")
    assert cluster.scontrol("show", "node", "n2", "-o").stdout.count(f"Reason={REASON} [root@") == 1
    # slurmd logs what the program printed, since it exited 1: the verdict and what was done.
    poll(lambda: "health_check failed: rc:1 output:gpuwarden slurm healthcheck n2: FAIL, xid 79 GPU2 0018:01:00.0 "
                 "and " in log_of(cluster, "slurmd-n2.log"), "slurmd's record of the failed health check")
    # More rounds: the drain is not sent again (its time, which the breaker reads, does not move), n1 stays in service.
    wiring.rounds("n1", "n2")
    assert reasons_set(cluster, "n2", REASON, mark) == 1
    assert set(wiring.count("healthcheck", "n1")) == {"0"}
    assert nodes(cluster)["n1"] == ("idle", "")

    wiring.judge("healthcheck", "n2", HEALTHY)  # repaired
    poll(lambda: nodes(cluster)["n2"] == ("idle", ""), "n2 resumed by its passing health check")
    assert nodes(cluster)["n1"] == ("idle", "")


def test_slurm_health_check_never_resumes_nor_rewrites_another_drain(slurm):
    cluster, wiring = slurm
    mark = ctld_mark(cluster)
    admin, nhc, daemon = "admin: bad fan", "NHC: check_fs_mount: /scratch not mounted", \
        "gpuwarden: xid 79 GPU0 0008:01:00.0"
    cluster.scontrol("update", "NodeName=n1", "State=DRAIN", f"Reason={admin}")  # healthy tray: passes
    cluster.scontrol("update", "NodeName=n2", "State=DRAIN", f"Reason={daemon}")  # the daemon's cordon: its own to undo
    cluster.scontrol("update", "NodeName=n3", "State=DRAIN", f"Reason={nhc}")
    wiring.judge("healthcheck", "n3", FAULTY)  # fails, but NHC holds it already
    wiring.rounds(*LIVE)
    assert nodes(cluster) == {"n1": ("drained", admin), "n2": ("drained", daemon), "n3": ("drained", nhc)}
    assert set(wiring.count("healthcheck", "n3")[-2:]) == {"1"}  # it did judge n3 as failing
    assert reasons_set(cluster, "n3", REASON, mark) == 0
    assert "held out by someone else (NHC: check_fs_mount" in log_of(cluster, "slurmd-n3.log")


def test_slurm_could_not_look_leaves_the_node_by_default_or_drains_it_as_configured(slurm, tmp_path):
    cluster, wiring = slurm
    mark = ctld_mark(cluster)
    blind = tmp_path / "blind"  # the healthy tray whose NVML cannot be read: the NVML checks are UNKNOWN
    subprocess.run(["cp", "-r", str(HEALTHY), str(blind)], check=True)
    (blind / "nvml.json").unlink()
    argv = [str(wiring.base / "gw"), "slurm", "healthcheck", "--node", "n1", "--root", str(blind), "--config",
            str(wiring.base / "gw.toml"), "--log-level", "error"]
    left = subprocess.run(argv, env={**cluster.env, "SLURMD_NODENAME": "n9"}, capture_output=True, text=True,
                          timeout=120)
    assert left.returncode == 2, left.stdout + left.stderr
    assert "could not look: ecc (" in left.stdout and "nvml.json" in left.stdout
    assert "node left as it is" in left.stdout
    assert nodes(cluster)["n1"] == ("idle", "")

    drained = subprocess.run(argv + ["--on-unknown", "drain"], env=cluster.env, capture_output=True, text=True,
                             timeout=120)
    assert drained.returncode == 2, drained.stdout + drained.stderr
    set_to = re.search(r"update_node: node n1 reason set to: (gpuwarden: preflight: unknown: [^\n]*)\n",
                       log_of(cluster, "slurmctld.log")[mark:])
    assert set_to and " ecc " in f" {set_to.group(1)} ", log_of(cluster, "slurmctld.log")[mark:]
    # n1's own health check judges a readable tray: it resumes the drain, which is the preflight's.
    poll(lambda: nodes(cluster)["n1"] == ("idle", ""), "n1 resumed by its passing health check")


def test_slurm_prolog_on_a_failing_node_drains_it_and_requeues_the_job(slurm):
    cluster, wiring = slurm
    mark = ctld_mark(cluster)
    ok = sbatch(cluster, "n1")  # a healthy node's Prolog passes: the job runs
    poll(lambda: job(cluster, ok).get("JobState") == "COMPLETED", "the job on n1 to complete")

    wiring.judge("prolog", "n3", FAULTY)  # a fault since the last health check, which still passes
    bad = sbatch(cluster, "n3")
    # Requeued (COMPLETING on n3 first, while its allocation is released), held for its owner.
    poll(lambda: (lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1")(job(cluster, bad)),
         "the job on n3 requeued")
    state = job(cluster, bad)
    assert state["Reason"] == "launch_failed_requeued_held" and state["Restarts"] == "1", state
    assert reasons_set(cluster, "n3", REASON, mark) == 1  # drained by the Prolog with gpuwarden's reason ...
    ctld = log_of(cluster, "slurmctld.log")[mark:]
    assert ctld.index(f"update_node: node n3 reason set to: {REASON}") < ctld.index(f"Requeuing JobId={bad}")
    assert "reason set to: Prolog error" not in ctld  # ... which Slurm kept (a drained node is not drained again)
    assert f"[job {bad}] prolog failed status=1:0" in log_of(cluster, "slurmd-n3.log")
    assert "prolog failed: rc:1 output:gpuwarden slurm prolog n3: FAIL, xid 79" in log_of(cluster, "slurmd-n3.log")
    # The node's health check judges it sound: the preflight's drain is resumed; the job stays held for its owner.
    poll(lambda: nodes(cluster)["n3"] == ("idle", ""), "n3 resumed by its passing health check")
    assert job(cluster, bad)["JobState"] == "PENDING"


def test_slurm_epilog_on_a_failing_node_drains_it(slurm):
    cluster, wiring = slurm
    mark = ctld_mark(cluster)
    wiring.judge("epilog", "n2", FAULTY)  # the fault appears while the job runs
    done = sbatch(cluster, "n2")
    poll(lambda: reasons_set(cluster, "n2", REASON, mark) == 1, "n2 drained by its Epilog")
    poll(lambda: job(cluster, done).get("JobState") == "COMPLETED", "the job to complete")
    assert "epilog failed: rc:1 output:gpuwarden slurm epilog n2: FAIL, xid 79" in log_of(cluster, "slurmd-n2.log")
    assert "reason set to: Epilog error" not in log_of(cluster, "slurmctld.log")[mark:]


def test_slurm_conf_example_names_the_shipped_scripts_with_timeouts_that_fit():
    """packaging/slurm/slurm.conf.example: each program is a shipped script (installed in /usr/lib/gpuwarden/), and
    its time limits leave the program's own budget room (slurmd's fixed 60 s for the health check)."""
    from gpuwarden.agent.cli.slurm import BUDGET_S, SCONTROL_TIMEOUT_S

    conf = example_conf()
    for key, mode in (("HealthCheckProgram", "healthcheck"), ("Prolog", "prolog"), ("Epilog", "epilog")):
        assert conf[key] == f"/usr/lib/gpuwarden/slurm-{mode}"
        script = ROOT / "packaging" / "slurm" / f"slurm-{mode}"
        assert os.access(script, os.X_OK)
        assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
        assert f" slurm {mode} " in script.read_text()
    worst = {mode: budget + 3 * SCONTROL_TIMEOUT_S for mode, budget in BUDGET_S.items()}  # three Slurm calls
    assert worst["healthcheck"] + 5 <= 60  # slurm.conf(5): killed if it does not end within 60 seconds
    assert int(conf["HealthCheckInterval"]) > 60  # a run ends (or is killed) before the next starts
    assert max(worst["prolog"], worst["epilog"]) + 5 <= int(conf["PrologEpilogTimeout"])
    assert conf["PrologFlags"] == "Alloc" and conf["HealthCheckNodeState"] == "ANY,CYCLE"


# -- without a cluster: the name, the reason ------------------------------------------------------------------------
def _config(tmp_path: Path, text: str = ""):
    from gpuwarden.agent.core import config as config_mod
    from gpuwarden.checks import all_specs

    path = tmp_path / "gw.toml"
    path.write_text(text)
    return config_mod.load(all_specs(), path, explicit=True)


def test_slurm_node_name_is_the_flag_then_slurmd_s_then_the_config_then_the_hostname(tmp_path):
    import socket

    from gpuwarden.agent.cli.slurm import node_name
    from gpuwarden.agent.core.errors import GpuwardenError

    named = _config(tmp_path, '[remediation]\nnode_name = "gb200-r07-t03"\n')
    assert node_name("n1", named, {"SLURMD_NODENAME": "n2"}) == "n1"
    assert node_name(None, named, {"SLURMD_NODENAME": "n2"}) == "n2"
    assert node_name(None, named, {}) == "gb200-r07-t03"
    assert node_name(None, _config(tmp_path), {}) == socket.gethostname().split(".", 1)[0]
    # A hostlist or an option would make scontrol act on other nodes, or on none: refused before anything runs.
    for bad in ("n[1-9]", "n1,n2", "-x", "n1 n2", "x" * 65, "n1\nNodeName=n2", "nœ"):
        with pytest.raises(GpuwardenError, match="not a single Slurm node name"):
            node_name(None, named, {"SLURMD_NODENAME": bad})


def test_slurm_reason_is_the_worst_finding_readable_and_bounded(tmp_path):
    from gpuwarden.agent.cli.node import node as _node
    from gpuwarden.agent.cli.slurm import reason_for, unknown_reason
    from gpuwarden.agent.core.model import Action, CheckResult, Entity, Finding, Report, Status
    from gpuwarden.agent.node.runner import run_checks
    from gpuwarden.checks import ALL

    quick = [s for s in ALL if s.level == "quick"]
    cfg = _config(tmp_path)
    faulty = Report("n1", tuple(run_checks(_node(FAULTY), quick, cfg, None, budget_s=60)))
    assert faulty.exit_code == 1 and reason_for(faulty) == REASON

    blind = tmp_path / "blind"
    subprocess.run(["cp", "-r", str(HEALTHY), str(blind)], check=True)
    (blind / "nvml.json").unlink()
    unknown = Report("n1", tuple(run_checks(_node(blind), quick, cfg, None, budget_s=60)))
    assert unknown.exit_code == 2
    assert unknown_reason(unknown).startswith("gpuwarden: preflight: unknown: ")
    assert set(unknown_reason(unknown).split(": ")[-1].split()) == {
        r.check for r in unknown.results if r.status is Status.UNKNOWN}

    # An entity id from a device or a log is not trusted: quotes, newlines and length are taken out.
    hostile = Finding("ib_port", "ib-port-down", Entity("ib_port", "mlx5_0/1\" State=RESUME\n" + "x" * 500),
                      Status.FAIL, "down", Action.DRAIN)
    text = reason_for(Report("n1", (CheckResult("ib_port", Status.FAIL, (hostile,)),)))
    assert text.startswith("gpuwarden: preflight: ib_port ib-port-down ib_port mlx5_0/1 State=RESUME x")
    assert len(text) <= 200 and all(c.isprintable() and c not in "\"'\\`\n" for c in text)


def test_slurm_a_node_whose_slurmd_starts_on_a_fault_registers_drained(slurm):
    """slurmd runs the health check once when it starts, before it registers (22.05.8 waits for it, up to its 60 s
    limit): a node that comes up with a fault joins drained, with the readable reason, before any job reaches it."""
    cluster, wiring = slurm
    cluster.stop_slurmd("n3")
    poll(lambda: nodes(cluster)["n3"][0].endswith("*"), "slurmctld to mark n3 not responding")
    mark = ctld_mark(cluster)
    wiring.judge("healthcheck", "n3", FAULTY)
    cluster.start_slurmd("n3")
    poll(lambda: nodes(cluster)["n3"] == ("drained", REASON), "n3 registered, drained by its start-up health check")
    ctld = log_of(cluster, "slurmctld.log")[mark:]
    assert ctld.count(f"update_node: node n3 reason set to: {REASON}\n") == 1
    assert ctld.index(f"update_node: node n3 reason set to: {REASON}") < ctld.index("Node n3 now responding")
    slurmd = log_of(cluster, "slurmd-n3.log")
    assert "health_check failed: rc:1 output:gpuwarden slurm healthcheck n3: FAIL, xid 79" in \
        slurmd[slurmd.rindex("slurmd started on"):]

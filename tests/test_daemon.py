"""The daemon driven through time on a recorded node: faults injected by appending kernel-log records and
rewriting the scenario's files, the node state moving, and /metrics reflecting it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, append_kmsg, edit_nvml, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.retest import run_retest
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs
from prometheus_client import generate_latest

XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
XID31 = "3,{seq},{usec},-;NVRM: Xid (PCI:000a:01:00): 31, pid=7, name=python3, MMU Fault"


@pytest.fixture
def daemon(scenario_copy, tmp_path):
    root = scenario_copy("gb200-nvl72-healthy")
    specs = all_specs()
    policy = dict(DEFAULT_POLICY, quarantine_after_s=0.5)
    store = Store(tmp_path / "state" / "state.db")
    collector = DaemonCollector()
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(specs), store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), collector,
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, policy=policy))
    d.start()
    yield d, root, collector
    d.stop()
    store.close()


def metrics_text(collector) -> str:
    return generate_latest(registry_for(collector)).decode()


def test_xid_moves_the_node_and_the_metrics(daemon):
    d, root, collector = daemon
    wait_for(lambda: "xid" in d.results(), what="the first kernel-log tick")
    assert d.record.state is NodeState.HEALTHY
    assert 'gpuwarden_node_state{state="healthy"} 1.0' in metrics_text(collector)
    append_kmsg(root, XID79)
    wait_for(lambda: d.record.state is NodeState.CORDONED or d.record.state is NodeState.QUARANTINED,
             what="the XID 79 to cordon the node")
    (finding,) = [f for f in d.results()["xid"].findings if f.code == "79"]
    assert finding.entity.index == 0 and finding.entity.id.startswith("GPU-")  # named through NVML
    # XID 79 asks for a reboot: past cordon, straight on to quarantine (drain).
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine")
    text = metrics_text(collector)
    assert 'gpuwarden_node_state{state="quarantined"} 1.0' in text
    assert 'gpuwarden_xid_events{pci="0008:01:00.0",xid="79"} 1.0' in text
    # The intents are carried out by the engine's worker after the transition: wait for it, then the exact list.
    wait_for(lambda: len(d.adapter.actions()) >= 2, what="both intents carried out")
    assert [a["action"] for a in d.adapter.actions()] == ["cordon", "drain"]


def test_burst_is_one_incident(daemon):
    d, root, _ = daemon
    wait_for(lambda: "xid" in d.results())
    append_kmsg(root, XID13, 50)
    wait_for(lambda: [f for f in d.results()["xid"].findings if f.evidence.get("count") == 50],
             what="50 XID 13 in one incident")
    (finding,) = d.results()["xid"].findings
    assert finding.code == "13" and finding.status.value == "warn" and d.record.state is NodeState.SUSPECT


# -- the real command in its own process: kill -9 and restart ------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, state: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(state), "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def status(state: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(state), "--json"],
                          capture_output=True, text=True, timeout=30)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def xid13_count(state: Path) -> int | None:
    checks = {c["check"]: c for c in status(state).get("checks", [])}
    found = [f for f in checks.get("xid", {}).get("findings", []) if f["code"] == "13"]
    return found[0]["evidence"]["count"] if found else None


def test_kill_9_mid_incident_loses_and_repeats_nothing(scenario_copy, tmp_path):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    proc = start(root, state, free_port())
    try:
        wait_for(lambda: status(state).get("checks"), what="the daemon's first commit")
        append_kmsg(root, XID13, 3)
        wait_for(lambda: xid13_count(state) == 3, what="3 XID 13 counted")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        append_kmsg(root, XID13, 2)  # logged while the daemon was dead
        proc = start(root, state, free_port())
        wait_for(lambda: xid13_count(state) == 5, what="5 XID 13 after the restart")
        append_kmsg(root, XID31)  # once a later line is counted, the 13s have been read past: the count stays
        wait_for(lambda: any(f["code"] == "31" for c in status(state).get("checks", []) for f in c["findings"]),
                 what="a later XID")
        assert xid13_count(state) == 5
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0  # SIGTERM is a clean stop


def test_ready_reload_and_graceful_stop_under_systemd(scenario_copy, tmp_path):
    """READY=1 over $NOTIFY_SOCKET, SIGHUP with a broken config keeps the running one, SIGTERM exits 0."""
    root, state, sock_path = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", tmp_path / "notify.sock"
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text("[checks.xid]\nhold_s = 60.0\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(sock_path))
        server.settimeout(30)
        proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root),
                                 "--state-dir", str(state), "--listen", f"127.0.0.1:{free_port()}", "--config",
                                 str(cfg), "--log-format", "json"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "NOTIFY_SOCKET": str(sock_path)})
        try:
            assert server.recv(4096).startswith(b"READY=1")
            cfg.write_text("[checks.xid]\nhold_s = \"long\"\n")
            proc.send_signal(signal.SIGHUP)
            append_kmsg(root, XID13)  # still watching after the failed reload
            wait_for(lambda: xid13_count(state) == 1, what="an XID after the reload")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "config reload failed; keeping the running config" in err and "checks.xid.hold_s" in err


def test_a_reload_names_what_only_a_restart_applies_and_the_agent_keeps_acting(scenario_copy, tmp_path):
    """An operator turns [remediation] mode back to dry-run and reloads: the agent says the change waits for a
    restart, and it still acts on the next fault (rather than seeming to have stopped while it goes on draining)."""
    root, state, cfg = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", tmp_path / "gpuwarden.toml"
    acting = ('[remediation]\nmode = "act"\nadapter = "local"\n[remediation.ladder]\nreboot = false\n'
              'reset_gpu = false\n[remediation.spares]\nswap = false\n')
    cfg.write_text(acting + "[checks.xid]\nhold_s = 60.0\n")
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(state), "--listen", f"127.0.0.1:{free_port()}", "--config", str(cfg),
                             "--log-format", "json"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: status(state).get("checks"), what="the daemon's first commit")
        cfg.write_text(acting.replace('"act"', '"dry-run"') + "[checks.xid]\nhold_s = 30.0\n")
        proc.send_signal(signal.SIGHUP)
        append_kmsg(root, XID79)
        wait_for(lambda: any(i["action"] == "cordon" and i.get("done") is not None
                             for i in status(state).get("intents", [])), what="the cordon carried out")
        st = status(state)
        assert st["remediation"]["mode"] == "act"
        (cordon,) = [i for i in st["intents"] if i["action"] == "cordon"]
        assert cordon["outcome"] == "done", cordon
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    (warned,) = [e for e in lines if e.get("event", "").startswith("config changed where only a restart applies")]
    assert warned["keys"] == ["remediation.mode"]  # the check's hold_s is not among them: a reload applies it
    assert any(e.get("event") == "config reloaded" for e in lines)


def test_restart_needed_names_each_key_only_a_restart_applies():
    from gpuwarden.agent.cli.run import restart_needed

    base = config.defaults(all_specs())
    fresh = config.defaults(all_specs())
    assert restart_needed(base, fresh) == []
    fresh.checks["xid"]["hold_s"] = 1.0  # read at each judgement: a reload applies it
    fresh.agent["level"] = "full"  # preflight's, not the daemon's
    assert restart_needed(base, fresh) == []
    fresh.agent["listen"] = "127.0.0.1:1"
    fresh.remediation["breaker"]["cluster_share"] = 0.5
    fresh.remediation["mode"] = "act"
    fresh.topology["domain"] = "rack-9"
    assert restart_needed(base, fresh) == ["agent.listen", "remediation.breaker.cluster_share", "remediation.mode",
                                           "topology.domain"]


def test_textfile_output_for_node_exporter(scenario_copy, tmp_path):
    root, textfile = scenario_copy("gb200-nvl72-healthy"), tmp_path / "gpuwarden.prom"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(tmp_path / "state"), "--listen", f"127.0.0.1:{free_port()}", "--textfile",
                             str(textfile)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        text = wait_for(lambda: textfile.exists() and "gpuwarden_check_success" in textfile.read_text()
                        and textfile.read_text(), what="the textfile")
    finally:
        proc.terminate()
        proc.wait(20)
    assert 'gpuwarden_node_state{state="healthy"} 1.0' in text


# -- every kind of signal through the running daemon -------------------------------------------------------------
@pytest.fixture
def fast_daemon(scenario_copy, tmp_path):
    """All passive checks polled every 0.1 s, thresholds scaled down, on a copy of the H100 node."""
    root = scenario_copy("h100-hgx-healthy")
    specs = all_specs()
    cfg = config.defaults(specs)
    cfg.checks["ib_port"]["down_fail_s"] = 0.3
    store = Store(tmp_path / "state" / "state.db")
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE}))
    d.start()
    yield d, root
    d.stop()
    store.close()


def test_sysfs_change_ib_port_down_cordons(fast_daemon):
    d, root = fast_daemon
    wait_for(lambda: d.results().get("ib_port") and d.results()["ib_port"].status.value == "ok",
             what="ib_port's first look")
    port = root / "sys/class/infiniband/mlx5_5/ports/1"
    (port / "state").write_text("1: DOWN\n")
    (port / "phys_state").write_text("3: Disabled\n")
    wait_for(lambda: d.record.state is NodeState.CORDONED, what="the port-down cordon")
    (f,) = d.results()["ib_port"].findings
    assert (f.code, f.entity.id) == ("ib-port-down", "mlx5_5/1")
    text = metrics_text(d.collector)
    assert 'gpuwarden_ib_port_up{port="mlx5_5/1"} 0.0' in text
    assert 'gpuwarden_node_state{state="cordoned"} 1.0' in text


def test_nvml_change_nvlink_down_quarantines(fast_daemon):
    d, root = fast_daemon
    wait_for(lambda: d.results().get("nvlink_lanes") and d.results()["nvlink_lanes"].status.value == "ok",
             what="nvlink_lanes' first look")
    edit_nvml(root, lambda snap: snap["gpus"][3]["nvlinks"][7].update(state=0))
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="nvlink-down (RESET_GPU) to quarantine")
    (f,) = d.results()["nvlink_lanes"].findings
    assert f.code == "nvlink-down" and f.entity.index == 3 and f.entity.link == 7
    # The action worker applies intents outside the lock, after the transition: wait for it.
    wait_for(lambda: [a["action"] for a in d.adapter.actions()] == ["cordon", "drain"], what="the actions applied")


def test_a_hung_sample_is_unknown_and_blocks_nothing(scenario_copy, tmp_path):
    import threading

    from gpuwarden.agent.core.passive import Judgement, PassiveSpec

    release = threading.Event()
    hung = PassiveSpec("hung", "never returns", sample=lambda n, c, s: release.wait(30),
                       judge=lambda s, x, c, now: Judgement({}), interval_s=0.05, timeout_s=0.2)
    root = scenario_copy("gb200-nvl72-healthy")
    specs = [*all_specs(), hung]
    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), [hung], list(KERNEL_CONSUMERS), config.defaults(specs), store,
               LocalAdapter(tmp_path / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05))
    d.start()
    try:
        # "sample timed out after 0.2s", then on later ticks "sample still running after 0.2s"
        wait_for(lambda: d.results().get("hung") and "0.2s" in (d.results()["hung"].error or ""),
                 what="the hung sample to be UNKNOWN")
        append_kmsg(root, XID13)  # the kernel-log consumers go on regardless
        wait_for(lambda: d.results()["xid"].findings, what="the XID while a sample hangs")
        assert d.results()["hung"].status.value == "unknown"
    finally:
        release.set()
        d.stop()
        store.close()


def down_since(state: Path, port: str) -> float | None:
    db = Store(state / "state.db", readonly=True)  # what `gpuwarden status` reads, another process's view
    try:
        return db.check("ib_port").state["ports"][port]["down_since"]
    finally:
        db.close()


def ib_finding(state: Path) -> dict | None:
    checks = {c["check"]: c for c in status(state).get("checks", [])}
    found = checks.get("ib_port", {}).get("findings", [])
    return found[0] if found else None


def test_kill_9_keeps_ib_downtime(scenario_copy, tmp_path):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    proc = start(root, state, free_port())
    try:
        wait_for(lambda: any(c["check"] == "ib_port" for c in status(state).get("checks", [])))
        port = root / "sys/class/infiniband/mlx5_1/ports/1"
        (port / "state").write_text("1: DOWN\n")
        (port / "phys_state").write_text("2: Polling\n")
        before = wait_for(lambda: ib_finding(state), what="ib-port-down (2 s)")
        since = down_since(state, "mlx5_1/1")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc = start(root, state, free_port())
        wait_for(lambda: (f := ib_finding(state)) and f["evidence"]["down_for_s"] > before["evidence"]["down_for_s"],
                 what="the outage to go on counting after the restart")
        after = ib_finding(state)
        assert after["code"] == "ib-port-down"
        # The outage still runs from when it was first seen before the kill: had the restart lost it, it would
        # start again at the restart (and the port be seen down for another down_fail_s before failing again).
        assert since is not None and down_since(state, "mlx5_1/1") == since
    finally:
        proc.terminate()
        proc.wait(10)


XID48 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 48, pid=1, name=p, An uncorrectable double bit error"


def test_retest_outcome_goes_through_the_journal(scenario_copy, tmp_path):
    """A RESET_GPU-class XID quarantines; once it has expired and all looked clear, the retest passes: resume is
    applied once and marked done in the journal (so a restart does not replay it)."""
    root = scenario_copy("gb200-nvl72-healthy")
    cfg = config.defaults(all_specs())
    cfg.checks["xid"]["hold_s"] = 0.3
    store = Store(tmp_path / "state.db")
    node = Node.recorded_at(root)
    # The real retest, as `gpuwarden run` gives it (the quick preflight from the recovery on), never a stub.
    d = Daemon(node, [], list(KERNEL_CONSUMERS), cfg, store,
               LocalAdapter(tmp_path / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05,
                             retest=lambda since: run_retest(node, d.config, since)[0],
                             policy=dict(DEFAULT_POLICY, retest_after_s=0.2, cordon_clear_s=3600.0)))
    d.start()
    try:
        wait_for(lambda: "xid" in d.results())
        append_kmsg(root, XID48)
        wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine")
        wait_for(lambda: d.record.state is NodeState.HEALTHY, what="the retest to resume the node")
        # The action worker applies intents outside the lock, after the transition: wait for it.
        wait_for(lambda: [a["action"] for a in d.adapter.actions()] == ["cordon", "drain", "resume"],
                 what="the actions applied")
        assert store.intents(pending_only=True) == []
        assert store.transitions(1)[0].to is NodeState.HEALTHY
    finally:
        d.stop()
        store.close()


def test_an_incident_whose_hold_ends_is_dropped_when_it_ends_not_at_the_next_idle_tick(scenario_copy, tmp_path):
    """The kernel-log consumers are judged again when the earliest hold ends (Judgement.wake_at), so a quarantined
    node's faults clear on time. The idle tick is an hour here: nothing else would judge the XID again."""
    root = scenario_copy("gb200-nvl72-healthy")
    cfg = config.defaults(all_specs())
    cfg.checks["xid"]["hold_s"] = 1.0
    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), cfg, store,
               LocalAdapter(tmp_path / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=3600.0))
    d.start()
    try:
        wait_for(lambda: "xid" in d.results(), what="the first look at the kernel log")
        append_kmsg(root, XID48)  # RESET_GPU: below REBOOT, so it holds hold_s after it was logged
        wait_for(lambda: [f.code for f in d.results()["xid"].findings] == ["48"], what="the XID 48 incident")
        assert d.record.state is NodeState.QUARANTINED
        wait_for(lambda: not d.results()["xid"].findings, timeout_s=30, what="the incident to end with its hold")
        assert d.results()["xid"].status is Status.OK
    finally:
        d.stop()
        store.close()


def test_every_passive_check_fires_through_the_daemon(scenario_copy, tmp_path):
    """One recorded GB200 tray, every passive check and kernel-log consumer running at a fast pace, one fault
    injected per check through the file it reads (kmsg, sysfs, nvml.json): each check's finding appears, the node
    state climbs the ladder, and /metrics carries each fault."""
    root = scenario_copy("gb200-nvl72-healthy")
    cfg = config.defaults(all_specs())
    cfg.checks["ib_port"]["down_fail_s"] = 0.3
    cfg.checks["clock_events"].update(min_window_s=0.3)
    cfg.checks["thermal"].update(sustain_s=0.0, gpu_max_c=80.0)
    cfg.checks["fabric"].update(settle_s=0.0)
    store = Store(tmp_path / "state" / "state.db")
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE}))
    d.start()

    def codes(check: str) -> set[str]:
        rec = d.results().get(check)
        return {f.code for f in rec.findings} if rec else set()

    try:
        wait_for(lambda: all(d.results().get(s.name) for s in PASSIVE), what="every check's first look")
        assert d.record.state is NodeState.HEALTHY, d.results()
        faults = [  # (check, expected code, injection)
            ("clock_events", "hw-power-brake-slowdown",
             lambda: edit_nvml(root, lambda s: s["gpus"][1].update(clocks_event_reasons=0x88))),
            ("thermal", "gpu-over-temperature",
             lambda: edit_nvml(root, lambda s: s["gpus"][2]["temperature"].update(gpu=91))),
            ("fabric", "fabric-not-ready",
             lambda: edit_nvml(root, lambda s: s["gpus"][3]["fabric"].update(state=2))),
            ("nvlink_lanes", "nvlink-down",
             lambda: edit_nvml(root, lambda s: s["gpus"][0]["nvlinks"][5].update(state=0))),
            ("ib_port", "ib-port-down",
             lambda: (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")),
            ("pcie_aer", "pcie-aer-uncorrectable",
             lambda: _bump_aer_fatal(root / "sys/bus/pci/devices/0009:01:00.0/aer_dev_fatal")),
            ("nvswitch_sxid", "sxid-20034",
             lambda: append_kmsg(root, "3,{seq},{usec},-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, "
                                  "Link 48 LTSSM Fault Up")),
            ("ecc", "ecc-uncorrectable",
             lambda: edit_nvml(root, lambda s: s["gpus"][2]["ecc_errors"]["volatile"].update(uncorrected=1))),
            ("xid", "79", lambda: append_kmsg(root, XID79)),
        ]
        for check, code, inject in faults:
            inject()
            wait_for(lambda c=check, k=code: k in codes(c), what=f"{check}: {code}")
        assert d.record.state in (NodeState.QUARANTINED, NodeState.RETIRED)
        text = metrics_text(d.collector)
        finding_lines = [line for line in text.splitlines() if line.startswith("gpuwarden_finding{")]
        for check, code, _ in faults:
            assert any(f'check="{check}"' in line and f'code="{code}"' in line for line in finding_lines), check
        assert 'gpuwarden_ib_port_up{port="mlx5_1/1"} 0.0' in text
        assert 'gpuwarden_node_state{state="healthy"} 0.0' in text
    finally:
        d.stop()
        store.close()


def _bump_aer_fatal(path: Path) -> None:
    """One uncorrectable (fatal) error on a device: its first counter and TOTAL_ERR_FATAL go up by one."""
    lines = path.read_text().splitlines()
    out = [f"{lines[0].rsplit(' ', 1)[0]} {int(lines[0].rsplit(' ', 1)[1]) + 1}"]
    for line in lines[1:]:
        name, value = line.rsplit(" ", 1)
        out.append(f"{name} {int(value) + 1}" if name == "TOTAL_ERR_FATAL" else line)
    path.write_text("\n".join(out) + "\n")


def test_the_daemon_and_preflight_judge_the_boots_log_alike(scenario_copy, tmp_path):
    """The same decision in both modes: the daemon reads the boot's kernel log at start as a backlog, each record at
    the time it was logged (not as news), so its XID and SXid findings are preflight's: the tray's XID 63 logged ten
    days before its XID 79 has aged out in both, the 79 and the fatal SXids stand in both."""
    from gpuwarden.agent.node.runner import run_checks
    from gpuwarden.checks import ALL

    root = scenario_copy("gb200-nvl72-faulty")
    cfg = config.defaults(all_specs())
    kernel_checks = [s for s in ALL if s.name in ("xid", "nvswitch_sxid")]
    pre = {r.check: sorted((f.code, f.entity.id) for f in r.findings if f.code != "nvml-events")
           for r in run_checks(Node.recorded_at(root), kernel_checks, cfg)}
    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), cfg, store, LocalAdapter(tmp_path / "a.jsonl"),
               DaemonCollector(), DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05))
    d.start()
    try:
        wait_for(lambda: "xid" in d.results() and "nvswitch_sxid" in d.results(), what="the backlog judged")
        daemon = {name: sorted((f.code, f.entity.id) for f in d.results()[name].findings if f.code != "nvml-events")
                  for name in pre}
    finally:
        d.stop()
        store.close()
    assert daemon == pre
    assert [code for code, _ in pre["xid"]] == ["79"] and len(pre["nvswitch_sxid"]) == 3


def test_the_first_verdict_of_the_kernel_log_checks_comes_after_the_log_was_read(scenario_copy, tmp_path):
    """NVML's XID events are a second source of the same checks. Their loop must not judge the checks before the
    kernel log's backlog has been: a verdict made on no log at all said "no XID" while the log held an XID 79."""
    root = scenario_copy("gb200-nvl72-faulty")
    node = Node.recorded_at(root)
    make_follower = node.kmsg_follower

    def slow_follower(*args, **kwargs):
        follower, polls = make_follower(*args, **kwargs), []
        poll = follower.poll

        def first_poll_late():
            if not polls:
                polls.append(time.monotonic())
                time.sleep(1.0)  # the log read late: NVML's loop has long been ready by then
            return poll()

        follower.poll = first_poll_late
        return follower

    node.kmsg_follower = slow_follower
    cfg = config.defaults(all_specs())
    store = Store(tmp_path / "state.db")
    d = Daemon(node, [], list(KERNEL_CONSUMERS), cfg, store, LocalAdapter(tmp_path / "a.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05))
    d.start()
    try:
        first = wait_for(lambda: d.results().get("xid"), what="the first xid verdict")
        assert "79" in [f.code for f in first.findings], first
    finally:
        d.stop()
        store.close()


# -- acting on the finding: the scheduler, the ladder, the spare -------------------------------------------------------
HOST = "gb200-rack07-tray03"  # gb200-nvl72-healthy's hostname


def test_act_mode_drains_with_our_reason_swaps_a_spare_and_climbs_the_ladder(scenario_copy, tmp_path):
    """mode = act on a recorded node: an XID 79 quarantines it at the scheduler with the agent's reason and the
    finding, a spare of its NVLink domain goes into service, and the recovery ladder runs its steps in order (a
    reboot, then, the fault still there after the settle time, a ticket with the finding on the hook's stdin)."""
    from types import SimpleNamespace

    from fake_scheduler import DictScheduler
    from gpuwarden.agent.act.remediation import Settings

    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    sched = DictScheduler({HOST: {"domain": "rack07"}, "tray04": {"domain": "rack07"},
                           "spare-a": {"domain": "rack07", "spare": True, "service": "drained", "ours": True,
                                       "reason": "gpuwarden: spare"}})
    rebooted, ticket = tmp_path / "rebooted", tmp_path / "ticket.json"
    settings = Settings(mode="act", node_name=HOST, retry_min_s=0.05, retry_max_s=0.2,
                        reboot_command=(sys.executable, "-c", f"open({str(rebooted)!r}, 'a').write('x')"),
                        ticket_command=(sys.executable, "-c",
                                        f"import sys; open({str(ticket)!r}, 'w').write(sys.stdin.read())"))
    policy = dict(DEFAULT_POLICY, step_after_s=0.2, reboot_settle_s=0.5)
    store = Store(state / "state.db")
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), config.defaults(all_specs()), store, sched,
               DaemonCollector(), DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, policy=policy, domain="rack07",
                                                remediation=settings, judge=lambda fleet, *a, **k: SimpleNamespace(
                                                    allow=True, reason="allowed", cluster=(1, 3), domain=(1, 3))))
    d.start()
    try:
        wait_for(lambda: "xid" in d.results(), what="the first kernel-log tick")
        append_kmsg(root, XID79)
        journal = wait_for(lambda: (j := [(i["action"], i["outcome"]) for i in store.intents()])
                           and [a for a, _ in j][-1:] == ["ticket"] and j[-1][1] is not None and j, timeout_s=60,
                           what="the ladder's last step carried out")
        assert [a for a, _ in journal] == ["publish_domain", "cordon", "drain", "take_spare", "reboot", "ticket"]
        assert sched.changes == [("cordon", HOST), ("quarantine", HOST), ("take_spare", "spare-a")]
        me = sched.state(HOST)
        assert me["quarantined"] and me["reason"] == "gpuwarden: xid 79 GPU0 0008:01:00.0"
        assert sched.state("spare-a")["service"] == "in_service"
        assert dict(journal)["take_spare"] == "done: spare spare-a of rack07 taken into service"
        assert d.record.step == "ticket"
        text = metrics_text(d.collector)
        assert 'gpuwarden_ladder_step{step="ticket"} 1.0' in text and "gpuwarden_remediation_acting 1.0" in text
        assert rebooted.read_text() == "x" and dict(journal)["reboot"].startswith("done")
        sent = json.loads(ticket.read_text())
        assert sent["finding"]["code"] == "79" and sent["node"] == HOST and sent["idempotency_key"].endswith("ticket")
    finally:
        d.stop()
        store.close()

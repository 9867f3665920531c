"""The daemon under faults: a check whose code raises, a loop that gets stuck, a scheduler that hangs, a state
store that is full, locked, unreadable or deleted while running, a port or a state folder it cannot have. Each
on a recorded node through the real daemon; each says what it saw, goes on detecting, and recovers by itself."""
from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT, append_kmsg, wait_for
from fake_scheduler import DictScheduler
from gpuwarden.agent.core import config
from gpuwarden.agent.core.passive import Judgement, PassiveSpec
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.folder_lock import LOCK_NAME
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs, ib_downtime
from prometheus_client import generate_latest

XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FAST = dict(kmsg_tick_s=0.01, idle_tick_s=0.05, error_backoff_s=0.05, retry_max_s=0.2, store_check_s=0.1)


def metrics(d: Daemon) -> str:
    return generate_latest(registry_for(d.collector)).decode()


def xid_count(records: dict, code: str = "13") -> int | None:
    rec = records.get("xid")
    found = [f for f in rec.findings if f.code == code] if rec else []
    return found[0].evidence["count"] if found else None


def make(root: Path, state: Path, passive=(), adapter=None, store: Store | None = None, **options) -> Daemon:
    store = store or Store(state / "state.db", lock=True)
    cfg = config.defaults([*all_specs(), *passive])
    return Daemon(Node.recorded_at(root), list(passive), list(KERNEL_CONSUMERS), cfg, store,
                  adapter, DaemonCollector(),
                  DaemonOptions(**{**FAST, **options}))


@pytest.fixture
def running():
    started: list[Daemon] = []

    def start(d: Daemon) -> Daemon:
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        d.store.close()


# -- a kernel log that cannot be read -------------------------------------------------------------------------------
def test_a_kernel_log_that_cannot_be_read_makes_its_checks_unknown_and_a_standing_fault_stays(scenario_copy,
                                                                                              tmp_path, running):
    """Could not look is not healthy: while the log cannot be read the kernel-log checks are UNKNOWN with the
    reason, not OK; an XID 79 already read still FAILs; once the log is back they judge it again. pcie_aer's sysfs
    poll (every 50 ms here) shares the check's record with its kernel-log half and does not make it OK meanwhile."""
    root = scenario_copy("gb200-nvl72-healthy")
    aer_poll = [s for s in PASSIVE if s.name == "pcie_aer"]
    d = running(make(root, tmp_path / "state", aer_poll, intervals={"pcie_aer": 0.05}))
    append_kmsg(root, XID79)
    wait_for(lambda: xid_count(d.results(), "79") == 1, what="the XID 79 counted")
    assert d.results()["pcie_aer"].status.value == "ok"

    text = (root / "kmsg").read_text()
    (root / "kmsg").unlink()
    (root / "kmsg").mkdir()  # a path that exists and is not a log: the follower cannot read it
    wait_for(lambda: d.results()["kmsg"].status.value == "unknown", what="the follower UNKNOWN")
    wait_for(lambda: d.results()["pcie_aer"].status.value == "unknown", what="pcie_aer UNKNOWN")
    for name in ("pcie_aer", "nvswitch_sxid"):
        rec = d.results()[name]
        assert rec.status.value == "unknown" and rec.error.startswith("kernel log: ") and "not read" in rec.error
    xid = d.results()["xid"]
    assert xid.status.value == "fail" and "79" in [f.code for f in xid.findings]  # what was read still stands
    assert 'gpuwarden_check_success{check="pcie_aer"} 0.0' in metrics(d)
    seen = set()
    deadline = time.monotonic() + 0.6  # a dozen of pcie_aer's polls
    while time.monotonic() < deadline:
        seen.add(d.results()["pcie_aer"].status.value)
        time.sleep(0.01)
    assert seen == {"unknown"}

    (root / "kmsg").rmdir()
    (root / "kmsg").write_text(text)
    wait_for(lambda: d.results()["pcie_aer"].status.value == "ok", what="pcie_aer OK with the log back")
    assert d.results()["kmsg"].status.value == "ok" and d.results()["pcie_aer"].error is None


# -- no loop dies; a stuck loop starves the watchdog ---------------------------------------------------------------
def test_a_check_whose_code_raises_is_unknown_retried_and_recovers(scenario_copy, tmp_path, running):
    """A bug outside the sample's own try (here the check's `quiet` predicate, run when its record is committed)
    used to end the check's thread for good while /metrics kept its last OK."""
    broken = threading.Event()
    broken.set()

    def quiet(state):
        if broken.is_set():
            raise KeyError("ports")
        return True

    looks = []
    spec = PassiveSpec("flaky", "a check with a bug", sample=lambda n, c, s: looks.append(1) or 1,
                       judge=lambda s, x, c, now: Judgement({"n": x}), interval_s=0.02, quiet=quiet)
    d = running(make(scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", [spec]))
    rec = wait_for(lambda: (r := d.results().get("flaky")) and r.status.value == "unknown" and r,
                   what="the check UNKNOWN with the reason")
    assert "internal error: KeyError" in rec.error
    assert 'gpuwarden_check_success{check="flaky"} 0.0' in metrics(d)
    asked = len(looks)
    wait_for(lambda: len(looks) > asked + 1, what="the check asked again (the loop lives)")
    assert d.stalled() == []
    broken.clear()
    wait_for(lambda: d.results()["flaky"].status.value == "ok", what="the check back to OK once the bug is gone")
    assert 'gpuwarden_check_success{check="flaky"} 1.0' in metrics(d)


def test_a_stuck_loop_is_named_and_the_watchdog_is_not_fed(scenario_copy, tmp_path, running, monkeypatch):
    from gpuwarden.agent.cli.run import _feed_watchdog

    release = threading.Event()
    hung = PassiveSpec("hung", "never returns", sample=lambda n, c, s: release.wait(60),
                       judge=lambda s, x, c, now: Judgement({}), interval_s=0.02, timeout_s=0.1)
    d = running(make(scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", [hung], stall_after_s=0.3))
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(sock_path))
        server.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
        wait_for(lambda: d.stalled() == ["poll-hung"], what="the stuck poll loop named")
        assert "gpuwarden_loops_stalled 1.0" in metrics(d)  # read at the scrape: nothing publishes for the stuck
        assert _feed_watchdog(d, []) == ["poll-hung"]
        sent = server.recv(4096).decode()
        assert "WATCHDOG=1" not in sent and "stalled: poll-hung" in sent
        append_kmsg(d.node.root, XID13)  # the other loops go on meanwhile
        wait_for(lambda: xid_count(d.results()) == 1, what="an XID while a loop is stuck")
        release.set()
        wait_for(lambda: d.stalled() == [], what="the loop making progress again")
        assert "gpuwarden_loops_stalled 0.0" in metrics(d)
        assert _feed_watchdog(d, ["poll-hung"]) == []
        assert server.recv(4096).decode().startswith("WATCHDOG=1")


# -- a scheduler that hangs delays actions, never detection -------------------------------------------------------
HOST = "gb200-rack07-tray03"  # gb200-nvl72-healthy's hostname: the scheduler's name for it


def allow(nodes, node, domain, now, policy, reset_at=None):
    """A circuit-breaker verdict that lets the cordon through (agent/act/breaker.py's own tests judge the fleet)."""
    from types import SimpleNamespace

    return SimpleNamespace(allow=True, reason="allowed", cluster=(1, len(nodes)), domain=None)


def acting(**options) -> dict:
    from gpuwarden.agent.act.remediation import Settings

    return dict(remediation=Settings(mode="act", node_name=HOST, retry_min_s=0.05, retry_max_s=0.2), judge=allow,
                **options)


class AnswerLost(DictScheduler):
    """A scheduler that carries a change out and then never answers (until released): what a kill of the agent
    during the call, or a timeout after the change took effect, leaves behind."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _change(self, what, node, **fields):
        super()._change(what, node, **fields)
        assert self.release.wait(60), "never released"


def test_a_hung_scheduler_delays_actions_never_detection(scenario_copy, tmp_path, running):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    adapter = DictScheduler({HOST: {}, "tray04": {}})
    adapter.block = threading.Event()
    ib = replace(ib_downtime.SPEC, change_probe=None)
    d = make(root, state, [ib], adapter=adapter, intervals={"ib_port": 0.05},
             policy=dict(DEFAULT_POLICY, quarantine_after_s=0.5), **acting())
    d.config.checks["ib_port"]["down_fail_s"] = 0.2
    running(d)
    wait_for(lambda: "xid" in d.results() and d.results().get("ib_port"), what="the first looks")
    append_kmsg(root, XID79)
    wait_for(lambda: adapter.calls == [("node", HOST)], what="the cordon's first scheduler call, which hangs")
    # Detection goes on while the scheduler hangs: the node moves on, a new XID and an IB port going down are
    # judged, /metrics shows them.
    append_kmsg(root, XID13)
    (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine while the cordon hangs")
    wait_for(lambda: xid_count(d.results()) == 1, what="the XID 13 while the scheduler hangs")
    wait_for(lambda: [f.code for f in d.results()["ib_port"].findings] == ["ib-port-down"],
             what="the IB port down while the scheduler hangs")
    text = metrics(d)
    assert 'gpuwarden_node_state{state="quarantined"} 1.0' in text and "gpuwarden_actions_pending 2.0" in text
    assert 'code="ib-port-down"' in text and 'gpuwarden_xid_events{pci="0009:01:00.0",xid="13"} 1.0' in text
    assert d.stalled() == []  # waiting on the scheduler is not a stuck agent
    wait_for(lambda: {i["action"] for i in d.store.intents(pending_only=True)} == {"cordon", "drain"},
             what="both intents journalled, pending")
    adapter.block.set()
    wait_for(lambda: d.store.intents() and not d.store.intents(pending_only=True), what="the intents marked done")
    assert adapter.changes == [("cordon", HOST), ("quarantine", HOST)]  # each once, in order
    assert [(i["action"], i["outcome"]) for i in d.store.intents()] == [("cordon", "done"), ("drain", "done")]
    assert adapter.state(HOST)["reason"] == "gpuwarden: xid 79 GPU0 0008:01:00.0"  # our prefix and the finding
    assert "gpuwarden_actions_pending 0.0" in metrics(d)


def test_intents_left_pending_by_a_crash_are_reconciled_at_the_next_start(scenario_copy, tmp_path, running):
    """The scheduler cordoned the node and the agent died before it heard back: the next start reads the node's
    state, marks the cordon done without a second call, and carries out the drain that was never asked."""
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    adapter = AnswerLost({HOST: {}, "tray04": {}})
    d = running(make(root, state, adapter=adapter, **acting()))
    wait_for(lambda: "xid" in d.results())
    append_kmsg(root, XID79)
    wait_for(lambda: len(d.store.intents(pending_only=True)) == 2 and adapter.changes == [("cordon", HOST)],
             what="the intents journalled, the cordon carried out and its answer lost")
    d._write_wanted.clear()
    d.stop_event.set()  # the scheduler never answered: what a kill leaves behind
    d.store.close()
    adapter.release.set()
    again = running(make(root, state, adapter=adapter, **acting()))
    wait_for(lambda: not again.store.intents(pending_only=True), what="the pending intents done")
    assert adapter.changes == [("cordon", HOST), ("quarantine", HOST)]  # the cordon not asked twice
    outcomes = {i["action"]: i["outcome"] for i in again.store.intents()}
    assert outcomes["cordon"].startswith("already so at the scheduler (cordoned, ours")
    assert outcomes["drain"] == "done"


# -- the state store: full, locked, unreadable, deleted ----------------------------------------------------------------
def _mount_small_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    where.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def _fill(where: Path) -> Path:
    filler = where / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_is_reported_detection_goes_on_and_the_store_catches_up(scenario_copy, tmp_path, running):
    mount = tmp_path / "small"
    _mount_small_tmpfs(mount, "2m")
    try:
        root, state = scenario_copy("gb200-nvl72-healthy"), mount / "state"
        d = running(make(root, state))
        wait_for(lambda: d.store.check("xid"), what="the first write")
        filler = _fill(mount)
        append_kmsg(root, XID13, 5)
        wait_for(lambda: d.store_error, what="the failed write reported")
        text = metrics(d)
        assert "gpuwarden_store_ok 0.0" in text and 'gpuwarden_check_success{check="store"} 0.0' in text
        wait_for(lambda: xid_count(d.results()) == 5, what="the XIDs counted in memory while the disk is full")
        append_kmsg(root, XID13, 2)
        wait_for(lambda: xid_count(d.results()) == 7, what="more XIDs while the disk is full")
        assert d.stalled() == []  # no thread ended
        filler.unlink()
        wait_for(lambda: d.store_error is None, what="the store writable again")
        wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 7,
                 what="the pending state written")
        assert "gpuwarden_store_ok 1.0" in metrics(d)
        append_kmsg(root, XID13)
        wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 8,
                 what="new XIDs counted and written after the disk is freed")
        fault = d.store.meta("store_fault")
        assert fault["until"] >= fault["since"] and "full" in fault["error"]
        d.stop()
        with sqlite3.connect(state / "state.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_locked_database_is_reported_and_caught_up_once_released(scenario_copy, tmp_path, running):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    d = running(make(root, state, store=Store(state / "state.db", lock=True, busy_timeout_s=0.1)))
    wait_for(lambda: d.store.check("xid"), what="the first write")
    other = sqlite3.connect(state / "state.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the database
    try:
        append_kmsg(root, XID13, 3)
        wait_for(lambda: d.store_error and "locked" in d.store_error, what="the locked database reported")
        wait_for(lambda: xid_count(d.results()) == 3, what="the XIDs counted while the database is locked")
        assert "gpuwarden_store_ok 0.0" in metrics(d)
    finally:
        other.execute("ROLLBACK")
        other.close()
    wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 3,
             what="the pending state written once released")
    # The writer marks the store recovered just after its commit lands: wait for that too, then the page.
    wait_for(lambda: d.store_error is None, what="the store reported writable again")
    assert "gpuwarden_store_ok 1.0" in metrics(d)


def status(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("damage", ["json-value", "not-a-database"])
def test_an_unreadable_store_is_reported_by_status_and_set_aside_by_the_daemon(scenario_copy, tmp_path, running,
                                                                                damage):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    d = running(make(root, state))
    append_kmsg(root, XID13)
    wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 1, what="a written XID")
    d.stop()
    d.store.close()
    db = state / "state.db"
    if damage == "json-value":
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE checks SET state = '{\"incidents\": [' WHERE name = 'xid'")
    else:
        for extra in ("-wal", "-shm"):
            Path(f"{db}{extra}").unlink(missing_ok=True)
        db.write_bytes(b"this is not a database " * 200)
    shown = status(state)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert "unreadable" in shown.stdout + shown.stderr
    # The daemon sets it aside, says so, and starts afresh (the kernel log read again from the boot's start).
    again = running(make(root, state))
    assert [p.name for p in state.glob("state.db.corrupt-*")] and again.store.set_aside
    wait_for(lambda: xid_count(again.results()) == 1, what="the XID counted again from the kernel log, once")
    wait_for(lambda: again.store.meta("store_set_aside"), what="the note written into the fresh store")
    again.stop()
    shown = status(state)
    assert shown.returncode == 0 and "set aside as state.db.corrupt-" in shown.stdout, shown.stdout + shown.stderr


def test_a_state_folder_deleted_while_running_is_recreated(scenario_copy, tmp_path, running):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    d = running(make(root, state))
    append_kmsg(root, XID13)
    wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 1, what="a written XID")
    shutil.rmtree(state)
    wait_for(lambda: (state / "state.db").exists(), what="the state folder recreated")
    append_kmsg(root, XID13)
    wait_for(lambda: (c := d.store.check("xid")) and xid_count({"xid": c}) == 2,
             what="the state, old and new, written into the new folder")
    assert (state / LOCK_NAME).read_text().strip() == str(os.getpid())
    assert d.store.node() is not None and d.store.meta("kmsg_cursor")
    wait_for(lambda: d.store.meta("store_fault"), what="the deletion recorded")


# -- `gpuwarden run` refuses what it cannot have, in one line ---------------------------------------------------
def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "run", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_is_one_line_exit_2_and_creates_nothing(tmp_path):
    root = ROOT / "fixtures/nodes/gb200-nvl72-healthy"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("--root", str(root), "--state-dir", str(tmp_path / "state"), "--listen", f"127.0.0.1:{port}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and f"127.0.0.1:{port}" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_a_state_folder_that_cannot_be_made_is_one_line_exit_2(tmp_path):
    (tmp_path / "file").write_text("")
    proc = run_cli("--root", str(ROOT / "fixtures/nodes/gb200-nvl72-healthy"), "--state-dir",
                   str(tmp_path / "file" / "state"), "--listen", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "state folder" in proc.stderr


def test_a_second_daemon_on_one_state_folder_refuses_naming_the_first(scenario_copy, tmp_path):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    argv = [sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir", str(state)]
    first = subprocess.Popen([*argv, "--listen", f"127.0.0.1:{free_port()}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (state / LOCK_NAME).exists() and (state / LOCK_NAME).read_text().strip()
                 == str(first.pid), what="the first daemon's lock")
        second = run_cli("--root", str(root), "--state-dir", str(state), "--listen", f"127.0.0.1:{free_port()}")
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.pid}" in second.stderr and len(second.stderr.strip().splitlines()) == 1
        first.kill()  # the kernel releases the lock with its holder
        first.wait(10)
        port = free_port()
        third = subprocess.Popen([*argv, "--listen", f"127.0.0.1:{port}"], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: (state / LOCK_NAME).read_text().strip() == str(third.pid), what="the lock taken over")
            # Running (its signal handlers set) before it is asked to stop: a TERM during start-up ends it as TERM
            # ends any process, which is not what this test is about.
            wait_for(lambda: _answers(port), what="the third daemon serving")
        finally:
            third.terminate()
            assert third.wait(20) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)


def _answers(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_records_of_checks_no_longer_run_are_dropped_at_start(scenario_copy, tmp_path):
    """A state database from a version that named the daemon's XID check `xid_watch`: its last FAIL must not hold the
    node's state (or show in `status`) for ever once the check goes by another name."""
    from gpuwarden.agent.core.model import Action, Entity, Finding, Status
    from gpuwarden.agent.state.check_record import CheckRecord

    state = tmp_path / "state"
    old = Store(state / "state.db")
    stale = Finding("xid_watch", "79", Entity("gpu", "GPU-x", 2, "0018:01:00.0"), Status.FAIL, "off the bus",
                    Action.REBOOT)
    old.commit([CheckRecord("xid_watch", {}, Status.FAIL, None, (stale,), 1.0, 0.0)])
    old.close()
    root = scenario_copy("gb200-nvl72-healthy")
    store = Store(state / "state.db")
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), config.defaults(all_specs()), store,
               None, DaemonCollector(), DaemonOptions(kmsg_tick_s=0.01))
    try:
        assert "xid_watch" not in d.results() and store.check("xid_watch") is None
        d.start()
        wait_for(lambda: "xid" in d.results(), what="the first kernel-log tick")
        assert d.record.state.value == "healthy"
    finally:
        d.stop()
        store.close()


def test_a_commit_whose_check_hook_raises_changes_nothing(scenario_copy, tmp_path):
    """A check's quiet (or durable) hook that raises while its record is committed leaves memory as it was: no record
    that /metrics was never told of (the check's loop then reports it UNKNOWN, as the test above shows)."""
    from gpuwarden.agent.core.model import Status
    from gpuwarden.agent.state.check_record import CheckRecord

    def quiet(state):
        raise KeyError("ports")

    spec = PassiveSpec("flaky", "a check with a bug", sample=lambda n, c, s: 1,
                       judge=lambda s, x, c, now: Judgement({"n": x}), interval_s=0.02, quiet=quiet)
    d = make(scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", [spec])
    try:
        before = d.results()
        with d._lock, pytest.raises(KeyError):
            d._commit([CheckRecord("flaky", {"n": 1}, Status.OK, None, (), 1.0, 0.0)], None, 1.0)
        assert d.results() == before and "flaky" not in d._quiet_records
    finally:
        d.store.close()

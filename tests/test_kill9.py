"""kill -9 at many points while XIDs flow: the real `gpuwarden run` in its own process on a copy of a recorded node,
XIDs appended to its kernel log and NVML XID events to its nvml.json without pause, the process killed with
SIGKILL at varied moments and started again each time. At the end every XID is counted exactly once, the database
passes SQLite's integrity check, and the node never went back to healthy without a recorded reason."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT, wait_for
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.store_errors import StoreError

XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
XID31 = "3,{seq},{usec},-;NVRM: Xid (PCI:000a:01:00): 31, pid=7, name=python3, MMU Fault"
GPU3 = "0019:01:00.0"  # GPU 3 of gb200-nvl72-healthy, where the NVML XIDs are raised
HEALTHY_REASONS = {"clear", "fault cleared before quarantine", "retest passed"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Writer:
    """Appends XID 13 lines to the kernel log and XID 43 events (GPU 3) to nvml.json, in a thread, and counts
    what it wrote."""

    def __init__(self, root: Path):
        self.root, self.kmsg, self.nvml = root, 0, 0
        # Sequence and kernel clock continue from the log's last record, as the kernel's would.
        last = [line.split(",") for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit()]
        self._seq, self._usec = max(int(f[1]) for f in last), max(int(f[2]) for f in last)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._rng = random.Random(8)

    def line(self, template: str) -> None:
        self._seq, self._usec = self._seq + 1, self._usec + 1000
        with open(self.root / "kmsg", "a") as f:
            f.write(template.format(seq=self._seq, usec=self._usec) + "\n")

    def event(self) -> None:
        # Written whole and renamed into place: a reader never sees half a file.
        path = self.root / "nvml.json"
        data = json.loads(path.read_text())
        data["xid_events"].append({"gpu": 3, "xid": 43})
        stamp = path.stat().st_mtime_ns + 1_000_000_000
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.utime(tmp, ns=(stamp, stamp))
        os.replace(tmp, path)
        self.nvml += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(self._rng.randint(1, 5)):
                self.line(XID13)
                self.kmsg += 1
            if self._rng.random() < 0.3:
                self.event()
            self._stop.wait(self._rng.uniform(0.005, 0.05))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def start(root: Path, state: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(state), "--listen", f"127.0.0.1:{free_port()}", "--log-format", "json"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def incident(db: Path, pci: str, xid: int) -> dict:
    """The incident as the store holds it now (read-only; {} while the daemon has not written it)."""
    try:
        store = Store(db, readonly=True)  # what `gpuwarden status` reads, another process's view
        try:
            rec = store.check("xid")
        finally:
            store.close()
    except StoreError:
        return {}
    return rec.state.get("incidents", {}).get(f"{pci}|{xid}", {}) if rec else {}


def test_kill_9_while_xids_flow_loses_and_repeats_nothing(scenario_copy, tmp_path):
    from conftest import edit_nvml

    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    edit_nvml(root, lambda d: d.update(xid_events=[]))  # this node has NVML XID events
    db = state / "state.db"
    rng = random.Random(9)
    writer = Writer(root)
    proc = start(root, state)
    try:
        wait_for(lambda: db.exists() and incident(db, "0009:01:00.0", 13) == {} and state.joinpath("gpuwarden.lock")
                 .exists(), what="the first daemon up")
        writer.start()
        for _ in range(7):
            # Varied moments: right after start (replaying), mid-stream, after a longer run.
            time.sleep(rng.choice([0.05, 0.2, 0.5, 1.0, 1.5]))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            proc = start(root, state)
        writer.stop()
        writer.line(XID31)  # written last: once it is in the store, everything before it has been read
        wait_for(lambda: incident(db, "000a:01:00.0", 31).get("count") == 1, timeout_s=60,
                 what="the last line counted")
        wait_for(lambda: incident(db, GPU3, 43).get("nvml_count") == writer.nvml, timeout_s=60,
                 what=f"{writer.nvml} NVML XIDs counted")
        kmsg = incident(db, "0009:01:00.0", 13)
        assert kmsg["kmsg_count"] == writer.kmsg, (kmsg, writer.kmsg)  # none lost, none counted twice
    finally:
        writer.stop()
        proc.terminate()
        proc.wait(20)
    assert incident(db, GPU3, 43)["nvml_count"] == writer.nvml > 0  # the same after the clean stop
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        transitions = conn.execute("SELECT frm, too, reason FROM transitions ORDER BY id").fetchall()
        (node,) = conn.execute("SELECT record FROM node").fetchone()
    # One unbroken chain of transitions; back to healthy only with a reason the state machine gives.
    assert transitions and transitions[0][0] == "healthy"
    for (_, to, _), (frm, _, _) in zip(transitions, transitions[1:], strict=False):
        assert to == frm, transitions
    assert all(reason in HEALTHY_REASONS for _, to, reason in transitions if to == "healthy"), transitions
    assert json.loads(node)["state"] == transitions[-1][1] != "healthy"

"""kill -9 of the agent at many points during remediation: the real `gpuwarden run` (mode = act) on a copy of a
recorded node, an XID 79 injected through its kernel log, the process killed with SIGKILL at varied moments while
it cordons, quarantines and swaps a spare in, and started again each time. At the end the scheduler's own record
shows every intended change made exactly once (none lost, none twice), and the journal holds no pending intent."""
from __future__ import annotations

import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, append_kmsg, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter

HOST = "gb200-rack07-tray03"  # gb200-nvl72-healthy's hostname
XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
CONFIG = """
[remediation]
mode = "act"
adapter = "local"
retry_min_s = 0.05
retry_max_s = 0.5
[remediation.breaker]
cluster_share = 1.0
domain_share = 1.0
[remediation.ladder]
reboot = false
[topology]
domain = "rack07"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, state: Path, cfg: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "kill9_agent.py"), "0.15", "--", "run",
                             "--root", str(root), "--state-dir", str(state), "--listen", f"127.0.0.1:{free_port()}",
                             "--config", str(cfg), "--log-format", "json"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def journal(db: Path) -> list[tuple[str, float | None, str | None]]:
    try:
        with sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute("SELECT action, done, outcome FROM intents ORDER BY created, rowid").fetchall()
    except sqlite3.Error:
        return []


def changes(state: Path) -> list[tuple[str, str]]:
    """The scheduler's own record of what changed, in order."""
    return [(a["action"], a.get("node", "")) for a in LocalAdapter(state / "actions.jsonl").actions()
            if a.get("changed")]


def test_kill_9_during_remediation_loses_and_repeats_nothing(scenario_copy, tmp_path):
    root, state = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state"
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text(CONFIG)
    state.mkdir()
    LocalAdapter(state / "actions.jsonl").return_to_pool("spare-a", "rack07")  # the domain's spare
    before = changes(state)
    db = state / "state.db"
    rng = random.Random(79)
    kills = 0

    def starts() -> int:  # each start journals the node's domain once
        return sum(1 for a, _, _ in journal(db) if a == "publish_domain")

    proc = start(root, state, cfg)
    try:
        wait_for(lambda: starts() == 1, timeout_s=60, what="the first agent up")
        append_kmsg(root, XID79)
        # Each round: the agent up (reconciling what the last kill left), then killed a varied moment later (each
        # scheduler call takes 0.15 s: during a call, between two intents, between a call and its journal write).
        while kills < 12 and not (journal(db) and "take_spare" in {a for a, d, _ in journal(db) if d is not None}):
            time.sleep(rng.uniform(0.0, 0.45))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            kills += 1
            proc = start(root, state, cfg)
            wait_for(lambda n=kills + 1: starts() == n, timeout_s=60, what=f"agent {kills + 1} up")
        wait_for(lambda: (j := journal(db)) and "take_spare" in {a for a, _, _ in j}
                 and all(done is not None for _, done, _ in j), timeout_s=120, what="every intent done")
    finally:
        proc.terminate()
        proc.wait(20)
    assert kills >= 3  # killed during remediation, not only before or after it
    made = changes(state)[len(before):]
    ours = [(a, n) for a, n in made if a != "take_spare"]
    # The local scheduler commits a change with its line to its SQLite file, then appends the line to actions.jsonl:
    # a kill between the two leaves the line in the file's database, and the next call (or actions()) writes it, once.
    expected = [("publish_domain", HOST), ("cordon", HOST), ("quarantine", HOST)]
    assert ours == expected, made  # each once, in order, none lost
    assert [a for a, _ in made].count("take_spare") <= 1, made  # one spare taken, whatever the kills
    scheduler = LocalAdapter(state / "actions.jsonl")
    me = scheduler.node(HOST)
    assert me.quarantined and me.ours and me.service.value in ("drained", "cordoned"), me
    taken = [v for v in scheduler.nodes() if v.name == "spare-a"]
    assert taken and not taken[0].spare and taken[0].service.value == "in_service", taken  # the spare, taken once
    intents = journal(db)
    for action in ("cordon", "drain", "take_spare"):
        assert [a for a, _, _ in intents].count(action) == 1, intents  # one intent each, carried out once
    assert all(outcome for _, _, outcome in intents), intents
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

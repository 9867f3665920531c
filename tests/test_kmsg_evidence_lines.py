"""Which line a kernel record's evidence names: the followed file's own line, whichever poll read it and however much
the file held when the follower began (`analyze` of the same file names the same line); none for live /dev/kmsg,
which is no file (the record's seq names it). Through the follower and through the real `gpuwarden run`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, wait_for
from gpuwarden.agent.core.kernel_log import parse_kmsg_text
from gpuwarden.agent.daemon.events import _keep
from gpuwarden.agent.sources import kmsg as kmsg_source
from gpuwarden.agent.sources.kmsg import KernelLog, KmsgFollower
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS
from test_store_damage import GPU13, SEEN_S, XID13, Agent, agent  # noqa: F401 - the fixture

KEEP = _keep(list(KERNEL_CONSUMERS))
NOISE = "6,{seq},{usec},-;usb 1-1: new high-speed USB device number {seq} using xhci_hcd"


def _append(path: Path, template: str, n: int) -> None:
    records = parse_kmsg_text(path.read_text(), "kmsg")[0] if path.exists() else []
    seq = max((r.seq for r in records if r.seq is not None), default=0)
    with open(path, "a") as f:
        f.write("".join(template.format(seq=seq + i, usec=1000 * (seq + i)) + "\n" for i in range(1, n + 1)))


def _file_lines(path: Path) -> dict[int, int]:
    """seq -> the file's own line of that record, as the whole file's parse numbers it."""
    return {r.seq: r.line for r in parse_kmsg_text(path.read_text(), "kmsg")[0]}


@pytest.mark.parametrize("keep", [KEEP, None], ids=["scan", "text"])
def test_a_followed_file_s_records_carry_the_file_s_own_lines_across_polls(tmp_path, keep, monkeypatch):
    monkeypatch.setattr(kmsg_source, "_POLL_BYTES", 4096)  # a poll stops mid-file: several polls read one append
    path = tmp_path / "kmsg"
    _append(path, NOISE, 500)
    follower = KmsgFollower(KernelLog(path, live=False, boot_id="b"), Cursor("b", -1), keep)
    got = []
    try:
        while True:
            got += follower.poll()
            if not follower.more:
                break
        for _ in range(3):  # appends while following, each after more noise
            _append(path, NOISE, 300)
            _append(path, XID13, 1)
            while True:
                got += follower.poll()
                if not follower.more:
                    break
    finally:
        follower.close()
    lines = _file_lines(path)
    xids = [r for r in got if "Xid" in r.message]
    assert len(xids) == 3
    assert [(r.seq, r.line) for r in got] == [(r.seq, lines[r.seq]) for r in got]
    assert xids[-1].line == len(path.read_text().splitlines())


def test_a_truncated_followed_file_is_numbered_from_its_start_again(tmp_path):
    path = tmp_path / "kmsg"
    _append(path, NOISE, 50)
    follower = KmsgFollower(KernelLog(path, live=False, boot_id="b"), Cursor("b", -1), KEEP)
    try:
        follower.poll()
        path.write_text("")
        follower.poll()
        _append(path, NOISE, 2)
        _append(path, XID13, 1)
        follower.cursor = Cursor("b", -1)  # the rewritten log starts its seqs over: read it all
        (xid,) = follower.poll()
    finally:
        follower.close()
    assert xid.line == 3


def test_live_kmsg_records_carry_no_line(tmp_path):
    path = tmp_path / "kmsg"  # read as /dev/kmsg is: whole records, until EOF
    _append(path, NOISE, 5)
    _append(path, XID13, 1)
    live = KernelLog(path, live=True, boot_id="b", name="/dev/kmsg")
    follower = KmsgFollower(live, Cursor("b", -1), KEEP)
    try:
        (xid,) = follower.poll()
    finally:
        follower.close()
    assert (xid.source, xid.line, xid.seq) == ("/dev/kmsg", None, 6)
    assert {r.line for r in live.records()} == {None}


def _stored_xid(db: Path) -> dict:
    store = Store(db, readonly=True)
    try:
        return store.check("xid").state["incidents"][f"{GPU13}|13"]
    finally:
        store.close()


def test_the_daemon_s_xid_evidence_names_the_file_s_own_line_after_a_large_append(agent):  # noqa: F811 - the fixture
    """The outside report: a log appended to a running daemon had every stored last_line low by the lines the file
    held at the daemon's start. The stored lines are the file's, as `analyze` of the same file names them."""
    a = agent().start()
    kmsg = a.root / "kmsg"
    held = len(kmsg.read_text().splitlines())
    assert held > 10  # the recorded node's own log, before anything is appended
    _append(kmsg, NOISE, 20_000)
    _append(kmsg, XID13, 1)
    _append(kmsg, NOISE, 20_000)
    _append(kmsg, XID13, 1)
    records = [r for r in parse_kmsg_text(kmsg.read_text(), "kmsg")[0] if "Xid" in r.message and "0009:01" in r.message]
    first, last = records[0], records[-1]
    wait_for(lambda: a.count(GPU13, 13) == len(records), timeout_s=SEEN_S, what="both XIDs counted")
    a.stop()
    inc = _stored_xid(a.state / "state.db")
    assert (inc["last_line"], inc["last_seq"]) == (last.line, last.seq)
    assert (inc["first_line"], inc["first_seq"]) == (first.line, first.seq)
    shown = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "analyze", "--json", str(kmsg)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    (finding,) = [f for f in json.loads(shown.stdout)["findings"] if f["check"] == "xid"]
    assert (finding["evidence"]["first_line"], finding["evidence"]["last_line"]) == (first.line, last.line)

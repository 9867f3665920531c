"""The followed kernel log read in pieces: the byte scan finds exactly what the record-by-record parse finds, and a
running daemon counts every XID of a log appended in writes that cut lines anywhere."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from conftest import wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.kernel_log import parse_kmsg_filtered
from gpuwarden.agent.daemon.events import _keep
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources import kmsg as kmsg_source
from gpuwarden.agent.sources import kmsg_scan
from gpuwarden.agent.sources.kmsg import KernelLog, KmsgFollower
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.kmsg_scan import Interest
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, all_specs

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
KEEP = _keep(list(KERNEL_CONSUMERS))
XID = "3,{seq},{usec},-;NVRM: Xid (PCI:{pci}): {xid}, pid=1234, name=python3, Ch 00000008\n"
NOISE = "6,{seq},{usec},-;mlx5_core 0000:03:00.0: poll_health: health compromised - reached miss count\n"
PCIS = ("0008:01:00", "0009:01:00", "0018:01:00", "0019:01:00")
XIDS = (13, 31, 48, 79, 94)


def follow(path: Path, keep=KEEP, cursor: Cursor | None = None) -> KmsgFollower:
    return KmsgFollower(KernelLog(path, live=False, boot_id="b"), cursor, keep)


def as_rows(records, errors, last):
    return ([(r.message, r.line, r.seq, r.usec, r.priority, r.facility) for r in records],
            [(e.what, e.line) for e in errors], last)


HOSTILE = (
    "6,1,100,-;plain record\n"
    "\n"
    " SUBSYSTEM=pci\n"
    " DEVICE=+pci:0000:01:00.0 NVRM: in a continuation is not a record\n"
    "3,2,200,-;NVRM: Xid (PCI:0000:01:00): 79, pid=1, GPU has fallen off the bus.\n"
    "not a kmsg line at all NVRM: \n"
    "6,3,300;no flags field\n"
    "6,-4,300,-;negative seq\n"
    "6,4,400,c,extra,fields;NVRM: GPU at PCI:0000:01:00: GPU-abc\n"
    "6,123456789012345678901,1,-;a seq past the fast pattern's bounds\n"
    "6,5,500," + "f" * 40 + ";long flags NVRM: kept by the exact test\n"
    "3,6,600,-;pcieport 0000:00:01.0: AER: Multiple Uncorrected (Fatal) error received\n"
    "3,7,700,-;NVRM: bad utf-8 \xff\xfe here\n"
    "4,8,800,-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal\r\n"
    "3,9,900,-;CR in the middle\r of NVRM: a line\n"
    "6,10,1000,-;last record\n"
    " TRAILING=continuation\n"
)


def texts():
    yield "fixture gb200-nvl72-faulty", (NODES / "gb200-nvl72-faulty" / "kmsg").read_bytes()
    yield "fixture h100-hgx-healthy", (NODES / "h100-hgx-healthy" / "kmsg").read_bytes()
    yield "hostile", HOSTILE.encode("latin-1")
    yield "ends malformed", (HOSTILE + "garbage without a header\n\n").encode("latin-1")


@pytest.mark.parametrize("name,data", list(texts()), ids=[n for n, _ in texts()])
def test_the_byte_scan_finds_what_the_parser_finds(tmp_path, name, data):
    """Every record kept, every malformed line reported, the last seq: as parse_kmsg_filtered gives them for the
    text, whether the file is read in one piece or in pieces that cut lines anywhere."""
    want = as_rows(*parse_kmsg_filtered(data.decode(errors="replace"), "kmsg", KEEP))
    assert want[0], name  # the comparison has something to compare
    for piece in (1 << 18, 7, 61):
        path = tmp_path / f"kmsg-{piece}"
        path.write_bytes(b"")
        f = follow(path, cursor=Cursor("b", -10))
        old = kmsg_source._PIECE
        kmsg_source._PIECE = piece
        try:
            with open(path, "ab") as out:
                out.write(data)
            scan = f._scan_file()
        finally:
            kmsg_source._PIECE = old
        assert scan is not None
        assert as_rows(*scan[0]) == want, (name, piece)


def test_the_byte_scan_is_used_only_for_ascii_needles():
    assert Interest(["NVRM: ", "AER"]).raw == (b"NVRM: ", b"AER")
    assert Interest(["NVRM: ", "µ"]).raw is None  # the record-by-record filter then
    assert KEEP is not None and KEEP.raw is not None  # the bundled consumers take the byte scan


def test_a_line_without_end_is_reported_and_skipped_not_held(tmp_path):
    path = tmp_path / "kmsg"
    path.write_bytes(b"6,1,1,-;first\n" + b"x" * (kmsg_scan.MAX_LINE + 10))
    f = follow(path)
    f.poll()
    assert f.cursor.seq == 1 and f.malformed == 1 and "without a newline" in str(f.parse_errors[0])
    with open(path, "ab") as out:
        out.write(b"yyy\n3,2,2,-;NVRM: Xid (PCI:0000:01:00): 79, after\n")
    (rec,) = f.poll()
    assert rec.seq == 2 and "after" in rec.message and f.malformed == 1


def test_a_backlog_is_read_within_the_budget_and_more_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(kmsg_source, "_POLL_BYTES", 4096)
    monkeypatch.setattr(kmsg_source, "_PIECE", 1024)
    path = tmp_path / "kmsg"
    path.write_text("".join(XID.format(seq=i, usec=i, pci="0008:01:00", xid=13) for i in range(1, 501)))
    f = follow(path)
    got, polls = [], 0
    while True:
        got += f.poll()
        polls += 1
        if not f.more:
            break
    assert [r.seq for r in got] == list(range(1, 501)) and polls > 5
    assert f.cursor.seq == 500 and f.advanced == 500


def flood(first_seq: int, lines: int, rng: random.Random) -> tuple[bytes, dict[tuple[str, int], int]]:
    out, injected = [], {}
    for i in range(lines):
        seq = first_seq + i
        if rng.random() < 0.05:
            pci, xid = rng.choice(PCIS), rng.choice(XIDS)
            injected[(pci + ".0", xid)] = injected.get((pci + ".0", xid), 0) + 1
            out.append(XID.format(seq=seq, usec=seq * 10, pci=pci, xid=xid))
        else:
            out.append(NOISE.format(seq=seq, usec=seq * 10))
    return "".join(out).encode(), injected


def test_a_running_daemon_counts_every_xid_appended_in_pieces_that_split_lines(tmp_path):
    """Appended while the daemon runs, in writes of random sizes cut anywhere in a line: every record read once
    (the record counter), every XID counted once per (GPU, XID), and the cursor at the last record."""
    root = tmp_path / "node"
    shutil.copytree(NODES / "gb200-nvl72-healthy", root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    seqs = [int(line.split(",")[1]) for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit()]
    rng = random.Random(13)
    data, injected = flood(max(seqs) + 1, 20_000, rng)
    store = Store(tmp_path / "state" / "state.db")
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), config.defaults(all_specs()), store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), DaemonCollector(), DaemonOptions())
    d.start()
    try:
        wait_for(lambda: d._kmsg_records >= len(seqs), what="the boot log read")
        fd = os.open(root / "kmsg", os.O_WRONLY | os.O_APPEND)
        try:
            pos = 0
            while pos < len(data):
                n = rng.choice([1, 17, 100, 4096, 65536])
                os.write(fd, data[pos:pos + n])
                pos += n
        finally:
            os.close(fd)
        wait_for(lambda: d._kmsg_records >= len(seqs) + 20_000, what="every appended record read")

        def counted():
            incidents = d.results()["xid"].state.get("incidents", {})
            return {(i["pci"], int(i["xid"])): int(i["kmsg_count"]) for i in incidents.values()}

        wait_for(lambda: counted() == injected, what="every XID counted")
        assert d._kmsg_records == len(seqs) + 20_000
    finally:
        d.stop()
        store.close()
    reopened = Store(tmp_path / "state" / "state.db")
    try:
        assert reopened.meta("kmsg_cursor")["seq"] == max(seqs) + 20_000
        incidents = reopened.check("xid").state["incidents"]
        assert {(i["pci"], int(i["xid"])): i["kmsg_count"] for i in incidents.values()} == injected
    finally:
        reopened.close()


def test_live_kmsg_records_are_scanned_as_the_parser_reads_them(tmp_path):
    """/dev/kmsg hands over whole records: the scan of what one poll read equals the record-by-record parse (a
    regular file read as /dev/kmsg is, until EOF), with no line: /dev/kmsg is no file, a record's seq names it."""
    path = tmp_path / "kmsg"
    path.write_bytes(HOSTILE.encode("latin-1"))
    want = as_rows(*parse_kmsg_filtered(HOSTILE.encode("latin-1").decode(errors="replace"), "kmsg", KEEP))
    f = KmsgFollower(KernelLog(path, live=True, boot_id="b"), Cursor("b", -10), KEEP)
    try:
        got = f.poll()
        assert [(r.message, r.line, r.seq) for r in got] == [(m, None, s) for m, _n, s, *_ in want[0]]
        assert [(e.what, e.line) for e in f.parse_errors] == [(what, None) for what, _ in want[1]]
        assert f.cursor.seq == want[2] == 10
    finally:
        f.close()

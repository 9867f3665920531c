"""The job-log reader's lines counted in C (agent/core/_repeats.h): a line whose every flood is past its first lines
is registered, and the lines of its shape with the same digits where its floods' keys were read are counted by the C
search instead of parsed. explain's answers must not change for it: the reader gives the same events with the table
as without it (the fallback where the C part is not built), on the real job logs, on logs whose volatile numbers
collide with ranks, and over buffers small enough that most lines are counted in C."""
from __future__ import annotations

import ast
import random
import re
import re._constants as sre_constants
import re._parser as sre_parser
from pathlib import Path

import pytest
from gpuwarden.agent.core import line_search
from gpuwarden.agent.core.line_search import native
from gpuwarden.agent.jobs import joblog, joblog_lines
from gpuwarden.agent.jobs.joblog_patterns import shipped

ROOT = Path(__file__).resolve().parent.parent
JOB_LOGS = sorted((ROOT / "fixtures" / "job_logs").glob("*.log"))
needs_c = pytest.mark.skipif(native is None, reason="the package was built without its C search")
DIGITS = set(range(ord("0"), ord("9") + 1))


def _events(path: Path, repeats: bool, chunk: int, monkeypatch: pytest.MonkeyPatch) -> tuple:
    monkeypatch.setattr(joblog, "CHUNK", chunk)
    if not repeats:
        monkeypatch.setattr(joblog, "new_repeats", lambda *_: None)
    counted = []
    if repeats:
        real = joblog._Reader.flush

        def flush(self, lineno):
            counted.append(sum(count for _, count, _, _ in self._repeats.hits()))
            real(self, lineno)
        monkeypatch.setattr(joblog._Reader, "flush", flush)
    log = joblog.read_job_log(path)
    monkeypatch.undo()
    events = [(e.kind, e.line, e.text, sorted(e.fields.items(), key=repr), e.host, e.pid, e.dev, e.rank, e.local_rank,
               e.stamp) for e in log.events]
    return (events, log.notes, log.lines), sum(counted)


def _flood_log(path: Path, lines: int, seed: int) -> None:
    """Floods from 16 ranks on 4 hosts whose stamps, sequence numbers and ports take the ranks' values (a rank 12
    watchdog stamped 12:12:12), interleaved with lines of no interest and a rank whose lines change shape."""
    rnd = random.Random(seed)
    out = []
    for i in range(lines):
        rank = rnd.randrange(16)
        host, pid = f"gpu{rank // 4 + 10}", 4000 + rank
        hh, mm, ss = (rnd.choice([rank, rnd.randrange(24)]), rnd.choice([rank, rnd.randrange(60)]),
                      rnd.randrange(60))
        seq = rnd.choice([rank, rnd.randrange(10, 10**6)])
        glog = f"[rank{rank}]:[E1206 {hh:02}:{mm:02}:{ss:02}.{rnd.randrange(10**6):06} ProcessGroupNCCL.cpp:"
        form = rnd.randrange(5)
        if form == 0:
            out.append(f"{glog}{rnd.choice([616, 1566])}] [Rank {rank}] Watchdog caught collective operation timeout: "
                       f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn={rank * 1000}, NumelOut={rank * 1000}, "
                       f"Timeout(ms)=600000) ran for {600000 + rnd.randrange(100)} milliseconds before timing out.")
        elif form == 1:
            peer = rnd.choice([rank, (rank + 1) % 16])
            out.append(f"{host}:{pid}:{pid + rnd.randrange(9)} [{rank % 4}] transport/net_ib.cc:{rnd.randrange(999)}"
                       f" NCCL WARN NET/IB : Got completion from peer 10.0.{peer}.{rank}<{rnd.randrange(10**5)}> "
                       f"with status={rnd.choice([5, 12])} opcode=0 len=0 vendor err {rnd.choice([129, 244])} (Recv)")
        elif form == 2:
            out.append(f"{glog}1664] [PG ID {rnd.choice([0, 1])} PG GUID 0(default_pg) Rank {rank}] Exception "
                       f"(either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: "
                       f"{seq}, last completed NCCL work: {max(seq - rank, 0)}.")
        elif form == 3:
            out.append(f"{host}:{pid}:{pid} [{rank % 4}] NCCL INFO Channel {rank:02}/0 : {rank} -> {seq % 16} via "
                       "P2P/IPC")
        else:
            out.append(f"step {i} loss {rnd.random():.4f} rank {rank}")
    path.write_text("\n".join(out) + "\n")


def test_explain_reads_the_same_events_with_lines_counted_in_c_on_every_real_job_log(monkeypatch):
    """Buffers of 512 bytes: each real log spans many, so the lines registered in one are counted in the next."""
    assert JOB_LOGS
    for path in JOB_LOGS:
        with_table, _ = _events(path, True, 512, monkeypatch)
        without, _ = _events(path, False, 512, monkeypatch)
        assert with_table == without, path.name


@needs_c
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_explain_reads_the_same_events_when_a_floods_numbers_collide_with_its_ranks(tmp_path, monkeypatch, seed):
    path = tmp_path / "floods.log"
    _flood_log(path, 6000, seed)
    with_table, counted = _events(path, True, 4096, monkeypatch)
    without, _ = _events(path, False, 4096, monkeypatch)
    assert with_table == without
    assert counted > 2000, "most of the floods' lines are counted in C, not parsed"
    kept = {(e[0], e[7]) for e in with_table[0]}
    assert ("watchdog_timeout", 12) in kept and ("ib_completion", None) in kept


@needs_c
def test_explain_counts_a_repeated_real_log_in_c_and_keeps_each_floods_last_line(tmp_path, monkeypatch):
    text = "".join(p.read_text() + "\n" for p in JOB_LOGS)
    path = tmp_path / "repeated.log"
    path.write_text(text * 12)
    with_table, counted = _events(path, True, 1 << 16, monkeypatch)
    without, _ = _events(path, False, 1 << 16, monkeypatch)
    assert with_table == without
    found = sum(any(n.decode() in line for n in joblog_lines.NEEDLES) for line in text.splitlines()) * 12
    assert counted > found // 2, "the copies after the first few are mostly counted in C"
    lines = with_table[2]
    last = {e[0]: e[1] for e in with_table[0] if e[0] == "watchdog_timeout"}
    assert last and max(last.values()) > lines - text.count("\n"), "the flood's last line is the last copy's"


def _digit_rules(pattern: str) -> list[str]:
    """What in one regex tells digits apart (a literal digit but the 0 of "0x", a range holding some digits only, a
    reference to a group): each makes two lines of one shape parse differently."""
    bad = []

    def walk(items) -> None:
        items = list(items)
        for i, (op, av) in enumerate(items):
            if op in (sre_constants.LITERAL, sre_constants.NOT_LITERAL) and av in DIGITS:
                nxt = items[i + 1] if i + 1 < len(items) else None
                if not (av == ord("0") and op is sre_constants.LITERAL and nxt is not None
                        and nxt[0] is sre_constants.LITERAL and nxt[1] in (ord("x"), ord("X"))):
                    bad.append(f"the literal digit {chr(av)!r}")
            elif op is sre_constants.IN:
                for iop, iav in av:
                    if iop is sre_constants.LITERAL and iav in DIGITS:
                        bad.append(f"the digit {chr(iav)!r} in a set")
                    elif iop is sre_constants.RANGE and 0 < len(DIGITS & set(range(iav[0], iav[1] + 1))) < 10:
                        bad.append(f"the range {chr(iav[0])}-{chr(iav[1])}")
            elif op in (sre_constants.GROUPREF, sre_constants.GROUPREF_EXISTS):
                bad.append("a group reference")
            for part in av if isinstance(av, (tuple, list)) else (av,):
                if isinstance(part, sre_parser.SubPattern):
                    walk(part.data)
                elif isinstance(part, list):
                    for sub in part:
                        if isinstance(sub, sre_parser.SubPattern):
                            walk(sub.data)
    walk(sre_parser.parse(pattern).data)
    return bad


def test_explain_patterns_read_digits_only_as_digits():
    """The premise of _repeats.h: lines that differ only in their digits (of the same lengths, the 0 of "0x" kept) take
    the same way through the parse. Every shipped pattern, the texts the CUDA errors are told apart by, and the
    texts the parse looks for hold no digit but the 0 of "0x"."""
    data = shipped()
    sources = {name: pattern.pattern for name, pattern in data.patterns.items()}
    assert sources and all(not _digit_rules(src) for src in sources.values()), {
        name: _digit_rules(src) for name, src in sources.items() if _digit_rules(src)}
    assert not [key for key, _, _ in joblog_lines.HARDWARE_CUDA if re.search(r"[0-9]", key)]
    for module in ("joblog_lines.py", "joblog_prefix.py"):
        tree = ast.parse((ROOT / "agent" / "jobs" / module).read_text())
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                and isinstance(node.body[0], ast.Expr)}
        texts = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                 and isinstance(node.value, str) and id(node) not in docs]
        assert not [t for t in texts if re.search(r"[1-9]", t.replace("0123456789", ""))
                    or re.search(r"0(?![xX.])", t.replace("0123456789", ""))], module


def test_the_digit_rules_guard_sees_what_tells_digits_apart():
    assert _digit_rules(r"comm 0x[0-9a-f]+ rank (\d+)") == []
    assert _digit_rules(r"status=1\d") == ["the literal digit '1'"]
    assert _digit_rules(r"port [1-9]\d*") == ["the range 1-9"]
    assert _digit_rules(r"(\d+)-\1") == ["a group reference"]
    assert _digit_rules(r"(?:a|b0)") == ["the literal digit '0'"]


@needs_c
def test_repeats_counts_only_lines_of_a_registered_shape_with_its_significant_digits():
    table = native.Repeats(8, 64)
    probes = line_search.probes_for([b"WARN"])
    assert table.add(b"gpu1:12 WARN peer 10.0.0.7 at 12:30", 0b0000011, 0)  # host and pid runs significant
    assert not table.add(b"gpu1:12 WARN peer 10.0.0.7 at 12:30", 0b11, 5), "there already"
    buf = (b"gpu1:12 WARN peer 10.0.0.9 at 23:59\n"     # same shape, host and pid: counted
           b"gpu2:12 WARN peer 10.0.0.7 at 12:30\n"     # another host: handed on
           b"gpu1:12 WARN peer 10.0.0.77 at 12:30\n"    # a run of another length: another shape
           b"noise\n"
           b"gpu1:12 WARN peer 10.0.0.1 at 00:00\r\n")  # counted, its CR taken off
    joined, numbers, newlines, befores, found = native.gather(buf, 0, len(buf), probes, 100, 1, table)
    assert joined.split(b"\n") == [b"gpu2:12 WARN peer 10.0.0.7 at 12:30", b"gpu1:12 WARN peer 10.0.0.77 at 12:30"]
    assert numbers == [102, 103] and befores == [1, 2] and found == 4 and newlines == 5
    assert table.hits() == [(0, 2, 105, b"gpu1:12 WARN peer 10.0.0.1 at 00:00")]
    assert native.gather(buf, 0, len(buf), probes, 0)[1] == [1, 2, 3, 5], "without a table every line is handed on"


@needs_c
def test_repeats_narrows_a_shape_to_the_runs_every_registered_line_shares():
    table = native.Repeats(8, 64)
    probes = line_search.probes_for([b"WARN"])
    assert table.add(b"r3 WARN 12 34", 0b111, 0)
    assert table.add(b"r4 WARN 12 34", 0b011, 1)  # the last run is not significant after all: a new entry
    buf = b"r4 WARN 12 99\nr3 WARN 12 99\nr3 WARN 12 34\n"
    joined, _, _, _, found = native.gather(buf, 0, len(buf), probes, 0, 1, table)
    assert joined == b"r3 WARN 12 99\nr3 WARN 12 34" and found == 3, "r3's entry was made under the three runs"
    assert table.hits() == [(1, 1, 1, b"r4 WARN 12 99")]


@needs_c
def test_repeats_refuses_what_it_cannot_hold():
    table = native.Repeats(2, 16)
    assert not table.add(b"x" * 17, 0, 0), "longer than max_line"
    many = native.Repeats(2, 1024)
    assert not many.add(b" ".join(b"7" for _ in range(65)), 0, 0), "more than 64 runs of digits"
    assert table.add(b"a 1", 0, 0) and table.add(b"b 1", 0, 1)
    assert not table.add(b"c 1", 0, 2), "max_lines registered"
    assert table.registered() == 2
    with pytest.raises(ValueError):
        native.Repeats(-1, 16)
    with pytest.raises(TypeError):
        native.gather(b"a\n", 0, 2, line_search.probes_for([b"a"]), 0, 1, object())


@needs_c
def test_explain_counts_lines_counted_in_c_in_a_desync_reports_window(tmp_path, monkeypatch):
    """A desync report's rank lines are looked for in the 64 found lines after its head: the lines counted in C
    between them count there, so a rank line 70 flood lines on is not the report's. The head, the flood after it and
    the rank line lie in one buffer, the one after the flood's first lines registered it."""
    flood = [f"gpu1:{4000 + r}:{4000 + r} [0] misc/socket.cc:49 NCCL WARN Net : Connection closed by remote peer "
             f"gpu2.ib<{50000 + i}>" for i, r in ((i, i % 4) for i in range(400))]
    for gap, kept in ((70, False), (40, True)):
        lines = [*flood[:200],
                 "[rank0]:[E1206 10:15:02.123] To our best knowledge, the lagging/dead/mismatched ranks that caused "
                 "the desync are:", *flood[200:200 + gap],
                 "  - [7] finished collective #182, but didn't join collective #183 (count from 1)"]
        path = tmp_path / f"desync-{gap}.log"
        path.write_text("\n".join(lines) + "\n")
        with_table, counted = _events(path, True, 16384, monkeypatch)
        without, _ = _events(path, False, 16384, monkeypatch)
        assert with_table == without and counted >= gap
        assert any(e[0] == "desync_rank" for e in with_table[0]) is kept

"""`gpuwarden analyze` streams a kernel log (agent/node/kernel_scan.py): the findings, notes and format are those of a
parse of the whole file, on every recorded log and on generated ones (CRLF, invalid UTF-8, lines across chunk
boundaries, long lines, no newline at the end, empty files), read in chunks of many sizes."""
from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys

import pytest
from conftest import NODES, ROOT
from deadline import MIB, deadline
from gpuwarden.agent.cli import analyze as analyze_mod
from gpuwarden.agent.cli import analyze_ahead
from gpuwarden.agent.cli.analyze import analyze_file
from gpuwarden.agent.core.kernel_log import detect_format, parse_log_text
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.node import kernel_scan, kernel_scan_lines, kernel_scan_readers
from gpuwarden.agent.node.kernel_scan import read_head, scan
from gpuwarden.checks import nvswitch_sxid, xid

KERNEL = ROOT / "fixtures" / "logs" / "kernel"
RECORDED = sorted(p for p in KERNEL.iterdir() if p.is_file()) + sorted(NODES.glob("*/kmsg"))
CONSUMERS = (xid.CONSUMER, nvswitch_sxid.SXID_CONSUMER)


def whole(data: bytes, source: str) -> tuple[str, list, list[str]]:
    """What a parse of the whole file gives: its format, the kernel-log checks' findings, the malformed records."""
    text = data.decode(errors="replace")
    records, errors = parse_log_text(text, source)
    return detect_format(text), xid.judge_records(records) + nvswitch_sxid.judge_records(records), [
        str(e) for e in errors]


def streamed(data: bytes, source: str, chunk: int, line_max: int = 1 << 20) -> tuple[str, list, list[str], int]:
    f = io.BytesIO(data)
    head, head_text = read_head(f)
    fmt = detect_format(head_text)
    result = scan(f, source, fmt == "kmsg", CONSUMERS, first=head, chunk=chunk, line_max=line_max)
    return fmt, result.findings, [str(e) for e in result.errors] + result.notes, result.lines


def lines_in(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recorded_log_streams_to_the_findings_of_a_whole_parse(path):
    data = path.read_bytes()
    fmt, findings, notes = whole(data, str(path))
    for chunk in (1 << 20, 4096, 61):
        assert streamed(data, str(path), chunk) == (fmt, findings, notes, lines_in(data)), chunk
    result = analyze_file(path)
    assert list(result.findings) == findings and list(result.notes) == notes
    assert result.source == f"{path} (kernel-log/{fmt})"


def test_recorded_logs_hold_what_the_comparison_needs():
    """The comparison above means something: the recorded logs hold XIDs, SXids and a malformed kmsg record."""
    codes = {f.code for p in RECORDED for f in whole(p.read_bytes(), str(p))[1]}
    assert {"79", "119", "sxid-20034", "xid-unreadable"} <= codes
    assert any(whole(p.read_bytes(), str(p))[2] for p in RECORDED)


GPUS = ("0000:19:00", "0000:3b:00", "0000:4c:00", "0000:5d:00", "0000:9b:00", "0000:bb:00", "0000:cb:00", "0000:db:00")
NOISE = [line.split(";", 1)[1] for line in (NODES / "h100-hgx-healthy" / "kmsg").read_text().splitlines()
         if ";" in line and not line.startswith(" ")]


def driver_line(rnd: random.Random) -> str:
    gpu = rnd.choice(GPUS)
    return rnd.choice([
        f"NVRM: Xid (PCI:{gpu}): {rnd.choice((13, 31, 43, 48, 63, 79, 94, 119))}, pid={rnd.randint(1, 9)}, "
        f"name=python3, Ch 0000000{rnd.randint(0, 9)}",
        f"NVRM: Xid (PCI:{gpu}): 45, pid='<unknown>', name=<unknown>, Ch 00000010",
        f"NVRM: Xid (PCI:{gpu}): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        f"NVRM: Xid (PCI:{gpu}): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
        f"NVRM: Xid (PCI:{gpu} GPU-I:0{rnd.randint(1, 7)}): 43, pid=77, name=train, Ch 00000001",
        f"NVRM: GPU at PCI:{gpu}: GPU-{rnd.randrange(16 ** 8):08x}-c55b-d076-fa0e-d464e4c7e08b",
        f"NVRM: Xid PCI:{gpu} 79 (a form the driver does not print)",
        f"nvidia-nvswitch{rnd.randint(0, 3)}: SXid (PCI:0000:0{rnd.randint(5, 8)}:00.0): 20034, Fatal, Link "
        f"{rnd.randint(0, 63)} LTSSM Fault Up",
        f"nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 12028, Non-fatal, Link {rnd.randint(0, 63)} egress",
        "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60 Sub-engine instance 00",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01",
    ])


def generated(seed: int, fmt: str, n: int = 1500) -> bytes:
    """A kernel log of `fmt` with ~10 % driver lines, CRLF and invalid UTF-8 here and there."""
    rnd = random.Random(seed)
    out = bytearray()
    t = 100.0
    for i in range(1, n + 1):
        t += rnd.random()
        message = driver_line(rnd) if rnd.random() < 0.1 else rnd.choice(NOISE)
        raw = message.encode()
        if rnd.random() < 0.03:  # a byte that is no UTF-8, or a character cut in the middle, inside the line
            at = rnd.randrange(len(raw) + 1)
            raw = raw[:at] + rnd.choice((b"\xff", b"\xe2\x82", b"\xc3", "é".encode(), b"\x00")) + raw[at:]
        if fmt == "kmsg":
            line = b"%d,%d,%d,-;" % (rnd.choice((3, 4, 6)), i, int(t * 1e6)) + raw
            if rnd.random() < 0.05:
                line += b"\n SUBSYSTEM=pci\n DEVICE=+pci:0000:19:00.0"
        elif fmt == "dmesg":
            line = b"[%12.6f] " % t + raw
        elif fmt == "syslog":
            line = b"Jan %2d 09:30:%02d node17 kernel: [%12.6f] " % (1 + i // 1000, i % 60, t) + raw
        else:  # journal, short-iso
            line = b"2025-01-21T02:21:%02d+0000 node17 kernel: " % (i % 60) + raw
        out += line + (b"\r\n" if rnd.random() < 0.1 else b"\n")
        if rnd.random() < 0.02:
            out += rnd.choice((b"\n", b"   \n", b"\r\n"))
    return bytes(out)


@pytest.mark.parametrize("fmt", ["kmsg", "dmesg", "syslog", "journal"])
@pytest.mark.parametrize("seed", [1, 2])
def test_generated_logs_stream_to_the_findings_of_a_whole_parse(fmt, seed):
    data = generated(seed, fmt)
    detected, findings, notes = whole(data, "gen.log")
    assert detected == ("journal-iso" if fmt == "journal" else fmt)
    assert len(findings) > 10  # XIDs on several GPUs, SXids, an unreadable XID line
    for chunk in (1 << 20, 8192, 333, 97):
        assert streamed(data, "gen.log", chunk) == (detected, findings, notes, lines_in(data)), chunk


@pytest.mark.parametrize("batch, batch_bytes", [(1, 1 << 20), (7, 1 << 20), (4096, 300)])
def test_judging_in_batches_is_judging_the_whole(monkeypatch, batch, batch_bytes):
    """The checks' judges carry their state from batch to batch: a post-mortem in many batches is one in one."""
    monkeypatch.setattr(kernel_scan, "BATCH", batch)
    monkeypatch.setattr(kernel_scan, "BATCH_BYTES", batch_bytes)
    for fmt in ("kmsg", "dmesg"):
        data = generated(6, fmt)
        assert streamed(data, "b.log", 1 << 20) == (*whole(data, "b.log"), lines_in(data))


@pytest.mark.parametrize("ending", [b"", b"\r", b"\n", b"\r\n", b"\n\n", b"\xe2\x82"])
def test_the_last_line_with_or_without_a_newline(ending):
    data = generated(3, "dmesg", 200) + b"[ 9999.000001] NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=x, gone" + ending
    expected = whole(data, "end.log")
    assert any(f.evidence.get("last_line") == lines_in(data.rstrip(b"\n")) for f in expected[1])
    for chunk in (1 << 20, 64, 7):
        assert streamed(data, "end.log", chunk) == (*expected, lines_in(data))


def test_a_line_longer_than_a_chunk_is_read_whole():
    long_xid = b"[ 5.000000] " + b"x" * 300_000 + b" NVRM: Xid (PCI:0000:3b:00): 31, pid=5, name=a, " + b"y" * 5000
    data = generated(4, "dmesg", 300) + long_xid + b"\n" + generated(5, "dmesg", 300)
    expected = whole(data, "long.log")
    assert any(f.evidence["first_message"].startswith("NVRM: Xid (PCI:0000:3b:00): 31") for f in expected[1])
    for chunk in (1 << 16, 4096):
        assert streamed(data, "long.log", chunk) == (*expected, lines_in(data))


def test_a_line_past_line_max_is_read_cut_and_named():
    before = b"[ 1.000000] NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=a, DBE\n" * 3
    huge = b"[ 2.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, " + b"z" * 50_000 + b" NVRM: Xid x"
    after = b"\n[ 3.000000] NVRM: Xid (PCI:0000:4c:00): 94, pid=1, name=a, Contained\n"
    fmt, findings, notes, lines = streamed(before + huge + after, "cut.log", chunk=1024, line_max=4096)
    assert notes == [f"cut.log:4: line of {len(huge)} bytes; its first 4096 bytes read"]
    assert lines == 5
    assert [(f.code, f.evidence["first_line"]) for f in findings] == [("48", 1), ("79", 4), ("94", 5)]
    # The XID mark past the cut is not read: a whole parse would also report that line as unreadable.
    assert "xid-unreadable" not in {f.code for f in findings}


def test_lines_past_line_max_are_named_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(kernel_scan, "MAX_NOTES", 2)
    monkeypatch.setattr(kernel_scan_lines, "MAX_NOTES", 2)  # the readers' bound
    data = (b"q" * 5000 + b"\n") * 5 + b"[ 3.000000] NVRM: Xid (PCI:0000:4c:00): 94, pid=1, name=a, Contained\n"
    fmt, findings, notes, lines = streamed(data, "many.log", chunk=1024, line_max=4096)
    assert notes == ["many.log:1: line of 5000 bytes; its first 4096 bytes read",
                     "many.log:2: line of 5000 bytes; its first 4096 bytes read",
                     "many.log: 3 more line(s) longer than 4096 bytes, read cut"]
    assert [(f.code, f.evidence["first_line"]) for f in findings] == [("94", 6)] and lines == 6


@pytest.mark.parametrize("content, error", [
    (b"", "empty file"), (b"\n\n", "empty file"), (b" \t\r\n\x0c\n", "empty file"),
    ("\u3000\n\u2003".encode(), "empty file"),  # white space beyond ASCII
    (b"lunch at noon\nbring the cables\n", "not a format gpuwarden reads"),
])
def test_empty_and_unreadable_files_are_unknown(tmp_path, content, error):
    path = tmp_path / "f.log"
    path.write_bytes(content)
    result = analyze_file(path)
    assert result.status is Status.UNKNOWN and error in result.error and str(path) in result.error


def test_kmsg_records_the_checks_read_and_the_last_line_are_validated(tmp_path):
    """A raw kmsg file: a malformed record among the checks' lines, or at the end (a cut-off write), is a note with
    file:line; a malformed one elsewhere, which the checks would skip, is not looked for."""
    ok = "6,{0},{0}000,-;pci 0000:19:00.0: enabling device\n"
    lines = [ok.format(i) for i in range(1, 2001)]
    lines[99] = "4,100,100000;NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=a, gone\n"  # no flags: malformed
    lines[499] = "6,500,500000-;pci noise\n"  # malformed, not a line the checks read
    path = tmp_path / "kmsg"
    path.write_text("".join(lines) + "6,2001,20")
    result = analyze_file(path)
    assert result.source.endswith("(kernel-log/kmsg)")
    assert [n.split(": malformed")[0] for n in result.notes] == [f"{path}:100", f"{path}:2001"]
    path.write_text("".join(lines[:-1]) + "6,2000,20\n")
    assert [n.split(": malformed")[0] for n in analyze_file(path).notes] == [f"{path}:100", f"{path}:2000"]


def test_tool_outputs_are_detected_from_the_head_and_bounded(tmp_path, monkeypatch):
    nccl = ROOT / "fixtures" / "tools" / "nccl" / "EDITED__all_reduce_perf__1node-8xH100__g021__pass.txt"
    assert analyze_file(nccl).source.endswith("(nccl-tests)")
    monkeypatch.setattr(analyze_mod, "TOOL_MAX", nccl.stat().st_size - 1)
    result = analyze_file(nccl)
    assert result.status is Status.UNKNOWN and result.source.endswith("(nccl-tests)")
    assert result.error.startswith(f"{nccl}: larger than ") and "the most gpuwarden reads of a tool's output" in (
        result.error)


def test_a_kernel_log_quoting_a_tool_line_is_read_as_a_kernel_log(tmp_path):
    """Most lines are kernel-log lines: the tools' analyzers are not asked (nor imported), and the XID counts."""
    path = tmp_path / "kern.log"
    path.write_text("".join(f"Jan 01 09:30:{i % 60:02d} node17 kernel: pci noise {i}\n" for i in range(50))
                    + "Jan 01 09:31:00 node17 job[7]: #  size count type redop root time algbw busbw\n"
                    + "Jan 01 09:31:01 node17 kernel: NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=a, gone\n")
    result = analyze_file(path)
    assert result.source.endswith("(kernel-log/syslog)") and [f.code for f in result.findings] == ["79"]


def test_analyze_of_a_kernel_log_imports_only_the_kernel_log_checks():
    code = ("import sys, json; from pathlib import Path; from gpuwarden.agent.cli.analyze import analyze_file; "
            f"r = analyze_file(Path({str(NODES / 'gb200-nvl72-faulty' / 'kmsg')!r})); "
            "print(json.dumps([len(r.findings), sorted(m for m in sys.modules if m.startswith('gpuwarden.checks'))]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found, modules = json.loads(proc.stdout)
    assert found > 0
    assert set(modules) == {"gpuwarden.checks", "gpuwarden.checks.nvswitch_sxid", "gpuwarden.checks.unread_lines",
                            "gpuwarden.checks.line_patterns", "gpuwarden.checks.xid", "gpuwarden.checks.xid_catalog",
                            "gpuwarden.checks.xid_findings", "gpuwarden.checks.xid_log", "gpuwarden.checks.xid_reuse"}


@pytest.mark.parametrize("content", [
    b"\n" * MIB + b"x\n",  # blank lines, then text: the tools' detectors read the head
    b" \n" * (MIB // 2) + b"#",
    b"a " * MIB,  # one long line of words
    (b"#" + b" " * 1000 + b"\n") * 1000,
])
def test_detection_is_linear_on_hostile_heads(tmp_path, content):
    path = tmp_path / "hostile.txt"
    path.write_bytes(content)
    with deadline():
        result = analyze_file(path)
    assert result.status is Status.UNKNOWN and "not a format gpuwarden reads" in result.error


# ---------------------------------------------------------------- a large file read in parts by several processes

def in_parts(path, workers: int, part: int, line_max: int = 1 << 20, source: str = "p.log", chunk: int = 1 << 20):
    with open(path, "rb") as f:
        head, head_text = read_head(f)
        fmt = detect_format(head_text)
        result = scan(f, source, fmt == "kmsg", CONSUMERS, first=head, chunk=chunk, line_max=line_max, workers=workers,
                      part=part)
    return fmt, result.findings, [str(e) for e in result.errors] + result.notes, result.lines


def no_child_left() -> bool:
    """Every process a scan started has ended and been waited for."""
    import os

    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.parametrize("fmt", ["kmsg", "dmesg", "syslog", "journal"])
def test_parts_read_by_several_processes_give_the_findings_of_a_whole_parse(tmp_path, fmt):
    """Parts of one byte (every line a part of its own, so a boundary falls at every line end, between every CR
    and its LF) up to parts of many lines; the last line with no newline, in kmsg a record cut off there."""
    data = generated(7, fmt) + (b"6,9999,12" if fmt == "kmsg" else b"[ 9999.000001] NVRM: Xid (PCI:0000:19:00): 79,")
    path = tmp_path / "p.log"
    path.write_bytes(data)
    expected = (*whole(data, "p.log"), lines_in(data))
    assert expected[2] if fmt == "kmsg" else expected[1]
    for workers, part in ((2, 1), (3, 97), (2, 4096), (5, 50_000), (2, len(data) // 2)):
        assert in_parts(path, workers, part) == expected, (workers, part)
    assert no_child_left()


def test_a_part_boundary_inside_a_long_line(tmp_path):
    """A line longer than a part (and than line_max) is read by one process, cut and named with its number."""
    long_xid = b"[ 5.000000] NVRM: Xid (PCI:0000:3b:00): 31, pid=5, name=a, " + b"y" * 20_000
    before = generated(4, "dmesg", 300)
    data = before + long_xid + b"\r\n" + b"q" * 9000 + b"\n" + generated(5, "dmesg", 300)
    path = tmp_path / "long.log"
    path.write_bytes(data)
    one = in_parts(path, 1, 1 << 20, line_max=4096, chunk=1024)
    at = before.count(b"\n") + 1
    assert [n for n in one[2] if "line of" in n] == [
        f"p.log:{at}: line of {len(long_xid) + 1} bytes; its first 4096 bytes read",  # its CR counted
        f"p.log:{at + 1}: line of 9000 bytes; its first 4096 bytes read"]
    assert any(f.evidence["first_message"].startswith("NVRM: Xid (PCI:0000:3b:00): 31") for f in one[1])
    for part in (1, 1000, 5000, 30_000):
        assert in_parts(path, 2, part, line_max=4096, chunk=1024) == one, part
    assert in_parts(path, 3, 700) == (*whole(data, "p.log"), lines_in(data))  # no cut: as a whole parse


@pytest.mark.parametrize("fmt", ["dmesg", "kmsg"])
def test_whole_lines_read_with_a_long_lines_end_are_lines_of_their_own(tmp_path, fmt):
    """The lines that come in the same read as the end of a line past line_max are read one by one, with their own
    numbers, also where the file ends there (they were once read as one last line, newlines and all)."""
    if fmt == "dmesg":
        long, tail = b"q" * 9000, [b"[ 3.000000] NVRM: Xid (PCI:0000:4c:00): 94, pid=1, name=a, Contained",
                                   b"[ 4.000000] NVRM: Xid (PCI:0000:4c:00): 94, pid=2, name=b, Contained"]
    else:
        long, tail = b"6,1,1000,-;" + b"q" * 9000, [
            b"4,2,3000000,-;NVRM: Xid (PCI:0000:4c:00): 94, pid=1, name=a, Contained",
            b"4,3,4000000,-;NVRM: Xid (PCI:0000:4c:00): 94, pid=2, name=b, Contained"]
    data = b"\n".join((b"6,0,0,-;kernel start" if fmt == "kmsg" else b"[ 0.000000] kernel start", long, *tail)) + b"\n"
    path = tmp_path / "end.log"
    path.write_bytes(data)
    detected, findings, _ = whole(data, "p.log")
    [xid94] = findings
    assert (xid94.evidence["first_line"], xid94.evidence["last_line"], xid94.evidence["count"]) == (3, 4, 2)
    for workers, part in ((1, 1 << 20), (2, 50)):
        got = in_parts(path, workers, part, line_max=4096, chunk=1024)
        assert (got[0], got[1], got[3]) == (detected, findings, 4), (workers, part)
        assert got[2] == ["p.log:2: line of %d bytes; its first 4096 bytes read" % len(long)]


def test_notes_are_bounded_across_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_scan, "MAX_NOTES", 3)
    monkeypatch.setattr(kernel_scan_lines, "MAX_NOTES", 3)  # the readers' bound
    data = (b"q" * 5000 + b"\n") * 7 + b"[ 3.000000] NVRM: Xid (PCI:0000:4c:00): 94, pid=1, name=a, Contained\n"
    path = tmp_path / "many.log"
    path.write_bytes(data)
    expected = in_parts(path, 1, 1 << 20, line_max=4096, chunk=1024)
    assert expected[2][-1] == "p.log: 4 more line(s) longer than 4096 bytes, read cut"
    assert in_parts(path, 2, 6000, line_max=4096, chunk=1024) == expected
    ok = "6,{0},{0}000,-;pci 0000:19:00.0: enabling device\n"
    bad = "6,{0},{0}000;NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=a, gone\n"  # no flags: malformed
    path.write_text("".join((bad if i % 50 == 0 else ok).format(i) for i in range(1, 400)))
    expected = in_parts(path, 1, 1 << 20)
    assert len(expected[2]) == 4 and expected[2][-1] == "p.log: 4 more malformed kmsg record(s), not listed"
    assert in_parts(path, 3, 1000) == expected


@pytest.mark.parametrize("how", ["raises", "dies", "killed"])
def test_a_process_that_fails_is_an_error_naming_the_file(tmp_path, monkeypatch, how):
    """Never a partial result: a reader that raises, exits or is killed makes the file UNKNOWN, named."""
    import os
    import signal

    real = kernel_scan_lines._text_rows  # what a reader calls on each part's lines it reads

    def failing(raws, linenos):
        if any(b"0000:db:00" in raw for raw in raws):  # a part in the middle of the file
            if how == "raises":
                raise MemoryError("no room")
            if how == "dies":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(raws, linenos)

    data = generated(8, "syslog", 3000)
    path = tmp_path / "f.log"
    path.write_bytes(data)
    monkeypatch.setattr(kernel_scan_lines, "_text_rows", failing)
    with pytest.raises(kernel_scan_readers.ScanError) as caught:
        in_parts(path, 2, 5000, source=str(path))
    assert str(caught.value).startswith(f"{path}: reading bytes ") and "the file was not read whole" in str(
        caught.value)
    assert {"raises": "MemoryError: no room", "dies": "exited with status 3",
            "killed": f"killed by signal {signal.SIGKILL}"}[how] in str(caught.value)
    assert no_child_left()
    monkeypatch.setattr(kernel_scan, "PARALLEL_MIN", 0)
    monkeypatch.setattr(kernel_scan, "PART", 5000)
    result = analyze_file(path)
    if len(os.sched_getaffinity(0)) > 1:  # read in parts only where this process may use more than one CPU
        assert result.status is Status.UNKNOWN and result.error.startswith(f"{path}: reading bytes ")
    assert no_child_left()


def test_a_reader_that_is_held_up_reads_fewer_parts_and_the_result_is_the_same(tmp_path, monkeypatch):
    """Parts go to whichever reader is free: one reader slowed down (as by sharing its CPU with the judging) leaves
    its parts to the other, instead of the whole waiting on it; the findings stay the whole parse's."""
    import os
    import time

    data = generated(9, "dmesg", 4000)
    path = tmp_path / "held.log"
    path.write_bytes(data)
    slow, log = tmp_path / "slow", tmp_path / "who"
    real = kernel_scan._read_part

    def read_part(*args):
        try:  # the first reader to read a part is the slow one
            os.close(os.open(slow, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.environ["HELD_UP"] = "1"
        except FileExistsError:
            pass
        if os.environ.get("HELD_UP"):
            time.sleep(0.05)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"%d\n" % os.getpid())
        os.close(fd)
        return real(*args)

    monkeypatch.setattr(kernel_scan, "_read_part", read_part)
    monkeypatch.delenv("HELD_UP", raising=False)
    got = in_parts(path, 2, 4096)
    assert got == (*whole(data, "p.log"), lines_in(data))
    counts = sorted(log.read_text().split().count(pid) for pid in set(log.read_text().split()))
    with open(path, "rb") as f:
        assert len(counts) == 2 and sum(counts) == len(kernel_scan_readers._parts(f.fileno(), 0, len(data), 4096))
    assert counts[1] > 2 * counts[0], counts  # read in turn, each would have read half
    assert no_child_left()


def counting_forks(monkeypatch) -> list[int]:
    import os

    forks: list[int] = []
    real_fork = os.fork

    def fork():
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(kernel_scan.os, "fork", fork)
    return forks


def test_a_large_file_is_read_in_parts_by_default(tmp_path, monkeypatch):
    """Past PARALLEL_MIN bytes, as many processes as CPUs read it: the result is the whole parse's."""
    import os

    forks = counting_forks(monkeypatch)
    monkeypatch.setattr(kernel_scan, "PARALLEL_MIN", 0)
    monkeypatch.setattr(kernel_scan, "PART", 4096)
    path = NODES / "gb200-nvl72-faulty" / "kmsg"
    data = path.read_bytes()
    fmt, findings, notes = whole(data, str(path))
    result = analyze_file(path)
    assert list(result.findings) == findings and list(result.notes) == notes and findings
    assert len(forks) == min(len(os.sched_getaffinity(0)), kernel_scan.MAX_WORKERS, -(-len(data) // 4096)) or (
        len(os.sched_getaffinity(0)) == 1 and not forks)


def test_parts_start_at_line_starts(tmp_path):
    import os

    data = b"a\r\nbb\n\nccc" + b"d" * 100 + b"\n" + b"e"
    path = tmp_path / "x"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for part in (1, 2, 3, 50, 1000):
            parts = kernel_scan_readers._parts(fd, 0, len(data), part)
            assert parts[0][0] == 0 and parts[-1][1] == len(data)
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
            assert all(data[s - 1:s] == b"\n" and e - s >= min(part, len(data) - s) for s, e in parts[1:])
    finally:
        os.close(fd)


def test_the_texts_analyze_reads_are_the_kernel_log_checks_interest():
    consumers = analyze_mod._kernel_consumers()
    assert consumers == CONSUMERS
    assert analyze_mod.KERNEL_INTEREST == tuple(t for c in consumers for t in c.interest)


def test_a_reader_reads_each_stamp_as_a_whole_parse(tmp_path):
    """A reader takes a "[secs.frac] " line at once; journalctl's monotonic form (a host after the stamp), a stamp
    after white space, and a stamp of another shape are read as a whole parse reads them."""
    xid_line = "NVRM: Xid (PCI:0000:19:00): {}, pid=1, name=a, text"
    lines = [f"[{i:6d}.{i:06d}] node17 kernel: " + xid_line.format(13) for i in range(1, 200)]
    lines += [f"  [{i:6d}.{i:06d}] " + xid_line.format(31) for i in range(200, 400)]
    lines += [f"[{i}.5]" + xid_line.format(43) for i in range(400, 600)]  # no space after the stamp
    lines += [f"[{i:6d}.{i:09d}] " + xid_line.format(48) for i in range(600, 800)]
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / "mono.log"
    path.write_bytes(data)
    expected = (*whole(data, "p.log"), lines_in(data))
    assert {f.code for f in expected[1]} == {"13", "31", "43", "48"}
    assert in_parts(path, 2, 3000) == expected


@pytest.mark.parametrize("content", [
    "".join(f"[{i:6d}.000001] pci {'x' * (i % 300)} noise\n" for i in range(2500)),  # the vote's lines past the
    "".join(f"[{i:6d}.000001] pci noise\n" for i in range(2500)),  # first head read, and within it
    "é" * 300_000 + "\n" + "[ 1.000001] NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=a, gone\n",  # one long line
])
def test_the_head_read_in_two_steps_is_the_head(tmp_path, monkeypatch, content):
    """The vote is taken on the same first lines, and a file that is not a kernel log gets the whole head."""
    path = tmp_path / "h.log"
    path.write_text(content)
    with open(path, "rb") as f:
        head, text = read_head(f, 1000)
        assert read_head(f, kernel_scan.HEAD_CHARS, have=head) == read_head(io.BytesIO(path.read_bytes()))
    seen = []
    monkeypatch.setattr(analyze_mod, "format_votes", lambda text: seen.append(text) or detect_votes(text))
    result = analyze_file(path)
    data = path.read_bytes()
    fmt = whole(data, str(path))[0]
    assert result.source.endswith(f"(kernel-log/{fmt})") and list(result.findings) == whole(data, str(path))[1]
    assert detect_votes(seen[0]) == detect_votes(data.decode()[:kernel_scan.HEAD_CHARS])


def detect_votes(text):
    from gpuwarden.agent.core.kernel_log import format_votes

    return format_votes(text)


def test_no_process_to_be_had_reads_the_file_here(tmp_path, monkeypatch):
    """fork fails (a limit on processes): the readers started are ended and the file is read by this process."""
    import errno
    import os

    real_fork, forks = os.fork, []

    def fork():
        if forks:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        forks.append(real_fork())
        return forks[-1]

    data = generated(9, "kmsg")
    path = tmp_path / "k.log"
    path.write_bytes(data)
    monkeypatch.setattr(kernel_scan.os, "fork", fork)
    assert in_parts(path, 3, 2000) == (*whole(data, "p.log"), lines_in(data))
    assert len(forks) == 1 and no_child_left()


# ---------------------------------------------------------------- the first FILE's readers, started before the CLI

def test_readers_started_ahead_give_the_report_analyze_gives_alone(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("read in parts only where this process may use more than one CPU")
    monkeypatch.setattr(kernel_scan, "PARALLEL_MIN", 0)
    monkeypatch.setattr(kernel_scan, "PART", 4096)
    data = generated(11, "dmesg", 3000)
    path = tmp_path / "big.log"
    path.write_bytes(data)
    forks = counting_forks(monkeypatch)
    analyze_ahead.read_ahead(["--log-level", "info", "--json", f"{tmp_path}/./big.log", "other.log"])
    started = len(forks)
    assert started >= 2 and len(analyze_mod._AHEAD) == 1
    report = analyze_mod.analyze([Path(f"{tmp_path}/./big.log")])  # as argparse gives it
    assert len(forks) == started and not analyze_mod._AHEAD  # taken up: no reader started again
    [result] = report.results
    assert (list(result.findings), list(result.notes)) == whole(data, str(path))[1:] and result.findings
    assert no_child_left()


def test_a_command_line_the_cli_refuses_ends_the_readers_started_ahead(tmp_path, monkeypatch):
    import os
    import sys

    from gpuwarden.agent.cli import command

    monkeypatch.setattr(kernel_scan, "PARALLEL_MIN", 0)
    monkeypatch.setattr(kernel_scan, "PART", 4096)
    path = tmp_path / "big.log"
    path.write_bytes(generated(12, "dmesg", 3000))
    forks = counting_forks(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["gpuwarden", "analyze", str(path), "--no-such-flag"])
    with pytest.raises(SystemExit) as ended:
        command.console()
    assert ended.value.code == 2
    assert forks or len(os.sched_getaffinity(0)) < 2
    assert not analyze_mod._AHEAD and no_child_left()


@pytest.mark.parametrize(("args", "first"), [
    (["a.log", "b.log"], "a.log"),
    (["--json", "a.log"], "a.log"),
    (["--log-format", "json", "--log-level=debug", "a.log"], "a.log"),
    (["--", "-a.log"], "-a.log"),
    (["--help", "a.log"], None),  # any other option: argparse decides, nothing is read ahead
    (["--js", "a.log"], None),  # an abbreviation argparse takes is left to it too
    (["-"], None),
    ([], None),
])
def test_the_first_file_read_ahead_is_only_one_the_cli_reads_the_same(args, first):
    assert analyze_ahead._first_file(args) == first


def test_only_a_large_regular_file_is_read_ahead(tmp_path, monkeypatch):
    """A pipe named first is not opened (its bytes would be lost to the analyze that follows); a small file is left
    to analyze_file."""
    import os

    forks = counting_forks(monkeypatch)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with deadline():
        analyze_ahead.read_ahead([str(fifo)])  # an open() of it would wait for a writer
    small = tmp_path / "small.log"
    small.write_bytes(generated(13, "dmesg", 100))
    analyze_ahead.read_ahead([str(small)])
    assert not analyze_mod._AHEAD and not forks


def test_a_reader_started_ahead_that_fails_makes_the_file_unknown(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("read in parts only where this process may use more than one CPU")
    real = kernel_scan_lines._text_rows

    def failing(raws, linenos):
        if any(b"0000:db:00" in raw for raw in raws):
            os._exit(3)
        return real(raws, linenos)

    monkeypatch.setattr(kernel_scan_lines, "_text_rows", failing)
    monkeypatch.setattr(kernel_scan, "PARALLEL_MIN", 0)
    monkeypatch.setattr(kernel_scan, "PART", 5000)
    path = tmp_path / "f.log"
    path.write_bytes(generated(8, "syslog", 3000))
    analyze_ahead.read_ahead([str(path)])
    assert analyze_mod._AHEAD
    [result] = analyze_mod.analyze([Path(path)]).results
    assert result.status is Status.UNKNOWN and result.error.startswith(f"{path}: reading bytes ")
    assert "exited with status 3" in result.error and not analyze_mod._AHEAD and no_child_left()


def test_a_flood_read_in_parts_makes_records_only_for_the_lines_the_judges_ask_for(tmp_path, monkeypatch):
    """The readers send rows; the xid judge reads every message and makes a record of the first and last line of
    each text of a batch (its evidence), not of every line of a flood: the findings are the whole parse's."""
    texts = ["NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
             "NVRM: Xid (PCI:0000:3b:00): 13, pid=12, name=python, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0)",
             "NVRM: GPU at PCI:0000:19:00: GPU-5f6c4c1e-26a8-0f1b-6a8d-bd1b5a2ac0b1"]
    noise = "usb 1-1: new high-speed USB device number 2 using xhci_hcd"
    lines = [f"[{i / 1000:12.6f}] {texts[i % 3] if i % 4 else noise}" for i in range(1, 20001)]
    path = tmp_path / "flood.log"
    path.write_text("\n".join(lines) + "\n")
    made = []
    real = kernel_scan.RowRecords.__getitem__

    def counted(self, i):
        made.append(i)
        return real(self, i)

    monkeypatch.setattr(kernel_scan.RowRecords, "__getitem__", counted)
    _, findings, notes, count = in_parts(path, 2, 20000)
    assert count == 20000 and not notes
    xid_lines = sum(1 for line in lines if "Xid" in line)
    assert 0 < len(made) < xid_lines // 50  # a few per batch and text, of 10,000 XID lines
    records, _ = parse_log_text(path.read_text(), "p.log")
    whole = xid.judge_records(records)
    assert sorted((f.code, f.evidence["count"], f.evidence["first_line"], f.evidence["last_line"])
                  for f in findings if f.check == "xid") == sorted(
        (f.code, f.evidence["count"], f.evidence["first_line"], f.evidence["last_line"]) for f in whole)


def test_a_reader_holds_its_results_past_a_full_pipe_up_to_its_bound_and_sends_them_in_order(monkeypatch):
    """While this process is busy (loading the checks) a reader reads on, its results held past a full pipe, but
    no more than OUTBOX_BYTES of them: then it waits for the pipe. What arrives is every result, in order."""
    import threading

    r, w = os.pipe()
    monkeypatch.setattr(kernel_scan_readers, "OUTBOX_BYTES", 1 << 20)
    outbox = kernel_scan_readers._Outbox(w)
    messages = [("part", i, [f"{i} {k} " + "x" * 1000 for k in range(50)]) for i in range(8)]  # ~50 KB each
    for message in messages:
        outbox.send(message)  # nobody reads (the pipe holds 64 KiB): held here, not waited for
    assert outbox.held > 0 and outbox.held <= 1 << 20
    got = []
    taker = threading.Thread(target=lambda: got.extend(kernel_scan_readers._receive(r) for _ in range(40)))
    taker.start()
    monkeypatch.setattr(kernel_scan_readers, "OUTBOX_BYTES", 100_000)
    more = [("part", i, [f"{i} {k} " + "y" * 1000 for k in range(50)]) for i in range(8, 40)]
    for message in more:
        outbox.send(message)  # past the bound: waits for the taker
        assert outbox.held <= 100_000 + 60_000
    outbox.flush()
    taker.join(10)
    os.close(w)
    assert [tuple(m) for m in got] == messages + more and os.read(r, 1) == b""
    os.close(r)

"""agent/core/_line_scan.c, the line search in C: built wherever a C compiler and Python's headers are, giving
line_search's Python answers exactly (the lines, their numbers, the joined text, the newlines), on the readers' own
buffers and on hostile ones, and refusing bad probes with an error rather than reading past a buffer."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from gpuwarden.agent.core import line_search
from gpuwarden.agent.core.line_search import native, probes_for, python_gather, python_lines_holding
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
needs_c = pytest.mark.skipif(native is None, reason="the package was built without its C search")

KERNEL_TEXTS = (b"Xid", b"NVRM: GPU at ", b"SXid", b"NVSwitch")
PIECES = (*KERNEL_TEXTS, b"NVRM: Xid (PCI:0000:19:00): 79, ", b"X", b"V", b"N", b"NVRM", b"\r", b"\r\n", b"\n",
          b"\x00", b"\xff\xfe", b"noise ", b"[ 12.345678] ", b"desync", b"atchdog")


def test_the_c_search_is_built_where_a_compiler_and_the_headers_are():
    """CI runs where both are: the suite must exercise the C search there, not only its fallback."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip(f"no C compiler or no {headers}: the package is built without its C search here")
    assert native is not None, "a C compiler and Python.h are here, yet gpuwarden.agent.core._line_scan is not built"
    assert line_search.lines_holding.__module__ == line_search.__name__


@needs_c
@settings(max_examples=500, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=300), lead=st.binary(max_size=4),
       tail=st.binary(max_size=12), base=st.integers(0, 10**9),
       texts=st.sampled_from([KERNEL_TEXTS, (b"Xid",), (b"desync", b"atchdog", b"NVRM: "), (b"\xff\xfe",)]))
def test_c_and_python_find_the_same_lines_numbers_and_text(parts, lead, tail, base, texts):
    body = b"".join(parts) + b"\n"
    buf = bytearray(lead.replace(b"\n", b" ") + b"\n" + body + tail.replace(b"\n", b" "))
    start, stop = len(lead) + 1, len(lead) + 1 + len(body)
    probes = probes_for(texts)
    assert native.lines_holding(buf, start, stop, probes) == python_lines_holding(buf, start, stop, probes)
    assert native.gather(buf, start, stop, probes, base) == python_gather(buf, start, stop, probes, base)
    assert native.count_newlines(buf, start, stop) == buf.count(b"\n", start, stop)


@needs_c
def test_c_and_python_agree_on_every_recorded_kernel_and_job_log():
    logs = [p for d in ("fixtures/logs", "fixtures/nodes") for p in (ROOT / d).rglob("*") if p.is_file()
            and p.stat().st_size < 8 << 20]
    assert len(logs) > 20, logs
    from gpuwarden.agent.jobs.joblog_lines import NEEDLES

    for path in logs:
        data = path.read_bytes()
        stop = data.rfind(b"\n") + 1
        for texts in (KERNEL_TEXTS, tuple(NEEDLES)):
            probes = probes_for(texts)
            assert native.gather(data, 0, stop, probes, 7) == python_gather(data, 0, stop, probes, 7), path
            assert native.lines_holding(data, 0, stop, probes) == python_lines_holding(data, 0, stop, probes), path


@needs_c
def test_counting_newlines_is_exact_at_every_alignment_and_length():
    data = bytes(range(256)) * 3 + b"\n\n\x0a\x8a\x0b\x09" * 40
    for start in range(0, 70):
        for stop in (start, start + 1, start + 15, start + 16, start + 17, start + 63, start + 64, start + 65,
                     len(data)):
            assert native.count_newlines(data, start, stop) == data.count(b"\n", start, stop)
    # Across the blocks of 255 rows of 16 bytes the count is kept in, and with every byte a newline (each lane's
    # count at its most, 255).
    for data in (b"\n" * 20_000, (b"ab\ncd" * 4000)):
        for start in (0, 1, 15):
            for stop in (4079 + start, 4080 + start, 4081 + start, 8160 + start, 8161 + start, len(data)):
                assert native.count_newlines(data, start, stop) == data.count(b"\n", start, stop)


@needs_c
def test_a_text_that_would_reach_past_the_buffer_is_never_compared_there():
    """A region whose last line has no newline (the readers never hand one; the Python search assumes none): the
    C search compares no text past the buffer's end, and names such a line's end -1."""
    probes = probes_for((b"NVSwitch", b"NVRM: "))  # one probe: V, the second byte of each
    assert native.lines_holding(b"NV", 0, 2, probes) == []
    assert native.lines_holding(b"a\nxNVRM:", 0, 8, probes) == []
    assert native.lines_holding(b"a\nxNVRM: ", 0, 9, probes) == [(2, -1)]
    assert native.lines_holding(bytearray(b"NVRM: \nNVSwi"), 0, 12, probes) == [(0, 6)]


@needs_c
@pytest.mark.parametrize("probes, error", [
    ([(b"XX", 0, (b"XX",))], ValueError),  # a probe byte is one byte
    ([(b"X", 3, (b"Xid",))], ValueError),  # the byte is not at its offset in the text
    ([(b"X", 0, (b"X\n",))], ValueError),  # a text holds no newline
    ([(b"X", -1, (b"Xid",))], ValueError),
    ([(b"X", 0, [b"Xid"])], TypeError),  # the texts are a tuple
    ([(b"X", 0, ("Xid",))], ValueError),  # of bytes
    ([("X", 0, (b"Xid",))], TypeError),
    ([None], TypeError),
    (None, TypeError),
])
def test_bad_probes_are_refused_with_an_error(probes, error):
    with pytest.raises(error):
        native.lines_holding(b"a Xid\n", 0, 6, probes)
    with pytest.raises(error):
        native.gather(b"a Xid\n", 0, 6, probes, 0)


@needs_c
def test_a_region_outside_the_buffer_is_refused_by_gather_and_bounded_by_lines_holding():
    probes = probes_for((b"Xid",))
    for start, stop in ((-1, 6), (0, 7), (5, 2)):
        with pytest.raises(ValueError):
            native.gather(b"a Xid\n", start, stop, probes, 0)
    assert native.lines_holding(b"a Xid\n", -5, 99, probes) == [(0, 5)]
    assert native.lines_holding(b"a Xid\n", 4, 2, probes) == []
    assert native.gather(b"", 0, 0, probes, 0) == (b"", [], 0)


def test_without_the_c_search_the_readers_give_the_same_findings(tmp_path):
    """The fallback is what runs where no compiler was: `analyze --json` of a dense log with the C search or the C
    rows (or both) hidden from the process gives the findings it gives with them."""
    log = tmp_path / "kern.log"
    lines = []
    for i in range(30_000):
        if i % 7 == 0:
            lines.append(f"[{i / 1000:12.6f}] NVRM: Xid (PCI:0000:{(i // 7) % 4:02x}:00): {(13, 31, 79)[i % 3]}, "
                         f"pid={100 + i % 5}, name=python, Graphics Exception\r")
        else:
            lines.append(f"[{i / 1000:12.6f}] usb 1-{i % 9}: new high-speed USB device number {i}")
    log.write_text("\n".join(lines) + "\n")

    def analyze(*hidden: str) -> str:
        code = ("import sys\n"
                + "".join(f"sys.modules['gpuwarden.agent.core.{name}'] = None\n" for name in hidden)
                + "from gpuwarden.agent.core import line_search, log_rows\n"
                + f"assert (line_search.native is None) is {'_line_scan' in hidden}\n"
                + f"assert (log_rows.native is None) is {'_log_rows' in hidden}\n"
                + "from gpuwarden.agent.cli.main import main\n"
                + f"sys.exit(main(['analyze', '--json', {str(log)!r}]))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": "0"})
        assert proc.returncode == 1, proc.stderr
        return re.sub(r'"duration_s": [0-9.]+', '"duration_s": _', proc.stdout)  # how long it took differs

    if native is None:
        pytest.skip("the package was built without its C search: only the fallback is here")
    found = analyze()
    # the search in Python, the rows in Python (agent/core/_log_rows.c), or both
    assert analyze("_line_scan") == found and analyze("_log_rows") == found
    assert analyze("_line_scan", "_log_rows") == found


@needs_c
@settings(max_examples=60, deadline=None)
@given(noise=st.lists(st.sampled_from([b"a", b"aa ", b"banana ", b"atchdo ", b"\n", b"watchdog", b"desync", b"X"]),
                      min_size=100, max_size=2000),
       every=st.integers(1, 400))
def test_a_probe_byte_common_in_the_buffer_turns_to_the_texts_and_finds_the_same_lines(noise, every):
    """Past a run of misses the C search looks for the texts themselves (memmem): the same lines as before it."""
    parts = [p for i, p in enumerate(noise) for p in ((p, b"\n[rank3]: Watchdog caught collective operation timeout\n")
                                                       if i % every == every - 1 else (p,))]
    buf = b"".join(parts) + b"\n"
    # ("anx", "ana"): two texts of one probe (a, 0), the first never found: each text keeps its own place.
    for texts in ((b"atchdog",), (b"atchdog", b"desync", b"Xid"), (b"ana",), (b"anx", b"ana")):
        probes = probes_for(texts)
        assert native.lines_holding(buf, 0, len(buf), probes) == python_lines_holding(buf, 0, len(buf), probes)
        assert native.gather(buf, 0, len(buf), probes, 3) == python_gather(buf, 0, len(buf), probes, 3)


def _routes() -> list[int]:
    """The routes of native's `multi` argument this CPU has: 0 the probes' passes, 1 the best one-pass route, 2 the
    16-byte one (NEON on aarch64; SSSE3 on x86_64, where AVX2 is the best)."""
    return [0, 1] + ([2] if native.MULTI_ROUTE != "none" else [])


def _job_texts() -> tuple[bytes, ...]:
    from gpuwarden.agent.jobs.joblog_lines import NEEDLES

    return tuple(NEEDLES)


# Pieces of the job-log texts: each whole, cut short by a byte, and with the byte a nibble filter lets through in
# place of one of its own (the same low or high nibble), so that the filter's candidates and its misses both occur.
def _near_misses(text: bytes) -> list[bytes]:
    out = [text, text[:-1], text[1:]]
    for i in range(len(text)):
        out.append(text[:i] + bytes([text[i] ^ 0x10]) + text[i + 1:])
        out.append(text[:i] + bytes([text[i] ^ 0x01]) + text[i + 1:])
    return out


JOB_PIECES = tuple(p for t in _job_texts() for p in _near_misses(t)) + (b"\n", b"\r\n", b"\x00", b"\xff", b" ", b"a")


@needs_c
@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(JOB_PIECES), max_size=400), lead=st.binary(max_size=4),
       tail=st.sampled_from([b"", b"NCC", b"Xi", b"NCCL WAR", b"Tracebac", b"desyn"]), base=st.integers(0, 10**6),
       cut=st.integers(0, 40))
def test_the_one_pass_for_many_texts_finds_the_lines_the_probes_find(parts, lead, tail, base, cut):
    """Past MULTI_PROBES probes (the job-log reader's 20) one vector pass looks for all texts at once: on each route
    it finds the lines the probes' passes and the Python search find, up to a region's end that cuts a text (a tail
    past `stop` that is the start of a text, and a region ending mid-line)."""
    body = b"".join(parts) + b"\n"
    buf = bytearray(lead.replace(b"\n", b" ") + b"\n" + body + tail)
    start = len(lead) + 1
    probes = probes_for(_job_texts())
    for stop in (start + len(body), max(start, start + len(body) - cut)):
        want = python_lines_holding(buf, start, stop, probes)
        for route in _routes():
            assert native.lines_holding(buf, start, stop, probes, route) == want, route
            if stop == start + len(body):
                assert native.gather(buf, start, stop, probes, base, route) == python_gather(buf, start, stop, probes,
                                                                                             base), route


@needs_c
def test_the_one_pass_finds_a_text_at_every_place_of_a_vector_step_and_at_the_buffer_end():
    """A text at each offset across two 32-byte steps, and the buffer's last bytes (the scalar tail), on each route."""
    probes = probes_for(_job_texts())
    for text in _job_texts():
        for pad in range(70):
            buf = b"x" * pad + text + b"\n" + b"y" * (pad % 5)
            want = python_lines_holding(buf, 0, len(buf), probes)
            assert want == [(0, pad + len(text))]
            for route in _routes():
                assert native.lines_holding(buf, 0, len(buf), probes, route) == want, (text, pad, route)
                assert native.lines_holding(buf, 0, pad + len(text), probes, route) == [(0, -1)], (text, pad, route)
                # the region ends inside the text: not a hit of this region
                cut = pad + probes_offset(probes, text)
                assert native.lines_holding(buf, 0, cut, probes, route) == python_lines_holding(buf, 0, cut,
                                                                                                probes) == []


def probes_offset(probes, text: bytes) -> int:
    return next(at for _, at, texts in probes for t in texts if t == text)


@needs_c
def test_the_one_pass_route_is_named_and_a_route_this_cpu_lacks_is_refused():
    assert native.MULTI_ROUTE in {"avx2", "vec16", "none"}
    probes = probes_for(_job_texts())
    if native.MULTI_ROUTE == "none":
        with pytest.raises(ValueError, match="16-byte route"):
            native.lines_holding(b"a Xid\n", 0, 6, probes, 2)
    else:
        assert native.lines_holding(b"a Xid\n", 0, 6, probes, 2) == [(0, 5)]

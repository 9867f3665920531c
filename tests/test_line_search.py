"""agent/core/line_search.py: the lines of a buffer that hold one of a few texts, found by a rare byte of each and,
where that byte is common, by the texts themselves: the same lines as a plain search of every line, whichever way,
in C (agent/core/_line_scan.c) and in Python alike."""
from __future__ import annotations

import pytest
from gpuwarden.agent.core.line_search import (
    FORGET_AFTER,
    RUN_MIN,
    ProbeMemory,
    native,
    probes_for,
    python_lines_holding,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def c_lines_holding(buf, start, stop, probes, memory=None):
    return native.lines_holding(buf, start, stop, probes)


SEARCHES = [pytest.param(python_lines_holding, id="python"),
            pytest.param(c_lines_holding, id="c", marks=pytest.mark.skipif(native is None, reason="built without C"))]

TEXTS = (b"NVRM: ", b"SXid", b"NVSwitch", b"AER", b"PCIe Bus Error", b"[Hardware Error]:")
# Pieces of lines: the texts, their rare bytes alone and in near misses (so a probe byte is common or rare), noise.
PIECES = (*TEXTS, b"X", b"V", b"R", b"H", b"B", b"Xid", b"NVR", b"AE", b"SX", b"[Hardware", b"ERROR", b"noise ", b"\n")


def plain(buf: bytes, texts: tuple[bytes, ...]) -> list[tuple[int, int]]:
    out, at = [], 0
    while at < len(buf):
        end = buf.index(b"\n", at)
        if any(t in buf[at:end] for t in texts):
            out.append((at, end))
        at = end + 1
    return out


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=400), lead=st.binary(max_size=3),
       texts=st.sampled_from([TEXTS, TEXTS[:3], TEXTS[3:], (b"SXid",), (b"Xid", b"SXid", b"NVRM: Xid", b"NVSwitch")]))
@pytest.mark.parametrize("lines_holding", SEARCHES)
def test_the_lines_found_are_those_that_hold_a_text(lines_holding, parts, lead, texts):
    body = b"".join(parts) + b"\n"
    buf = lead.replace(b"\n", b" ") + b"\n" + body + b"partial line after the last newline, X V R SXid"
    start, stop = len(lead) + 1, len(lead) + 1 + len(body)
    got = lines_holding(buf, start, stop, probes_for(texts))
    want = [(s, e) for s, e in plain(buf[:stop], texts) if s >= start]
    assert got == want


@pytest.mark.parametrize("lines_holding", SEARCHES)
def test_a_common_probe_byte_turns_to_the_texts_and_finds_the_same_lines(lines_holding):
    line = b"ROUTER RR: reset R R R\n"  # R is the probe byte of "AER": far more than one a KiB, none a text
    buf = line * 500 + b"pcieport 0000:00:01.0: AER: Corrected error received\n" + line * 500
    probes = probes_for((b"AER",))
    assert probes == [(b"R", 2, (b"AER",))]
    assert buf.count(b"R") > RUN_MIN and lines_holding(buf, 0, len(buf), probes) == plain(buf, (b"AER",))


@settings(max_examples=150, deadline=None)
@given(buffers=st.lists(st.lists(st.sampled_from(PIECES), max_size=300), min_size=1, max_size=6),
       texts=st.sampled_from([TEXTS, TEXTS[3:], (b"AER",)]))
@pytest.mark.parametrize("lines_holding", SEARCHES)
def test_a_memory_of_earlier_buffers_changes_no_line_found(lines_holding, buffers, texts):
    memory, probes = ProbeMemory(), probes_for(texts)
    for parts in buffers:
        buf = b"".join(parts) + b"\n"
        assert lines_holding(buf, 0, len(buf), probes, memory) == plain(buf, texts)


def test_a_probe_byte_common_in_one_buffer_is_searched_by_its_texts_in_the_next_and_forgotten_later():
    lines_holding = python_lines_holding  # the Python search's route; the C search needs no memory
    noisy = b"ROUTER RR: reset R R R\n" * 500 + b"pcieport 0000:00:01.0: AER: Corrected error received\n"
    quiet = b"kernel: all well\n" * 50 + b"pcieport 0000:00:01.0: AER: Corrected error received\n"
    memory, probes = ProbeMemory(), probes_for((b"AER",))
    assert lines_holding(noisy, 0, len(noisy), probes, memory) == plain(noisy, (b"AER",))
    assert memory.common == {0}  # learnt: the next buffer searches for "AER" itself
    for _ in range(FORGET_AFTER - 2):
        assert lines_holding(quiet, 0, len(quiet), probes, memory) == plain(quiet, (b"AER",))
        assert memory.common == {0}
    lines_holding(quiet, 0, len(quiet), probes, memory)
    assert memory.common == set()  # forgotten: where the byte is rare again it is the probe again
    lines_holding(quiet, 0, len(quiet), probes, memory)
    assert memory.common == set()


@pytest.mark.parametrize("lines_holding", SEARCHES)
def test_a_text_that_holds_another_is_found_with_it(lines_holding):
    """"SXid" holds "Xid": a line with it holds "Xid" too, so it is not looked for apart (its probe byte, X, would
    be a miss on every XID line, and past the misses allowed the buffer searched again for it)."""
    probes = probes_for((b"Xid", b"NVRM: GPU at ", b"SXid", b"NVSwitch", b"NVRM: Xid"))
    assert [texts for _, _, texts in probes] == [(b"Xid",), (b"NVRM: GPU at ", b"NVSwitch")]
    buf = b"a\nnvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20034\nNVRM: Xid (PCI:0000:19:00): 79, x\nb\n"
    assert [buf[s:e] for s, e in lines_holding(buf, 0, len(buf), probes)] == [
        b"nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20034", b"NVRM: Xid (PCI:0000:19:00): 79, x"]

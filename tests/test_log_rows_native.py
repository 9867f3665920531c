"""agent/core/_log_rows.c, a dense kernel log's found lines made rows and the runs of their texts in C: built
wherever a C compiler and Python's headers are, giving the Python answers exactly. dmesg_rows reads only the lines
DMESG_LINES surely reads as it does and defers the rest to the pattern, so a dmesg part's records are the pattern's
on hostile lines too (a stamp of Unicode digits, a journal's host, white space past ASCII, bad UTF-8); text_runs is
python_text_runs; RowRecords gives the same records from a part's columns as from its rows."""
from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
from gpuwarden.agent.core import log_rows
from gpuwarden.agent.core.log_rows import native, python_text_runs
from gpuwarden.agent.node import kernel_scan, kernel_scan_lines
from gpuwarden.agent.node.kernel_scan import RowRecords
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
needs_c = pytest.mark.skipif(native is None, reason="the package was built without its C part")

FIRST = b"[    1.000000] NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=python, GPU has fallen off the bus."
# Pieces of dmesg lines and of what only looks like one: each decides a branch of DMESG_LINES or of the C reading.
PIECES = (b"[", b"]", b" ", b"  ", b".", b"0", b"12", b"123456", b"1234567890123", b"\xd9\xa3",  # ARABIC-INDIC 3
          b"\xc2\xa0", b"\xe2\x80\xa8", b"\x1c", b"\t", b"\x0b", b"\r", b"\x00", b"\xff", b"\xe2\x82",
          b"host", b" kernel: ", b"kernel:", b"NVRM: Xid (PCI:0000:3b:00): 13, ", b"Graphics Exception",
          b"nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, ", b"<6>", b"Dec  7 12:00:00 ")


def test_the_c_part_is_built_where_a_compiler_and_the_headers_are():
    """CI runs where both are: the suite must exercise the C code there, not only its fallback."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip(f"no C compiler or no {headers}: the package is built without its C part here")
    assert native is not None, "a C compiler and Python.h are here, yet gpuwarden.agent.core._log_rows is not built"


def _as_rows(rows: kernel_scan_lines.Rows) -> list[tuple]:
    """A part's records as rows, whichever form they came in, as the judges get them."""
    records = RowRecords("-")
    records.add(rows, 0)
    return [(r.message, r.line, r.seq, r.usec, r.priority, r.timestamp, r.facility) for r in records]


def _pattern_rows(raws: list[bytes], linenos: list[int], monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    with monkeypatch.context() as m:
        m.setattr(log_rows, "native", None)
        rows = kernel_scan_lines._text_rows(raws, linenos)
    assert type(rows) is list
    return _as_rows(rows)


# A stamp, most often one the pattern takes, else one just past its bounds.
STAMPS = st.tuples(st.sampled_from([b"[", b"[ ", b"[     ", b""]),
                   st.sampled_from([b"1", b"12345", b"123456789012", b"1234567890123", b"\xd9\xa3", b""]),
                   st.sampled_from([b".", b"", b","]),
                   st.sampled_from([b"5", b"123456789", b"1234567890", b"\xd9\xa3", b""]),
                   st.sampled_from([b"] ", b"]", b"]  ", b"", b"]\t"])).map(b"".join)
LINES = st.tuples(STAMPS, st.lists(st.sampled_from(PIECES), max_size=10).map(b"".join)).map(b"".join)


@needs_c
@settings(max_examples=800, deadline=None)
@given(lines=st.lists(LINES, max_size=40), base=st.integers(1, 10**9))
def test_c_and_the_pattern_make_the_same_records_of_any_dmesg_part(lines, base):
    raws = [b"\n".join([FIRST, *lines])]
    linenos = [base + 3 * k for k in range(len(lines) + 1)]
    with pytest.MonkeyPatch.context() as m:
        expected = _pattern_rows(raws, linenos, m)
    got = kernel_scan_lines._text_rows(raws, linenos)
    assert _as_rows(got) == expected


@needs_c
def test_what_the_c_code_is_not_sure_of_is_deferred_and_the_rest_goes_as_columns(monkeypatch):
    sure = [b"[  12.345678] NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
            b"[12.3] short stamp, no space after it:[x]",
            b"[ 123456789012.123456789]  two spaces: the second is the message's"]
    unsure = [b"[ 1234567890123.5] thirteen digits: no stamp to the pattern",
              b"[\xd9\xa3.5] a stamp of Unicode digits",
              b"[ 1.5] node12 kernel: a journal's host after the stamp",
              b"[ 1.5] word\xc2\xa0kernel: white space past ASCII may end the word",
              b"no stamp at all: Xid"]
    messages, stamps, ends, deferred = native.dmesg_rows(b"\n".join(sure + unsure), list(range(8)), {})
    assert [k for k, _ in deferred] == [3, 4, 5, 6, 7] and [raw for _, raw in deferred] == unsure
    assert messages[:3] == ["NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception", "short stamp, no space after it:[x]",
                            " two spaces: the second is the message's"] and messages[3:] == [None] * 5
    assert kernel_scan_lines.stamp_texts(stamps, ends) == ["12.345678", "12.3", "123456789012.123456789", *[""] * 5]
    assert type(kernel_scan_lines._text_rows([b"\n".join(sure)], [1, 2, 3])) is tuple  # columns
    assert type(kernel_scan_lines._text_rows([b"\n".join(sure + unsure)], list(range(8)))) is list  # rows
    assert _as_rows(kernel_scan_lines._text_rows([b"\n".join(sure + unsure)], list(range(8)))) == _pattern_rows(
        [b"\n".join(sure + unsure)], list(range(8)), monkeypatch)


@needs_c
def test_one_object_for_each_text_and_bad_utf8_read_as_the_pattern_reads_it(monkeypatch):
    line = b"[ 5.000001] NVRM: Xid (PCI:0000:19:00): 79, \xff\xe2\x82 GPU has fallen off the bus."
    raws = [b"\n".join([line] * 3)]
    messages, *_ = native.dmesg_rows(raws[0], [1, 2, 3], {})
    assert messages[0] is messages[1] is messages[2] and "\ufffd" in messages[0]
    assert _as_rows(kernel_scan_lines._text_rows(raws, [1, 2, 3])) == _pattern_rows(raws, [1, 2, 3], monkeypatch)


@needs_c
def test_bad_arguments_are_refused_with_an_error():
    with pytest.raises(ValueError, match="2 numbers for 3 lines"):
        native.dmesg_rows(b"a\nb\nc", [1, 2], {})
    for args in ((b"a", (1,), {}), (b"a", [1], []), ("a", [1], {})):
        with pytest.raises(TypeError):
            native.dmesg_rows(*args)
    with pytest.raises(TypeError):
        native.text_runs(("a", "b"))
    with pytest.raises(TypeError):
        native.text_runs(["a", ["unhashable"]])


@needs_c
@settings(max_examples=400, deadline=None)
@given(texts=st.lists(st.one_of(st.sampled_from(["a", "b", "NVRM: Xid", ""]), st.text(max_size=3),
                                st.integers(-3, 3)), max_size=200))
def test_c_and_python_give_the_same_runs(texts):
    got = native.text_runs(texts)
    assert got == python_text_runs(texts) and list(got) == list(python_text_runs(texts))  # the order too


def test_runs_name_each_text_s_count_first_and_last_in_the_order_each_first_appears():
    texts = ["x", "y", "x", "z", "x", "y"]
    assert log_rows.text_runs(texts) == {"x": (3, 0, 4), "y": (2, 1, 5), "z": (1, 3, 3)}
    assert list(log_rows.text_runs(texts)) == ["x", "y", "z"] and log_rows.text_runs([]) == {}


@needs_c
def test_a_part_with_more_records_than_a_batch_is_taken_in_batches_the_same(monkeypatch):
    """A part's columns cut across batches (lines of a few bytes each) give the records its rows give."""
    lines = [b"[%d.%06d] Xid %d" % (k, k, k % 3) for k in range(50)]
    raws, linenos = [b"\n".join(lines)], list(range(10, 60))
    columns = kernel_scan_lines._text_rows(raws, linenos)
    assert type(columns) is tuple
    monkeypatch.setattr(kernel_scan, "BATCH", 7)
    cut = [kernel_scan._rows_slice(columns, at, at + 7) for at in range(0, 50, 7)]
    records = RowRecords("-")
    for part in cut:
        records.add(part, 100)
    whole = RowRecords("-")
    whole.add(columns, 100)
    assert [(r.message, r.line, r.usec) for r in records] == [(r.message, r.line, r.usec) for r in whole]
    assert whole[-1].line == 159 and whole[0].usec == 0 and whole[49].usec == 49_000_049
    with pytest.raises(IndexError):
        whole[50]

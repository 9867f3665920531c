"""parse_nvbandwidth on every real capture under fixtures/tools/nvbandwidth, on edits of them, and on arbitrary
text (only ParseError may escape)."""
from pathlib import Path

import pytest
from deadline import MIB, deadline
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.checks.parse_nvbandwidth import parse_nvbandwidth
from hypothesis import given, settings
from hypothesis import strategies as st

CAPTURES = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "nvbandwidth"
H100 = CAPTURES / "unattributed__d2d-read-write-ce-latency-h2d-d2h__8xH100-SXM__v0.10.0.txt"
GB200 = CAPTURES / "oci-hpc-oke__multinode-d2d-read-ce__2x4xGB200-NVL72__v0.7.txt"
A6000 = CAPTURES / "nvidia-nvbandwidth-issue50__d2d-read-ce__6xA6000-PCIe__v0.8.txt"
GH200 = CAPTURES / "superbenchmark__all-testcases__1xGH200__v0.6__FIXTURE-EDITED.txt"


def captures():
    return sorted(p for p in CAPTURES.iterdir() if not p.name.endswith(".source.txt"))


@pytest.mark.parametrize("path", captures(), ids=lambda p: p.name)
def test_every_capture_parses_and_has_a_source(path):
    assert (path.parent / (path.name + ".source.txt")).is_file()
    run = parse_nvbandwidth(path.read_text(), path.name)
    assert run.matrices and run.version and run.driver
    for m in run.matrices.values():
        assert m.total is not None and m.unit in ("GB/s", "ns")
        # SUM is nvbandwidth's own sum of the cells (N/A counted as 0), printed with two decimals.
        assert abs(sum(v or 0.0 for v in m.values.values()) - m.total) < 0.01 * len(m.values)


def test_h100_read_ce_matrix_every_pair():
    run = parse_nvbandwidth(H100.read_text(), H100.name)
    assert run.version == "v0.10.0" and run.driver == "595.71.05" and run.devices == {}
    m = run.matrices["device_to_device_memcpy_read_ce"]
    assert m.title == "memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)" and m.unit == "GB/s"
    assert m.columns == tuple(str(i) for i in range(8)) and m.rows == m.columns
    assert m.values[("0", "0")] is None and m.values[("3", "2")] == 395.23 and m.values[("7", "0")] == 395.05
    assert m.total == 22126.64
    assert run.matrices["device_to_device_latency_sm"].unit == "ns"
    assert run.matrices["device_to_host_memcpy_ce"].rows == ("0",)


def test_matrix_without_running_line_takes_its_name_from_sum():
    run = parse_nvbandwidth(A6000.read_text(), A6000.name)
    m = run.matrices["device_to_device_memcpy_read_ce"]
    assert len(m.values) == 36 and m.values[("3", "5")] == 26.35 and m.total == 715.53


def test_multinode_and_device_lines():
    run = parse_nvbandwidth(GB200.read_text(), GB200.name)
    m = run.matrices["multinode_device_to_device_memcpy_read_ce"]
    assert m.values[("1", "5")] == 798.25
    run = parse_nvbandwidth(GH200.read_text(), GH200.name)
    assert run.devices == {0: ("NVIDIA GH200 480GB", "0009:01:00")}
    assert "host_device_latency_sm" in run.matrices


def test_failed_and_waived_testcases_are_recorded():
    text = ("Running device_to_device_memcpy_read_ce.\n"
            " Invalid value when checking the pattern at 0x70a640000000\n"
            "ASSERT in expression h_errorFlag == 0 in void memcmpPatternHelper(...)() : memcpy.cpp:165\n"
            "Running device_to_device_memcpy_write_ce.\nWaived: \n")
    run = parse_nvbandwidth(text, "x")
    assert run.matrices == {}
    assert run.errors == {"device_to_device_memcpy_read_ce": "Invalid value when checking the pattern at "
                                                              "0x70a640000000"}
    assert run.waived == ("device_to_device_memcpy_write_ce",)


def test_old_release_zero_diagonal_without_sum():
    # NVIDIA/nvbandwidth README example of early releases: 0.00 on the diagonal, no SUM line.
    text = ("Running device_to_device_memcpy_read_ce.\nmemcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)\n"
            "          0         1\n0      0.00    264.36\n1    264.60      0.00\n")
    m = parse_nvbandwidth(text, "x").matrices["device_to_device_memcpy_read_ce"]
    assert m.values == {("0", "0"): 0.0, ("0", "1"): 264.36, ("1", "0"): 264.6, ("1", "1"): 0.0} and m.total is None


def test_truncated_row_and_bad_cell_name_the_line():
    lines = H100.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(" 4    395.19"))
    cut = "\n".join(lines[:at] + [" 4    395.19    395.08"] + lines[at + 1:])
    with pytest.raises(ParseError) as err:
        parse_nvbandwidth(cut, "nvbandwidth.out")
    assert err.value.line == at + 1 and "device_to_device_memcpy_read_ce" in str(err.value)
    bad = "\n".join(lines[:at] + [lines[at].replace("395.25", "39x.25")] + lines[at + 1:])
    with pytest.raises(ParseError, match="39x.25"):
        parse_nvbandwidth(bad, "nvbandwidth.out")


def test_garbage_has_no_matrix():
    assert parse_nvbandwidth("Segmentation fault (core dumped)\n", "x").matrices == {}


_LINE = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["Running device_to_device_memcpy_read_ce.", "memcpy CE GPU(row) -> GPU(column) bandwidth "
                     "(GB/s)", "           0         1", " 0       N/A    395.08", " 1    395.08       N/A",
                     "SUM device_to_device_memcpy_read_ce 790.16", "Waived:", "Device 0: X (00000000:19:00)",
                     "", "&&&& PERF x 1.0GB/s", " 0 1e5 -3"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINE, max_size=30))
def test_fuzz_only_parse_error_escapes(lines):
    try:
        parse_nvbandwidth("\n".join(lines), "fuzz")
    except ParseError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_fuzz_arbitrary_text(text):
    try:
        parse_nvbandwidth(text, "fuzz")
    except ParseError:
        pass


# -- hostile input: linear in the length of a line, every number finite and bounded ---------------------------------
DEVICE_LINE = "Device 0: NVIDIA GH200 480GB (00000009:01:00)"


@pytest.mark.parametrize("extra", [
    "Device 1: a" + " " * MIB + "b",  # the old device pattern (a lazy name before an optional bus) took hours
    "Device 1: " + "(" * MIB,
    "Running " + "a" * MIB,
    "SUM " + "a" * MIB,
    "title (" + " " * MIB + ") x",
])
def test_a_pathological_1mib_line_is_read_in_linear_time(extra):
    text = GH200.read_text().replace(DEVICE_LINE, DEVICE_LINE + "\n" + extra)
    with deadline():
        run = parse_nvbandwidth(text, "out")
    assert run.matrices.keys() == parse_nvbandwidth(GH200.read_text(), "out").matrices.keys()


def test_a_device_name_with_long_space_runs_and_its_bus():
    with deadline():
        run = parse_nvbandwidth("Device 3: a" + " " * MIB + "b (0000:1b:00)\n", "out")
    assert run.devices == {3: ("a" + " " * MIB + "b", "0000:1b:00")}


@pytest.mark.parametrize("old, new, what", [
    (DEVICE_LINE, "Device " + "1" * 5000 + ": NVIDIA GH200", "device number"),
    ("SUM host_to_device_memcpy_ce 1985.60", "SUM host_to_device_memcpy_ce 1e999", "not a finite number"),
    ("SUM host_to_device_memcpy_ce 1985.60", "SUM host_to_device_memcpy_ce " + "9" * 400, "characters"),
    ("369.36", "1e999", "not a finite number"),  # a cell
])
def test_a_number_past_its_bound_is_a_parse_error_naming_the_line(old, new, what):
    text = GH200.read_text()
    assert old in text
    text = text.replace(old, new, 1)
    with pytest.raises(ParseError) as info:
        parse_nvbandwidth(text, "out")
    assert what in info.value.what
    assert info.value.line == text[:text.index(new)].count("\n") + 1

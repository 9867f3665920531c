"""parse_nccl_tests on every real nccl-tests output in fixtures/tools/nccl/ (copied from ../shared/data/nccl/), on
edge cases, and under fuzzing: nothing but ParseError may escape."""
from pathlib import Path

import pytest
from deadline import MIB, deadline
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests
from hypothesis import given, settings
from hypothesis import strategies as st

NCCL = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "nccl"
SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "nccl"


def outputs() -> list[Path]:
    return sorted(p for p in NCCL.glob("*.txt") if not p.name.endswith(".source.txt"))


def parse(name: str):
    return parse_nccl_tests((NCCL / name).read_text(), name)


# file -> (rows, first size, last size, last (out-of-place busbw, in-place busbw), complete, avg busbw)
EXPECTED = {
    "amd-rccl-tests__alltoall_perf__1node-8gpu__inplace-wrong-NA.txt":
        (25, 0, 134217728, (322.22, 316.42), True, 58.3947),
    "aws__all_reduce_perf__2x-p4de-A100__srun-rank-prefix-0colon.txt":
        (29, 8, 2147483648, (78.33, 78.33), False, None),
    "aws__all_reduce_perf__2x-p5-H100-EKS__mpirun-tagged-output-prefix.txt":
        (7, 0, 2147483648, (437.79, 437.89), True, 52.9753),
    "aws__all_reduce_perf__2x-p5-H100__srun-rank-prefix-0colon.txt":
        (32, 8, 17179869184, (487.09, 487.26), False, None),
    "aws__all_reduce_perf__AWS-Batch-log-stream__mpirun-tagged__trailing-spaces.txt":
        (32, 8, 17179869184, (483.05, 483.35), True, 156.742),
    "aws__all_reduce_perf__p5en__elided-with-summary.txt":
        (3, 8, 17179869184, (369.86, 369.42), True, 84.0569),
    "dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-avg-busbw-check.txt":
        (1, 33554432, 33554432, (0.0, 0.0), True, 0.0),
    "dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-out-of-bounds-wrong1.txt":
        (1, 33554432, 33554432, (0.0, 0.0), True, 0.0),
    "dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__pass.txt":
        (1, 33554432, 33554432, (0.0, 0.0), True, 0.0),
    "lambdalabs__all_gather_perf__1node-2gpu__nccl-info-interleaved.txt":
        (30, 0, 4294967296, (46.76, 65.30), True, 24.9041),
    "EDITED__all_reduce_perf__1node-8xH100__g021__pass.txt":
        (29, 8, 2147483648, (443.72, 442.06), True, 88.0603),
}


def test_every_shared_file_is_copied_with_its_source():
    if SHARED.is_dir():
        for src in SHARED.iterdir():
            assert (NCCL / src.name).read_bytes() == src.read_bytes(), src.name
    for out in outputs():
        assert out.with_name(out.name + ".source.txt").is_file(), out.name


def test_every_output_has_expectations():
    assert {p.name for p in outputs()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_output_parses(name):
    rows, first, last, last_busbw, complete, avg = EXPECTED[name]
    run = parse(name)
    assert len(run.rows) == rows
    assert (run.rows[0].size_bytes, run.rows[-1].size_bytes) == (first, last)
    assert (run.rows[-1].out_of_place.busbw_gbps, run.rows[-1].in_place.busbw_gbps) == last_busbw
    assert run.complete is complete
    assert run.avg_busbw_gbps == avg
    assert not run.problems
    # Rows come in the order printed, each with its own line number.
    assert [r.line for r in run.rows] == sorted(r.line for r in run.rows)
    assert all(r.count >= 0 and r.type in ("float", "bfloat16") for r in run.rows)


def test_rccl_alltoall_in_place_na_is_not_zero_and_not_a_failure():
    run = parse("amd-rccl-tests__alltoall_perf__1node-8gpu__inplace-wrong-NA.txt")
    assert (run.tool, run.version) == ("rccl", "2.17.9-develop:2596ca5f71")
    assert run.collective == "alltoall_perf"
    assert (run.n_threads, run.n_gpus, run.min_bytes, run.max_bytes, run.validation) == (1, 8, 8, 134217728, 1)
    assert all(r.in_place.wrong is None for r in run.rows)
    assert all(r.out_of_place.wrong == 0 for r in run.rows)
    assert all(r.wrong == 0 for r in run.rows)
    assert run.out_of_bounds == 0 and not run.errors and not run.warnings
    assert run.ranks == 8 and run.hosts == ["Aliyun3"]
    dev = run.devices[6]
    assert (dev.rank, dev.group, dev.pid, dev.device, dev.bus, dev.name) == (6, 0, 1, 6, "0000:e5:00",
                                                                            "AMD Radeon Graphics")
    assert (run.rows[0].redop, run.rows[0].root) == ("none", -1)
    r = run.rows[4]
    assert (r.size_bytes, r.count, r.out_of_place.time_us, r.in_place.time_us) == (128, 4, 40.87, 59.46)


def test_srun_labels_are_stripped():
    run = parse("aws__all_reduce_perf__2x-p4de-A100__srun-rank-prefix-0colon.txt")
    r = run.rows[-2]
    assert (r.size_bytes, r.count, r.type, r.redop, r.root) == (1073741824, 268435456, "float", "sum", -1)
    assert (r.out_of_place.time_us, r.out_of_place.algbw_gbps, r.out_of_place.busbw_gbps, r.out_of_place.wrong) \
        == (26217.0, 40.96, 76.79, 0)
    assert (r.in_place.time_us, r.in_place.algbw_gbps, r.in_place.busbw_gbps, r.in_place.wrong) \
        == (26194.0, 40.99, 76.86, 0)
    assert run.out_of_bounds is None and run.devices == []


def test_mpirun_tags_and_elision():
    run = parse("aws__all_reduce_perf__2x-p5-H100-EKS__mpirun-tagged-output-prefix.txt")
    assert run.elided == [5]
    assert [r.size_bytes for r in run.rows] == [0, 67108864, 134217728, 268435456, 536870912, 1073741824,
                                                2147483648]
    assert run.rows[5].busbw_gbps == 313.29 and run.out_of_bounds == 0


def test_trailing_spaces_and_misaligned_header():
    run = parse("aws__all_reduce_perf__AWS-Batch-log-stream__mpirun-tagged__trailing-spaces.txt")
    by = {r.size_bytes: r for r in run.rows}
    assert by[1073741824].busbw_gbps == 441.81 and by[2147483648].in_place.busbw_gbps == 443.88
    assert run.out_of_bounds == 0


def test_author_elided_output():
    run = parse("aws__all_reduce_perf__p5en__elided-with-summary.txt")
    assert run.elided == [5] and run.out_of_bounds == 0


def test_nccl_tests_2_17_format():
    fail_bw = parse("dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-avg-busbw-check.txt")
    (row,) = fail_bw.rows
    assert row.iters == 20 and row.in_place.algbw_gbps == 175724.0 and row.out_of_place.algbw_gbps == 1305.8
    assert fail_bw.avg_busbw_failed and fail_bw.collective == "all_reduce_perf"
    assert [(e.line, e.text) for e in fail_bw.errors] == [(15, ".. testhost pid 12345: Test failure common.cu:1126")]
    assert (fail_bw.n_gpus, fail_bw.min_bytes, fail_bw.max_bytes) == (1, 33554432, 33554432)
    (dev,) = fail_bw.devices
    assert (dev.host, dev.pid, dev.bus, dev.name) == ("testhost", 12345, "0000:1b:00", "NVIDIA Test GPU")

    oob = parse("dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-out-of-bounds-wrong1.txt")
    assert (oob.rows[0].out_of_place.wrong, oob.rows[0].in_place.wrong, oob.rows[0].wrong) == (1, 1, 2)
    assert oob.out_of_bounds == 2 and not oob.avg_busbw_failed and [e.line for e in oob.errors] == [15]

    ok = parse("dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__pass.txt")
    assert ok.rows[0].wrong == 0 and not ok.errors and ok.out_of_bounds == 0 and not ok.avg_busbw_failed


def test_nccl_info_lines_interleaved_with_the_table():
    run = parse("lambdalabs__all_gather_perf__1node-2gpu__nccl-info-interleaved.txt")
    assert run.collective == "all_gather_perf"  # from the mpirun command line
    assert run.elided == [2] and not run.warnings and not run.errors
    assert run.rows[0].line == 9  # after the INFO line that sits between the header and the rows
    assert run.rows[-1].in_place.busbw_gbps == 65.30


def test_edited_single_node_h100_output():
    run = parse("EDITED__all_reduce_perf__1node-8xH100__g021__pass.txt")
    assert run.hosts == ["g021"] and run.ranks == 8 and run.n_gpus == 8 and run.max_bytes == 2147483648
    assert {d.name for d in run.devices} == {"NVIDIA H100 80GB HBM3"}
    assert [d.bus for d in run.devices] == ["0x19", "0x3b", "0x4c", "0x5d", "0x9b", "0xbb", "0xcb", "0xdb"]


HEADER = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   "
          "busbw #wrong\n")
ROW = ("  1073741824     268435456     float     sum      -1   4607.6  233.04  436.95      0   4565.6  235.18  "
       "440.96      0")


def test_garbage_and_empty_are_parse_errors():
    with pytest.raises(ParseError, match="not nccl-tests output") as err:
        parse_nccl_tests("Traceback (most recent call last):\n  File 'x'\nhello world\n# a title\n", "junk.txt")
    assert err.value.source == "junk.txt"
    with pytest.raises(ParseError, match="empty output"):
        parse_nccl_tests("  \n\n", "empty.txt")


def test_malformed_row_is_a_problem_with_its_line_and_the_rest_still_parses():
    text = HEADER + ROW + "\n" + "  2147483648     536870912     float     sum      -1   9074.5  236.6\n"
    run = parse_nccl_tests(text, "cut.txt")
    assert len(run.rows) == 1 and not run.complete
    (problem,) = run.problems
    assert (problem.source, problem.line) == ("cut.txt", 3) and "not a result row" in str(problem)


def test_split_row_fragment_is_a_problem_not_a_row():
    run = parse_nccl_tests(HEADER + "    579.3    0.00    0.00      0    137.0    0.00    0.00      0\n" + ROW, "x")
    assert len(run.rows) == 1 and len(run.problems) == 1 and run.problems[0].line == 2


def test_warn_and_error_lines_under_labels():
    text = "\n".join([
        "[1,3]<stderr>:g021:41215:41290 [3] NCCL WARN Cuda failure 'an illegal memory access was encountered'",
        "12: g021: Test NCCL failure common.cu:1008 'unhandled cuda error / '",
        "[1,0]<stdout>:" + HEADER.rstrip(),
        "[1,0]<stdout>:" + ROW,
        " .. g021 pid 41215: Test failure common.cu:891",
        "srun: error: g021: task 0: Exited with exit code 3",
    ])
    run = parse_nccl_tests(text, "crash.txt")
    assert [(w.line, w.text) for w in run.warnings] == [
        (1, "g021:41215:41290 [3] NCCL WARN Cuda failure 'an illegal memory access was encountered'")]
    assert [e.line for e in run.errors] == [2, 5, 6]
    assert run.errors[0].text == "g021: Test NCCL failure common.cu:1008 'unhandled cuda error / '"
    assert len(run.rows) == 1 and not run.complete


def test_older_and_other_formats():
    text = "\n".join([
        "rccl-tests: Version develop:ae3e635",
        "NCCL version 2.19.3+cuda12.2",
        "# nGpus(perProc) 1 minBytes 1 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20",
        "#   Rank  0 Pid     26 on nccl-tests-efa-worker-0 device  0 [0x10] A100-SXM4-40GB",
        "#       size         count      type     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
        "   134217728       2097152     float   500.10  268.38  234.83    N/A   501.00  268.00  234.50    N/A",
        "# Avg bus bandwidth    : 234.67 GB/s",
    ])
    run = parse_nccl_tests(text, "old.txt")
    assert (run.tool, run.version, run.nccl_version, run.n_gpus, run.max_bytes) == (
        "rccl", "develop:ae3e635", "2.19.3+cuda12.2", 1, 1073741824)
    (dev,) = run.devices
    assert (dev.rank, dev.group, dev.pid, dev.host, dev.bus, dev.name) == (0, None, 26, "nccl-tests-efa-worker-0",
                                                                          "0x10", "A100-SXM4-40GB")
    (row,) = run.rows
    assert (row.redop, row.root, row.out_of_place.wrong, row.in_place.wrong, row.wrong) == (None, None, None, None, 0)
    assert run.complete and run.avg_busbw_gbps == 234.67


def test_wrong_values_and_failed_out_of_bounds():
    row = ROW[:-1] + "7"
    run = parse_nccl_tests(HEADER + row + "\n# Out of bounds values : 1 FAILED\n# Avg bus bandwidth    : 438 \n", "w")
    assert run.rows[0].in_place.wrong == 7 and run.rows[0].wrong == 7 and run.out_of_bounds == 1 and run.complete


# -- fuzzing: nothing but ParseError escapes ------------------------------------------------------------------------
REAL_LINES = sorted({line for p in outputs() for line in p.read_text().splitlines()})
FRAGMENTS = ["0: ", "[1,0]<stdout>:", "#", "# Avg bus bandwidth : ", "# Out of bounds values : ", "N/A", "-1", "sum",
             "float", "NCCL WARN", "Test failure", "#  Rank  0 Group  0 Pid 1 on h device  0 [0x1] ", "nGpus",
             "...", "1" * 30, "9" * 5000, "1e999", "nan", "inf", "-", ".", "\t", "\r", "\x00", "é", "١٢٣"]


def _parse_or_parse_error(text: str) -> None:
    try:
        run = parse_nccl_tests(text, "fuzz")
    except ParseError:
        return
    for row in run.rows:
        assert row.size_bytes >= 0 and row.count >= 0
        assert all(isinstance(r.busbw_gbps, float) for r in (row.out_of_place, row.in_place))
    for problem in run.problems:
        assert isinstance(problem, ParseError) and problem.line is not None


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_arbitrary_text(text):
    _parse_or_parse_error(text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(REAL_LINES),
                          st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=16)
                          .map(" ".join)), max_size=40))
def test_fuzz_lines_of_real_outputs_mixed_with_noise(lines):
    _parse_or_parse_error("\n".join(lines))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(outputs()), st.data())
def test_fuzz_mutated_real_outputs(path, data):
    text = path.read_text()
    for _ in range(data.draw(st.integers(0, 6))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 40))
        text = text[:at] + data.draw(st.sampled_from(FRAGMENTS + [""])) + text[at + cut:]
    _parse_or_parse_error(text)


# -- hostile input: linear in the length of a line, every number finite and bounded ---------------------------------
PASS_8X = "EDITED__all_reduce_perf__1node-8xH100__g021__pass.txt"
# A 1 MiB line aimed at each pattern that could backtrack; the old device-line pattern took hours on the first.
PATHOLOGICAL = {
    "device-name-with-space-runs": "#  Rank  0 Group  0 Pid  1 on h device  0 [0x19] a" + " " * MIB + "b",
    "device-line-cut-before-the-bus": "#  Rank  0 on " + "h " * (MIB // 2),
    "settings-line-of-spaces": "# nThread 1 nGpus" + " " * MIB + "x",
    "tool-version-word": "# " + "a" * MIB + "-test",
    "command-word": " /" + "a_perf_" * (MIB // 7) + "x",
    "elision-dots": ". " * (MIB // 2) + "x",
    "launcher-labels": "0: " * (MIB // 3) + "x",
    "row-of-one-number": "8 " + "1" * MIB,
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_1mib_line_is_read_in_linear_time(name):
    text = (NCCL / PASS_8X).read_text() + PATHOLOGICAL[name] + "\n"
    with deadline():
        run = parse_nccl_tests(text, "out")
    assert len(run.rows) == len(parse(PASS_8X).rows)  # the long line changed nothing else


def test_a_device_name_with_long_space_runs_is_kept_whole():
    with deadline():
        run = parse_nccl_tests(PATHOLOGICAL["device-name-with-space-runs"], "out")
    (dev,) = run.devices
    assert (dev.rank, dev.device, dev.bus) == (0, 0, "0x19") and dev.name == "a" + " " * MIB + "b"


@pytest.mark.parametrize("line, what", [
    ("#  Rank  0 Group  0 Pid  1 on h device  " + "1" * 5000 + " [0x19] NVIDIA H100", "device"),
    ("#  Rank  " + "7" * 4400 + " Group  0 Pid  1 on h device  0 [0x19] NVIDIA H100", "rank"),
    ("# nThread 1 nGpus 99999999999999999999999 minBytes 8 maxBytes 8 step: 2(factor)", "nGpus"),
    ("# Out of bounds values : " + "9" * 400 + " OK", "out-of-bounds"),
])
def test_a_number_past_its_bound_is_a_problem_naming_the_line_not_a_crash_or_a_cut_number(line, what):
    text = (NCCL / PASS_8X).read_text() + line + "\n"
    run = parse_nccl_tests(text, "out")
    (problem,) = run.problems
    assert problem.line == text.count("\n") and what in problem.what
    assert len(run.devices) == 8 and run.n_gpus == 8 and run.out_of_bounds in (None, 0)


@pytest.mark.parametrize("value", ["1e999", "-1e400", "١٢٣", "²"])
def test_an_infinite_or_non_ascii_number_in_a_row_is_a_problem_not_a_value(value):
    text = (NCCL / PASS_8X).read_text()
    row = ("           8             2     float     sum      -1    69.12    0.00    0.00      0    72.43    0.00"
           "    0.00      0")
    assert row in text
    run = parse_nccl_tests(text.replace(row, row.replace("72.43", value)), "out")
    assert len(run.rows) == len(parse(PASS_8X).rows) - 1
    (problem,) = run.problems
    assert "not a result row" in problem.what
    avg = parse_nccl_tests(text.replace("# Avg bus bandwidth    : ", "# Avg bus bandwidth    : 1e999 #"), "out")
    assert avg.avg_busbw_gbps is None

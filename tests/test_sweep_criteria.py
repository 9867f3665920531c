"""Sweep criteria on real multi-node all_reduce_perf outputs (fixtures/tools/nccl/, each with its .source.txt):
outcomes by regime against baselines from the config, the bundled table and the nodes' history, each named with
its source; cycle outputs (-N) built from a real table; crashes, hangs, preemption; hostile baseline tables."""
import math
import re
import statistics
import tomllib
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.sweep_policy import CRITERIA_DEFAULTS, TABLE_SOURCE, check_policy, parse_baselines
from gpuwarden.agent.fleet.sweep.criteria import Baseline, Figure, baseline_for, bundled_baselines, judge, p95
from gpuwarden.agent.fleet.sweep.history import SweepHistory
from gpuwarden.agent.fleet.sweep.model import GroupRun, Outcome
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests

ROOT = Path(__file__).resolve().parent.parent
NCCL = ROOT / "fixtures" / "tools" / "nccl"
P5_SRUN = (NCCL / "aws__all_reduce_perf__2x-p5-H100__srun-rank-prefix-0colon.txt").read_text()
P5_MPIRUN = (NCCL / "aws__all_reduce_perf__2x-p5-H100-EKS__mpirun-tagged-output-prefix.txt").read_text()
P4DE_SRUN = (NCCL / "aws__all_reduce_perf__2x-p4de-A100__srun-rank-prefix-0colon.txt").read_text()
P5EN_ELIDED = (NCCL / "aws__all_reduce_perf__p5en__elided-with-summary.txt").read_text()
DCGM = "dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__{}.txt"
DCGM_WRONG = (NCCL / DCGM.format("FAIL-out-of-bounds-wrong1")).read_text()
DCGM_AVG_FAILED = (NCCL / DCGM.format("FAIL-avg-busbw-check")).read_text()
DCGM_PASS = (NCCL / DCGM.format("pass")).read_text()
H100 = "H100-SXM-HGX"
NODES = ("p5-st-1", "p5-st-2")
POLICY = dict(CRITERIA_DEFAULTS)
GIB = 1073741824


def with_summary(text, label="0: "):
    """The published srun excerpts stop at the last row (their author left out "a lot more information"); a run
    that nccl-tests finishes ends with these two lines, which is how the sweep tells a finished run from a
    truncated one. The average is nccl-tests' own: the mean of every row's out-of-place and in-place busbw."""
    rows = parse_nccl_tests(text, "fixture").rows
    avg = statistics.mean(b for r in rows for b in (r.out_of_place.busbw_gbps, r.in_place.busbw_gbps))
    return text + f"{label}# Out of bounds values : 0 OK\n{label}# Avg bus bandwidth    : {avg:.4f} \n"


P5 = with_summary(P5_SRUN)
P4DE = with_summary(P4DE_SRUN)


def cycles(text, factors, label="0: ", spikes=None):
    """What `all_reduce_perf -N <len(factors)>` prints, built from a real table: the header once, the whole table
    once per cycle, then the summary. Cycle k is the published rows with every time multiplied by factors[k]
    (and algbw/busbw divided by it, as nccl-tests derives them from the time): a stand-in for run-to-run
    variation, since no published output has -N. `spikes` {(cycle, size): extra factor} slows one size in one
    cycle."""
    spikes = spikes or {}
    head, rows = [], []
    for line in text.splitlines():
        body = line[len(label):]
        (rows if body.strip() and not body.lstrip().startswith("#") else head).append(body)
    out = [label + h for h in head]
    for k, f in enumerate(factors):
        for body in rows:
            t = body.split()
            g = f * spikes.get((k, int(t[0])), 1.0)
            for i in (5, 9):
                t[i] = f"{float(t[i]) * g:.2f}"
                t[i + 1] = f"{float(t[i + 1]) / g:.2f}"
                t[i + 2] = f"{float(t[i + 2]) / g:.2f}"
            out.append(label + " ".join(f"{x:>12}" for x in t))
    return with_summary("\n".join(out) + "\n", label)


def group(output, rc=0, ended="exited", stderr="", detail="", nodes=NODES):
    return GroupRun(nodes, output, stderr, rc, ended, 42.0, job_id="1234", detail=detail)


def h100(policy=POLICY, history=None, members=NODES, nodes=2, sku=H100):
    return baseline_for(sku, nodes, policy, history, members)


def with_config(**entries):
    return {**POLICY, "baselines": entries}


# -- real outputs against their SKU's baseline ------------------------------------------------------------------------
def test_sweep_p5_h100_srun_passes_against_the_bundled_baseline():
    j = judge(group(P5), h100(), POLICY)
    assert j.outcome is Outcome.PASS, j.reasons
    # Small sizes: each row's better half, median over 8 B .. 64 KiB (one cycle: the median, not a p95).
    assert j.latency_p95_us == pytest.approx(70.205)
    assert j.evidence["latency_statistic"] == "median"
    assert j.busbw_gbps == pytest.approx(487.26) and j.evidence["busbw_size_bytes"] == 16 * GIB
    # 128 KiB .. 512 MiB, reported on its own
    assert j.transition_busbw_gbps == pytest.approx(statistics.median(
        max(r.out_of_place.busbw_gbps, r.in_place.busbw_gbps) for r in parse_nccl_tests(P5, "x").rows
        if 65536 < r.size_bytes < GIB))
    source = f"{TABLE_SOURCE} 'H100-SXM-HGX/2'"
    assert any("within 1.5 x baseline 75 us" in r and source in r for r in j.reasons)
    assert any("within 0.8 x baseline 437 GB/s" in r and source in r for r in j.reasons)
    assert any("reported, not judged" in r for r in j.reasons)


def test_sweep_p5_h100_srun_as_published_ends_without_the_summary_so_is_truncated():
    j = judge(group(P5_SRUN), h100(), POLICY)
    assert j.outcome is Outcome.FAILED
    assert "ends before the closing '# Avg bus bandwidth' line (last size 17179869184 B)" in j.reasons[0]


def test_sweep_p5_h100_mpirun_elided_excerpt_judges_what_it_shows():
    j = judge(group(P5_MPIRUN), h100(), POLICY)
    assert j.outcome is Outcome.PASS, j.reasons
    assert j.latency_p95_us is None  # only a 0 B row below 64 MiB: it moves no data
    assert j.busbw_gbps == pytest.approx(437.89)
    assert "small-message latency not judged: no result row from 1 B to 65536 B" in j.reasons
    assert any(r.startswith("table incomplete: 1 elided line(s)") for r in j.reasons)


def test_sweep_p4de_a100_passes_with_the_figures_the_table_documents_for_config():
    # The A100 figures sit in a comment of nccl_sweep.toml as a [sweep.baselines] example: taken from there.
    text = (ROOT / "checks" / "data" / "thresholds" / "nccl_sweep.toml").read_text()
    (line,) = [ln.lstrip("# ") for ln in text.splitlines() if ln.startswith('#   "unknown/2"')]
    policy = {**POLICY, "baselines": tomllib.loads(line)}
    base = baseline_for("unknown", 2, policy, None, NODES)
    assert base.busbw_gbps == Figure(78.3, "GB/s", "config [sweep.baselines] 'unknown/2'")
    j = judge(group(P4DE), base, policy)
    assert j.outcome is Outcome.PASS, j.reasons
    assert j.latency_p95_us == pytest.approx(164.05) and j.busbw_gbps == pytest.approx(78.33)


def test_sweep_bundled_figures_follow_from_the_cited_outputs():
    rows = {name: parse_nccl_tests(text, name).rows for name, text in (("srun", P5_SRUN), ("mpirun", P5_MPIRUN))}
    worse = [max(r.out_of_place.time_us, r.in_place.time_us) for r in rows["srun"] if 0 < r.size_bytes <= 65536]
    at_2g = [r.busbw_gbps for rs in rows.values() for r in rs if r.size_bytes == 2 * GIB]
    table = bundled_baselines()[(H100, 2)]
    assert table["latency_p95_us"] == math.ceil(statistics.median(worse))
    assert table["busbw_gbps"] == math.floor(min(at_2g))
    # Each cited output passes against it; the A100 one is no H100 and fails its latency and bandwidth.
    assert judge(group(P4DE), h100(), POLICY).outcome is Outcome.SLOW


def test_sweep_baseline_above_a_real_output_is_slow_naming_the_figure_and_its_source():
    policy = with_config(**{"H100-SXM-HGX/2": {"busbw_gbps": 700.0}})
    base = h100(policy)
    assert base.busbw_gbps.source == "config [sweep.baselines] 'H100-SXM-HGX/2'"
    assert base.latency_p95_us.source == f"{TABLE_SOURCE} 'H100-SXM-HGX/2'"  # not configured: the table's
    j = judge(group(P5), base, policy)
    assert j.outcome is Outcome.SLOW
    assert j.reasons[0] == ("bus bandwidth 487.3 GB/s at 17179869184 B (median over 1 cycle(s)) < 0.8 x baseline "
                            "700 GB/s (config [sweep.baselines] 'H100-SXM-HGX/2')")


def test_sweep_latency_baseline_below_a_real_output_is_slow():
    policy = with_config(**{"H100-SXM-HGX/2": {"latency_p95_us": 40.0, "busbw_gbps": 437.0}})
    j = judge(group(P5), h100(policy), policy)
    assert j.outcome is Outcome.SLOW
    assert j.reasons[0].startswith("small-message latency 70.2 us (median over 14 sizes <= 65536 B")
    assert j.reasons[0].endswith("> 1.5 x baseline 40 us (config [sweep.baselines] 'H100-SXM-HGX/2')")


def test_sweep_no_baseline_is_not_judged_and_says_so():
    j = judge(group(P5), h100(sku="B200-HGX"), POLICY)
    assert j.outcome is Outcome.PASS
    assert sum("not judged: no baseline for B200-HGX/2 nodes (no sweep history)" in r for r in j.reasons) == 2
    assert j.evidence["baseline"] == {"key": "B200-HGX/2", "latency_p95_us": None, "busbw_gbps": None}


def test_sweep_p5en_elided_table_takes_the_better_half_and_says_what_is_missing():
    # Its 8 B row: 983.2 us out-of-place (a first-call outlier), 166.1 us in-place.
    j = judge(group(P5EN_ELIDED), h100(sku="H200-SXM-HGX"), POLICY)
    assert j.outcome is Outcome.PASS
    assert j.latency_p95_us == pytest.approx(statistics.median([166.1, 167.3]))
    assert j.busbw_gbps == pytest.approx(369.86) and j.transition_busbw_gbps is None
    assert any(r.startswith("table incomplete: 1 elided line(s) ('...' at line 5)") for r in j.reasons)
    assert any("not judged: no baseline for H200-SXM-HGX/2 nodes" in r for r in j.reasons)


# -- cycles (-N): p95 latency ------------------------------------------------------------------------------------------
FACTORS = [1.00, 1.03, 0.98, 1.05, 1.01, 0.99, 1.04, 1.00, 0.97, 1.02]


def test_sweep_cycles_give_a_p95_per_size_and_the_median_over_sizes():
    j = judge(group(cycles(P5_SRUN, FACTORS)), h100(), POLICY)
    assert j.outcome is Outcome.PASS, j.reasons
    assert j.evidence["cycles"] == 10 and j.evidence["latency_statistic"] == "p95"
    per_size = {s["size_bytes"]: s for s in j.evidence["sizes"]}
    eight = [round(69.12 * f, 2) for f in FACTORS]  # the 8 B row's better half, per cycle
    assert per_size[8]["latency_p95_us"] == pytest.approx(statistics.quantiles(eight, n=20, method="inclusive")[18],
                                                          abs=1e-3)
    assert j.latency_p95_us == pytest.approx(statistics.median(
        s["latency_p95_us"] for s in j.evidence["sizes"] if s["size_bytes"] <= 65536), abs=1e-3)
    assert any("p95 over 10+ cycles" in r for r in j.reasons)
    assert per_size[2 * GIB]["cycles"] == 10


def test_sweep_one_noisy_size_does_not_fail_the_group():
    spikes = {(k, 64): 4.0 for k in (2, 5, 8)}  # 64 B four times slower in three cycles
    j = judge(group(cycles(P5_SRUN, FACTORS, spikes=spikes)), h100(), POLICY)
    assert j.outcome is Outcome.PASS, j.reasons
    per_size = {s["size_bytes"]: s for s in j.evidence["sizes"]}
    assert per_size[64]["latency_p95_us"] > 3 * 75  # the size itself is far over, and shown
    assert j.latency_p95_us < 1.5 * 75


def test_sweep_intermittent_stalls_show_in_the_p95_not_in_the_median():
    # Two cycles of ten with every small size 1.8x slower (a node that stalls now and then).
    spikes = {(k, 2 ** e): 1.8 for k in (3, 7) for e in range(3, 17)}
    output = cycles(P5_SRUN, FACTORS, spikes=spikes)
    j = judge(group(output), h100(), POLICY)
    assert j.outcome is Outcome.SLOW
    assert "p95 over 10+ cycles) > 1.5 x baseline 75 us" in j.reasons[0]
    # Judged on the median over cycles instead (min_cycles above 10), the same run passes.
    lenient = judge(group(output), h100(), {**POLICY, "min_cycles": 11})
    assert lenient.outcome is Outcome.PASS and lenient.evidence["latency_statistic"] == "median"


def test_sweep_too_few_cycles_judge_the_median_and_say_so():
    j = judge(group(cycles(P5_SRUN, FACTORS[:3])), h100(), POLICY)
    assert j.evidence["cycles"] == 3 and j.evidence["latency_statistic"] == "median"
    assert any("median over 3 cycle(s), fewer than the 5 a p95 needs" in r for r in j.reasons)


def test_sweep_cycles_under_mpirun_tags_parse_the_same():
    output = cycles(P5_SRUN, FACTORS).replace("0: ", "[1,0]<stdout>:")
    j = judge(group(output), h100(), POLICY)
    assert j.outcome is Outcome.PASS and j.evidence["cycles"] == 10


def test_sweep_p95_interpolates_between_ranks():
    assert p95([1.0]) == 1.0
    assert p95(list(range(1, 21))) == pytest.approx(19.05)
    assert p95([5.0, 1.0, 3.0]) == pytest.approx(4.8)


# -- wrong values, failures, hangs, preemption ----------------------------------------------------------------------
def test_sweep_wrong_values_are_wrong_and_explain_the_exit_status():
    j = judge(group(DCGM_WRONG, rc=1), h100(), POLICY)
    assert j.outcome is Outcome.WRONG
    assert j.reasons[0].startswith("wrong values: #wrong > 0 at 33554432 B (line 10): 2; out of bounds values: 2")
    assert not any(r.startswith("failed") for r in j.reasons)  # nccl-tests exits 1 after its own verdict
    assert j.evidence["out_of_bounds"] == 2


def test_sweep_nccl_tests_own_bandwidth_check_failing_is_slow():
    j = judge(group(DCGM_AVG_FAILED, rc=1), h100(), POLICY)
    assert j.outcome is Outcome.SLOW
    assert "nccl-tests' own average bus bandwidth check FAILED (avg 0.0 GB/s)" in j.reasons


def test_sweep_output_with_no_judged_regime_passes_only_with_reasons():
    j = judge(group(DCGM_PASS), h100(), POLICY)
    assert j.outcome is Outcome.PASS
    assert "small-message latency not judged: no result row from 1 B to 65536 B" in j.reasons
    assert "bus bandwidth not judged: no result row at or above 1073741824 B" in j.reasons


def crashed(text=P5):
    """A rank loses its network at 256 MiB: NCCL warns, nccl-tests reports the failure, srun ends the step."""
    head = text.split("0:    536870912", 1)[0]
    return head + ("0: p5-st-2:41215:41290 [3] NCCL WARN NET/OFI Request 0x7f completed with error. RC: 12. "
                   "Error: remote access error\n"
                   "0: p5-st-2: Test NCCL failure common.cu:1008 'remote process exited or there was a network "
                   "error / '\n0:  .. p5-st-2 pid 41215: Test failure common.cu:891\n")


def test_sweep_crash_with_nccl_error_lines_is_failed_with_the_last_error():
    j = judge(group(crashed(), rc=1, stderr="srun: error: p5-st-2: task 12: Exited with exit code 1\n"),
              h100(), POLICY)
    assert j.outcome is Outcome.FAILED
    assert "ends before the closing '# Avg bus bandwidth' line (last size 268435456 B)" in j.reasons[0]
    assert "exit status 1" in j.reasons[0] and "4 error line(s)" in j.reasons[0]
    assert j.reasons[0].endswith("last error: srun: error: p5-st-2: task 12: Exited with exit code 1")
    assert any("NCCL WARN NET/OFI" in e for e in j.evidence["error_lines"])


def test_sweep_launcher_error_after_a_complete_table_is_failed():
    j = judge(group(P5, rc=1, stderr="srun: error: p5-st-1: task 3: Killed\n"), h100(), POLICY)
    assert j.outcome is Outcome.FAILED
    assert j.reasons[0].startswith("failed: exit status 1; 1 error line(s); last error: srun: error: p5-st-1")


def test_sweep_nccl_notice_is_evidence_not_a_failure():
    text = P5.replace("0:            8 ", "0: p5-st-1:1:1 [0] NCCL WARN NET/OFI Using a non-default provider\n"
                      "0:            8 ", 1)
    j = judge(group(text), h100(), POLICY)
    assert j.outcome is Outcome.PASS
    assert j.evidence["warn_lines"] == ["3: p5-st-1:1:1 [0] NCCL WARN NET/OFI Using a non-default provider"]


@pytest.mark.parametrize("rc, output, expected", [
    (137, P5, "failed: exit status 137"),
    (None, P5, "failed: no exit status"),
    (1, "", "failed: no result table (all_reduce_perf on p5-st-1,p5-st-2: empty output); exit status 1"),
])
def test_sweep_exit_without_a_good_table_is_failed(rc, output, expected):
    j = judge(group(output, rc=rc), h100(), POLICY)
    assert j.outcome is Outcome.FAILED and j.reasons[0] == expected


def test_sweep_timeout_is_hung_with_where_it_stopped():
    j = judge(group(P5.split("0:    536870912", 1)[0], rc=None, ended="timeout", detail="scancel 1234"),
              h100(), POLICY)
    assert j.outcome is Outcome.HUNG and j.outcome.bad
    assert j.reasons[0] == ("hung: ran past its time limit (42 s, last size printed: 268435456 B); the job was "
                            "ended (scancel 1234)")


def test_sweep_wrong_values_before_a_hang_make_it_wrong():
    text = re.sub(r"(0:      1048576 .*)      0\n", r"\1      7\n", P5.split("0:    536870912", 1)[0])
    j = judge(group(text, rc=None, ended="timeout"), h100(), POLICY)
    assert j.outcome is Outcome.WRONG
    assert [r.split(":")[0] for r in j.reasons[:2]] == ["wrong values", "hung"]


def test_sweep_preempted_run_has_no_verdict():
    j = judge(group(P5.split("0:    536870912", 1)[0], rc=None, ended="preempted",
                    detail="CANCELLED DUE TO PREEMPTION"), h100(), POLICY)
    assert j.outcome is Outcome.PREEMPTED and not j.outcome.decided
    assert j.reasons == ("preempted: the scheduler took the nodes back after 42 s (CANCELLED DUE TO PREEMPTION): "
                         "no verdict",)
    assert j.latency_p95_us == pytest.approx(70.205)  # what it measured is still shown


@pytest.mark.parametrize("ended", ["not-started", "launch-error"])
def test_sweep_not_started_is_not_run(ended):
    j = judge(group("", rc=None, ended=ended, detail="no allocation within 60 s"), h100(), POLICY)
    assert j.outcome is Outcome.NOT_RUN and not j.outcome.decided
    assert j.reasons == (f"not run ({ended}): no allocation within 60 s",)


# -- learned baselines ------------------------------------------------------------------------------------------------
def test_sweep_history_learns_each_members_figures_and_names_them(tmp_path):
    clock = iter(range(1_764_000_000, 1_764_000_100))
    history = SweepHistory(tmp_path / "history.db", clock=lambda: next(clock))
    base = h100(sku="B200-HGX")  # no table figure: only history can give one
    passed = judge(group(P5), base, POLICY)
    for _ in range(5):
        for node in NODES:
            assert history.record(node, 2, "B200-HGX", passed)
    learned = h100(sku="B200-HGX", history=history)
    assert learned.busbw_gbps.value == pytest.approx(487.26)
    assert learned.latency_p95_us.value == pytest.approx(70.205)
    assert learned.busbw_gbps.source == ("history: median of 2 of 2 members' own past figures at 2 nodes "
                                         "(p5-st-1: 5 since 2025-11-24, p5-st-2: 5 since 2025-11-24)")
    slower = P5.replace("  487.09  ", "  300.00  ").replace("  487.26  ", "  300.00  ")
    j = judge(group(slower), learned, POLICY)
    assert j.outcome is Outcome.SLOW and "(history: median of 2 of 2 members'" in j.reasons[0]
    # Config and table come first: a configured figure is used where there is one, history fills the rest.
    mixed = h100(policy=with_config(**{"B200-HGX/2": {"busbw_gbps": 450.0}}), sku="B200-HGX", history=history)
    assert mixed.busbw_gbps.source == "config [sweep.baselines] 'B200-HGX/2'"
    assert mixed.latency_p95_us.source.startswith("history:")


def test_sweep_history_too_thin_is_not_judged_with_the_reason(tmp_path):
    history = SweepHistory(tmp_path / "history.db")
    passed = judge(group(P5), h100(), POLICY)
    for _ in range(4):
        history.record(NODES[0], 2, "B200-HGX", passed)
    base = h100(sku="B200-HGX", history=history)
    assert base.busbw_gbps is None
    j = judge(group(P5), base, POLICY)
    assert any("not judged: no baseline for B200-HGX/2 nodes (history: no member has 5 past latency_p95_us "
               "figures at 2 nodes; history: no member has 5 past busbw_gbps figures at 2 nodes)" in r
               for r in j.reasons)


def test_sweep_unreadable_history_leaves_the_regime_unjudged_with_the_file_named(tmp_path):
    path = tmp_path / "history.db"
    history = SweepHistory(path)
    path.write_bytes(b"this is no database" * 100)
    base = h100(sku="B200-HGX", history=history)
    assert base.latency_p95_us is None and base.busbw_gbps is None
    assert base.notes[0].startswith(f"sweep history unreadable: {path}: ")


# -- baselines tables are hostile input --------------------------------------------------------------------------------
@pytest.mark.parametrize("table, message", [
    ([1, 2], "config [sweep.baselines]: must be a table"),
    ({"H100-SXM-HGX": {"busbw_gbps": 1.0}}, "key 'H100-SXM-HGX' must be \"<SKU>/<nodes>\""),
    ({"H100/2/3": {"busbw_gbps": 1.0}}, "key 'H100/2/3' must be"),
    ({"H100 SXM/2": {"busbw_gbps": 1.0}}, "the SKU must be letters, digits"),
    ({"/2": {"busbw_gbps": 1.0}}, "the SKU must be letters"),
    ({"H100/two": {"busbw_gbps": 1.0}}, "the node count must be a whole number from 2 to 100000"),
    ({"H100/1": {"busbw_gbps": 1.0}}, "key 'H100/1': the node count"),
    ({"H100/02": {"busbw_gbps": 1.0}}, "key 'H100/02': the node count"),
    ({"H100/\u0662": {"busbw_gbps": 1.0}}, "the node count"),
    ({"H100/9999999": {"busbw_gbps": 1.0}}, "the node count"),
    ({"H100/2": 5.0}, "'H100/2': must be a table"),
    ({"H100/2": {}}, "'H100/2': sets neither latency_p95_us nor busbw_gbps"),
    ({"H100/2": {"busbw": 1.0}}, "'H100/2': unknown key 'busbw'"),
    ({"H100/2": {"busbw_gbps": True}}, "'H100/2'.busbw_gbps: must be a number > 0 and <= 100000, got True"),
    ({"H100/2": {"busbw_gbps": "400"}}, "got '400'"),
    ({"H100/2": {"busbw_gbps": float("nan")}}, "got nan"),
    ({"H100/2": {"busbw_gbps": float("inf")}}, "got inf"),
    ({"H100/2": {"busbw_gbps": 0}}, "got 0"),
    ({"H100/2": {"latency_p95_us": -5.0}}, "'H100/2'.latency_p95_us: must be a number > 0 and <= 1e+07, got -5.0"),
    ({"H100/2": {"latency_p95_us": 10 ** 400}}, "latency_p95_us: must be a number > 0 and <= 1e+07, got a number"),
    ({"H100/2": {"latency_p95_us": 10 ** 5000}}, "got a number of thousands of digits"),
    ({f"S{i}/2": {"busbw_gbps": 1.0} for i in range(1001)}, "1001 entries, at most 1000"),
    ({"x" * 5000 + "/2": {"busbw_gbps": 1.0}}, "must be \"<SKU>/<nodes>\""),
])
def test_sweep_bad_baselines_table_is_a_config_error_naming_the_key(table, message):
    with pytest.raises(ConfigError) as err:
        parse_baselines(table, "config [sweep.baselines]")
    assert message in str(err.value)
    assert len(str(err.value)) < 400  # a hostile key is quoted, not echoed whole


def test_sweep_bad_baselines_in_the_policy_fail_the_lookup():
    with pytest.raises(ConfigError, match=r"config \[sweep.baselines\] 'H100-SXM-HGX/2'.busbw_gbps"):
        h100(with_config(**{"H100-SXM-HGX/2": {"busbw_gbps": -1}}))


def test_sweep_good_baselines_table_parses():
    parsed = parse_baselines({"H100-SXM-HGX/2": {"latency_p95_us": 80, "busbw_gbps": 430.5},
                              "GB200-NVL72/18": {"busbw_gbps": 700.0}}, "config [sweep.baselines]")
    assert parsed == {(H100, 2): {"latency_p95_us": 80.0, "busbw_gbps": 430.5},
                      ("GB200-NVL72", 18): {"busbw_gbps": 700.0}}


def test_sweep_judge_takes_a_hand_made_baseline():
    base = Baseline(None, Figure(650.0, "GB/s", "operator"), "H100-SXM-HGX/2")
    j = judge(group(P5), base, POLICY)
    assert j.outcome is Outcome.SLOW and j.reasons[0].endswith("< 0.8 x baseline 650 GB/s (operator)")
    assert any("not judged: no baseline for H100-SXM-HGX/2 nodes" in r for r in j.reasons)


@pytest.mark.parametrize("key, value, message", [
    ("latency_factor", 0.5, "[sweep] latency_factor: must be a number from 1 to 100, got 0.5"),
    ("busbw_fraction", 1.5, "busbw_fraction: must be a number from 0.01 to 1"),
    ("busbw_fraction", float("nan"), "got nan"),
    ("min_cycles", 1, "min_cycles: must be an integer from 2 to 10000, got 1"),
    ("min_cycles", 5.0, "must be an integer"),
    ("history_keep", True, "must be an integer"),
    ("small_max_bytes", 2 << 30, "small_max_bytes (2147483648) must be below large_min_bytes (1073741824)"),
])
def test_sweep_bad_criteria_keys_are_config_errors(key, value, message):
    with pytest.raises(ConfigError) as err:
        check_policy({**POLICY, key: value})
    assert message in str(err.value)
    with pytest.raises(ConfigError):
        judge(group(P5), h100(), {**POLICY, key: value})


def test_sweep_criteria_defaults_are_in_their_ranges():
    assert check_policy({}) == CRITERIA_DEFAULTS


def test_sweep_member_name_the_history_cannot_hold_is_said(tmp_path):
    base = h100(sku="B200-HGX", history=SweepHistory(tmp_path / "h.db"), members=("p5-st-1", "bad\nname"))
    assert base.busbw_gbps is None
    assert base.notes[0].startswith("sweep history not consulted: node must be a printable name")

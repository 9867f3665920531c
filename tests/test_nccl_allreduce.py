"""nccl_allreduce: the decision on parsed outputs, then the whole check on recorded scenarios (copies of bundled
ones plus a tools/all_reduce_perf.out/.rc/.hang), and `gpuwarden analyze` giving the same findings."""
import json
import re
from pathlib import Path

import pytest
from conftest import record_tool
from gpuwarden.agent.cli.analyze import analyze_file
from gpuwarden.agent.core import config
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.core.thresholds import sku_table
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.checks import nccl_allreduce
from gpuwarden.checks.nccl_allreduce import CHECK, Floor, analyze, argv, decide, detect, floor_for
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests

NCCL = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "nccl"
PASS_TEXT = (NCCL / "EDITED__all_reduce_perf__1node-8xH100__g021__pass.txt").read_text()
POLICY = dict(CHECK.defaults)
NODE = Entity("node", "g021")
H100 = floor_for("H100-SXM-HGX", POLICY)
GIB = 1073741824


# -- outputs derived from the pass output: one fault each -------------------------------------------------------------
def with_wrong_values(text=PASS_TEXT):
    """12 wrong elements in-place at 1 GiB, as nccl-tests reports them, then its failure line (it exits 1)."""
    text = re.sub(r"(\n  1073741824 .*  )    0\n", r"\1   12\n", text)
    text = text.replace("# Out of bounds values : 0 OK", "# Out of bounds values : 1 FAILED")
    return text + " .. g021 pid 41215: Test failure common.cu:1127\n"


def with_low_busbw(text=PASS_TEXT):
    """The two large rows at 60 % of their bus bandwidth (as with NVLinks down)."""
    def scale(m):
        cols = m.group(0).split()
        for i in (7, 11):
            cols[i] = f"{float(cols[i]) * 0.6:.2f}"
        return "  " + "  ".join(f"{c:>8}" for c in cols)
    return re.sub(r"^ *(1073741824|2147483648) .*$", scale, text, flags=re.M)


def crashed(text=PASS_TEXT):
    """A rank hits an illegal memory access at 256 MiB: NCCL warns, nccl-tests reports, the run dies."""
    head = text.split("   536870912", 1)[0]
    return head + ("g021:41215:41290 [3] NCCL WARN Cuda failure 'an illegal memory access was encountered'\n"
                   "g021: Test NCCL failure common.cu:1008 'unhandled cuda error (run with NCCL_DEBUG=INFO for "
                   "details) / '\n .. g021 pid 41215: Test failure common.cu:891\n")


def truncated(text=PASS_TEXT):
    return text.split("   536870912", 1)[0]


def parsed(text):
    return parse_nccl_tests(text, "test")


def codes(findings):
    return [f.code for f in findings]


# -- decide ---------------------------------------------------------------------------------------------------------
def test_healthy_run_has_no_findings():
    assert decide(parsed(PASS_TEXT), NODE, H100, POLICY, returncode=0) == []


def test_floors_come_from_the_table_and_config_wins():
    assert H100.gbps == 368.0 and "H100-SXM-HGX" in H100.origin
    assert set(sku_table("nccl_allreduce")) == {"H100-SXM-HGX", "H200-SXM-HGX", "GB200-NVL72"}
    configured = floor_for("H100-SXM-HGX", {**POLICY, "busbw_floor_gbps": 450.0})
    assert configured.gbps == 450.0 and "busbw_floor_gbps" in configured.origin
    unknown = floor_for("B200-HGX", POLICY)
    assert unknown.gbps is None and "busbw_floor_gbps" in unknown.origin


def test_wrong_values_are_silent_data_corruption_not_a_crash():
    (f,) = decide(parsed(with_wrong_values()), NODE, H100, POLICY, returncode=1)
    assert (f.code, f.status, f.action, f.entity) == ("nccl-wrong-results", Status.FAIL, Action.DRAIN, NODE)
    assert f.evidence["out_of_bounds"] == 1
    assert f.evidence["rows"] == [{"size_bytes": GIB, "type": "float", "redop": "sum", "line": 43,
                                   "out_of_place_wrong": 0, "in_place_wrong": 12}]


def test_low_busbw_at_large_sizes_names_measured_and_floor():
    (f,) = decide(parsed(with_low_busbw()), NODE, H100, POLICY, returncode=0)
    assert (f.code, f.status, f.action) == ("nccl-busbw-low", Status.FAIL, Action.DRAIN)
    assert [(x["size_bytes"], x["busbw_gbps"], x["floor_gbps"]) for x in f.evidence["low"]] == [
        (GIB, 264.58, 368.0), (2 * GIB, 266.23, 368.0)]  # max of out-of-place and in-place
    assert "368 GB/s" in f.message and "1073741824 B: 264.58 GB/s" in f.message


def test_only_large_sizes_are_judged_on_bandwidth():
    # 512 MiB runs at 394 GB/s: under a 400 GB/s floor, yet not judged (below large_size_bytes).
    (f,) = decide(parsed(PASS_TEXT), NODE, Floor(441.0, "test"), POLICY, returncode=0)
    assert [x["size_bytes"] for x in f.evidence["low"]] == [GIB]  # in-place 440.96 < 441; 2 GiB reaches 443.72
    assert decide(parsed(PASS_TEXT), NODE, Floor(400.0, "test"), POLICY, returncode=0) == []
    half = {**POLICY, "large_size_bytes": GIB // 2}
    assert codes(decide(parsed(PASS_TEXT), NODE, Floor(400.0, "test"), half, returncode=0)) == ["nccl-busbw-low"]


def test_crash_names_the_last_error_line():
    (f,) = decide(parsed(crashed()), NODE, H100, POLICY, returncode=3)
    assert (f.code, f.status, f.action) == ("nccl-crashed", Status.FAIL, Action.DRAIN)
    assert "exit status 3" in f.message and "closing '# Avg bus bandwidth'" in f.message
    assert "Test failure common.cu:891" in f.message
    assert f.evidence["last_size_bytes"] == 268435456 and f.evidence["rows"] == 26
    assert len(f.evidence["error_lines"]) == 3 and "NCCL WARN Cuda failure" in f.evidence["error_lines"][0]


def test_truncated_output_is_a_crash_even_with_exit_status_0():
    (f,) = decide(parsed(truncated()), NODE, H100, POLICY, returncode=0)
    assert f.code == "nccl-crashed" and "truncated" in f.message and f.evidence["returncode"] == 0


def test_non_zero_exit_after_a_complete_run_is_a_crash():
    (f,) = decide(parsed(PASS_TEXT), NODE, H100, POLICY, returncode=139)
    assert f.code == "nccl-crashed" and "exit status 139" in f.message


def test_a_failing_nccl_warn_is_a_crash_a_notice_only_a_warning():
    failing = PASS_TEXT + "g021:41215:41290 [0] NCCL WARN NET/IB : Got completion with error 12, opcode 0\n"
    assert codes(decide(parsed(failing), NODE, H100, POLICY, returncode=0)) == ["nccl-crashed"]
    warn = "g021:41215:41215 [0] NCCL WARN NCCL_SOCKET_IFNAME set by environment\n"
    notice = PASS_TEXT.replace("#\n#   ", warn + "#\n#   ", 1)
    (f,) = decide(parsed(notice), NODE, H100, POLICY, returncode=0)
    assert (f.code, f.status, f.action) == ("nccl-warnings", Status.WARN, Action.MONITOR)


def test_no_floor_is_a_visible_warning_not_a_pass():
    (f,) = decide(parsed(PASS_TEXT), NODE, floor_for("B200-HGX", POLICY), POLICY, returncode=0)
    assert (f.code, f.status) == ("nccl-no-floor", Status.WARN)
    assert f.evidence["large_sizes"] == [{"size_bytes": GIB, "busbw_gbps": 440.96},
                                         {"size_bytes": 2 * GIB, "busbw_gbps": 443.72}]


def test_no_large_sizes_is_a_visible_warning():
    text = "\n".join(ln for ln in PASS_TEXT.splitlines() if not re.match(r" *(1073741824|2147483648) ", ln))
    (f,) = decide(parsed(text), NODE, H100, POLICY, returncode=0)
    assert f.code == "nccl-no-large-sizes" and f.evidence["largest_size_bytes"] == 536870912


def test_na_wrong_column_is_neither_zero_nor_a_failure():
    run = parsed((NCCL / "amd-rccl-tests__alltoall_perf__1node-8gpu__inplace-wrong-NA.txt").read_text())
    assert decide(run, NODE, Floor(300.0, "test"), {**POLICY, "large_size_bytes": 134217728}, returncode=0) == []


def test_the_tools_own_average_check_failing_is_low_bandwidth():
    run = parsed((NCCL / "dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-avg-busbw-check.txt")
                 .read_text())
    (f,) = decide(run, NODE, Floor(None, "none"), POLICY, returncode=1)  # its "Test failure" line is explained
    assert f.code == "nccl-busbw-low" and f.evidence["tool_avg_check_failed"] is True


def test_argv():
    assert argv(8) == ["all_reduce_perf", "-b", "8", "-e", "2G", "-f", "2", "-g", "8", "-c", "1"]


# -- the check on recorded scenarios ---------------------------------------------------------------------------------
def scenario(scenario_copy, output=None, rc=None, hang=False, name="h100-hgx-healthy"):
    return record_tool(scenario_copy(name), "all_reduce_perf", output, rc, hang)


def check(root, **overrides):
    cfg = config.defaults([CHECK])
    cfg.checks[CHECK.name].update(overrides.pop("checks", {}))
    cfg.agent.update(overrides)
    (result,) = run_checks(Node.recorded_at(root), [CHECK], cfg)
    return result


def test_scenario_pass(scenario_copy):
    result = check(scenario(scenario_copy, PASS_TEXT))
    assert result.status is Status.OK and result.findings == () and result.error is None


@pytest.mark.parametrize("make, rc, code", [(with_wrong_values, 1, "nccl-wrong-results"),
                                            (with_low_busbw, 0, "nccl-busbw-low"),
                                            (crashed, 3, "nccl-crashed"),
                                            (truncated, 0, "nccl-crashed"),
                                            (lambda: PASS_TEXT, 1, "nccl-crashed")])
def test_scenario_fails(scenario_copy, make, rc, code):
    result = check(scenario(scenario_copy, make(), rc=rc))
    assert result.status is Status.FAIL and codes(result.findings) == [code]
    assert result.findings[0].entity == Entity("node", "g021") and result.action is Action.DRAIN


def test_scenario_tool_missing_is_skipped(scenario_copy):
    result = check(scenario(scenario_copy))
    assert result.status is Status.SKIPPED and "all_reduce_perf" in result.error


def test_scenario_hang_is_unknown_at_the_tool_timeout(scenario_copy):
    result = check(scenario(scenario_copy, PASS_TEXT, hang=True), checks={"tool_timeout_s": 0.2})
    assert result.status is Status.UNKNOWN and "no answer within 0.2s" in result.error


def test_scenario_hang_is_unknown_at_the_check_timeout(scenario_copy):
    root = scenario(scenario_copy, PASS_TEXT, hang=True)
    result = check(root, check_timeout_s=0.3, checks={"tool_timeout_s": 1.0})
    assert result.status is Status.UNKNOWN and "timed out after 0.3s" in result.error


def test_scenario_garbage_is_unknown_with_the_parse_error(scenario_copy):
    result = check(scenario(scenario_copy, "Hello from the container entrypoint\nall done\n"))
    assert result.status is Status.UNKNOWN and "not nccl-tests output" in result.error
    assert "all_reduce_perf output" in result.error


def test_scenario_garbage_with_failed_exit_is_a_crash(scenario_copy):
    text = "all_reduce_perf: error while loading shared libraries: libnccl.so.2: cannot open shared object file\n"
    result = check(scenario(scenario_copy, text, rc=127))
    (f,) = result.findings
    assert result.status is Status.FAIL and f.code == "nccl-crashed" and "libnccl.so.2" in f.message


def test_scenario_unparsed_row_is_a_visible_warning(scenario_copy):
    text = PASS_TEXT.replace("# Out of bounds", "     4194304       1048576     float     sum\n# Out of bounds")
    result = check(scenario(scenario_copy, text))
    assert result.status is Status.WARN and codes(result.findings) == ["nccl-unparsed-lines"]


def test_scenario_single_gpu_is_skipped(scenario_copy):
    root = scenario(scenario_copy, PASS_TEXT)
    snap = json.loads((root / "nvml.json").read_text())
    snap["gpus"] = snap["gpus"][:1]
    (root / "nvml.json").write_text(json.dumps(snap))
    result = check(root)
    assert result.status is Status.SKIPPED and "1 GPU(s)" in result.error


def test_scenario_unknown_sku_warns_until_a_floor_is_configured(scenario_copy):
    root = scenario(scenario_copy, with_low_busbw())
    toml = root / "node.toml"
    toml.write_text(toml.read_text().replace('sku = "H100-SXM-HGX"', 'sku = "unknown"'))
    result = check(root)
    assert result.status is Status.WARN and codes(result.findings) == ["nccl-no-floor"]
    result = check(root, checks={"busbw_floor_gbps": 300.0})
    assert result.status is Status.FAIL and codes(result.findings) == ["nccl-busbw-low"]


def test_scenario_gb200_tray_uses_its_floor(scenario_copy):
    result = check(scenario(scenario_copy, with_low_busbw(), name="gb200-nvl72-healthy"))
    (f,) = result.findings
    assert f.code == "nccl-busbw-low" and f.evidence["floor_gbps"] == 345.0 and "GB200-NVL72" in f.evidence[
        "floor_origin"]


def test_findings_survive_the_json_contract(scenario_copy):
    from gpuwarden.agent.core.model import Finding

    for text in (with_wrong_values(), with_low_busbw(), crashed(), PASS_TEXT):
        for floor in (H100, Floor(None, "none")):
            for f in decide(parsed(text), NODE, floor, POLICY, returncode=3):
                assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f


def test_check_spec():
    assert (CHECK.level, CHECK.resources, CHECK.timeout_s) == ("full", ("gpu",), 600)
    assert CHECK.defaults["tool_timeout_s"] < CHECK.timeout_s
    assert [a.fmt for a in CHECK.analyzers] == ["nccl-tests"]


# -- gpuwarden analyze ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [with_wrong_values, with_low_busbw, lambda: PASS_TEXT])
def test_analyze_reports_what_the_check_reports(scenario_copy, make):
    text = make()
    result = check(scenario(scenario_copy, text))
    findings, problems = analyze(text, "saved.txt")
    assert findings == list(result.findings) and problems == []


def test_analyze_without_device_lines_or_over_nodes_does_not_judge_bandwidth():
    findings, _ = analyze((NCCL / "aws__all_reduce_perf__AWS-Batch-log-stream__mpirun-tagged__trailing-spaces.txt")
                          .read_text(), "x")
    assert codes(findings) == ["nccl-no-floor"]
    two_nodes = PASS_TEXT.replace("on       g021 device  7", "on       g022 device  7")
    (f,) = analyze(with_low_busbw(two_nodes), "x")[0]
    assert f.code == "nccl-no-floor" and "2 nodes" in f.message and f.entity.id == "g021,g022"


def test_analyze_garbage_raises_parse_error():
    with pytest.raises(ParseError):
        analyze("nothing to see\n", "x")


def test_detect_reads_nccl_tests_outputs_and_not_kernel_logs():
    for path in NCCL.glob("*.txt"):
        if not path.name.endswith(".source.txt"):
            assert detect(path.read_text()), path.name
    kmsg = Path(__file__).resolve().parent.parent / "fixtures" / "nodes" / "h100-hgx-healthy" / "kmsg"
    assert not detect(kmsg.read_text(errors="replace"))


def test_gpuwarden_analyze_file_once_registered(tmp_path, monkeypatch):
    import gpuwarden.checks as checks

    monkeypatch.setattr(checks, "ALL", (*checks.ALL, nccl_allreduce.CHECK))
    saved = tmp_path / "all_reduce_perf.log"
    saved.write_text(with_wrong_values())
    result = analyze_file(saved)
    assert (result.check, result.status) == ("nccl_allreduce", Status.FAIL)
    assert codes(result.findings) == ["nccl-wrong-results"] and "(nccl-tests)" in result.source

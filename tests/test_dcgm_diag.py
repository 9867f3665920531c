"""dcgm_diag: decisions on real and built dcgmi diag outputs, recorded scenarios (pass, fail, warn, DCGM 4.x, dcgmi
missing, hang, garbage, dcgmi errors) and `gpuwarden analyze` on JSON and text giving the same findings."""
import json
import os
import subprocess
import sys

import gpuwarden.checks
import pytest
from conftest import NODES, ROOT, record_tool, run_spec
from gpuwarden.agent.cli.analyze import analyze_file
from gpuwarden.agent.core.errors import ToolError
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import dcgm_diag
from gpuwarden.checks.parse_dcgmi_diag import diag_from_json, parse_dcgmi_diag_json
from gpuwarden.checks.parse_dcgmi_diag_text import parse_dcgmi_diag_text
from test_parse_dcgmi_diag import (
    EMPTY_CATEGORIES,
    FOOTER,
    FRAG_MEMORY,
    FRAG_REMAP,
    HEADER,
    MALFORMED,
    R1_PASS_T4,
    R2_PASS_T4,
    band,
    message_rows,
    row,
    v3_doc,
    v4_doc,
    warning,
)

POLICY = dict(dcgm_diag.CHECK.defaults)
H100 = Node.recorded_at(NODES / "h100-hgx-healthy").gpus()  # 8 GPUs
MISMATCH = "A memory mismatch was detected on GPU 2, but no error was reported by CUDA or NVML."


def codes(findings):
    return [(f.code, f.entity.index, f.status, f.action) for f in findings]


def decide(doc, gpus=H100, **policy):
    return dcgm_diag.decide(diag_from_json(doc, "x"), gpus, {**POLICY, **policy}, "g021")


# ------------------------------------------------------------------------------------ decisions


def test_memory_fail_with_a_field_diag_error_needs_service_on_that_gpu():
    doc = v3_doc(8, per_gpu={("GPU Memory", 2): {"status": "Fail", "warnings": [warning(MISMATCH, 58, 10, 2)]}})
    (f,) = decide(doc)
    assert codes([f]) == [("dcgm-memory", 2, Status.FAIL, Action.SERVICE)]
    assert f.entity == H100[2].entity  # DCGM's GPU id is the NVML index: the finding carries the UUID and BDF
    assert MISMATCH in f.message and "(DCGM error 58)" in f.message and "GPU-973565ff" in f.message
    assert f.evidence["error_ids"] == [58] and f.evidence["error_severities"] == ["ISOLATE"]
    assert f.evidence["format"] == "dcgm-3.x-json"


@pytest.mark.parametrize("error, action", [
    (warning("Bandwidth of GPU 2 in direction h2d of 10.00 did not exceed minimum required bandwidth of 20.00.",
             30, 13, 4), Action.DRAIN),  # the default for a failed test
    (warning("GPU 2 had memory errors and row remappings are pending", 85, 10, 6), Action.RESET_GPU),
    (warning("Detected 2 volatile double-bit ECC error(s) in GPU 2.", 4, 10, 6), Action.RESET_GPU),
    (warning("Some future error", 4242, 15, 6), Action.RESET_GPU),  # DCGM_ERROR_RESET: "Drain and reset GPU"
    (warning("GPU 2 had uncorrectable memory errors and row remapping failed.", 80, 10, 2), Action.SERVICE),
    (warning("Persistence mode for GPU 2 is disabled.", 29, 3, 5), Action.DRAIN),
    ("an old plain-string warning", Action.DRAIN),
])
def test_failure_action_by_dcgm_error(error, action):
    doc = v3_doc(8, per_gpu={("PCIe", 2): {"status": "Fail", "warnings": [error]}})
    assert codes(decide(doc)) == [("dcgm-pcie", 2, Status.FAIL, action)]


def test_warn_is_warn_monitor_and_skip_is_no_finding():
    text = "\n".join([row("DCGM Version", "3.3.5"), row("GPU Device IDs Detected", "2330,2330"),
                      row("PCIe", "Pass - GPU: 0"), row("", "Warn - GPU: 1"),
                      *message_rows("Warning", "Clocks are being throttled for GPU 1 because of clock throttling "
                                               "starting 9.0 seconds into the test."),
                      row("EUD Test", "Skip - All")])
    found = dcgm_diag.decide(parse_dcgmi_diag_text(text, "x"), H100[:2], POLICY, "g021")
    assert codes(found) == [("dcgm-pcie", 1, Status.WARN, Action.MONITOR)]
    assert "Clocks are being throttled for GPU 1" in found[0].message


def test_ignore_tests_by_either_name():
    doc = v3_doc(8, per_gpu={("GPU Memory", 2): {"status": "Fail"}, ("PCIe", 3): {"status": "Fail"}})
    assert codes(decide(doc, ignore_tests=["memory"])) == [("dcgm-pcie", 3, Status.FAIL, Action.DRAIN)]
    assert codes(decide(doc, ignore_tests=["GPU Memory", "PCIe"])) == []


def test_deployment_failure_lands_on_the_gpu_it_names_else_the_node():
    doc = v3_doc(8, deployment={"Page Retirement/Row Remap": {"status": "Fail", "gpu_id": 3, "warnings": [
        warning("GPU 3 had memory errors and row remappings are pending", 85, 10, 6, key="warnings")]}})
    assert codes(decide(doc)) == [("dcgm-page-retirement-row-remap", 3, Status.FAIL, Action.RESET_GPU)]
    doc = v3_doc(8, deployment={"CUDA Main Library": {"status": "Fail", "warnings": [warning(
        "Cannot open library libcuda.so: 'libcuda.so: cannot open shared object file'", 22, 4, 5)]}})
    (f,) = decide(doc)
    assert (f.code, f.entity.kind, f.entity.id, f.status, f.action) == (
        "dcgm-cuda-main-library", "node", "g021", Status.FAIL, Action.DRAIN)


def test_the_same_code_on_3x_and_4x():
    v3 = v3_doc(8, per_gpu={("GPU Memory", 2): {"status": "Fail", "warnings": [warning(MISMATCH, 58, 10, 2)]}})
    v4 = v4_doc(8, per_gpu={("memory", 2): {"status": "Fail", "warnings": [warning(MISMATCH, 58, 10, 2)]}})
    assert codes(decide(v3)) == codes(decide(v4)) == [("dcgm-memory", 2, Status.FAIL, Action.SERVICE)]


def test_gpus_dcgm_did_not_report_are_unknown_not_passed():
    # The real pass output is a 1 x T4 run: on an 8-GPU node it says nothing about GPUs 1..7. They were not
    # tested, so they are UNKNOWN (the check's status is UNKNOWN, exit code 2), and GPU 0 has no finding.
    found = dcgm_diag.decide(parse_dcgmi_diag_json(R2_PASS_T4.read_text(), "x"), H100, POLICY, "g021")
    assert codes(found) == [("dcgm-gpu-not-tested", i, Status.UNKNOWN, Action.NONE) for i in range(1, 8)]
    assert "it tested GPU 0" in found[0].message
    # DCGM's own GPU list counts too (analyze: no node): 4.x lists 4 GPUs, results for 3
    doc = v4_doc(4)
    for test in doc["DCGM Diagnostic"]["test_categories"]:
        for t in test["tests"]:
            t["results"] = t["results"][:3]
    assert codes(decide(doc, gpus=())) == [("dcgm-gpu-not-tested", 3, Status.UNKNOWN, Action.NONE)]


def test_a_level1_run_has_no_per_gpu_results_to_miss():
    doc = json.loads((R2_PASS_T4.parent / "virtualclient__dcgmi-diag-r1-j__DCGM-3.x-schema__1xT4__pass.json")
                     .read_text())
    assert decide(doc, level=1) == []
    assert {f.code for f in decide(doc, level=2)} == {"dcgm-gpu-not-tested"}  # level 2 must test every GPU


def statuses(doc, status):
    """Every result of a built document set to one status."""
    for cat in next(iter(doc.values()))["test_categories"]:
        for test in cat["tests"]:
            for r in test["results"]:
                r["status"] = status
            if "test_summary" in test:
                test["test_summary"]["status"] = status
    return doc


def without_results(doc):
    for cat in doc["DCGM GPU Diagnostic"]["test_categories"]:
        for test in cat["tests"]:
            test["results"] = []
    return doc


# A run that tested nothing is undecided, whatever its level: nothing in it was looked at. Skip and Not Run are
# tests DCGM did not run (a plugin it could not load, a GPU it would not test), so a run of only those is no pass.
NOTHING_RAN = [
    pytest.param(json.loads(EMPTY_CATEGORIES.read_text()), "DCGM reported no test result (it lists no test "
                 "('test_categories' is empty)): nothing was tested", id="empty-test_categories"),
    pytest.param(without_results(v3_doc(8)), "it lists 11 test(s), none with a result", id="tests-without-results"),
    pytest.param(statuses(v3_doc(8), "Skip"), "every result DCGM reported is a test that did not run (25 skip)",
                 id="all-skip-3x"),
    pytest.param(statuses(v4_doc(4), "Skip"), "a test that did not run (12 skip)", id="all-skip-4x"),
    pytest.param(statuses(v3_doc(2), "Not Run"), "(13 not run)", id="all-not-run"),
]


@pytest.mark.parametrize("doc, reason", NOTHING_RAN)
def test_a_diag_that_tested_nothing_is_could_not_look(doc, reason):
    run = diag_from_json(doc, "x")
    for level in (1, 2):
        with pytest.raises(ToolError) as err:
            dcgm_diag.require_ran(run, f"dcgmi diag -r {level} -j")
        assert reason in str(err.value) and "nothing is known healthy" in str(err.value)


def test_a_skip_beside_tests_that_ran_is_no_finding_and_no_pass_for_its_gpu():
    # The real r3 output: EUD skipped on GPU 0, every other test passed on it: GPU 0 was tested.
    r3 = json.loads((R2_PASS_T4.parent / "virtualclient__dcgmi-diag-r3-j__DCGM-3.x-schema__1xT4__pass-with-skip.json")
                    .read_text())
    dcgm_diag.require_ran(diag_from_json(r3, "x"), "x")
    assert decide(r3, gpus=H100[:1]) == []
    # A GPU whose every per-GPU test was skipped was not tested: UNKNOWN, not passed.
    doc = v3_doc(8, per_gpu={("PCIe", 5): {"status": "Skip"}, ("GPU Memory", 5): {"status": "Skip"}})
    (f,) = decide(doc)
    assert codes([f]) == [("dcgm-gpu-not-tested", 5, Status.UNKNOWN, Action.NONE)]


@pytest.mark.parametrize("doc", [
    pytest.param(json.loads(R1_PASS_T4.read_text()), id="real-r1-system-wide-only"),
    pytest.param(v3_doc(0), id="per-gpu-tests-with-no-gpu"),
    pytest.param(v4_doc(0) | {"entity_groups": []}, id="4x-no-entity"),
    pytest.param({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
        {"name": "cpu_eud", "results": [{"entity_group": "CPU", "entity_group_id": 7, "entity_id": 0,
                                         "status": "Pass"}]}]}]}}, id="4x-cpu-entity-only"),
])
def test_no_per_gpu_result_and_no_gpu_known_is_unknown_at_level_2(doc):
    """analyze of a file that names no GPU: at level 2 (the default) each GPU is to be tested; none was."""
    assert diag_from_json(doc, "x").results  # results there are, none of a GPU
    (f,) = decide(doc, gpus=())
    assert (f.code, f.entity.kind, f.status, f.action) == ("dcgm-no-gpu-result", "node", Status.UNKNOWN, Action.NONE)
    assert "no GPU was tested, so none is known healthy" in f.message
    assert decide(doc, gpus=(), level=1) == []  # a level-1 run has only system-wide tests


# ------------------------------------------------------------------------------------ scenarios


def node_with(scenario_copy, name="h100-hgx-healthy", out=None, rc=None, hang=False, tool="dcgmi-diag-r2"):
    text = out if out is None or isinstance(out, str) else json.dumps(out, indent="\t")
    return Node.recorded_at(record_tool(scenario_copy(name), tool, text, rc, hang))


def run_check(node, spec=dcgm_diag.CHECK, check_timeout_s=0.0, **cfg):
    return run_spec(node, spec, check_timeout_s, **cfg)


def test_scenario_pass_on_every_gpu(scenario_copy):
    result = run_check(node_with(scenario_copy, out=v3_doc(8)))
    assert (result.status, result.findings, result.error) == (Status.OK, (), None)


def test_scenario_real_t4_pass_leaves_the_other_gpus_unknown(scenario_copy):
    result = run_check(node_with(scenario_copy, out=R2_PASS_T4.read_text()))
    assert result.status is Status.UNKNOWN and result.error is None
    assert [f.entity.index for f in result.findings] == list(range(1, 8))


def test_scenario_fail(scenario_copy):
    doc = v3_doc(8, per_gpu={("GPU Memory", 2): {"status": "Fail", "warnings": [warning(MISMATCH, 58, 10, 2)]}})
    result = run_check(node_with(scenario_copy, out=doc, rc=215))  # dcgmi exits non-zero when a test fails
    assert result.status is Status.FAIL and result.action is Action.SERVICE
    assert codes(result.findings) == [("dcgm-memory", 2, Status.FAIL, Action.SERVICE)]


def test_scenario_warn_and_4x_reset(scenario_copy):
    doc = v4_doc(4, per_gpu={("memory", 1): {"status": "Fail", "warnings": [
        warning("GPU 1 had memory errors and row remappings are pending", 85, 10, 6)]}})
    result = run_check(node_with(scenario_copy, "gb200-nvl72-healthy", out=doc, rc=226))
    assert codes(result.findings) == [("dcgm-memory", 1, Status.FAIL, Action.RESET_GPU)]
    assert result.findings[0].entity.pci == "0009:01:00.0"


def test_scenario_dcgmi_missing_is_skipped(scenario_copy):
    result = run_check(node_with(scenario_copy))
    assert result.status is Status.SKIPPED and "dcgmi" in result.error


def test_scenario_hang_is_unknown(scenario_copy):
    node = node_with(scenario_copy, hang=True)
    result = run_check(node, check_timeout_s=0.3, timeout_s=1.0)
    assert result.status is Status.UNKNOWN and "timed out after 0.3s" in result.error
    # dcgmi's own limit, when it is the shorter one
    result = run_check(node, timeout_s=0.2)
    assert result.status is Status.UNKNOWN and "no answer within 0.2s" in result.error


@pytest.mark.parametrize("out, rc, reason", [
    ("\x00\x17garbage{{\n", 0, "malformed JSON"),
    (MALFORMED.read_text(), 0, "'DCGM GPU Diagnostic' is a list, not an object: the 'test_categories' level is "
                               "missing"),
    ("Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n", 255,
     "exited 255: Error: Unable to connect to host engine"),
    (json.dumps({"DCGM GPU Diagnostic": {"version": "3.3.5", "runtime_error": "Error: Diagnostic could not be run "
                                                                              "while DCGM is paused."}}), 220,
     "DCGM did not run the diagnostic: Error: Diagnostic could not be run while DCGM is paused."),
])
def test_scenario_garbage_and_dcgmi_errors_are_unknown(scenario_copy, out, rc, reason):
    result = run_check(node_with(scenario_copy, out=out, rc=rc))
    assert result.status is Status.UNKNOWN and reason in result.error, result.error


@pytest.mark.parametrize("doc, reason", NOTHING_RAN)
def test_scenario_a_diag_that_tested_nothing_is_unknown(scenario_copy, doc, reason):
    """The preflight path on a recorded node: dcgmi exited 0 with a document that tested nothing."""
    result = run_check(node_with(scenario_copy, out=doc, rc=0))
    assert result.status is Status.UNKNOWN and result.findings == (), result
    assert result.error.startswith("dcgmi diag -r 2 -j: ") and reason in result.error, result.error


def test_scenario_the_empty_fixture_as_dcgmi_printed_it(scenario_copy):
    result = run_check(node_with(scenario_copy, out=EMPTY_CATEGORIES.read_text(), rc=0))
    assert result.status is Status.UNKNOWN and "'test_categories' is empty" in result.error


def test_scenario_level_comes_from_config(scenario_copy):
    node = node_with(scenario_copy, out=v3_doc(8, tests=()), tool="dcgmi-diag-r1")
    assert run_check(node, level=1).status is Status.OK
    bad = run_check(node, level=7)
    assert bad.status is Status.UNKNOWN and "level must be 1..4" in bad.error


def test_spec():
    spec = dcgm_diag.CHECK
    assert (spec.level, spec.resources, spec.timeout_s) == ("full", ("gpu",), 900)
    assert spec.defaults["timeout_s"] < spec.timeout_s
    assert [a.fmt for a in spec.analyzers] == ["dcgmi-diag-json", "dcgmi-diag-text"]


# ------------------------------------------------------------------------------------ analyze


@pytest.fixture
def registered(monkeypatch):
    """`gpuwarden analyze` with dcgm_diag among the checks (until checks/__init__.py lists it)."""
    if dcgm_diag.CHECK not in gpuwarden.checks.ALL:
        monkeypatch.setattr(gpuwarden.checks, "ALL", (*gpuwarden.checks.ALL, dcgm_diag.CHECK))


def test_analyze_json_and_text_of_one_run_give_the_same_findings(tmp_path, registered):
    msg = "GPU 2 had memory errors and row remappings are pending"
    doc = v3_doc(4, per_gpu={("GPU Memory", 2): {"status": "Fail", "warnings": [warning(msg, 85, 10, 6)]}})
    text = [*HEADER, "|-----  Metadata  ----------+------------------------------------------------|",
            row("DCGM Version", "3.3.5"), row("GPU Device IDs Detected", "2330,2330,2330,2330"),
            "|-----  Deployment  --------+------------------------------------------------|",
            *(row(t, "Pass") for t in ("Denylist", "NVML Library", "Persistence Mode")),
            band("Integration"), row("PCIe", "Pass - All"), band("Hardware"), row("GPU Memory", "Pass - GPUs: 0, 1, 3"),
            row("", "Fail - GPU: 2"), *message_rows("Warning", msg), *FOOTER]
    (tmp_path / "diag.json").write_text(json.dumps(doc, indent="\t"))
    (tmp_path / "diag.txt").write_text("\n".join(text) + "\n")
    as_json, as_text = analyze_file(tmp_path / "diag.json"), analyze_file(tmp_path / "diag.txt")
    assert as_json.source.endswith("(dcgmi-diag-json)") and as_text.source.endswith("(dcgmi-diag-text)")
    assert as_json.check == as_text.check == "dcgm_diag"
    assert codes(as_json.findings) == codes(as_text.findings) == [("dcgm-memory", 2, Status.FAIL, Action.RESET_GPU)]
    assert as_json.findings[0].entity == as_text.findings[0].entity
    assert as_json.status is Status.FAIL


def test_analyze_real_files(registered):
    memory = analyze_file(FRAG_MEMORY)
    assert codes(memory.findings) == [("dcgm-memory", 0, Status.FAIL, Action.DRAIN)]
    assert "Thermal violations totaling 13.3 seconds" in memory.findings[0].message
    remap = analyze_file(FRAG_REMAP)
    # The fragment holds no per-GPU result: GPU 3 is named by the failed deployment test, no GPU is known tested.
    assert codes(remap.findings) == [("dcgm-deployment", 3, Status.FAIL, Action.RESET_GPU),
                                     ("dcgm-no-gpu-result", None, Status.UNKNOWN, Action.NONE)]
    assert remap.status is Status.FAIL
    assert remap.findings[0].evidence["error_ids"] == [85]  # named by DCGM's message template
    assert analyze_file(R2_PASS_T4).status is Status.OK  # no node, no GPU list in the file: GPU 0 passed
    bad = analyze_file(MALFORMED)
    assert bad.status is Status.UNKNOWN and "test_categories" in bad.error


def test_analyze_runtime_error_is_unknown(tmp_path, registered):
    path = tmp_path / "diag.json"
    path.write_text(json.dumps({"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "Error: Unable to complete "
                                                    "diagnostic. Return: (-3) : Not Supported"}}))
    result = analyze_file(path)
    assert result.status is Status.UNKNOWN and "Not Supported" in result.error


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, stdin=subprocess.DEVNULL)


def test_cli_analyze_of_a_diag_that_tested_nothing_is_undecided(tmp_path):
    proc = cli("analyze", "--json", str(EMPTY_CATEGORIES))
    assert proc.returncode == 2, proc.stdout
    (result,) = json.loads(proc.stdout)["results"]
    assert result["status"] == "unknown" and result["source"].endswith("(dcgmi-diag-json)")
    assert "DCGM reported no test result" in result["error"] and "'test_categories' is empty" in result["error"]
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps(statuses(v4_doc(4), "Skip"), indent="\t"))
    proc = cli("analyze", str(skipped))
    assert proc.returncode == 2 and "a test that did not run (12 skip)" in " ".join(proc.stdout.split())


def test_cli_analyze_of_a_diag_with_no_per_gpu_result_is_undecided():
    proc = cli("analyze", "--json", str(R1_PASS_T4))
    assert proc.returncode == 2, proc.stdout
    (result,) = json.loads(proc.stdout)["results"]
    assert result["check"] == "dcgm_diag" and result["status"] == "unknown"
    assert [f["code"] for f in result["findings"]] == ["dcgm-no-gpu-result"]
    assert cli("analyze", str(R2_PASS_T4)).returncode == 0  # GPU 0 tested and passed

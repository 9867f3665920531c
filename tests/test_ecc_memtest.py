"""ecc_memtest: DCGM's memory test per GPU, the action by DCGM's documented next step for its error, and recorded
scenarios (pass, memory fault, setup error, dcgmi missing, hang, garbage, dcgmi error)."""
import json

import pytest
from conftest import NODES
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import ecc_memtest
from gpuwarden.checks.parse_dcgmi_diag import diag_from_json
from gpuwarden.checks.parse_dcgmi_diag_text import parse_dcgmi_diag_text
from test_dcgm_diag import codes, node_with, run_check
from test_parse_dcgmi_diag import FRAG_MEMORY, R2_PASS_T4, v3_doc, v4_doc, warning

GB200 = Node.recorded_at(NODES / "gb200-nvl72-healthy").gpus()  # 4 GPUs
MEMORY_ONLY_3X = (("Hardware", "GPU Memory"),)
MEMORY_ONLY_4X = (("Deployment", "software"), ("Hardware", "memory"))


def memory_fail(*warnings, status="Fail", gpu=1):
    return v4_doc(4, {("memory", gpu): {"status": status, "warnings": list(warnings)}}, tests=MEMORY_ONLY_4X)


def decide(doc, gpus=GB200):
    return ecc_memtest.decide(diag_from_json(doc, "x"), gpus, ecc_memtest.CHECK.defaults, "gb-tray-1")


@pytest.mark.parametrize("warnings, expected", [
    # "Run a field diagnostic on the GPU." (DCGM_FR_MEMORY_MISMATCH_NEXT, DCGM_FR_FAULTY_MEMORY_NEXT)
    ([warning("A memory mismatch was detected on GPU 1, but no error was reported by CUDA or NVML.", 58, 10, 2)],
     ("hbm-memtest-fail", Status.FAIL, Action.SERVICE)),
    ([warning("Found 12 faulty memory elements on GPU 1", 52, 10, 2)],
     ("hbm-memtest-fail", Status.FAIL, Action.SERVICE)),
    # "Drain the GPU and reset it or reboot the node." (DCGM_FR_VOLATILE_DBE_DETECTED_NEXT)
    ([warning("Detected 1 volatile double-bit ECC error(s) in GPU 1.", 4, 10, 6)],
     ("hbm-memtest-fail", Status.FAIL, Action.RESET_GPU)),
    ([warning("GPU 1 had memory errors and row remappings are pending", 85, 10, 6)],
     ("hbm-memtest-fail", Status.FAIL, Action.RESET_GPU)),
    # a hardware-memory error DCGM names but this table does not know: memory fault, field diagnostic
    ([warning("A new memory error", 4242, 10, 2)], ("hbm-memtest-fail", Status.FAIL, Action.SERVICE)),
    # setup errors: the test could not judge the memory ("could not complete because of a setup error")
    ([warning("Couldn't allocate at least 75.0% of GPU memory on GPU 1", 56, 16, 4)],
     ("hbm-memtest-error", Status.UNKNOWN, Action.NONE)),
    ([warning("Skipping test memory because ECC is not enabled on GPU 1", 55, 3, 5)],
     ("hbm-memtest-error", Status.UNKNOWN, Action.NONE)),
    # no error DCGM explains: a failure all the same, the node out until someone looks
    ([], ("hbm-memtest-fail", Status.FAIL, Action.DRAIN)),
])
def test_memory_failures_by_dcgm_error(warnings, expected):
    (f,) = decide(memory_fail(*warnings))
    assert (f.code, f.status, f.action) == expected
    assert f.entity == GB200[1].entity


def test_skipped_and_unreported_gpus_are_unknown():
    doc = v4_doc(4, {("memory", 0): {"status": "Skip"}}, tests=MEMORY_ONLY_4X)
    doc["DCGM Diagnostic"]["test_categories"][1]["tests"][0]["results"].pop()  # no memory result for GPU 3
    assert codes(decide(doc)) == [("hbm-memtest-skipped", 0, Status.UNKNOWN, Action.NONE),
                                  ("hbm-memtest-not-run", 3, Status.UNKNOWN, Action.NONE)]


def test_only_the_memory_test_is_judged_here():
    doc = v4_doc(4, {("software", 2): {"status": "Fail", "warnings": [warning("Persistence mode for GPU 2 is "
                                                                              "disabled.", 29, 3, 5)]}},
                 tests=MEMORY_ONLY_4X)
    assert decide(doc) == []  # dcgm_diag reports deployment failures


def test_3x_shape_and_text_fragment():
    doc = v3_doc(4, per_gpu={("GPU Memory", 3): {"status": "Fail", "warnings": [
        warning("CUDA APIs have indicated that a double-bit ECC error has occured on GPU 3.", 57, 10, 2)]}},
        tests=MEMORY_ONLY_3X)
    assert codes(decide(doc)) == [("hbm-memtest-fail", 3, Status.FAIL, Action.SERVICE)]
    # stas00: GPU Memory failed on GPU 0 with only a thermal warning: no memory fault named -> FAIL/DRAIN
    run = parse_dcgmi_diag_text(FRAG_MEMORY.read_text(), "x")
    found = ecc_memtest.decide(run, (), ecc_memtest.CHECK.defaults)
    assert codes(found) == [("hbm-memtest-fail", 0, Status.FAIL, Action.DRAIN)]


# ------------------------------------------------------------------------------------ scenarios
TOOL = "dcgmi-diag-memory"


def test_scenario_pass(scenario_copy):
    node = node_with(scenario_copy, "gb200-nvl72-healthy", out=v4_doc(4, tests=MEMORY_ONLY_4X), tool=TOOL)
    result = run_check(node, ecc_memtest.CHECK)
    assert (result.status, result.findings, result.error) == (Status.OK, (), None)


def test_scenario_real_t4_memory_result_on_an_8_gpu_node(scenario_copy):
    result = run_check(node_with(scenario_copy, out=R2_PASS_T4.read_text(), tool=TOOL), ecc_memtest.CHECK)
    assert result.status is Status.UNKNOWN
    assert codes(result.findings) == [("hbm-memtest-not-run", i, Status.UNKNOWN, Action.NONE) for i in range(1, 8)]


def test_scenario_fail(scenario_copy):
    doc = memory_fail(warning("Found 3 faulty memory elements on GPU 1", 52, 10, 2))
    result = run_check(node_with(scenario_copy, "gb200-nvl72-healthy", out=doc, rc=215, tool=TOOL),
                       ecc_memtest.CHECK)
    assert result.status is Status.FAIL and result.action is Action.SERVICE
    assert codes(result.findings) == [("hbm-memtest-fail", 1, Status.FAIL, Action.SERVICE)]
    assert "Found 3 faulty memory elements on GPU 1 (DCGM error 52)" in result.findings[0].message


def test_scenario_dcgmi_missing_is_skipped(scenario_copy):
    assert run_check(node_with(scenario_copy), ecc_memtest.CHECK).status is Status.SKIPPED


def test_scenario_hang_is_unknown(scenario_copy):
    node = node_with(scenario_copy, hang=True, tool=TOOL)
    result = run_check(node, ecc_memtest.CHECK, check_timeout_s=0.3, timeout_s=1.0)
    assert result.status is Status.UNKNOWN and "timed out after 0.3s" in result.error


@pytest.mark.parametrize("out, rc, reason", [
    ("garbage\n", 0, "no JSON object in dcgmi output: 'garbage'"),
    ("{ \"DCGM Diagnostic\": [", 0, "malformed JSON"),
    ("Error: Unable to connect to host engine.\n", 255, "exited 255: Error: Unable to connect to host engine."),
    (json.dumps({"DCGM Diagnostic": {"runtime_error": "Error: Unable to complete diagnostic. Return: (-3) : Not "
                                                      "Supported"}}), 253, "DCGM did not run the diagnostic"),
])
def test_scenario_garbage_and_errors_are_unknown(scenario_copy, out, rc, reason):
    result = run_check(node_with(scenario_copy, out=out, rc=rc, tool=TOOL), ecc_memtest.CHECK)
    assert result.status is Status.UNKNOWN and reason in result.error, result.error


def test_spec():
    spec = ecc_memtest.CHECK
    assert (spec.level, spec.resources) == ("full", ("gpu",))
    assert spec.defaults["timeout_s"] < spec.timeout_s
    assert ecc_memtest.ARGV == ("dcgmi", "diag", "-r", "memory", "-j")

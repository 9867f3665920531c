"""burnin: the real torch GEMM on the CPU with tiny sizes, the pure decision on crafted results, recorded
burnin.json scenarios, the DCGM fallback, the path without PyTorch, and a hang."""
import dataclasses
import functools
import json

import pytest
from conftest import ROOT, run_spec
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.gemm import Gemm, GemmResult, run_gemm, torch_available
from gpuwarden.checks import burnin

needs_torch = pytest.mark.skipif(not torch_available(), reason="PyTorch not installed (the [burnin] extra)")
TINY = {"device": "cpu", "matrix_size": 48, "seconds": 0.02, "tflops_floor": 1e-12}
H100 = "NVIDIA H100 80GB HBM3"


def run_one(node, spec=burnin.CHECK, timeout_s=0.0, **overrides):
    return run_spec(node, spec, timeout_s, **overrides)


def with_gemm(gemm):
    """The check with an explicitly constructed source (live torch on a recorded node, or torch disabled)."""
    return dataclasses.replace(burnin.CHECK, run=functools.partial(burnin.run, gemm=gemm))


# -- the real torch code on the CPU -----------------------------------------------------------------------------
@needs_torch
def test_run_gemm_on_cpu_is_deterministic_and_measures():
    a = run_gemm("cpu", 48, "bfloat16", 0.02, seed=7)
    b = run_gemm("cpu", 48, "bfloat16", 0.02, seed=7)
    c = run_gemm("cpu", 48, "bfloat16", 0.02, seed=8)
    assert a.device == "cpu" and a.iterations >= 1 and a.tflops > 0 and a.stable
    assert len(a.checksum) == 64 and a.checksum == b.checksum != c.checksum
    assert run_gemm("cpu", 48, "float32", 0.01, seed=7).checksum != a.checksum


@needs_torch
def test_devices_run_concurrently_and_agree_bitwise():
    results = Gemm().run(["cpu", "cpu:0"], 64, "float16", 0.02, seed=3)
    assert sorted(results) == ["cpu", "cpu:0"]
    assert results["cpu"].checksum == results["cpu:0"].checksum


@needs_torch
@pytest.mark.parametrize("device, dtype, match", [("cuda:99", "bfloat16", "cuda:99: GEMM failed"),
                                                  ("cpu", "int8", "dtype 'int8'")])
def test_torch_errors_become_source_errors_naming_the_device(device, dtype, match):
    with pytest.raises(SourceError, match=match):
        run_gemm(device, 16, dtype, 0.01, seed=1)


@needs_torch
def test_check_on_cpu_through_the_runner_is_ok(scenario_copy):
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy"))
    result = run_one(node, with_gemm(Gemm()), **TINY)
    assert result.status is Status.OK and result.findings == ()


@needs_torch
def test_cpu_without_configured_floor_says_it_has_none(scenario_copy):
    node = Node.recorded_at(scenario_copy("gb200-nvl72-healthy"))
    result = run_one(node, with_gemm(Gemm()), **{**TINY, "tflops_floor": 0.0})
    (f,) = result.findings
    assert (f.code, f.status, f.entity.kind) == ("gemm-floor-unknown", Status.WARN, "node")
    assert f.evidence["bf16_dense_peak_tflops"] == 2500.0  # the SKU's figure, not applied to a CPU


# -- decide: crafted results ---------------------------------------------------------------------------------------
def gpu(i):
    return Entity("gpu", f"GPU-{i}", i, f"0000:{0x19 + i:02x}:00.0")


def runs(checksums, tflops=None, model=H100, stable=None):
    tflops = tflops or [700.0] * len(checksums)
    stable = stable or [True] * len(checksums)
    return [burnin.GpuGemm(gpu(i), model, GemmResult(f"cuda:{i}", t, 100, c, model, 132, s))
            for i, (c, t, s) in enumerate(zip(checksums, tflops, stable, strict=True))]


POLICY = dict(burnin.CHECK.defaults)


def test_all_equal_and_fast_is_clean():
    assert burnin.decide(runs(["a"] * 8), 593.0, POLICY) == []


def test_majority_names_the_odd_gpu_out():
    (f,) = burnin.decide(runs(["a", "a", "a", "b", "a", "a", "a", "a"]), 593.0, POLICY)
    assert (f.code, f.entity.index, f.status, f.action) == ("gemm-checksum-mismatch", 3, Status.FAIL, Action.SERVICE)
    assert f.evidence["majority_checksum"] == "a" and "7 of 8" in f.message


@pytest.mark.parametrize("sums", [["a", "b"], ["a", "a", "b", "b"], ["a", "b", "c"]])
def test_without_a_majority_every_gpu_is_drained_and_the_message_says_why(sums):
    found = burnin.decide(runs(sums), None, POLICY)
    assert [f.entity.index for f in found] == list(range(len(sums)))
    assert all(f.code == "gemm-checksum-mismatch" and f.action is Action.DRAIN for f in found)
    assert "cannot be told" in found[0].message


def test_different_models_are_not_compared():
    mixed = runs(["a", "a"]) + [dataclasses.replace(r, model="NVIDIA H200") for r in runs(["z", "z"])]
    assert burnin.decide(mixed, None, POLICY) == []


def test_unstable_result_on_one_gpu():
    (f,) = burnin.decide(runs(["a"] * 4, stable=[True, True, False, True]), None, POLICY)
    assert (f.code, f.entity.index, f.action) == ("gemm-result-unstable", 2, Action.SERVICE)


def test_slow_below_floor_and_below_median():
    speeds = [700.0, 710.0, 560.0, 600.0, 705.0, 700.0]  # median 700: 630 is 10 % below it
    found = burnin.decide(runs(["a"] * 6, tflops=speeds), 593.0, POLICY)
    by = {f.entity.index: f for f in found}
    assert sorted(by) == [2, 3]
    assert "below the floor of 593" in by[2].message and "below the node's median" in by[2].message
    assert "floor" not in by[3].message.split("TFLOP/s")[1] and by[3].evidence["median_tflops"] == 700.0
    assert all(f.code == "gemm-slow" and f.action is Action.DRAIN for f in found)
    # relative_drop 0 turns the median rule off
    no_median = burnin.decide(runs(["a"] * 6, tflops=speeds), 593.0, {**POLICY, "relative_drop": 0.0})
    assert [f.entity.index for f in no_median] == [2]


# -- recorded burnin.json ----------------------------------------------------------------------------------------
def recorded(root, entries):
    (root / "tools").mkdir(exist_ok=True)
    (root / "tools" / "burnin.json").write_text(json.dumps(entries))
    return Node.recorded_at(root)


def h100_entries(n=8, checksum="9f" * 32, tflops=712.4):
    return [{"device": f"cuda:{i}", "tflops": tflops, "iterations": 880, "checksum": checksum, "name": H100,
             "sm_count": 132, "stable": True} for i in range(n)]


def test_recorded_pass(scenario_copy):
    node = recorded(scenario_copy("h100-hgx-healthy"), h100_entries())
    assert run_one(node).status is Status.OK


def test_recorded_corrupt_and_slow_gpus(scenario_copy):
    entries = h100_entries()
    entries[3]["checksum"] = "00" * 32
    entries[5]["tflops"] = 401.0
    node = recorded(scenario_copy("h100-hgx-healthy"), entries)
    result = run_one(node)
    by = {(f.code, f.entity.index): f for f in result.findings}
    assert set(by) == {("gemm-checksum-mismatch", 3), ("gemm-slow", 5)}
    assert by[("gemm-checksum-mismatch", 3)].entity.id == "GPU-6b932a61-abfd-5ea1-b26a-7dea7f2fa601"
    assert result.status is Status.FAIL and result.action is Action.SERVICE


def test_recorded_gpu_error_and_lost_gpu_others_still_judged(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    snap = json.loads((root / "nvml.json").read_text())
    snap["gpus"][6]["errors"] = {"*": "GPU_IS_LOST"}
    (root / "nvml.json").write_text(json.dumps(snap))
    entries = h100_entries()
    entries[1] = {"device": "cuda:1", "error": "CUDA error: an illegal memory access was encountered"}
    entries[4]["tflops"] = 300.0
    result = run_one(recorded(root, entries))
    codes = {(f.code, f.entity.index, f.status) for f in result.findings}
    assert codes == {("gpu-lost", 6, Status.FAIL), ("gemm-error", 1, Status.UNKNOWN), ("gemm-slow", 4, Status.FAIL)}


def test_recorded_malformed_burnin_is_unknown(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "tools").mkdir()
    (root / "tools" / "burnin.json").write_text("[{")
    (f,) = run_one(Node.recorded_at(root)).findings
    assert f.status is Status.UNKNOWN and "burnin.json" in f.message


def test_hang_is_unknown_through_the_runner(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "tools").mkdir()
    (root / "tools" / "burnin.hang").write_text("")
    result = run_one(Node.recorded_at(root), timeout_s=0.3)
    assert result.status is Status.UNKNOWN and "timed out" in result.error


# -- without PyTorch ---------------------------------------------------------------------------------------------
def test_without_torch_and_without_dcgm_is_skipped_with_the_reason(scenario_copy):
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy"))
    result = run_one(node, with_gemm(Gemm(use_torch=False)))
    assert result.status is Status.SKIPPED
    assert "PyTorch not used" in result.error and "no DCGM" in result.error
    # a recorded node without burnin.json and without dcgmi output: the same
    result = run_one(node)
    assert result.status is Status.SKIPPED and "burnin.json" in result.error and "no DCGM" in result.error


def dcgm_targeted_stress(statuses, schema=4):
    """dcgmi diag -j output with a targeted_stress test (crafted: the keys follow DCGM's own JSON schema for
    4.x, NVIDIA/DCGM testing/python3/dcgm_diag_schema.json, and the 3.x layout of the real VirtualClient
    capture in fixtures/tools/dcgmi; no real targeted_stress capture was available)."""
    if schema == 4:
        results = [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": i, "status": s,
                    **({"warnings": [{"error_category": 1, "error_id": 95, "error_severity": 2,
                                      "warning": f"GPU {i} failed to reach the target power"}]} if s == "Fail"
                       else {})} for i, s in enumerate(statuses)]
        return {"DCGM Diagnostic": {"test_categories": [{"category": "Stress", "tests": [
            {"name": "targeted_stress", "results": results, "test_summary": {"status": "Fail"}}]}]},
            "metadata": {"version": "4.0.0"}}
    results = [{"gpu_ids": str(i), "status": s, "info": "ok"} for i, s in enumerate(statuses)]
    return {"DCGM GPU Diagnostic": {"test_categories": [{"category": "Stress", "tests": [
        {"name": "Targeted Stress", "results": results}]}]}}


@pytest.mark.parametrize("schema", [3, 4])
def test_without_torch_dcgm_targeted_stress_is_used(scenario_copy, schema):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "tools").mkdir()
    out = dcgm_targeted_stress(["Pass", "Pass", "Fail", "Warn"], schema)
    (root / "tools" / f"{burnin.DCGM_TOOL}.out").write_text(json.dumps(out, indent=1))
    (root / "tools" / f"{burnin.DCGM_TOOL}.rc").write_text("226\n")  # dcgmi exits non-zero when a test fails
    result = run_one(Node.recorded_at(root), with_gemm(Gemm(use_torch=False)))
    by = {f.entity.index: f for f in result.findings}
    assert sorted(by) == [2, 3]
    assert (by[2].code, by[2].status, by[2].action) == ("dcgm-targeted-stress-fail", Status.FAIL, Action.DRAIN)
    assert by[3].status is Status.WARN


def test_dcgm_garbage_is_unknown(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "tools").mkdir()
    (root / "tools" / f"{burnin.DCGM_TOOL}.out").write_text(json.dumps({"DCGM Diagnostic": {"test_categories": []}}))
    result = run_one(Node.recorded_at(root), with_gemm(Gemm(use_torch=False)))
    assert result.status is Status.UNKNOWN and "no targeted_stress result" in result.error


def test_real_dcgm_capture_without_targeted_stress_is_a_parse_error():
    real = ROOT / "fixtures/tools/dcgmi/virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json"
    with pytest.raises(Exception, match="no targeted_stress"):
        burnin.targeted_stress_results(real.read_text(), real.name)


def test_thresholds_table_has_every_nvlink_sku():
    from gpuwarden.agent.core.thresholds import sku_table

    table = sku_table("burnin")
    assert set(table) == {"H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX", "GB200-NVL72", "GB300-NVL72"}
    for sku, row in table.items():
        assert row["tflops_floor"] == pytest.approx(0.6 * row["bf16_dense_peak_tflops"], abs=1), sku


@needs_torch
def test_cpu_only_torch_on_a_gpu_node_falls_back_and_says_why(scenario_copy):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy"))
    result = run_one(node, with_gemm(Gemm()))  # device "cuda" (the default) with a CPU-only torch
    assert result.status is Status.SKIPPED and "sees no CUDA device" in result.error and "no DCGM" in result.error


def test_recorded_source_maps_gpus_by_nvml_index(scenario_copy):
    node = Node.recorded_at(scenario_copy("gb200-nvl72-healthy"))
    gemm = Gemm.for_node(node)
    assert gemm.recorded and [gemm.cuda_device(g) for g in node.gpus()] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert gemm.why_unavailable().startswith("no recorded") and not gemm.available()


def test_only_the_gemm_source_imports_torch():
    offenders = []
    for folder in ("agent", "checks"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if path.name != "gemm.py" and ("import torch" in text or "from torch" in text):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []

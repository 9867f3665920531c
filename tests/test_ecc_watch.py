"""The daemon form of ecc on recorded nodes: the `ecc` judgement every minute, and the counts as metrics."""
from __future__ import annotations

import shutil

import pytest
from conftest import PassiveClock, edit_nvml, exposition, promtool_lint
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.checks import PASSIVE, ecc_watch
from gpuwarden.checks.ecc_watch import SPEC

T0 = 1_760_000_000.0


def drive(root, **overrides) -> PassiveClock:
    return PassiveClock(SPEC, root, {**SPEC.defaults, **overrides}, T0, ecc_watch.INTERVAL_S)


def faults(j):
    return sorted((f.entity.index, f.code, f.status, f.action) for f in j.findings)


def value(j, name, gpu, **labels):
    (v,) = [m.value for m in j.metrics if m.name == name and m.labels["gpu"] == str(gpu)
            and all(m.labels[k] == want for k, want in labels.items())]
    return v


def test_registered_as_a_passive_check():
    assert SPEC in PASSIVE and SPEC.interval_s == 60.0


def test_healthy_node_has_no_finding_and_exports_the_counts(scenario_copy):
    j = drive(scenario_copy("h100-hgx-healthy")).tick()
    assert faults(j) == []
    assert value(j, "gpuwarden_gpu_ecc_errors", 0, counter="volatile", type="uncorrected") == 0.0
    assert value(j, "gpuwarden_gpu_row_remap_pending", 0) == 0.0
    assert {m.labels["gpu"] for m in j.metrics} == {str(i) for i in range(8)}


def test_faulty_tray_names_each_gpu_as_the_preflight_does(scenario_copy):
    j = drive(scenario_copy("gb200-nvl72-faulty")).tick()
    got = faults(j)
    assert (1, "row-remap-pending", Status.FAIL, Action.RESET_GPU) in got
    assert (1, "ecc-uncorrectable", Status.FAIL, Action.RESET_GPU) in got
    assert (3, "row-remap-headroom-exhausted", Status.WARN, Action.SERVICE) in got
    assert any(i == 2 and c == "gpu-lost" and s is Status.FAIL for i, c, s, _ in got)
    assert all(f.check == "ecc" for f in j.findings)  # one name for the concern in every mode
    assert value(j, "gpuwarden_gpu_remapped_rows", 1, type="uncorrectable") == 1.0
    assert value(j, "gpuwarden_gpu_row_remap_pending", 1) == 1.0


def test_an_uncorrectable_error_under_load_fails_at_the_next_look_and_clears_after_reset(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = drive(root)
    assert faults(d.tick()) == []
    edit_nvml(root, lambda s: s["gpus"][5]["ecc_errors"]["volatile"].update(uncorrected=2))
    j = d.tick()
    assert faults(j) == [(5, "ecc-uncorrectable", Status.FAIL, Action.RESET_GPU)]
    assert value(j, "gpuwarden_gpu_ecc_errors", 5, counter="volatile", type="uncorrected") == 2.0
    edit_nvml(root, lambda s: s["gpus"][5]["ecc_errors"]["volatile"].update(uncorrected=0))  # GPU reset
    assert faults(d.tick()) == []


def test_an_nvml_error_on_one_gpu_is_unknown_for_that_gpu_only(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, lambda s: s["gpus"][4].update(errors={"nvmlDeviceGetTotalEccErrors": "UNKNOWN"}))
    j = drive(root).tick()
    (f,) = j.findings
    # The counts are one field read: the message names the count that failed and its NVML field.
    assert (f.entity.index, f.status) == (4, Status.UNKNOWN)
    assert "ECC errors, volatile corrected: NVML_FI_DEV_ECC_SBE_VOL_TOTAL" in f.message
    assert {m.labels["gpu"] for m in j.metrics} == {str(i) for i in range(8)} - {"4"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) not installed")
def test_metrics_are_lint_clean(scenario_copy):
    promtool_lint(exposition(drive(scenario_copy("gb200-nvl72-faulty")).tick().metrics))

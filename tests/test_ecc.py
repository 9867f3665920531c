"""ecc decisions on readings shaped like NVML's (values from real nvidia-smi -q captures where noted)."""
import pytest
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.checks import ecc

GPU = Entity("gpu", "GPU-1", 1, "0009:01:00.0")
POLICY = dict(ecc.CHECK.defaults)
CLEAN_ERRORS = {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {"corrected": 0, "uncorrected": 0}}
CLEAN_ROWS = {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
# H100 80GB: 2560 banks, all with every spare row (gpud nvidia-smi -q capture, 535.183.01).
FULL_H100 = {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0}


def reading(errors=CLEAN_ERRORS, rows=CLEAN_ROWS, hist=FULL_H100, mode=None):
    return ecc.EccReading(mode or {"current": 1, "pending": 1}, errors, rows, hist)


def codes(findings):
    return [(f.code, f.status, f.action) for f in findings]


def test_clean_gpu_has_no_finding():
    assert ecc.decide(GPU, reading(), POLICY) == []


def test_remap_pending_as_captured_on_an_a100():
    # stas00 A100 capture: Correctable Error 1, Pending Yes, histogram Max 639 High 1.
    rows = {"correctable": 1, "uncorrectable": 0, "pending": True, "failure": False}
    found = ecc.decide(GPU, reading(rows=rows, hist={"max": 639, "high": 1, "partial": 0, "low": 0, "none": 0}),
                       POLICY)
    assert codes(found) == [("row-remap-pending", Status.FAIL, Action.RESET_GPU)]
    assert "GPU 1 GPU-1 0009:01:00.0" in found[0].message


def test_remap_failure_needs_service_and_outranks_pending():
    rows = {"correctable": 0, "uncorrectable": 9, "pending": True, "failure": True}
    assert codes(ecc.decide(GPU, reading(rows=rows), POLICY)) == [("row-remap-failure", Status.FAIL, Action.SERVICE)]


def test_volatile_uncorrectable_fails_and_history_warns():
    vol = {"volatile": {"corrected": 3, "uncorrected": 2}, "aggregate": {"corrected": 3, "uncorrected": 2}}
    assert codes(ecc.decide(GPU, reading(errors=vol), POLICY)) == [
        ("ecc-uncorrectable", Status.FAIL, Action.RESET_GPU)]
    old = {"volatile": {"corrected": 0, "uncorrected": 0}, "aggregate": {"corrected": 0, "uncorrected": 2}}
    assert codes(ecc.decide(GPU, reading(errors=old), POLICY)) == [
        ("ecc-uncorrectable-history", Status.WARN, Action.MONITOR)]
    assert ecc.decide(GPU, reading(errors=old), {**POLICY, "aggregate_uncorrected_warn": 5}) == []


@pytest.mark.parametrize("hist, expected", [
    ({"max": 2555, "high": 3, "partial": 2, "low": 0, "none": 0}, []),
    ({"max": 2555, "high": 3, "partial": 1, "low": 1, "none": 0},
     [("row-remap-headroom-low", Status.WARN, Action.MONITOR)]),
    ({"max": 2555, "high": 3, "partial": 0, "low": 1, "none": 1},
     [("row-remap-headroom-exhausted", Status.WARN, Action.SERVICE)]),
])
def test_headroom_warns_before_the_banks_run_out(hist, expected):
    assert codes(ecc.decide(GPU, reading(hist=hist), POLICY)) == expected


def test_headroom_thresholds_are_configurable():
    hist = {"max": 2555, "high": 3, "partial": 0, "low": 1, "none": 1}
    policy = {**POLICY, "banks_without_spares_max": 1, "banks_low_spares_warn": 2}
    assert ecc.decide(GPU, reading(hist=hist), policy) == []


def test_ecc_disabled_and_pending_mode():
    assert codes(ecc.decide(GPU, reading(mode={"current": 0, "pending": 0}), POLICY)) == [
        ("ecc-disabled", Status.FAIL, Action.RESET_GPU)]
    assert codes(ecc.decide(GPU, reading(mode={"current": 1, "pending": 0}), POLICY)) == [
        ("ecc-mode-pending", Status.WARN, Action.RESET_GPU)]


def test_gpu_without_row_remapper_is_judged_on_ecc_alone():
    assert ecc.decide(GPU, ecc.EccReading({"current": 1, "pending": 1}, CLEAN_ERRORS, None, None), POLICY) == []

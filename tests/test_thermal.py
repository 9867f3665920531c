"""thermal driven through time on recorded nodes: nvml.json's temperatures are edited between steps, `now` advances
by the production interval, and the state goes through JSON between steps (as the daemon persists it)."""
from __future__ import annotations

import re

import pytest
from conftest import ROOT, PassiveClock, edit_nvml
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.core.thresholds import sku_table
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import thermal
from gpuwarden.checks.thermal import SPEC

SMI = ROOT / "fixtures/tools/nvidia-smi"
H100_CAPTURES = sorted(p for p in SMI.glob("gpud__nvidia-smi-q__8xH100-SXM__*.txt")
                       if not p.name.endswith(".source.txt"))
T0 = 1_760_000_000.0


def set_temps(root, temps: dict[int, tuple[int, int | None]], errors: dict[int, dict] | None = None) -> None:
    def change(data):
        for g in data["gpus"]:
            if g["index"] in temps:
                core, mem = temps[g["index"]]
                g["temperature"] = {"gpu": core, "memory": mem}
            if errors and g["index"] in errors:
                g["errors"] = errors[g["index"]]

    edit_nvml(root, change)


class Drive(PassiveClock):
    """Steps the check through time like the daemon (tests/conftest.py PassiveClock)."""

    def __init__(self, root, **overrides):
        super().__init__(SPEC, root, {**SPEC.defaults, **overrides}, T0, thermal.INTERVAL_S)


def faults(j):
    return sorted((f.entity.index, f.code, f.status) for f in j.findings if f.status is not Status.OK)


def notes(j):
    return sorted(f.code for f in j.findings if f.status is Status.OK)


def metric(j, name, gpu, **labels):
    found = [m.value for m in j.metrics if m.name == name and m.labels["gpu"] == str(gpu)
             and all(m.labels[k] == v for k, v in labels.items())]
    return found[0] if found else None


def test_h100_limits_agree_with_real_captures():
    """The table's H100 max operating temperature matches what 16 real H100s report relative to T.Limit."""
    limit = sku_table("thermal")["H100-SXM-HGX"]
    assert (limit["gpu_max_c"], limit["memory_max_c"]) == (87, 95)
    assert len(H100_CAPTURES) == 2
    for path in H100_CAPTURES:
        text = path.read_text()
        current = [int(v) for v in re.findall(r"GPU Current Temp\s+: (\d+) C", text)]
        margin = [int(v) for v in re.findall(r"GPU T.Limit Temp\s+: (\d+) C", text)]
        assert len(current) == len(margin) == 8
        assert "GPU Max Operating T.Limit Temp    : 0 C" in text
        assert all(limit["gpu_max_c"] - 2 <= c + m <= limit["gpu_max_c"] for c, m in zip(current, margin, strict=True))


def test_healthy_h100_real_temperatures(scenario_copy):
    j = Drive(scenario_copy("h100-hgx-healthy")).run(600)
    assert j.findings == ()
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 0, sensor="gpu") == 36.0  # gpud's 8x H100 idle capture
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 0, sensor="memory") == 44.0
    assert metric(j, "gpuwarden_gpu_hbm_gradient_celsius", 0) == 8.0
    uuids = {m.labels["uuid"] for m in j.metrics if m.labels["gpu"] == "7"}
    assert uuids == {"GPU-7e78e6c8-c71c-66c7-9ded-f8836cecab32"}


def set_thresholds(root, limits: dict | None, errors: dict | None = None) -> None:
    """Each GPU's recorded NVML temperature thresholds (None: the driver reports none)."""
    def change(data):
        for g in data["gpus"]:
            g.pop("temperature_thresholds", None)
            if limits is not None:
                g["temperature_thresholds"] = dict(limits)
            if errors:
                g.setdefault("errors", {}).update(errors)

    edit_nvml(root, change)


def test_gb200_limits_come_from_each_gpu_when_the_table_has_none(scenario_copy):
    """GB200-NVL72 has no figures in thermal.toml: each GPU's own (NVML temperature thresholds) are judged by."""
    assert "GB200-NVL72" not in sku_table("thermal")
    root = scenario_copy("gb200-nvl72-healthy")
    d = Drive(root)
    assert d.run(120).findings == ()  # limits known for every GPU: no note
    set_temps(root, {1: (86, 70)})
    (f,) = d.run(70).findings
    assert (f.entity.index, f.code, f.status) == (1, "gpu-over-temperature", Status.FAIL)
    assert f.evidence["limit_c"] == 85 and f.evidence["limit_source"] == "gpu"
    assert "at or over its max operating 85 C" in f.message


def test_a_gpus_limits_are_read_once(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Drive(root)
    d.tick()
    set_thresholds(root, {"gpu_max": 50, "mem_max": 60})  # a driver's limits do not move while it runs
    set_temps(root, {0: (55, 58)})
    assert faults(d.run(120)) == []


def test_sku_without_limits_says_so_and_still_judges_the_gradient(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_thresholds(root, None)  # a driver that reports no thresholds, on a SKU the table has no figures for
    d = Drive(root)
    j = d.run(120)
    assert faults(j) == [] and notes(j) == ["thermal-limits-not-checked"]
    (note,) = j.findings
    assert note.entity == Entity.node("gb200-rack07-tray03")
    assert note.evidence == {"sku": "GB200-NVL72", "missing": ["gpu_max_c", "memory_max_c"], "gpus": [0, 1, 2, 3]}
    assert "the GPU's driver reports none" in note.message
    set_temps(root, {2: (35, 60)})
    j = d.run(70)
    assert faults(j) == [(2, "hbm-gradient-outlier", Status.WARN)]


def test_a_failed_threshold_read_is_asked_again(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_thresholds(root, {"gpu_max": 85, "mem_max": 95}, errors={"nvmlDeviceGetTemperatureThreshold": "UNKNOWN"})
    d = Drive(root)
    assert notes(d.tick()) == ["thermal-limits-not-checked"]
    set_thresholds(root, {"gpu_max": 85, "mem_max": 95})
    edit_nvml(root, lambda data: [g["errors"].pop("nvmlDeviceGetTemperatureThreshold") for g in data["gpus"]])
    assert notes(d.tick()) == []


def test_configured_limit_wins(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_temps(root, {0: (72, 80)})
    j = Drive(root, gpu_max_c=70.0).run(70)
    assert faults(j) == [(0, "gpu-over-temperature", Status.FAIL)]
    (f,) = j.findings  # memory_max_c from the GPU itself: nothing left unjudged
    assert f.evidence["limit_c"] == 70 and f.evidence["limit_source"] == "config"


def test_the_sku_table_serves_a_gpu_that_reports_no_limits(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")  # recorded without thresholds: the H100 figures of thermal.toml
    set_temps(root, {5: (88, 50)})
    (f,) = [f for f in Drive(root).run(70).findings if f.code == "gpu-over-temperature"]
    assert f.evidence["limit_c"] == 87 and f.evidence["limit_source"] == "sku-table"


def test_hbm_over_limit_must_be_sustained(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Drive(root, gradient_outlier_c=0.0, gradient_max_c=0.0)  # the limits alone (the gradient has its own tests)
    d.run(100)
    set_temps(root, {3: (60, 97)})  # one reading over the limit
    assert faults(d.tick()) == []
    set_temps(root, {3: (39, 46)})
    assert faults(d.run(100)) == []

    set_temps(root, {3: (70, 96)})
    j = d.run(50)
    assert faults(j) == []  # 50 s < sustain_s
    set_temps(root, {3: (71, 98)})
    j = d.run(20)
    (f,) = j.findings
    assert (f.entity.index, f.code, f.status, f.action) == (3, "hbm-over-temperature", Status.FAIL, Action.DRAIN)
    assert f.evidence["limit_c"] == 95 and f.evidence["peak"] == 98 and f.evidence["sustained_s"] >= 60
    assert f.entity.id == "GPU-6b932a61-abfd-5ea1-b26a-7dea7f2fa601" and "98 C" in f.message

    set_temps(root, {3: (70, 92)})  # below the limit, within the margin: the near-limit run has held all along
    j = d.tick()
    assert faults(j) == [(3, "hbm-temperature-near-limit", Status.WARN)]
    set_temps(root, {3: (50, 60)})
    assert d.tick().findings == ()


def test_hot_hbm_on_an_idle_node_is_also_a_gradient(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_temps(root, {3: (71, 98)})  # 27 C over its core, 19 C more than the idle others
    j = Drive(root).run(70)
    assert faults(j) == [(3, "hbm-gradient-high", Status.WARN), (3, "hbm-over-temperature", Status.FAIL)]


def test_core_near_limit_warns(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_temps(root, {6: (84, 80)})
    j = Drive(root).run(70)
    assert faults(j) == [(6, "gpu-temperature-near-limit", Status.WARN)]
    assert j.findings[0].action is Action.MONITOR


def test_growing_gap_on_a_liquid_cooled_tray(scenario_copy):
    """GB200 tray: one GPU's HBM pulls away from its core while the others stay put (a cold-plate fault)."""
    root = scenario_copy("gb200-nvl72-healthy")
    d = Drive(root)
    seen = []
    for gap in range(8, 40, 2):
        set_temps(root, {1: (45, 45 + gap)})
        j = d.run(30)
        seen.append((gap, tuple(f.code for f in j.findings if f.status is not Status.OK)))
    first = {codes: gap for gap, codes in reversed(seen)}
    # node median of (7, 8, 8, gap) is 8 until the gap passes it; outlier once gap - median > 10 for 60 s
    assert first[("hbm-gradient-outlier",)] in (22, 24)
    assert first[("hbm-gradient-high",)] in (28, 30)  # the absolute bound takes over (one finding, not two)
    f = j.findings[-1]
    assert f.evidence["gradient_c"] == 38 and f.evidence["node_median_gradient_c"] == 7.5


def test_flapping_condition_never_sustains(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Drive(root)
    for i in range(30):
        set_temps(root, {0: (88, 44) if i % 2 else (40, 44)})
        assert faults(d.tick()) == []


def test_gap_longer_than_sustain_restarts_runs(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_temps(root, {5: (90, 50)})
    d = Drive(root)
    d.run(50)
    d.node = Node.recorded_at(root)  # a restart with the persisted state, 5 minutes later
    j = d.tick(300)
    assert faults(j) == []
    assert d.state["gpus"]["GPU-06db64f6-6181-5a90-cf95-5ce52a58c4e5"]["runs"]["gpu_over"]["since"] == d.t
    j = d.run(60)
    assert faults(j) == [(5, "gpu-over-temperature", Status.FAIL)]


def test_no_hbm_sensor_judges_core_only_and_says_so(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_temps(root, {0: (90, None), 1: (40, None)})
    j = Drive(root).run(70)
    assert faults(j) == [(0, "gpu-over-temperature", Status.FAIL)]
    (note,) = [f for f in j.findings if f.code == "hbm-temp-unavailable"]
    assert note.status is Status.OK and note.evidence == {"gpus": [0, 1]} and "core temperature only" in note.message
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 0, sensor="memory") is None
    assert metric(j, "gpuwarden_gpu_hbm_gradient_celsius", 0) is None
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 0, sensor="gpu") == 90.0


def test_lost_gpu_fails_through_per_gpu(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")  # GPU 2 is lost in this scenario
    j = Drive(root).run(70)
    assert faults(j) == [(2, "gpu-lost", Status.FAIL)]
    assert [f.action for f in j.findings if f.code == "gpu-lost"] == [Action.REBOOT]
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 2, sensor="gpu") is None
    assert metric(j, "gpuwarden_gpu_temperature_celsius", 3, sensor="gpu") == 38.0


def test_other_nvml_error_is_unknown(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_temps(root, {}, errors={4: {"nvmlDeviceGetFieldValues": "UNKNOWN"}})
    j = Drive(root).tick()
    assert faults(j) == [(4, "nvml-error", Status.UNKNOWN)]


@pytest.mark.parametrize("gradients, expect", [((8, 20), None), ((8, 8, 20), 8.0), ((7, 8, 9, 20), 8.5)])
def test_median_needs_three_gpus(gradients, expect):
    readings = tuple((Entity("gpu", f"GPU-{i}", i), 40, 40 + g) for i, g in enumerate(gradients))
    s = thermal.ThermalSample("n1", "GB200-NVL72", {"gpu_max_c": None, "memory_max_c": None}, readings, ())
    cfg = {**SPEC.defaults, "sustain_s": 0.0}
    j = thermal.judge({}, s, cfg, T0)
    outliers = [f for f in j.findings if f.code == "hbm-gradient-outlier"]
    if expect is None:
        assert outliers == []
    else:
        (f,) = outliers
        assert f.entity.index == len(gradients) - 1 and f.evidence["node_median_gradient_c"] == expect

"""NVML errors of every kind on one GPU of a recorded 8-GPU node, while the others are read: every check that reads
NVML per GPU (preflight's quick checks and the daemon's polls) still judges the other seven, and the bad GPU gives
the finding its error calls for: lost -> FAIL gpu-lost, not supported -> nothing, anything else -> UNKNOWN
nvml-error. Also a failure below NVML's error codes (ctypes refusing a value), which must read as UNKNOWN too."""
from __future__ import annotations

import json

import pytest
from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.core.passive import step
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml
from gpuwarden.checks import ALL, PASSIVE

NO_NVML = ("xid", "nvswitch_sxid", "ib_port", "pcie_aer")  # kernel log and sysfs only
BAD, FAULTY = 3, 6  # the GPU whose NVML calls fail, and a GPU with a real fault that must still be found
QUICK = [s for s in ALL if s.level == "quick"]
NVML_POLLS = [s for s in PASSIVE if s.name in ("clock_events", "thermal", "nvlink_lanes", "fabric", "ecc")]
# The per-device reads (identity calls excluded: a GPU that cannot even be named is the "*" case below).
IDENTITY = {"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetName",
            "nvmlDeviceGetSerial", "nvmlDeviceRegisterEvents"}
READS = sorted(n for n in dir(RecordedNvml) if n.startswith("nvmlDevice") and n not in IDENTITY)
KINDS = {  # NVML error -> what the bad GPU must show in each check that reads it
    "GPU_IS_LOST": ("gpu-lost", Status.FAIL),
    "UNKNOWN": ("nvml-error", Status.UNKNOWN),
    "TIMEOUT": ("nvml-error", Status.UNKNOWN),
    "INSUFFICIENT_POWER": ("nvml-error", Status.UNKNOWN),
    "NO_PERMISSION": ("nvml-error", Status.UNKNOWN),
    "IRQ_ISSUE": ("nvml-error", Status.UNKNOWN),
    "MEMORY": ("nvml-error", Status.UNKNOWN),
    "CORRUPTED_INFOROM": ("nvml-error", Status.UNKNOWN),
    "RESET_REQUIRED": ("nvml-error", Status.UNKNOWN),
    "DRIVER_NOT_LOADED": ("nvml-error", Status.UNKNOWN),
    "NOT_SUPPORTED": None,
}


def prepare(scenario_copy, errors: dict[str, str] | None = None, **gpu_fields):
    root = scenario_copy("h100-hgx-healthy")
    root = root.rename(root.with_name(f"h100-{len(list(root.parent.iterdir()))}"))  # each call its own copy
    path = root / "nvml.json"
    data = json.loads(path.read_text())
    data["gpus"][FAULTY]["remapped_rows"]["pending"] = True  # ecc must still FAIL this one
    data["gpus"][FAULTY]["clocks_event_reasons"] = 0x8  # HW_SLOWDOWN: clock_events must still see it
    bad = data["gpus"][BAD]
    if errors is not None:
        bad["errors"] = {**bad.get("errors", {}), **errors}
    bad.update(gpu_fields)
    path.write_text(json.dumps(data))
    return root, bad


def judged(node):
    """(check, findings, GPUs with metrics) of every quick check and every NVML poll of the daemon, fresh state."""
    out = [(r.check, list(r.findings), set()) for r in run_checks(node, QUICK, config.defaults(QUICK))]
    for spec in NVML_POLLS:
        j = step(spec, node, dict(spec.defaults), {}, 1_700_000_000.0)
        out.append((spec.name, list(j.findings), {m.labels["gpu"] for m in j.metrics if "gpu" in m.labels}))
    return out


def key(f):
    return f.check, f.code, f.entity, f.status, f.action


def about(findings, index):
    return [(f.code, f.status) for f in findings if f.entity.index == index]


def assert_others_judged(results, baseline):
    """Every other GPU is judged as on the same node without the errors: the same findings, the same metrics."""
    for (check, findings, gpus), (_, want, want_gpus) in zip(results, baseline, strict=True):
        others = [f for f in findings if f.entity.index != BAD and f.code not in ("nvml-error", "gpu-lost")]
        assert [key(f) for f in others] == [key(f) for f in want if f.entity.index != BAD], check
        assert gpus - {str(BAD)} == want_gpus - {str(BAD)}, check
    ecc = next(findings for check, findings, _ in results if check == "ecc")
    assert ("row-remap-pending", Status.FAIL) in about(ecc, FAULTY)


@pytest.fixture
def baseline(scenario_copy):
    root, _ = prepare(scenario_copy)
    return judged(Node.recorded_at(root))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_error_kind_on_every_read_of_one_gpu(scenario_copy, baseline, kind):
    root, bad = prepare(scenario_copy, dict.fromkeys(READS, kind))
    results = judged(Node.recorded_at(root))
    assert_others_judged(results, baseline)
    for check, findings, _ in results:
        if check in NO_NVML:
            continue  # no NVML read
        if KINDS[kind] is None:
            if check == "nvlink_lanes":  # the SKU expects 18 links and NVML offers none: judged as the links' loss
                assert {code for code, _ in about(findings, BAD)} == {"nvlink-down"}
                continue
            assert about(findings, BAD) == [], check
            continue
        assert about(findings, BAD) == [KINDS[kind]], check
        (f,) = [f for f in findings if f.entity.index == BAD]
        assert f.evidence["nvml_error"] == kind and f.entity.id == bad["uuid"]


@pytest.mark.parametrize("kind", ["GPU_IS_LOST", "UNKNOWN", "TIMEOUT"])
def test_a_gpu_that_cannot_even_be_opened_is_named_from_the_driver(scenario_copy, baseline, kind):
    root, bad = prepare(scenario_copy, {"*": kind})
    results = judged(Node.recorded_at(root))
    assert_others_judged(results, baseline)
    pci = "0000:" + bad["pci_bus_id"].split(":", 1)[1].lower()
    for check, findings, _ in results:
        if check in NO_NVML:
            continue
        assert about(findings, BAD) == [KINDS[kind]], check
        (f,) = [f for f in findings if f.entity.index == BAD]
        assert f.entity.pci == pci  # named by its PCI address, from the kernel's view
    assert not any(f.code == "gpu-missing-from-nvml" for _, fs, _ in results for f in fs)  # NVML still counts it


def test_a_failure_below_nvml_codes_is_unknown_for_that_gpu_only(scenario_copy, baseline):
    """ctypes refuses a value on its way to the bindings (here a PCI bus id longer than nvmlPciInfo_t's field): the
    GPU cannot be identified through NVML, which is UNKNOWN with the reason, never a crash and never OK."""
    root, _ = prepare(scenario_copy, pci_bus_id="0000" * 20 + ":5d:00.0")
    results = judged(Node.recorded_at(root))
    assert_others_judged(results, baseline)
    for check, findings, _ in results:
        if check in NO_NVML:
            continue
        bad = [f for f in findings if f.entity.index == BAD]
        assert [(f.code, f.status) for f in bad] == [("nvml-error", Status.UNKNOWN)], check
        assert "ValueError" in bad[0].message  # the reason, from ctypes

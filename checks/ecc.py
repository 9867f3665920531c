"""ECC and HBM row remapping: uncorrectable errors, remaps pending a reset, remap failures, and the spare-row
headroom left per bank (from NVML's row-remapper histogram), so a GPU is flagged before its banks run out."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass

CHECK_NAME = "ecc"


@dataclass(frozen=True)
class EccReading:
    """One GPU's ECC mode, error counts and row-remapper state, as NVML reports them."""

    ecc_mode: Mapping[str, int]
    errors: Mapping[str, Mapping[str, int]]  # volatile/aggregate -> corrected/uncorrected
    remapped: Mapping[str, Any] | None  # None: the GPU has no row remapper (pre-Ampere)
    histogram: Mapping[str, int] | None  # None with `remapped` set: NVML does not report it (headroom not known)


def decide(entity: Entity, r: EccReading, policy: Mapping[str, Any]) -> list[Finding]:
    def finding(code: str, status: Status, action: Action, msg: str, **evidence: Any) -> Finding:
        return Finding(CHECK_NAME, code, entity, status, f"{entity.label()}: {msg}", action, evidence)

    out: list[Finding] = []
    if r.ecc_mode.get("current") == 0:
        out.append(finding("ecc-disabled", Status.FAIL, Action.RESET_GPU,
                           "ECC is disabled: memory errors go undetected (enable with nvidia-smi -e 1, then reset)",
                           **r.ecc_mode))
    elif r.ecc_mode.get("pending") != r.ecc_mode.get("current"):
        out.append(finding("ecc-mode-pending", Status.WARN, Action.RESET_GPU,
                           "an ECC mode change waits for a GPU reset", **r.ecc_mode))

    vol_unc = r.errors["volatile"]["uncorrected"]
    agg_unc = r.errors["aggregate"]["uncorrected"]
    if vol_unc > policy["volatile_uncorrected_max"]:
        out.append(finding("ecc-uncorrectable", Status.FAIL, Action.RESET_GPU,
                           f"{vol_unc} uncorrectable ECC error(s) since the last reset", volatile_uncorrected=vol_unc,
                           aggregate_uncorrected=agg_unc))
    elif agg_unc > policy["aggregate_uncorrected_warn"]:
        out.append(finding("ecc-uncorrectable-history", Status.WARN, Action.MONITOR,
                           f"{agg_unc} uncorrectable ECC error(s) over the GPU's life", aggregate_uncorrected=agg_unc))

    if r.remapped is not None:
        rows = dict(r.remapped)
        if rows["failure"]:
            # NVIDIA: a row-remapping failure means the GPU should be replaced.
            out.append(finding("row-remap-failure", Status.FAIL, Action.SERVICE,
                               "a row remapping failed: no spare row was left; the GPU needs service", **rows))
        elif rows["pending"]:
            # The faulty row stays in use until the GPU is reset and the remap takes effect.
            out.append(finding("row-remap-pending", Status.FAIL, Action.RESET_GPU,
                               "a row remap is pending: drain and reset the GPU to activate it", **rows))

    if r.histogram is None:
        if r.remapped is not None:
            # A note, not UNKNOWN: NOT_SUPPORTED is the board's fact and stays so on every pass; pending and failed
            # remaps above come from the remapped-rows read and are judged all the same.
            out.append(finding("row-remap-headroom-unknown", Status.OK, Action.NONE,
                               "spare-row headroom not judged: NVML does not report the row-remapper histogram "
                               "(NOT_SUPPORTED); pending and failed remaps are judged", histogram="NOT_SUPPORTED"))
    else:
        h = dict(r.histogram)
        banks = sum(h.values())
        if h["none"] > policy["banks_without_spares_max"]:
            out.append(finding("row-remap-headroom-exhausted", Status.WARN, Action.SERVICE,
                               f"{h['none']} of {banks} HBM banks have no spare row left: the next uncorrectable "
                               "error there cannot be remapped; plan a replacement", **h))
        elif h["low"] + h["none"] > policy["banks_low_spares_warn"]:
            out.append(finding("row-remap-headroom-low", Status.WARN, Action.MONITOR,
                               f"{h['low']} of {banks} HBM banks are down to their last spare row", **h))
    return out


def read_gpu(node: Any, gpu: Any) -> EccReading:
    """One GPU's ECC mode, counts, remapped rows (one NVML field read) and histogram (the last two None before
    Ampere; the histogram alone None where NVML does not report it)."""
    nvml = node.nvml
    counters = nvml.ecc_counters(gpu)
    remapped, histogram = counters["remapped_rows"], None
    if remapped is not None:
        try:
            histogram = nvml.row_remapper_histogram(gpu)
        except NvmlError as err:
            if not err.not_supported:
                raise
            # Only the headroom needs the histogram: the pending and failure flags read above still stand.
    return EccReading(counters["ecc_mode"], counters["ecc_errors"], remapped, histogram)


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: read_gpu(node, gpu))
    yield from problems
    for gpu, reading in readings:
        yield from decide(gpu.entity, reading, cfg)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="ECC errors, pending/failed row remaps and row-remap headroom per GPU",
    run=run,
    defaults={
        "volatile_uncorrected_max": 0,  # any uncorrectable error since reset needs a reset
        "aggregate_uncorrected_warn": 0,  # lifetime uncorrectables above this warn
        "banks_without_spares_max": 0,  # banks allowed to have no spare row left
        "banks_low_spares_warn": 0,  # banks allowed on their last spare row before warning
    },
    timeout_s=20,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="ecc", order=30, level="quick", look="CHECK", poll="ecc_watch.SPEC", poll_order=7,
)

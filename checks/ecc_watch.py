"""ECC and HBM row remapping, watched: the `ecc` preflight check's judgement (uncorrectable errors since the last
reset, remaps pending or failed, spare-row headroom) every minute while the node runs jobs, and the counts as
metrics. An uncorrectable error or a pending remap that appears under load reaches the state machine here, not
at the next preflight; the corrected-error and remap counts feed dashboards and fleet-wide trends."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from gpuwarden.agent.core.model import Entity, Finding
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks import ecc

CHECK_NAME = "ecc"  # the daemon form of the ecc concern: one name, one config table
INTERVAL_S = 60.0  # the counts move rarely; an uncorrectable error also raises an XID (48, 63, 94, 95) at once


@dataclass(frozen=True)
class EccSample:
    readings: tuple[tuple[Entity, ecc.EccReading], ...]
    problems: tuple[Finding, ...]  # GPUs NVML could not read (lost -> FAIL, other errors -> UNKNOWN)


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> EccSample:
    readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: ecc.read_gpu(node, gpu))
    return EccSample(tuple((gpu.entity, r) for gpu, r in readings), tuple(problems))


def judge(state: Mapping[str, Any], smp: EccSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    findings = list(smp.problems)
    metrics: list[MetricSample] = []
    for entity, reading in smp.readings:
        findings += [replace(f, check=CHECK_NAME) for f in ecc.decide(entity, reading, cfg)]
        metrics += _metrics(entity, reading)
    return Judgement({}, tuple(findings), tuple(metrics))


def _metrics(entity: Entity, r: ecc.EccReading) -> list[MetricSample]:
    gpu = {"gpu": str(entity.index), "uuid": entity.id}
    out = [MetricSample("gpuwarden_gpu_ecc_errors", "ECC errors NVML counts: volatile (since the last GPU reset) "
                        "and aggregate (the GPU's life), corrected and uncorrected.",
                        {**gpu, "counter": counter, "type": kind}, float(n))
           for counter, kinds in r.errors.items() for kind, n in kinds.items()]
    if r.remapped is not None:
        out += [MetricSample("gpuwarden_gpu_remapped_rows", "HBM rows remapped, by the error that caused it.",
                             {**gpu, "type": kind}, float(r.remapped[kind]))
                for kind in ("correctable", "uncorrectable")]
        out += [MetricSample("gpuwarden_gpu_row_remap_pending", "1 if a row remap waits for a GPU reset.", gpu,
                             1.0 if r.remapped["pending"] else 0.0),
                MetricSample("gpuwarden_gpu_row_remap_failure", "1 if a row remap failed (no spare row was left).",
                             gpu, 1.0 if r.remapped["failure"] else 0.0)]
    if r.histogram is not None:
        out += [MetricSample("gpuwarden_gpu_row_remap_banks", "HBM banks by how many spare rows they have left "
                             "(NVML's row-remapper histogram).", {**gpu, "spares": level}, float(n))
                for level, n in r.histogram.items()]
    return out


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary=ecc.CHECK.summary + ", every minute",
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults=ecc.CHECK.defaults,  # the one [checks.ecc] table
    timeout_s=20.0,
    # Judged from the counts alone: without findings, the same counts judged again give the same nothing.
    quiet=lambda state: True,
    quiet_rejudge_s=600.0,
)

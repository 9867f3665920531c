"""Per-GPU reading for checks: one GPU that NVML cannot read becomes a finding for that GPU, and the
other GPUs are still judged."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from gpuwarden.agent.core.errors import NotApplicable, NvmlError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status

T = TypeVar("T")


def device_error_finding(check: str, entity: Entity, err: NvmlError) -> Finding:
    """A GPU NVML cannot read: lost is a fault (FAIL, reboot to recover); anything else is UNKNOWN."""
    if err.gpu_lost:
        return Finding(check, "gpu-lost", entity, Status.FAIL,
                       f"{entity.label()}: NVML says the GPU is lost ({err.call}); reboot to recover it",
                       Action.REBOOT, {"nvml_call": err.call, "nvml_error": err.code})
    return Finding(check, "nvml-error", entity, Status.UNKNOWN, f"{entity.label()}: could not read: {err}",
                   Action.NONE, {"nvml_call": err.call, "nvml_error": err.code})


def read_each_gpu(node: Any, check: str, read: Callable[[Any], T]) -> tuple[list[tuple[Any, T]], list[Finding]]:
    """Apply `read(gpu)` to every GPU. Returns the readings and, for GPUs that could not be read, findings
    (lost -> FAIL, other NVML errors -> UNKNOWN). GPUs answering NOT_SUPPORTED are left out; if every GPU
    does, the check does not apply (NotApplicable -> SKIPPED)."""
    gpus = node.gpus()
    if not gpus:
        raise NotApplicable("NVML reports no GPU on this node")
    readings: list[tuple[Any, T]] = []
    problems: list[Finding] = []
    unsupported: list[NvmlError] = []
    for gpu in gpus:
        try:
            if gpu.error is not None:
                raise gpu.error
            readings.append((gpu, read(gpu)))
        except NvmlError as err:
            if err.not_supported:
                unsupported.append(err)
            else:
                problems.append(device_error_finding(check, gpu.entity, err))
    if unsupported and len(unsupported) == len(gpus):
        raise NotApplicable(f"not supported on any GPU ({unsupported[0]})")
    return readings, problems

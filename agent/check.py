"""What a check is: a name, its config defaults, and a function from a node's sources to findings.

A check yields findings and nothing else. The runner (agent/runner.py) owns timing, timeouts,
exceptions (-> UNKNOWN), NotApplicable (-> SKIPPED) and folding findings into a status.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from .model import Finding

if TYPE_CHECKING:  # pragma: no cover
    from .node import Node


@dataclass(frozen=True)
class CheckSpec:
    name: str
    summary: str
    run: "Callable[[Node, Mapping[str, Any]], Iterable[Finding]]"
    # Config keys this check accepts, with their defaults; the type of each default is the type the
    # config loader enforces for the key.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Element type of list-valued keys whose default is empty (so the loader can still check them).
    list_types: Mapping[str, type] = field(default_factory=dict)
    timeout_s: float = 30.0
    level: str = "quick"  # quick: non-disturbing, seconds; full: loads the GPUs or the network


# -- shared per-GPU plumbing --------------------------------------------------------------------
from typing import TypeVar  # noqa: E402

from .errors import NotApplicable, NvmlError  # noqa: E402
from .model import Action, Entity, Status  # noqa: E402

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

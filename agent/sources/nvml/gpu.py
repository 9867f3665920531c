"""A GPU as NVML enumerates it, and NVML's bus id in the form sysfs and the findings use."""
from __future__ import annotations

from dataclasses import field
from typing import Any

from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.model import Entity
from gpuwarden.agent.core.records import dataclass


def canonical_bdf(nvml_bus_id: str) -> str:
    """NVML prints an 8-hex-digit domain ("00000008:01:00.0"); sysfs and findings use 4 ("0008:01:00.0")."""
    text = nvml_bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    return f"{int(domain, 16):04x}:{rest}" if domain else rest


@dataclass
class Gpu:
    """A GPU as NVML enumerates it. Identity fields are None when NVML could not read them."""

    index: int
    handle: Any = None
    uuid: str | None = None
    name: str | None = None
    serial: str | None = None
    pci: str | None = None  # canonical BDF, "0008:01:00.0"
    bus_id: str | None = None  # as NVML prints it, "00000008:01:00.0"
    error: NvmlError | None = None  # set when the device could not be opened or identified
    _errors: dict[str, NvmlError] = field(default_factory=dict, repr=False)
    # The NVLinks the GPU has (fixed by the board), learnt at a read of every link: the reads between ask for those
    # alone (NVML_NVLINK_MAX_LINKS is 36 in newer bindings, twice what any GPU has).
    _links: tuple[int, ...] | None = field(default=None, repr=False)
    _link_reads: int = field(default=0, repr=False)

    @property
    def entity(self) -> Entity:
        return Entity("gpu", self.uuid or self.pci or f"index-{self.index}", self.index, self.pci)

"""The PCIe tree as sysfs shows it, for checks/pcie_link.py: each NVIDIA/Mellanox function's path from its host
bridge, the physical links on that path with their trained and supported speed and width at both ends, and which GPUs
and network functions are on the bus."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.model import Entity, Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.pci import nvidia_pci_gpus

CHECK_NAME = "pcie_link"
PCI_DEVICES = "/sys/bus/pci/devices"
VENDORS = {"0x10de": "NVIDIA", "0x15b3": "Mellanox"}
_SPEED = re.compile(r"^\s*([\d.]+)\s*GT/s")
_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


@dataclass(frozen=True)
class Link:
    """One physical PCIe link: the device below it and, where the sysfs path shows it, the port above it (root
    port or switch downstream port). The trained speed/width is read at the device below (both ends agree)."""

    bdf: str
    role: str  # of the device below: gpu | nic | bridge (a switch's upstream port) | other (NVSwitch, ...)
    speed_gts: float | None
    width: int | None
    max_speed_gts: float | None
    max_width: int | None
    upstream: str | None = None
    up_max_speed_gts: float | None = None
    up_max_width: int | None = None

    @property
    def can_speed(self) -> float | None:
        ends = [s for s in (self.max_speed_gts, self.up_max_speed_gts) if s]
        return min(ends) if ends else None

    @property
    def can_width(self) -> int | None:
        ends = [w for w in (self.max_width, self.up_max_width) if w]
        return min(ends) if ends else None


def gen(speed_gts: float | None) -> int | None:
    return _GEN.get(speed_gts) if speed_gts is not None else None


def parse_speed(text: str) -> float | None:
    """"32.0 GT/s PCIe" -> 32.0; "Unknown" (link down, or a VF) -> None."""
    m = _SPEED.match(text)
    return float(m[1]) if m else None


def pci_path(sysfs: Any, bdf: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(name, kernel path) of each level from the host bridge ("pci0000:15") down to `bdf`, where
    /sys/bus/pci/devices/<bdf> links into /sys/devices/pci...; just [(bdf, its path)] for a flat capture. `root`: the
    sysfs root resolved (a caller walking every device resolves it once)."""
    link = f"{PCI_DEVICES}/{bdf}"
    try:
        root = root or sysfs.root.resolve()
        parts = sysfs.path(link).resolve(strict=True).relative_to(root).parts
    except (OSError, ValueError):
        return [(bdf, link)]
    # The last host bridge on the path: a VMD domain nests one ("pci10000:e0") under a root port.
    start = max((i for i, p in enumerate(parts) if _HOST_BRIDGE.match(p)), default=None)
    if start is None or parts[-1] != bdf or not all(_BDF.match(p) for p in parts[start + 1:]):
        return [(bdf, link)]
    return [(parts[i], "/" + str(Path(*parts[:i + 1]))) for i in range(start, len(parts))]


def _role(vendor: str, cls: str) -> str:
    if cls.startswith("0x03") and vendor == "0x10de":
        return "gpu"
    return "nic" if cls.startswith("0x02") else "other"


def _attrs(sysfs: Any, base: str) -> tuple[float | None, int | None, float | None, int | None] | None:
    """(speed, width, max speed, max width) of one function; None when it has no PCIe link files."""
    names = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
    if not any(sysfs.exists(f"{base}/{n}") for n in names):
        return None
    text = [sysfs.read(f"{base}/{n}") for n in names]
    try:
        widths = [int(t.lower().lstrip("x")) for t in (text[1], text[3])]
    except ValueError:
        raise SourceError(f"{sysfs.path(base)}: link width {text[1]!r}/{text[3]!r} is not a number") from None
    return parse_speed(text[0]), widths[0], parse_speed(text[2]), widths[1]


def read_links(sysfs: Any, ignore: Iterable[str] = ()) -> tuple[list[Link], list[Finding]]:
    """Every link on the way to each NVIDIA/Mellanox function (VFs and the 2nd.. function of a device skipped:
    they share the link), each link once."""
    ignored = set(ignore)
    links: dict[str, Link] = {}
    problems: list[Finding] = []
    slots: set[str] = set()
    root = sysfs.root.resolve()
    for bdf in sysfs.listdir(PCI_DEVICES):
        base = f"{PCI_DEVICES}/{bdf}"
        try:
            vendor, cls = sysfs.read(f"{base}/vendor"), sysfs.read(f"{base}/class")
        except SourceError:
            continue  # not a device of ours as far as we can tell; lost GPUs are per_gpu's
        if (vendor not in VENDORS or cls.startswith("0x0604") or bdf in ignored or sysfs.exists(f"{base}/physfn")
                or bdf.rsplit(".", 1)[0] in slots):
            continue
        slots.add(bdf.rsplit(".", 1)[0])
        levels = [lv for lv in pci_path(sysfs, bdf, root) if _BDF.match(lv[0])]
        # Below a root port the ports alternate downstream/upstream (root port, switch up, switch down, ...,
        # device), so the physical links pair them up; an odd chain (a legacy bridge) keeps only the last link.
        pairs = ([(levels[i], levels[i + 1]) for i in range(0, len(levels), 2)] if len(levels) % 2 == 0
                 else [(levels[-2] if len(levels) > 1 else None, levels[-1])])
        for up, (name, path) in pairs:
            if name in links or name in ignored:
                continue
            try:
                here = _attrs(sysfs, path)
                above = _attrs(sysfs, up[1]) if up is not None else None
                role = _role(vendor, cls) if name == bdf else "bridge"
            except SourceError as err:
                problems.append(Finding(CHECK_NAME, "pcie-link-unreadable", Entity("pcie", name, pci=name),
                                        Status.UNKNOWN, f"{name}: could not read the PCIe link: {err}"))
                continue
            if here is None:
                continue
            links[name] = Link(name, role, *here, upstream=up[0] if up and above else None,
                               up_max_speed_gts=above[2] if above else None, up_max_width=above[3] if above else None)
    return list(links.values()), problems


def _gpus_on_bus(sysfs: Any, ignore: set[str]) -> list[str]:
    """NVIDIA display/3D functions 0 on the PCI bus (virtual functions and ignored devices left out)."""
    return [bdf for bdf in nvidia_pci_gpus(sysfs)
            if bdf not in ignore and bdf.endswith(".0") and not sysfs.exists(f"{PCI_DEVICES}/{bdf}/physfn")]


def _nic_on_bus(sysfs: Any) -> bool:
    """An NVIDIA/Mellanox network function on the PCI bus (an HCA whose driver is not bound has no RDMA device)."""
    for bdf in sysfs.listdir(PCI_DEVICES):
        try:
            if (sysfs.read(f"{PCI_DEVICES}/{bdf}/vendor") in VENDORS
                    and _role("", sysfs.read(f"{PCI_DEVICES}/{bdf}/class")) == "nic"):
                return True
        except SourceError:
            continue
    return False

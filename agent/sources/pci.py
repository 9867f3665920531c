"""The NVIDIA GPUs on the PCI bus, as sysfs and the driver's /proc files show them: readable when NVML is not."""
from __future__ import annotations

from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.sources.sysfs import Sysfs

NVIDIA_VENDOR = "0x10de"


def nvidia_pci_gpus(sysfs: Sysfs) -> list[str]:
    """BDFs of NVIDIA display/3D controllers (class 0x03xxxx), sorted."""
    out = []
    for bdf in sysfs.listdir("/sys/bus/pci/devices"):
        base = f"/sys/bus/pci/devices/{bdf}"
        try:
            if sysfs.read(f"{base}/vendor") == NVIDIA_VENDOR and sysfs.read(f"{base}/class").startswith("0x03"):
                out.append(bdf)
        except SourceError:
            continue
    return out


def driver_gpu_uuid(sysfs: Sysfs, bdf: str) -> str | None:
    """The UUID the NVIDIA driver keeps in /proc/driver/nvidia/gpus/<bdf>/information (readable when NVML
    is not: the driver caches it at probe time)."""
    try:
        text = sysfs.read(f"/proc/driver/nvidia/gpus/{bdf}/information")
    except SourceError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "GPU UUID":
            return value.strip() or None
    return None

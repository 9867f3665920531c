"""`gpuwarden record`: write a scenario (docs/scenario-format.md) from a node, through the same sources
the checks read, so what is recorded is exactly what preflight will read back."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
from importlib import metadata
from pathlib import Path

from .errors import NvmlError, SourceError
from .node import Node
from .sources.nvml import SNAPSHOT_FORMAT
from .sources.sysfs import Sysfs

PCI_DEVICES = "/sys/bus/pci/devices"
IB_CLASS = "/sys/class/infiniband"
DRIVER_GPUS = "/proc/driver/nvidia/gpus"
# Vendors whose PCI functions the checks look at: NVIDIA (GPUs, NVSwitches) and Mellanox/NVIDIA networking.
RECORDED_VENDORS = {"0x10de", "0x15b3"}
PCI_FILES = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "current_link_speed",
             "current_link_width", "max_link_speed", "max_link_width", "aer_dev_correctable", "aer_dev_fatal",
             "aer_dev_nonfatal", "numa_node")
IB_PORT_FILES = ("state", "phys_state", "rate", "link_layer")


def record(node: Node, out: Path) -> list[str]:
    """Write the scenario; returns the problems met (a part that could not be read is noted, not fatal)."""
    out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    info = node.info
    info.recorded_at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    info.versions.setdefault("kernel", platform.release())
    info.versions["gpuwarden"] = metadata.version("gpuwarden")
    try:
        snapshot = node.nvml.snapshot()
        info.versions.setdefault("driver", snapshot.get("driver_version", ""))
    except NvmlError as exc:
        # Keep the failure itself: replaying the bundle then fails the same way the node did.
        problems.append(f"nvml: {exc}")
        snapshot = {"format": SNAPSHOT_FORMAT, "errors": {exc.call: exc.code}, "gpus": []}
    (out / "nvml.json").write_text(json.dumps(snapshot, indent=2) + "\n")
    (out / "node.toml").write_text(info.to_toml())
    try:
        (out / "kmsg").write_text(node.kmsg.raw_text())
    except SourceError as exc:
        problems.append(f"kmsg: {exc}")
    problems += _copy_sys(node.sysfs, Sysfs(out))
    return problems


def _copy_file(src: Sysfs, dst: Sysfs, path: str, problems: list[str]) -> None:
    try:
        text = src.read(path)
    except SourceError as exc:
        if src.exists(path):  # unreadable, not absent: worth knowing in a support bundle
            problems.append(str(exc))
        return
    target = dst.path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n")


def _copy_sys(src: Sysfs, dst: Sysfs) -> list[str]:
    problems: list[str] = []
    for bdf in src.listdir(PCI_DEVICES):
        base = f"{PCI_DEVICES}/{bdf}"
        try:
            vendor = src.read(f"{base}/vendor")
        except SourceError:
            continue
        if vendor in RECORDED_VENDORS:
            for name in PCI_FILES:
                _copy_file(src, dst, f"{base}/{name}", problems)
    for bdf in src.listdir(DRIVER_GPUS):
        _copy_file(src, dst, f"{DRIVER_GPUS}/{bdf}/information", problems)
    for hca in src.listdir(IB_CLASS):
        pci = src.link_target_name(f"{IB_CLASS}/{hca}/device")
        if pci:
            link = dst.path(f"{IB_CLASS}/{hca}/device")
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                os.symlink(f"../../../bus/pci/devices/{pci}", link)
        for name in ("hca_type", "fw_ver", "board_id"):
            _copy_file(src, dst, f"{IB_CLASS}/{hca}/{name}", problems)
        for port in src.listdir(f"{IB_CLASS}/{hca}/ports"):
            base = f"{IB_CLASS}/{hca}/ports/{port}"
            for name in IB_PORT_FILES:
                _copy_file(src, dst, f"{base}/{name}", problems)
            for name in src.listdir(f"{base}/counters"):
                _copy_file(src, dst, f"{base}/counters/{name}", problems)
    return problems

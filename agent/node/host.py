"""A node as the checks see it: its identity plus one instance of every source, live or recorded."""
from __future__ import annotations

import copy
import os
import threading
from dataclasses import field
from pathlib import Path
from typing import Any

from gpuwarden.agent.core.config import read_toml
from gpuwarden.agent.core.errors import ConfigError, NvmlError, SourceError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.sku import KNOWN_SKUS, sku_from_gpu_name
from gpuwarden.agent.sources import confine, ib_events
from gpuwarden.agent.sources.dcgm import Dcgm
from gpuwarden.agent.sources.kmsg import DEV_KMSG, KernelLog, KmsgFollower
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.nvml.events import XidEvents
from gpuwarden.agent.sources.nvml.gpu import Gpu
from gpuwarden.agent.sources.pci import driver_gpu_uuid, nvidia_pci_gpus
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.agent.sources.tools import ToolRunner
from gpuwarden.agent.sources.udev import RecordedUdev, UdevMonitor

NODE_TOML_KEYS = {"hostname", "sku", "rack", "nvlink_domain", "boot_id", "recorded_at", "versions"}
BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass
class NodeInfo:
    """Who the node is: node.toml of a recorded node, the hostname and boot of a live one."""

    hostname: str
    sku: str = "unknown"
    rack: str | None = None
    nvlink_domain: str | None = None
    boot_id: str | None = None
    recorded_at: str | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_toml(cls, path: Path) -> "NodeInfo":
        try:
            data = read_toml(path)  # bounded, UTF-8, not nested too deeply: a scenario is untrusted input
        except FileNotFoundError:
            raise ConfigError(f"{path}: cannot read: No such file or directory") from None
        unknown = sorted(set(data) - NODE_TOML_KEYS)
        if unknown:
            raise ConfigError(f"{path}: unknown key '{unknown[0]}' (known: {', '.join(sorted(NODE_TOML_KEYS))})")
        if not isinstance(data.get("hostname"), str):
            raise ConfigError(f"{path}: 'hostname' is required and must be a string")
        for key in ("sku", "rack", "nvlink_domain", "boot_id", "recorded_at"):
            if key in data and not isinstance(data[key], str):
                raise ConfigError(f"{path}: '{key}' must be a string")
        versions = data.get("versions", {})
        if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
            raise ConfigError(f"{path}: [versions] must be a table of strings")
        sku = data.get("sku", "unknown")
        if sku not in KNOWN_SKUS:
            raise ConfigError(f"{path}: sku '{sku}' is not one of {', '.join(KNOWN_SKUS)}")
        return cls(**{k: v for k, v in data.items()})

    def to_toml(self) -> str:
        lines = [f"{k} = {_toml_str(v)}" for k, v in vars(self).items() if v is not None and k != "versions"]
        if self.versions:
            lines.append("\n[versions]")
            lines += [f"{k} = {_toml_str(v)}" for k, v in sorted(self.versions.items())]
        return "\n".join(lines) + "\n"


def _toml_str(value: Any) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class Node:
    """Sources bundled for one node. NVML opens lazily: a node without a driver still runs the checks
    that do not need it, and the ones that do report UNKNOWN with NVML's reason."""

    def __init__(self, info: NodeInfo, root: Path | None, sysfs: Sysfs, kmsg: KernelLog, tools: ToolRunner,
                 nvml_factory: Any):
        self.info, self.root = info, root
        self.sysfs, self.kmsg, self.tools = sysfs, kmsg, tools
        self.dcgm = Dcgm(tools)
        self._nvml_factory = nvml_factory
        self._nvml: Nvml | None = None
        self._nvml_error: NvmlError | None = None
        self._gpus_lock = threading.RLock()  # checks run concurrently; gpus() reads nvml under it
        self._nvml_stamp: int | None = None  # mtime of a recorded nvml.json when last loaded
        self._nvml_path: str | None = None
        self._follower: KmsgFollower | None = None

    @property
    def recorded(self) -> bool:
        return self.root is not None

    @property
    def hostname(self) -> str:
        return self.info.hostname

    @property
    def nvml(self) -> Nvml:
        if self.root is not None:
            self._reload_if_rerecorded()
        if self._nvml is None and self._nvml_error is None:
            try:
                self._nvml = self._nvml_factory()
            except NvmlError as exc:
                self._nvml_error = exc
        if self._nvml_error is not None:
            raise self._nvml_error
        assert self._nvml is not None
        return self._nvml

    def _reload_if_rerecorded(self) -> None:
        """A recorded node is re-read when its nvml.json changes, as a live node is re-read on every poll: the
        daemon's scenario tests inject a fault by rewriting the file."""
        assert self.root is not None
        if self._nvml_path is None:
            self._nvml_path = os.fspath(self.root / "nvml.json")  # asked at every NVML read: no path built each time
        try:
            stamp = os.stat(self._nvml_path).st_mtime_ns
        except OSError:
            stamp = None
        if stamp != self._nvml_stamp:
            with self._gpus_lock:
                self._nvml_stamp = stamp
                self._nvml, self._nvml_error = None, None

    def kmsg_follower(self, cursor: Cursor | None, keep: Any = None) -> KmsgFollower:
        """The node's one kernel-log follower, resumed at `cursor` (a new follower when the cursor is not where
        the current one stands, e.g. after a restart from persisted state)."""
        current = self._follower
        if current is None or (cursor is not None and current.cursor != cursor):
            if current is not None:
                current.close()
            current = self._follower = KmsgFollower(self.kmsg, cursor, keep)
        return current

    def kernel_log_after(self, cursor: Cursor | None) -> "Node":
        """This node with its kernel log seen from `cursor` on (the same sources otherwise): a retest judges what
        happened since the recovery, not the fault that quarantined the node."""
        view = copy.copy(self)
        view.kmsg = self.kmsg.after(cursor)
        return view

    def udev_monitor(self) -> UdevMonitor | RecordedUdev:
        """Device add/remove events (agent/sources/udev.py): the kernel's uevents live, the scenario's `udev` file on
        a recorded node (events appended after this call). Raises SourceError where no monitor can be had."""
        return RecordedUdev(self.root) if self.root is not None else UdevMonitor()

    def ib_port_events(self, devices: list[str], port_dirs: list[str]) -> Any:
        """What says when the IB ports' state may have changed (agent/sources/ib_events.py): live, the RDMA
        `devices`' asynchronous events; on a recorded node, its `port_dirs` (kernel paths) watched for writes.
        Raises SourceError, saying why, where neither can be had (the ports are then looked at every second)."""
        if self.root is not None:
            return ib_events.WatchedFolders(self.sysfs.watch(port_dirs))
        return ib_events.open_port_events(devices)

    def xid_events(self) -> XidEvents:
        """A subscription to NVML's XID events, the daemon's second XID source beside the kernel log (a recorded
        node serves nvml.json's "xid_events", appended ones included). Raises NvmlError when NVML fails."""
        return self.nvml.xid_events()

    @classmethod
    def recorded_at(cls, root: Path) -> "Node":
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"{root}: not a scenario folder")
        info = NodeInfo.from_toml(Path(confine.check(root / "node.toml", confine.scenario_prefix(root))))
        return cls(info, root, Sysfs(root), KernelLog(root / "kmsg", live=False, boot_id=info.boot_id, name="kmsg"),
                   ToolRunner(recorded_dir=root / "tools"), lambda: Nvml.recorded(root / "nvml.json"))

    @classmethod
    def live(cls) -> "Node":
        sysfs = Sysfs("/")
        boot_id = None
        try:
            boot_id = sysfs.read(BOOT_ID)
        except SourceError:
            pass
        info = NodeInfo(hostname=os.uname().nodename, boot_id=boot_id)  # what gethostname() returns on Linux
        node = cls(info, None, sysfs, KernelLog(DEV_KMSG, live=True, boot_id=boot_id), ToolRunner(), Nvml.live)
        try:
            gpus = node.nvml.gpus()
            info.sku = sku_from_gpu_name(next((g.name for g in gpus if g.name), None))
            info.versions["driver"] = node.nvml.driver_version()
        except NvmlError:
            pass  # the checks that need NVML will say why they could not look
        return node

    def uptime_usec(self) -> int | None:
        """Microseconds since boot (the clock of kmsg records), from /proc/uptime under the root."""
        try:
            return int(float(self.sysfs.read("/proc/uptime").split()[0]) * 1_000_000)
        except (SourceError, ValueError, IndexError):
            return None

    def gpus(self) -> list[Gpu]:
        """NVML's GPUs, with the identity of GPUs NVML cannot open filled in from the kernel's view."""
        with self._gpus_lock:
            gpus = self.nvml.gpus()
            if all(g.pci for g in gpus):
                return gpus
            pci_gpus = nvidia_pci_gpus(self.sysfs)
            # NVML enumerates in PCI bus order; only trust the positional match when the counts agree.
            if len(pci_gpus) == len(gpus):
                for gpu, bdf in zip(gpus, pci_gpus, strict=True):
                    if gpu.pci is None:
                        gpu.uuid = gpu.uuid or driver_gpu_uuid(self.sysfs, bdf)
                        gpu.pci = bdf
            return gpus

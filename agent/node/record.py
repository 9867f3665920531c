"""`gpuwarden record`: write a scenario (docs/scenario-format.md) from a node, through the same sources
the checks read, so what is recorded is exactly what preflight will read back."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shutil
import tempfile
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, GpuwardenError, NvmlError, SourceError
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.record_tools import capture_always, capture_full, tools_recorded
from gpuwarden.agent.sources.nvml.events import XidEvents
from gpuwarden.agent.sources.nvml.snapshot import SNAPSHOT_FORMAT, load_snapshot
from gpuwarden.agent.sources.procs import COMM_LEN
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.checks import all_specs
from gpuwarden.checks import job_discovery as discover
from gpuwarden.checks.fabric_manager import FM_PROCESS
from gpuwarden.checks.pcie_tree import pci_path

log = logs.get_logger("gpuwarden.record")
PARTIAL = ".partial"  # suffix of the hidden folder a recording is written into before it is renamed into place
PCI_DEVICES = "/sys/bus/pci/devices"
IB_CLASS = "/sys/class/infiniband"
DRIVER_GPUS = "/proc/driver/nvidia/gpus"
# Vendors whose PCI functions the checks look at: NVIDIA (GPUs, NVSwitches) and Mellanox/NVIDIA networking.
RECORDED_VENDORS = {"0x10de", "0x15b3"}
PCI_FILES = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "current_link_speed",
             "current_link_width", "max_link_speed", "max_link_width", "aer_dev_correctable", "aer_dev_fatal",
             "aer_dev_nonfatal", "numa_node")
IB_PORT_FILES = ("state", "phys_state", "rate", "link_layer")
PCI_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def record(node: Node, out: Path, cfg: Any = None, with_tools: bool = False,
           budget_s: float | None = None) -> list[str]:
    """Write the scenario; returns the problems met (a part that could not be read is noted, not fatal). `cfg` (the
    agent's config: defaults when None) sets the tools' argv and timeouts; `with_tools` also runs the full-level
    checks' tools (minutes, loads the GPUs), within `budget_s` when given.

    All or nothing: the scenario is written into a hidden folder beside `out` and renamed into place once complete, so
    a recording that fails (a full disk, Ctrl-C) leaves no half-written bundle to be taken for a node's state. An
    earlier recording at `out` is replaced whole; any other non-empty folder is refused. A failure is a
    GpuwardenError saying why."""
    out = Path(out)
    if node.root is not None and out.resolve() == Path(node.root).resolve():
        raise ConfigError(f"{out}: is the scenario being re-recorded; write to another folder")
    _check_out(out)
    if cfg is None:
        cfg = config_mod.defaults(all_specs())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=PARTIAL, dir=out.parent))
    except OSError as exc:
        raise SourceError(f"{out}: cannot create the recording: {exc.strerror or exc}") from None
    try:
        problems = _record_into(node, work, cfg, with_tools, budget_s)
        _put_in_place(work, out)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, GpuwardenError) or not isinstance(exc, Exception):
            raise  # the project's own error says why; KeyboardInterrupt and SystemExit go on up
        log.debug("recording failed", out=str(out), error=repr(exc), traceback=traceback.format_exc())
        raise SourceError(f"{out}: nothing recorded: {type(exc).__name__}: {exc}") from exc
    return problems


def _check_out(out: Path) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ConfigError(f"{out}: exists and is not a folder")
    try:
        entries = set(os.listdir(out))
    except OSError as exc:
        raise ConfigError(f"{out}: cannot list: {exc.strerror or exc}") from None
    if entries and "node.toml" not in entries:
        raise ConfigError(f"{out}: exists and is neither empty nor an earlier recording (no node.toml); "
                          "name a new or empty folder")


def _put_in_place(work: Path, out: Path) -> None:
    """Rename the finished recording to `out`, replacing an earlier one there (renamed aside, then removed)."""
    os.chmod(work, 0o777 & ~_umask())  # mkdtemp makes it 0700; a recording is as readable as a mkdir'd folder
    old = None
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / "recording")
    os.rename(work, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _record_into(node: Node, out: Path, cfg: Any, with_tools: bool, budget_s: float | None) -> list[str]:
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
    else:
        _xid_event_support(node, snapshot)
    (out / "nvml.json").write_text(json.dumps(snapshot, indent=2) + "\n")
    (out / "node.toml").write_text(info.to_toml())
    try:
        (out / "kmsg").write_text(node.kmsg.raw_text())
    except SourceError as exc:
        problems.append(f"kmsg: {exc}")
    problems += _copy_sys(node.sysfs, Sysfs(out))
    problems += _copy_processes(node.sysfs, Sysfs(out))
    problems += _copy_jobs(node, out)
    problems += capture_always(node, out, cfg)
    if with_tools:  # after nvml.json: its NVLink counters are the "before" of peer_p2p's copies
        problems += capture_full(node, out, cfg, budget_s)
    return problems


def _xid_event_support(node: Node, snapshot: dict[str, Any]) -> None:
    """nvml.json's "xid_events" key says the node has NVML XID events: subscribe once and close at once. Live there
    is no backlog, so the list is empty; a recorded node keeps its list. GPUs that refused registration keep their
    answer, and so does a failing nvmlEventSetCreate."""
    events = XidEvents(node.nvml)
    failed: NvmlError | None = None
    try:
        events.subscribe()
    except NvmlError as exc:
        failed = exc
    finally:
        events.close()
    if not events.available and failed is None:
        return  # no event support: no key
    if failed is not None and failed.call == "nvmlEventSetCreate":
        snapshot.setdefault("errors", {})[failed.call] = failed.code
    entries = {gpu.get("index"): gpu for gpu in snapshot["gpus"]}
    for index, exc in events.unsubscribed.items():
        entry = entries.get(index)
        if entry is not None and "*" not in entry.get("errors", {}):  # a lost GPU refuses every call already
            entry.setdefault("errors", {})[exc.call] = exc.code
    listed: list[Any] = []
    if node.root is not None:
        listed = load_snapshot(Path(node.root) / "nvml.json").get("xid_events", [])
    snapshot["xid_events"] = listed


def _copy_processes(src: Sysfs, dst: Sysfs) -> list[str]:
    """The process table as far as `fabric` reads it (docs/scenario-format.md, proc/<pid>): PID 1 and 2 (kthreadd
    marks the host's table) and every process whose comm is Fabric Manager's, with its cmdline."""
    fm_comms = (FM_PROCESS, FM_PROCESS[:COMM_LEN])
    problems: list[str] = []
    try:
        pids = [e for e in src.listdir("/proc") if e.isdigit()]
    except SourceError as exc:
        return [str(exc)]
    for pid in pids:
        base = f"/proc/{pid}"
        try:
            comm = src.read(f"{base}/comm")
        except SourceError:
            continue  # exited since the listing
        if pid in ("1", "2") or comm in fm_comms:
            _copy_file(src, dst, f"{base}/comm", problems)
        if comm in fm_comms:
            try:  # raw: arguments end in NULs, and a zombie's cmdline is empty
                data = src.read_bytes(f"{base}/cmdline")
            except OSError:
                continue
            except SourceError as exc:
                problems.append(str(exc))
                continue
            target = dst.path(f"{base}/cmdline")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return problems


def _copy_jobs(node: Node, out: Path) -> list[str]:
    """What `gpuwarden jobs` reads of the GPUs' processes (checks/job_discovery.py), as that reading taped it: their
    cgroup and stat, the environment's variables the job response reads (nothing else: an environment holds tokens),
    the lines of maps that map NCCL or PyTorch, the files that say their versions (a library only as the bytes around
    its banner, in place), and `scontrol pidinfo`'s answers (as every tool's: agent/node/record_tools.py)."""
    tape = discover.Tape()
    try:
        with tools_recorded(node, out / "tools") as files:
            found = discover.discover(node, [], 0.0, tape)
    except SourceError as exc:
        return [f"jobs: {exc}"]
    dst = Sysfs(out)
    for path, data in tape.files.items():
        target = dst.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for path, (offset, data) in tape.windows.items():
        target = dst.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:  # the bytes in place, the rest a hole: a sparse file of the library's size
            f.seek(offset)
            f.write(data)
    return [f"jobs: {p}" for p in (*found.problems, *files.problems)]


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


def _copy_pci(src: Sysfs, dst: Sysfs) -> list[str]:
    """The PCI functions the checks read, laid out as the node lays them out: ours (NVIDIA, Mellanox), every one with
    AER statistics (pcie_aer reads them all), and the bridges above them, whose link pcie_link judges too. Where
    bus/pci/devices/<bdf> links into devices/pci<domain>:<bus>/..., each function is written at its place in that tree
    and linked the same way; a flat scenario stays flat. The folder is written even when nothing in it is ours: a
    listing that found none is not a listing that could not be made (pcie_link's pcie-sysfs-missing, fabric's "PCI
    device list could not be read")."""
    problems: list[str] = []
    if not src.exists(PCI_DEVICES):
        return problems  # absent live too: the replay says so the same way
    try:
        bdfs = src.listdir(PCI_DEVICES)
    except SourceError as exc:
        return [f"{exc}; {PCI_DEVICES} not recorded"]
    dst.path(PCI_DEVICES).mkdir(parents=True, exist_ok=True)
    root = src.root.resolve()
    for bdf in bdfs:
        base = f"{PCI_DEVICES}/{bdf}"
        try:
            vendor = src.read(f"{base}/vendor")
        except SourceError:
            continue  # the checks pass over a function whose vendor cannot be read
        if vendor not in RECORDED_VENDORS and not src.exists(f"{base}/aer_dev_fatal"):
            continue
        levels = [lv for lv in pci_path(src, bdf, root) if PCI_BDF.match(lv[0])] or [(bdf, base)]
        for name, path in levels:
            if path != f"{PCI_DEVICES}/{name}":
                _link_pci_function(dst, name, path)
            for attr in PCI_FILES:
                _copy_file(src, dst, f"{path}/{attr}", problems)
        _copy_physfn(src, dst, levels[-1][1])
    return problems


def _link_pci_function(dst: Sysfs, bdf: str, kernel_path: str) -> None:
    """bus/pci/devices/<bdf> -> ../../../devices/pci.../<bdf>, the link text the kernel writes (pcie_aer reads it)."""
    link = dst.path(f"{PCI_DEVICES}/{bdf}")
    if link.is_symlink() or link.exists():
        return
    dst.path(kernel_path).mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(kernel_path, PCI_DEVICES), link)


def _copy_physfn(src: Sysfs, dst: Sysfs, kernel_path: str) -> None:
    """A virtual function's physfn link (to its physical function beside it): pcie_link passes over VFs by it."""
    target = src.link_target_name(f"{kernel_path}/physfn")
    if target is None or not PCI_BDF.match(target):
        return
    link = dst.path(f"{kernel_path}/physfn")
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../{target}", link)


def _copy_sys(src: Sysfs, dst: Sysfs) -> list[str]:
    problems = _copy_pci(src, dst)
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

"""Is Fabric Manager running on an NVSwitch HGX node? Up when the nvidia-fabricmanager systemd unit is active OR an
nv-fabricmanager process runs on the host; down only when both were looked at and neither is there.

Whose Fabric Manager it is (`fabric_manager = "auto"`): FM runs where the NVSwitches are, on bare-metal HGX or in a VM
given the GPUs AND the NVSwitches (full passthrough); a VM given GPUs without the switches (one GPU passed through,
or shared-NVSwitch multitenancy, where FM runs in a service VM that holds the switches) has no FM of its own (NVIDIA
Fabric Manager user guide, "Full Passthrough Virtualization Model" and "Shared NVSwitch Virtualization Model": "The
Guest VMs are configured with PCI passthrough for the GPUs only, without any visibility of the NVSwitches", as
OpenNebula's FM integration puts it). An NVSwitch is an NVIDIA PCI function of class 0x0680 ("Bridge [0680]: NVIDIA
Corporation GH100 [H100 NVSwitch] [10de:22a3]" on HGX H100/H200, four of them; AWS ParallelCluster decides to start FM
the same way, vendor 10de class 0680: aws/aws-parallelcluster-cookbook#3098). So auto watches FM:
- when an NVSwitch is on this system's PCI bus, on any SKU (A100 HGX too); FM down: FAIL, DRAIN;
- on the HGX SKUs when the PCI device list cannot be read at all (could not look: the SKU decides, as before);
- on the HGX SKUs when no NVSwitch is on the bus but a GPU takes part in an NVLink fabric (fabric state not
  NOT_SUPPORTED): a shared-NVSwitch guest (FM elsewhere: fine) or an HGX whose switches are not PCI functions of that
  class (FM on HGX B200 reaches its NVSwitches through NVLink management ports, siderolabs/extensions#893: "found
  NVSwitch LPF: device=mlx5_10"; whether B200 also enumerates them as class 0x0680 was not confirmed). Which one
  cannot be told from here, so FM down there WARNs (MONITOR) and names the setting; it never drains. The GPUs'
  own fabric registration is judged by `fabric` either way.
Otherwise (no NVSwitch, every GPU's fabric state NOT_SUPPORTED: a real H200 passed through alone to a VM, recorded
in fixtures/nodes/h200-vm-1gpu) FM is not this system's and is not watched. `required` watches FM on any node.

Sources:
- FM is a daemon, nv-fabricmanager, started by the nvidia-fabricmanager systemd unit on host-driver installs (NVIDIA
  Fabric Manager user guide, "Managing the Fabric Manager Service"); NVIDIA's GPU Operator starts the same binary
  inside its driver container (NVIDIA/gpu-driver-container, nvidia-driver `_start_daemons`: `nv-fabricmanager -c
  /usr/share/nvidia/nvswitch/fabricmanager.cfg`), where no host unit exists and `systemctl is-active` says
  "inactive". Both deployments are named in NVIDIA/NVSentinel#883. The host PID namespace sees the container's
  process, so the process table answers for both; the kernel truncates its comm to "nv-fabricmanage"
  (agent/sources/procs.py).
- NVML's fabric state is not taken as proof that FM runs. On H100 and later FM registers each GPU with the fabric
  (state IN_PROGRESS, then COMPLETED with status SUCCESS: FM guide, "Initializing NVSwitch and NVLink"), and the
  registration outlives FM until the GPU is reset: the guide's restart procedure for H100 and later resets the
  GPUs between stopping and starting FM. COMPLETED therefore says FM ran since the last reset, not that it runs;
  gpud took it for "FM up" and fixed that (leptonai/gpud#1151, "do not skip activeness check when fabric state is
  supported"). With FM down, NVLink/NVSwitch errors go unhandled and after the next GPU reset or reboot the GPUs
  cannot register (CUDA fails with cudaErrorSystemNotReady; NVSentinel#889: a broken FM left fabric.state "In
  Progress" for 20 days). A registration that never completes is `fabric`'s own fabric-not-ready.
- Asked every 30 s by the daemon, `systemctl` is a process started each time (some 4 ms of CPU): once FM's process
  is known it answers alone while it runs (read_fabric_manager).
- Could not look is not healthy: with neither systemctl nor the host's process table readable, or the unit not
  active and the process table unreadable (FM may run in a container we cannot see), FM is UNKNOWN.
"""
from __future__ import annotations

import weakref
from typing import Any

from gpuwarden.agent.core.errors import ConfigError, SourceError, ToolError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import MetricSample
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.pci import NVIDIA_VENDOR
from gpuwarden.agent.sources.procs import find_processes, still_running

MODES = ("auto", "required", "off")
FM_SKUS = ("H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX")  # NVSwitch HGX baseboards: FM runs on the node
FM_TOOL = "systemctl-fabricmanager"  # the recorded tool's name (tools/systemctl-fabricmanager.out)
FM_ARGV = ("systemctl", "is-active", "nvidia-fabricmanager")
FM_PROCESS = "nv-fabricmanager"
PCI_DEVICES = "/sys/bus/pci/devices"

NVSWITCH_CLASS = "0x0680"  # PCI base class 06 (bridge), subclass 80 (other): how NVSwitches enumerate
FM_TRANSITIONAL = ("activating", "reloading", "deactivating")
UP_HELP = ("1 if Fabric Manager runs: the nvidia-fabricmanager unit is active or an nv-fabricmanager process runs on "
           "the host (the GPU Operator's driver container).")


@dataclass(frozen=True)
class FmReading:
    unit: str | None  # `systemctl is-active nvidia-fabricmanager` word; None: could not run it (unit_error)
    unit_error: str | None
    pids: tuple[int, ...] | None  # nv-fabricmanager processes on the host; None: not looked (unit active) or failed
    procs_error: str | None

    def evidence(self) -> dict[str, Any]:
        return {"systemctl": self.unit, "systemctl_error": self.unit_error,
                "processes": None if self.pids is None else list(self.pids), "process_table_error": self.procs_error}


@dataclass(frozen=True)
class FmScope:
    """Whether this system's Fabric Manager is watched, why (one line), and whether FM down is a fault here."""

    watched: bool
    why: str
    fails: bool = True  # False: FM down only warns (no NVSwitch of this system's says FM must run here)
    nvswitches: tuple[str, ...] = ()


def check_mode(mode: str, check: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"checks.{check}.fabric_manager must be auto, required or off, got {mode!r}")


def nvswitches_on_bus(sysfs: Any) -> list[str] | None:
    """BDFs of the NVSwitches on this system's PCI bus (NVIDIA functions of class 0x0680xx); None when the PCI device
    list cannot be read at all."""
    if not sysfs.exists(PCI_DEVICES):
        return None
    try:
        bdfs = sysfs.listdir(PCI_DEVICES)
    except SourceError:
        return None
    out = []
    for bdf in bdfs:
        try:
            if (sysfs.read(f"{PCI_DEVICES}/{bdf}/vendor") == NVIDIA_VENDOR
                    and sysfs.read(f"{PCI_DEVICES}/{bdf}/class").startswith(NVSWITCH_CLASS)):
                out.append(bdf)
        except SourceError:
            continue  # a function that vanished or cannot be read: not one we can call an NVSwitch
    return out


def scope(mode: str, sku: str, check: str, nvswitches: list[str] | None, fabric_states: list[int]) -> FmScope:
    """The rule of the module docstring, pure: `nvswitches` from nvswitches_on_bus, `fabric_states` the GPUs' NVML
    fabric states (0 = NOT_SUPPORTED)."""
    check_mode(mode, check)
    if mode == "off":
        return FmScope(False, "fabric_manager = \"off\"")
    if mode == "required":
        return FmScope(True, "fabric_manager = \"required\"")
    if nvswitches:
        return FmScope(True, f"{len(nvswitches)} NVSwitch(es) on this system's PCI bus ({', '.join(nvswitches)})",
                       nvswitches=tuple(nvswitches))
    if sku not in FM_SKUS:
        return FmScope(False, f"no NVSwitch on this system's PCI bus and {sku} does not run Fabric Manager on the node")
    if nvswitches is None:
        return FmScope(True, f"the PCI device list could not be read: {sku} runs Fabric Manager on the node")
    if any(int(st) != 0 for st in fabric_states):
        return FmScope(True, "no NVSwitch on this system's PCI bus, but its GPUs take part in an NVLink fabric",
                       fails=False)
    return FmScope(False, "no NVSwitch on this system's PCI bus and no GPU in an NVLink fabric: Fabric Manager is not "
                          "this system's (a VM given GPUs without their NVSwitches)")


# What the last looks at a node's Fabric Manager found (by the node's sysfs): the nv-fabricmanager processes seen
# running; or "active", the unit found active and its process not looked for yet; or "unit", looked for while the unit
# was active and not found (the unit alone answers then). While a process seen still runs FM is up, and neither
# systemctl (a process started each look: some 4 ms of CPU, a quarter of an idle daemon's) nor the whole process
# table (hundreds of /proc entries) is read.
_seen: "weakref.WeakKeyDictionary[Any, tuple[int, ...] | str]" = weakref.WeakKeyDictionary()


def read_fabric_manager(node: Any, timeout_s: float) -> FmReading:
    """The unit's state, and the host's process table when the unit is not active (all of the I/O). On a node looked
    at before (the daemon's), an nv-fabricmanager process seen then that still runs answers alone; found active a
    second time, the unit's process is looked for once, to be that answer from then on."""
    seen = _seen.get(node.sysfs)
    if isinstance(seen, tuple):
        running = still_running(node.sysfs, FM_PROCESS, seen)
        if running:
            return FmReading(None, None, running, None)
    unit = unit_error = procs_error = None
    pids: tuple[int, ...] | None = None
    try:
        out = node.tools.run(FM_TOOL, list(FM_ARGV), timeout_s)
        words = out.output.split()
        unit = words[-1] if words else f"unknown (exit status {out.returncode})"
    except ToolError as err:  # ToolMissing included: no systemctl here (a container, a non-systemd host)
        unit_error = str(err)
    scan = unit != "active" or (seen is not None and seen != "unit")
    if scan:
        try:
            pids = tuple(p.pid for p in find_processes(node.sysfs, FM_PROCESS))
        except SourceError as err:
            procs_error = str(err)
    if pids:
        _seen[node.sysfs] = pids
    elif unit == "active":  # a one-shot preflight stops at "active": it reads no process table
        _seen[node.sysfs] = "unit" if scan or seen == "unit" else "active"
    else:
        _seen.pop(node.sysfs, None)
    return FmReading(unit, unit_error, pids, procs_error)


def judge_fabric_manager(r: FmReading, since: float | None, now: float, settle_s: float, check: str,
                         hostname: str, fm_scope: FmScope | None = None
                         ) -> tuple[list[Finding], list[MetricSample], float | None]:
    """Findings, the up metric and the new "not seen running since" time. Pure."""
    node = Entity.node(hostname)
    ev = {**r.evidence(), **({"watched_because": fm_scope.why} if fm_scope is not None else {})}
    if r.unit == "active" or r.pids:
        return [], [MetricSample("gpuwarden_fabric_manager_up", UP_HELP, {}, 1.0)], None
    if r.pids is None:  # the process table could not be read: FM may run where we cannot see it
        unit = str(r.unit_error) if r.unit is None else f"the nvidia-fabricmanager unit is {r.unit}"
        msg = (f"could not check Fabric Manager: {unit}, and the process table could not be read "
               f"({r.procs_error}): FM may run in a container (GPU Operator) that this agent cannot see")
        return [Finding(check, "fabric-manager-unknown", node, Status.UNKNOWN, msg, Action.NONE,
                        {**ev, "error": msg})], [], since
    since = now if since is None else since
    metrics = [MetricSample("gpuwarden_fabric_manager_up", UP_HELP, {}, 0.0)]
    if r.unit in FM_TRANSITIONAL and now - since < settle_s:
        return [], metrics, since  # a restart: grace of settle_s
    unit = str(r.unit_error) if r.unit is None else f"the nvidia-fabricmanager unit is {r.unit}"
    if fm_scope is not None and not fm_scope.fails:
        return [Finding(check, "fabric-manager-inactive", node, Status.WARN,
                        f"Fabric Manager not seen running for {now - since:.0f}s ({unit} and no {FM_PROCESS} process "
                        f"on the host); {fm_scope.why}: in a VM given GPUs under shared-NVSwitch multitenancy FM runs "
                        "in the service VM (set [checks.fabric] fabric_manager = \"off\"); on a bare-metal HGX whose "
                        "NVSwitches are not PCI functions (HGX B200) it must run here (set fabric_manager = "
                        "\"required\" to fail and drain when it does not)", Action.MONITOR,
                        {**ev, "inactive_since": since})], metrics, since
    return [Finding(check, "fabric-manager-inactive", node, Status.FAIL,
                    f"Fabric Manager not running for {now - since:.0f}s ({unit} and no {FM_PROCESS} process on the "
                    "host): the NVSwitch fabric is not managed (CUDA fails with cudaErrorSystemNotReady until it is "
                    "initialised; NVLink errors go unhandled)", Action.DRAIN,
                    {**ev, "inactive_since": since})], metrics, since

"""Is Fabric Manager running on an NVSwitch HGX node? Up when the nvidia-fabricmanager systemd unit is active OR an
nv-fabricmanager process runs on the host; down only when both were looked at and neither is there.

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
- Could not look is not healthy: with neither systemctl nor the host's process table readable, or the unit not
  active and the process table unreadable (FM may run in a container we cannot see), FM is UNKNOWN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwarden.agent.errors import ConfigError, SourceError, ToolError
from gpuwarden.agent.model import Action, Entity, Finding, Status
from gpuwarden.agent.passive import MetricSample
from gpuwarden.agent.sources.procs import find_processes

MODES = ("auto", "required", "off")
FM_SKUS = ("H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX")  # NVSwitch HGX baseboards: FM runs on the node
FM_TOOL = "systemctl-fabricmanager"  # the recorded tool's name (tools/systemctl-fabricmanager.out)
FM_ARGV = ("systemctl", "is-active", "nvidia-fabricmanager")
FM_PROCESS = "nv-fabricmanager"
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


def watched(mode: str, sku: str, check: str) -> bool:
    """auto: on the HGX SKUs whose baseboard NVSwitches FM manages; required: on any SKU; off: never."""
    if mode not in MODES:
        raise ConfigError(f"checks.{check}.fabric_manager must be auto, required or off, got {mode!r}")
    return mode == "required" or (mode == "auto" and sku in FM_SKUS)


def read_fabric_manager(node: Any, timeout_s: float) -> FmReading:
    """The unit's state, and the host's process table when the unit is not active (all of the I/O)."""
    unit = unit_error = procs_error = None
    pids: tuple[int, ...] | None = None
    try:
        out = node.tools.run(FM_TOOL, list(FM_ARGV), timeout_s)
        words = out.output.split()
        unit = words[-1] if words else f"unknown (exit status {out.returncode})"
    except ToolError as err:  # ToolMissing included: no systemctl here (a container, a non-systemd host)
        unit_error = str(err)
    if unit != "active":
        try:
            pids = tuple(p.pid for p in find_processes(node.sysfs, FM_PROCESS))
        except SourceError as err:
            procs_error = str(err)
    return FmReading(unit, unit_error, pids, procs_error)


def judge_fabric_manager(r: FmReading, since: float | None, now: float, settle_s: float, check: str,
                         hostname: str) -> tuple[list[Finding], list[MetricSample], float | None]:
    """Findings, the up metric and the new "not seen running since" time. Pure."""
    node, ev = Entity.node(hostname), r.evidence()
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
    return [Finding(check, "fabric-manager-inactive", node, Status.FAIL,
                    f"Fabric Manager not running for {now - since:.0f}s ({unit} and no {FM_PROCESS} process on the "
                    "host): the NVSwitch fabric is not managed (CUDA fails with cudaErrorSystemNotReady until it is "
                    "initialised; NVLink errors go unhandled)", Action.DRAIN,
                    {**ev, "inactive_since": since})], metrics, since

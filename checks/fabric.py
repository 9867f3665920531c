"""NVLink fabric per GPU from NVML's GPU fabric info (registration state, status, health mask, one NVLink domain per
node), and whether Fabric Manager runs on HGX nodes (checks/fabric_manager.py: systemd unit or host process).

NVSwitch SXid errors are the separate check `nvswitch_sxid` (checks/nvswitch_sxid.py): the daemon replaces a check's
findings with each judgement, so a poll must not erase an SXid incident and the other way round.

Sources:
- Fabric info fields, states and the health-mask layout: ../shared/data/fabric_gb200/nvml-gpu-fabric-info__facts.md
  (nvml.h); partition-assigned, GFM-state and "GPU state invalid" come from the same constants in nvidia-ml-py
  13.615 (tests/test_fabric.py compares the table with the installed bindings).
- A GPU whose fabric registration did not complete loses NVLink P2P (NVIDIA Fabric Manager user guide: "If a
  GPU fails to register with the fabric, it will lose its NVLink peer-to-peer capability"); CUDA on a node whose
  Fabric Manager did not initialise the fabric fails with cudaErrorSystemNotReady (same guide).
- Fabric Manager runs on NVSwitch HGX nodes (H100/H200/B200), as a systemd unit or in the GPU Operator's driver
  container, and in a VM only when the VM holds the NVSwitches (which node's FM it is: checks/fabric_manager.py).
  GB200/GB300 NVL72 compute trays do not run it: the NVLink switch trays' NVOS runs FM, NVLSM and
  NMX-Controller (NVIDIA MNNVL user guide and NMX-C docs, as summarised in leptonai/gpud
  components/accelerator/nvidia/fabric-manager), so there the NVML fabric state and health mask are the tray's
  view of the fabric.
"""
from __future__ import annotations

import time
import weakref
from collections import Counter
from typing import Any, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.nvml.errors import ERROR_NAMES
from gpuwarden.checks.fabric_manager import (
    MODES,
    FmReading,
    FmScope,
    check_mode,
    judge_fabric_manager,
    nvswitches_on_bus,
    read_fabric_manager,
    scope,
)

CHECK_NAME = "fabric"
COMPLETED = 3
STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
ZERO_UUID = "00000000-0000-0000-0000-000000000000"  # HGX: "no NVLink domain", never one shared domain

# Health mask: (field, shift, mask, {value: (meaning, status, action)}); value 0 = not supported, and values not
# listed (the healthy ones) are no finding.
_FAIL, _WARN = (Status.FAIL, Action.DRAIN), (Status.WARN, Action.MONITOR)
HEALTH_FIELDS: tuple[tuple[str, int, int, Mapping[int, tuple[str, Status, Action]]], ...] = (
    # Degraded bandwidth warns: on NVL72 it is usually a fabric-wide state (a switch tray down) that every tray
    # of the rack reports; a link down on this GPU is already a FAIL of nvlink_lanes.
    ("degraded_bandwidth", 0, 0x3, {1: ("NVLink bandwidth is degraded", *_WARN)}),
    ("route_recovery", 2, 0x3, {1: ("route recovery is in progress", *_WARN)}),
    ("route_unhealthy", 4, 0x3, {1: ("the fabric route to this GPU is unhealthy", *_FAIL)}),
    ("access_timeout_recovery", 6, 0x3, {1: ("access-timeout recovery is in progress", *_WARN)}),
    ("incorrect_configuration", 8, 0xF, {
        2: ("incorrect configuration: incorrect SysGUID", *_FAIL),
        3: ("incorrect configuration: incorrect chassis serial number", *_FAIL),
        4: ("incorrect configuration: no partition", *_FAIL),
        5: ("incorrect configuration: insufficient NVLinks", *_FAIL),
        6: ("incorrect configuration: incompatible GPU firmware", *_FAIL),
        7: ("incorrect configuration: invalid location", *_FAIL),
        8: ("incorrect configuration: GPU state invalid", *_FAIL),
    }),
    ("partition_assigned", 12, 0x3, {}),  # 1 assigned, 2 not: evidence only
    ("gfm_state", 14, 0x3, {2: ("the global fabric manager is disconnected", *_WARN)}),
)


def decode_health_mask(mask: int) -> dict[str, int]:
    return {name: (mask >> shift) & width for name, shift, width, _ in HEALTH_FIELDS}


@dataclass(frozen=True)
class GpuFabric:
    index: int
    uuid: str
    pci: str | None
    info: Mapping[str, Any]  # Nvml.fabric_info(): cluster_uuid, clique_id, state, status, health_mask

    @property
    def entity(self) -> Entity:
        return Entity("gpu", self.uuid, self.index, self.pci)


@dataclass(frozen=True)
class FabricSample:
    hostname: str
    gpus: tuple[GpuFabric, ...]
    problems: tuple[Finding, ...]
    fm: FmReading | None = None  # None: Fabric Manager not watched on this node
    fm_scope: FmScope | None = None


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> FabricSample:
    mode = cfg["fabric_manager"]
    check_mode(mode, CHECK_NAME)
    try:
        readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: node.nvml.fabric_info(gpu))
    except NotApplicable:
        readings, problems = [], []  # no GPU with fabric info: the Fabric Manager may still be this node's
    switches = _nvswitches(node.sysfs) if mode == "auto" else None
    fm_scope = scope(mode, node.info.sku, CHECK_NAME, switches, [int(info["state"]) for _, info in readings])
    gpus = tuple(GpuFabric(g.index, g.entity.id, g.pci, info) for g, info in readings if info["state"] != 0)
    if not gpus and not problems and not fm_scope.watched:
        raise NotApplicable(f"every GPU's NVLink fabric state is NOT_SUPPORTED, and Fabric Manager is not watched: "
                            f"{fm_scope.why}")
    fm = read_fabric_manager(node, float(cfg["tool_timeout_s"])) if fm_scope.watched else None
    return FabricSample(node.hostname, gpus, tuple(problems), fm, fm_scope)


NVSWITCH_RELIST_S = 300.0
_listed: "weakref.WeakKeyDictionary[Any, tuple[float, list[str] | None]]" = weakref.WeakKeyDictionary()


def _nvswitches(sysfs: Any) -> list[str] | None:
    """nvswitches_on_bus, listed again every NVSWITCH_RELIST_S: the listing reads every PCI function's vendor (hundreds
    on a GPU node) and NVSwitches do not come and go while the node runs; a fresh Node (preflight) lists afresh."""
    now = time.monotonic()
    got = _listed.get(sysfs)
    if got is None or now - got[0] >= NVSWITCH_RELIST_S:
        got = _listed[sysfs] = (now, nvswitches_on_bus(sysfs))
    return got[1]


def judge(state: Mapping[str, Any], smp: FabricSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    since: dict[str, Any] = dict(state.get("not_ready_since", {}))
    findings: list[Finding] = list(smp.problems)
    metrics: list[MetricSample] = []
    domains: dict[str, list[GpuFabric]] = {}
    for g in smp.gpus:
        info, ent = g.info, g.entity
        st, status = int(info["state"]), int(info.get("status", 0))
        labels = {"gpu": str(g.index), "uuid": g.uuid}
        metrics.append(MetricSample("gpuwarden_gpu_fabric_state", "NVML GPU fabric state: 1 not started, "
                                    "2 in progress, 3 completed.", labels, float(st)))
        ev = {**info, "state_name": STATES.get(st, str(st)), **decode_health_mask(int(info.get("health_mask", 0)))}
        if st != COMPLETED:
            first = since.setdefault(g.uuid, now)
            metrics.append(MetricSample("gpuwarden_gpu_fabric_not_ready_seconds", "Seconds the GPU's fabric "
                                        "registration has not been completed.", labels, now - first))
            if now - first >= cfg["settle_s"]:
                findings.append(Finding(CHECK_NAME, "fabric-not-ready", ent, Status.FAIL,
                                        f"{ent.label()}: fabric registration {STATES.get(st, st)} for "
                                        f"{now - first:.0f}s: the GPU cannot use the NVLink fabric (no NVLink P2P)",
                                        Action.DRAIN, {**ev, "not_ready_seconds": now - first}))
            continue
        since.pop(g.uuid, None)
        metrics.append(MetricSample("gpuwarden_gpu_fabric_not_ready_seconds", "Seconds the GPU's fabric "
                                    "registration has not been completed.", labels, 0.0))
        if status != 0:
            name = "NVML_ERROR_" + ERROR_NAMES.get(status, f"CODE_{status}")
            findings.append(Finding(CHECK_NAME, "fabric-error", ent, Status.FAIL,
                                    f"{ent.label()}: fabric registration completed with {name}: the GPU cannot "
                                    "use the NVLink fabric", Action.DRAIN, {**ev, "status_name": name}))
            continue
        findings.extend(_health_findings(ent, int(info.get("health_mask", 0)), ev))
        domain = f"{info['cluster_uuid']}.{info['clique_id']}"
        domains.setdefault(domain, []).append(g)
        metrics.append(MetricSample("gpuwarden_gpu_fabric_clique_info", "1 for the NVLink domain (cluster UUID "
                                    "and clique) the GPU is registered in.",
                                    {**labels, "cluster_uuid": str(info["cluster_uuid"]),
                                     "clique_id": str(info["clique_id"])}, 1.0))
    findings.extend(_clique_findings(domains, smp.hostname))
    fm_since = state.get("fm_inactive_since")
    if smp.fm is not None:
        fm_findings, fm_metrics, fm_since = judge_fabric_manager(smp.fm, fm_since, now, cfg["settle_s"], CHECK_NAME,
                                                                 smp.hostname, smp.fm_scope)
        findings.extend(fm_findings)
        metrics.extend(fm_metrics)
    return Judgement({"not_ready_since": since, "fm_inactive_since": fm_since}, tuple(findings), tuple(metrics))


def _health_findings(ent: Entity, mask: int, ev: Mapping[str, Any]) -> list[Finding]:
    out = []
    for name, shift, width, bad in HEALTH_FIELDS:
        value = (mask >> shift) & width
        if value in bad:
            meaning, status, action = bad[value]
            code = "fabric-" + name.replace("_", "-")
            out.append(Finding(CHECK_NAME, code, ent, status, f"{ent.label()}: {meaning} (NVML fabric health "
                               f"mask 0x{mask:x})", action, {**ev, "field": name, "value": value}))
    return out


def _clique_findings(domains: Mapping[str, list[GpuFabric]], hostname: str) -> list[Finding]:
    """Every GPU of a node (a GB200 tray) belongs to one NVLink domain; the odd ones out are misregistered."""
    if len(domains) < 2:
        return []
    sizes = Counter({d: len(gs) for d, gs in domains.items()})
    (top, n), *rest = sizes.most_common()
    seen = {d: [g.index for g in gs] for d, gs in domains.items()}
    if rest and rest[0][1] == n:  # a tie: no majority to call the right domain
        return [Finding(CHECK_NAME, "fabric-clique-mismatch", Entity.node(hostname), Status.FAIL,
                        f"the node's GPUs are split across NVLink domains {sorted(seen)} with no majority",
                        Action.DRAIN, {"domains": seen})]
    def name(d: str) -> str:
        return "no NVLink domain (zero cluster UUID)" if d.startswith(ZERO_UUID) else f"NVLink domain {d}"

    return [Finding(CHECK_NAME, "fabric-clique-mismatch", g.entity, Status.FAIL,
                    f"{g.entity.label()}: registered in {name(d)}, the node's other {n} GPU(s) in {name(top)}: it "
                    "cannot reach its tray peers over NVLink", Action.DRAIN,
                    {"domain": d, "majority_domain": top, "domains": seen})
            for d, gs in domains.items() if d != top for g in gs]


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="NVLink fabric per GPU (NVML fabric state, status, health mask, clique) and the Fabric Manager service",
    sample=sample,
    judge=judge,
    interval_s=30.0,
    defaults={
        "settle_s": 300.0,  # a registration not completed (or FM activating) for this long after first seen fails
        "fabric_manager": "auto",  # auto: where this system's NVSwitches say (fabric_manager.py) | required | off
        "tool_timeout_s": 5.0,  # systemctl is-active nvidia-fabricmanager
    },
    choices={"fabric_manager": MODES},
    timeout_s=15.0,
    # Every registration completed and Fabric Manager seen running: nothing is timed, so the same reading judges the
    # same (the daemon counts the check quiet only while its record has no findings).
    quiet=lambda state: not state.get("not_ready_since") and state.get("fm_inactive_since") is None,
    quiet_rejudge_s=300.0,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="fabric", order=70, level="quick", look="SPEC", poll="SPEC", poll_order=6,
)

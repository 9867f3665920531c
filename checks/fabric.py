"""NVSwitch / NVLink fabric: NVML's GPU fabric info (registration state, status, health mask, NVLink clique),
the Fabric Manager service on HGX nodes, and NVSwitch SXid errors from the kernel log.

Two specs: `SPEC` (polled: NVML fabric info + Fabric Manager) and `SXID_CONSUMER` (fed by the daemon's
kernel-log follower). They are separate checks because the daemon replaces a check's findings with each
judgement: a poll must not erase an SXid incident and the other way round.

Sources:
- Fabric info fields, states and the health-mask layout: ../shared/data/fabric_gb200/nvml-gpu-fabric-info__facts.md
  (nvml.h); partition-assigned, GFM-state and "GPU state invalid" come from the same constants in nvidia-ml-py
  13.615 (tests/test_fabric.py compares the table with the installed bindings).
- A GPU whose fabric registration did not complete loses NVLink P2P (NVIDIA Fabric Manager user guide: "If a
  GPU fails to register with the fabric, it will lose its NVLink peer-to-peer capability"); CUDA on a node whose
  Fabric Manager did not initialise the fabric fails with cudaErrorSystemNotReady (same guide).
- Fabric Manager runs as nvidia-fabricmanager on NVSwitch HGX nodes (H100/H200/B200). GB200/GB300 NVL72 compute
  trays do not run it: the NVLink switch trays' NVOS runs FM, NVLSM and NMX-Controller (NVIDIA MNNVL user guide
  and NMX-C docs, as summarised in leptonai/gpud components/accelerator/nvidia/fabric-manager), so there the
  NVML fabric state and health mask are the tray's view of the fabric. With the GPU Operator, FM runs inside the
  driver container, not as a systemd unit: set fabric_manager = "off" there.
- SXid severity: the kernel prints "Fatal" or "Non-fatal"; DCGM's NVSwitch health watch fails on fatal and warns
  on non-fatal errors ("Monitor the NVSwitch. It can still perform workload."), NVSentinel's SXid handler does
  the same split (NVIDIA/NVSentinel health-monitors/syslog-health-monitor/pkg/sxid).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from gpuwarden.agent.errors import ConfigError, NotApplicable, ParseError, ToolError
from gpuwarden.agent.kernel_log import LogRecord, parse_log_text
from gpuwarden.agent.model import Action, Entity, Finding, Status
from gpuwarden.agent.passive import Judgement, KernelConsumer, MetricSample, PassiveSpec
from gpuwarden.agent.per_gpu import read_each_gpu
from gpuwarden.agent.sources.nvml import ERROR_NAMES

CHECK_NAME = "fabric"
SXID_CHECK_NAME = "nvswitch_sxid"
COMPLETED = 3
STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
FM_SKUS = ("H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX")  # NVSwitch HGX baseboards: FM runs on the node
FM_ARGV = ("systemctl", "is-active", "nvidia-fabricmanager")
FM_TRANSITIONAL = ("activating", "reloading", "deactivating")
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
    fm_state: str | None = None  # `systemctl is-active` word; None: not looked at
    fm_error: str | None = None  # why FM could not be looked at


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> FabricSample:
    mode = cfg["fabric_manager"]
    if mode not in ("auto", "required", "off"):
        raise ConfigError(f"checks.{CHECK_NAME}.fabric_manager must be auto, required or off, got {mode!r}")
    fm_wanted = mode == "required" or (mode == "auto" and node.info.sku in FM_SKUS)
    try:
        readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: node.nvml.fabric_info(gpu))
    except NotApplicable:
        if not fm_wanted:
            raise  # no GPU with fabric info and no Fabric Manager to watch: SKIPPED
        readings, problems = [], []
    gpus = tuple(GpuFabric(g.index, g.entity.id, g.pci, info) for g, info in readings if info["state"] != 0)
    if not gpus and not problems and not fm_wanted:
        raise NotApplicable("no GPU takes part in an NVLink fabric (fabric state NOT_SUPPORTED)")
    fm_state = fm_error = None
    if fm_wanted:
        try:
            out = node.tools.run("systemctl-fabricmanager", list(FM_ARGV), float(cfg["tool_timeout_s"]))
            words = out.output.split()
            fm_state = words[-1] if words else f"unknown (exit status {out.returncode})"
        except ToolError as err:  # ToolMissing included: no systemctl here
            fm_error = str(err)
    return FabricSample(node.hostname, gpus, tuple(problems), fm_state, fm_error)


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
    if smp.fm_error is not None:
        findings.append(Finding(CHECK_NAME, "fabric-manager-unknown", Entity.node(smp.hostname), Status.UNKNOWN,
                                f"could not check nvidia-fabricmanager: {smp.fm_error}", Action.NONE,
                                {"error": smp.fm_error}))
    elif smp.fm_state is not None:
        up = smp.fm_state == "active"
        fm_since = None if up else (fm_since if fm_since is not None else now)
        metrics.append(MetricSample("gpuwarden_fabric_manager_up", "1 if the nvidia-fabricmanager service is "
                                    "active.", {}, 1.0 if up else 0.0))
        settling = smp.fm_state in FM_TRANSITIONAL and now - fm_since < cfg["settle_s"]
        if not up and not settling:
            findings.append(Finding(CHECK_NAME, "fabric-manager-inactive", Entity.node(smp.hostname), Status.FAIL,
                                    f"nvidia-fabricmanager is {smp.fm_state} for {now - fm_since:.0f}s: the NVSwitch "
                                    "fabric is not managed (CUDA fails with cudaErrorSystemNotReady until it is "
                                    "initialised; NVLink errors go unhandled)", Action.DRAIN,
                                    {"systemctl": smp.fm_state, "inactive_since": fm_since}))
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


# ---------------------------------------------------------------- NVSwitch SXid errors
_PCI = r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])"
# "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"; also the "Severity ..." and
# "Data {...}" detail lines of an event, and SOE messages without severity or link.
_SXID = re.compile(r"(?:(nvidia-nvswitch\d{1,4}): )?SXid \(PCI:" + _PCI + r"\): (\d{1,6}),? ?(.*)")
_SEVERITY = re.compile(r"(Fatal|Non-fatal),?\s*(?:Link (\d{1,4})(?!\d)\s*)?(.*)", re.IGNORECASE)
# Fabric Manager log: "detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus id 00000000:86:00.0
# physical id 3 port 61"
_FM = re.compile(r"detected NVSwitch (fatal|non-fatal) error (\d{1,6})(?: on fid \d{1,6})? on NVSwitch pci bus id "
                 + _PCI + r"(?: physical id (\d{1,4}))?(?: port (\d{1,4}))?", re.IGNORECASE)


@dataclass(frozen=True)
class SxidEvent:
    sxid: int
    pci: str  # the NVSwitch, canonical BDF "0000:06:00.0"
    fatal: bool | None  # None: the line does not say (Severity/Data detail lines, SOE messages)
    link: int | None  # NVSwitch link (port) number
    detail: str
    switch: str | None  # "nvidia-nvswitch1" (kernel) or "physical id 3" (Fabric Manager log)
    origin: str  # "kernel" | "fabricmanager"
    record: LogRecord | None = None


def _bdf(domain: str, bus: str, dev: str, fn: str) -> str:
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def parse_sxid(message: str, record: LogRecord | None = None) -> SxidEvent | None:
    """The SXid event in one kernel or Fabric Manager log message, or None."""
    m = _SXID.search(message)
    if m:
        rest = m[7].strip()
        sev = _SEVERITY.match(rest)
        fatal = link = None
        if sev:
            fatal, rest = sev[1].lower() == "fatal", sev[3].strip()
            link = int(sev[2]) if sev[2] else None
        return SxidEvent(int(m[6]), _bdf(m[2], m[3], m[4], m[5]), fatal, link, rest, m[1], "kernel", record)
    m = _FM.search(message)
    if m:
        return SxidEvent(int(m[2]), _bdf(m[3], m[4], m[5], m[6]), m[1].lower() == "fatal",
                         int(m[8]) if m[8] else None, message[m.end():].strip(),
                         f"physical id {m[7]}" if m[7] else None, "fabricmanager", record)
    return None


def sxid_events_from_records(records: Iterable[LogRecord]) -> list[SxidEvent]:
    out = []
    for r in records:
        if "SXid" in r.message or "NVSwitch" in r.message:  # cheap filter before the regexes
            event = parse_sxid(r.message, r)
            if event is not None:
                out.append(event)
    return out


def judge_kernel_records(state: Mapping[str, Any], batch: Any, cfg: Mapping[str, Any], now: float) -> Judgement:
    """SXid incidents, one per NVSwitch and SXid code. `batch` is the daemon's KernelBatch (records, gpus,
    boot_id) or a plain sequence of LogRecords. A fatal incident stands until the boot changes (or fatal_hold_s
    after its last event when that is set); a non-fatal one hold_s after its last event."""
    records = getattr(batch, "records", batch)
    boot_id = getattr(batch, "boot_id", state.get("boot_id"))
    same_boot = state.get("boot_id") == boot_id
    incidents: dict[str, Any] = json.loads(json.dumps(state.get("incidents", {}))) if same_boot else {}
    ignore = set(cfg["ignore_sxids"])
    for e in sxid_events_from_records(records):
        if e.sxid in ignore:
            continue
        inc = incidents.setdefault(f"{e.pci}|{e.sxid}", {
            "pci": e.pci, "sxid": e.sxid, "switch": e.switch, "events": 0, "fatal": 0, "links": [], "details": [],
            "first_at": now, "first_seq": e.record.seq if e.record else None,
            "first_message": e.record.message if e.record else e.detail})
        inc["last_at"], inc["last_seq"] = now, e.record.seq if e.record else None
        if e.fatal is None:  # a detail line of the event before it ("Severity 1 ...", "Data {...}")
            if len(inc["details"]) < 10:
                inc["details"].append(e.detail[:200])
            continue
        inc["events"] += 1
        inc["fatal"] += int(e.fatal)
        inc["last_detail"] = e.detail[:300]
        if e.link is not None and e.link not in inc["links"] and len(inc["links"]) < 64:
            inc["links"].append(e.link)
    force = set(cfg["fail_sxids"])
    kept, findings = {}, []
    for key, inc in incidents.items():
        fatal = inc["fatal"] > 0 or inc["sxid"] in force
        hold = cfg["fatal_hold_s"] if fatal else cfg["hold_s"]
        if hold > 0 and now - inc["last_at"] > hold:
            continue
        kept[key] = inc
        findings.append(_sxid_finding(inc, fatal))
    metrics = tuple(MetricSample("gpuwarden_nvswitch_sxid_events", "NVSwitch SXid events seen this boot, per "
                                 "switch and SXid code.", {"pci": i["pci"], "sxid": str(i["sxid"])},
                                 float(i["events"])) for i in kept.values())
    return Judgement({"boot_id": boot_id, "incidents": kept}, tuple(findings), metrics)


def _sxid_finding(inc: Mapping[str, Any], fatal: bool) -> Finding:
    links = ", ".join(str(n) for n in sorted(inc["links"])) or "not named"
    kind = "fatal" if inc["fatal"] else "non-fatal" if inc["events"] else "severity not stated"
    status, action = (Status.FAIL, Action.DRAIN) if fatal else (Status.WARN, Action.MONITOR)
    then = "drain, then reset the NVSwitch and its GPUs (or reboot)" if fatal else "watch the switch"
    switch = f" ({inc['switch']})" if inc.get("switch") else ""
    last = inc.get("last_detail") or (inc["details"][-1] if inc["details"] else "")
    return Finding(SXID_CHECK_NAME, f"sxid-{inc['sxid']}", Entity("nvswitch", inc["pci"], pci=inc["pci"]), status,
                   f"NVSwitch {inc['pci']}{switch}: SXid {inc['sxid']} ({kind}), link(s) {links}: {inc['events']} "
                   f"event(s), last: \"{last}\"; {then}", action,
                   {k: inc.get(k) for k in ("sxid", "events", "fatal", "links", "details", "first_at", "last_at",
                                            "first_seq", "last_seq", "first_message")})


def analyze_text(text: str, source: str) -> tuple[list[Finding], list[ParseError]]:
    """`gpuwarden analyze` for a kernel or Fabric Manager log: the SXid findings the consumer would give."""
    records, errors = parse_log_text(text, source)
    return list(judge_kernel_records({}, records, SXID_CONSUMER.defaults, 0.0).findings), errors


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="NVLink fabric per GPU (NVML fabric state, status, health mask, clique) and the Fabric Manager service",
    sample=sample,
    judge=judge,
    interval_s=30.0,
    defaults={
        "settle_s": 300.0,  # a registration not completed (or FM activating) for this long after first seen fails
        "fabric_manager": "auto",  # auto: check nvidia-fabricmanager on HGX SKUs | required | off
        "tool_timeout_s": 5.0,  # systemctl is-active nvidia-fabricmanager
    },
    timeout_s=15.0,
)

SXID_CONSUMER = KernelConsumer(
    name=SXID_CHECK_NAME,
    summary="NVSwitch SXid errors from the followed kernel log: fatal ones drain, non-fatal ones warn",
    judge=judge_kernel_records,
    defaults={
        "ignore_sxids": [],  # never reported
        "fail_sxids": [],  # treated as fatal
        "hold_s": 3600.0,  # a non-fatal incident stands this long after its last event
        "fatal_hold_s": 0.0,  # a fatal one: 0 = until the next boot
    },
    list_types={"ignore_sxids": int, "fail_sxids": int},
    interest=("SXid", "NVSwitch"),  # SXid lines and their Severity/Data continuations; Fabric Manager's wording
)

"""PCIe links of GPUs, NICs and the switches above them: trained speed and width against what both ends support
(sysfs, and NVML for GPUs), the GPU's PCIe replay counter, and each GPU's distance to its nearest NIC against the
SKU's design (`nvidia-smi topo -m`). A downtrained link (x8 of x16, Gen4 of Gen5) is a finding naming the BDF.
The links are read from sysfs by checks/pcie_tree.py; here they are judged."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import (
    ConfigError,
    NotApplicable,
    NvmlError,
    ParseError,
    SourceError,
    ToolError,
    ToolMissing,
)
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.thresholds import sku_table
from gpuwarden.checks.parse_nvidia_smi_topo import DISTANCE_NAMES, PCIE_DISTANCE, TopoMatrix, parse_topo_matrix
from gpuwarden.checks.pcie_tree import (
    CHECK_NAME,
    PCI_DEVICES,
    Link,
    _gpus_on_bus,
    _nic_on_bus,
    gen,
    read_links,
)

IB_CLASS = "/sys/class/infiniband"  # every RDMA device (InfiniBand or RoCE, any vendor)
TOPO_TOOL = "nvidia-smi-topo-m"  # the recorded tool's name (tools/nvidia-smi-topo-m.out)
TOPO_ARGV = ("nvidia-smi", "topo", "-m")
NVML_GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle


def decide_link(link: Link, entity: Entity, judge_speed: bool) -> list[Finding]:
    width_low = link.width is not None and link.can_width is not None and link.width < link.can_width
    speed_low = (judge_speed and link.speed_gts is not None and link.can_speed is not None
                 and link.speed_gts < link.can_speed)
    if not (width_low or speed_low):
        return []
    # A GPU or NIC at x8 halves what it can move to the host or the network: drain. A switch uplink shares
    # its loss among the devices below (their GPU<->NIC traffic stays under the switch): warn.
    status, action = (Status.FAIL, Action.DRAIN) if link.role in ("gpu", "nic") else (Status.WARN, Action.MONITOR)
    now = f"Gen{gen(link.speed_gts) or '?'} x{link.width}"
    can = f"Gen{gen(link.can_speed) or '?'} x{link.can_width}"
    share = (link.width or 0) / (link.can_width or 1)
    if speed_low:
        share *= (link.speed_gts or 0) / (link.can_speed or 1)
    ends = f"it and {link.upstream} above it" if link.upstream else "it"
    return [Finding(CHECK_NAME, "pcie-downtrained", entity, status,
                    f"{entity.label()} ({link.role} {link.bdf}): PCIe link trained at {now} where {ends} can do "
                    f"{can}: about {share:.0%} of its bandwidth; reseat or replace the riser, retimer or cable and "
                    "retest", action,
                    {"bdf": link.bdf, "role": link.role, "source": "sysfs", "speed_gts": link.speed_gts,
                     "width": link.width, "max_speed_gts": link.max_speed_gts, "max_width": link.max_width,
                     "upstream": link.upstream, "upstream_max_speed_gts": link.up_max_speed_gts,
                     "upstream_max_width": link.up_max_width, "speed_judged": judge_speed})]


@dataclass(frozen=True)
class NvmlLink:
    """A GPU's PCIe link as NVML reports it."""

    gen: int
    max_gen: int  # NVML: the highest generation both the GPU and the system support
    width: int
    max_width: int
    replay: int
    idle: bool | None  # NVML's GPU_IDLE clocks-event reason; None when not readable


def decide_nvml(entity: Entity, r: NvmlLink, judge_gen: bool, already_flagged: bool,
                policy: Mapping[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    evidence = {"source": "nvml", "gen": r.gen, "max_gen": r.max_gen, "width": r.width, "max_width": r.max_width,
                "replay": r.replay, "idle": r.idle, "gen_judged": judge_gen}
    if not already_flagged and (r.width < r.max_width or (judge_gen and r.gen < r.max_gen)):
        out.append(Finding(CHECK_NAME, "pcie-downtrained", entity, Status.FAIL,
                           f"{entity.label()}: PCIe link at Gen{r.gen} x{r.width}, the GPU and slot support "
                           f"Gen{r.max_gen} x{r.max_width} (NVML); reseat or replace the riser or retimer",
                           Action.DRAIN, evidence))
    if r.replay > policy["replay_warn"]:
        out.append(Finding(CHECK_NAME, "pcie-replays", entity, Status.WARN,
                           f"{entity.label()}: {r.replay} PCIe replays since the driver loaded "
                           f"(> {policy['replay_warn']}): the link retransmits; watch for a downtrain or AER errors",
                           Action.MONITOR, evidence))
    return out


def decide_affinity(matrix: TopoMatrix, worst: str, entity_of: Callable[[int], Entity],
                    node_entity: Entity) -> list[Finding]:
    """A GPU whose nearest NIC is further than `worst` (PIX < PXB < PHB < NODE < SYS) misses its rail's
    GPUDirect RDMA path: beyond PXB NCCL turns GPUDirect RDMA off and stages network traffic through host memory
    (NVIDIA/nccl src/graph/paths.cc, ncclTopoCheckGdr)."""
    if not matrix.nics:
        return [Finding(CHECK_NAME, "pcie-affinity-unknown", node_entity, Status.UNKNOWN,
                        "nvidia-smi topo -m lists no NIC: the GPU<->NIC affinity cannot be judged")]
    out = []
    for gpu in matrix.gpus:
        entity = entity_of(int(gpu[3:]))
        nearest = matrix.nearest_nic(gpu)
        if nearest is None or PCIE_DISTANCE[nearest[1]] > PCIE_DISTANCE[worst]:
            nic, dist = nearest or ("-", "none")
            out.append(Finding(CHECK_NAME, "pcie-gpu-nic-affinity", entity, Status.FAIL,
                               f"{entity.label()}: nearest NIC {matrix.nic_device(nic)} is at {dist}, this SKU puts "
                               f"one at {worst} or closer: a NIC is missing or misplaced; GPUDirect RDMA for this "
                               "GPU crosses the host", Action.DRAIN,
                               {"nearest_nic": matrix.nic_device(nic), "distance": dist, "expected": worst}))
    return out


def _gpus(node: Any) -> list[Any] | None:
    """NVML's GPUs (lost ones named by the driver's view); None when NVML cannot be read at all."""
    try:
        return node.gpus()
    except SourceError:
        return None


def decide_missing(on_bus: Iterable[str], nvml_gpus: list[Any], node_entity: Entity,
                   driver_lists: Callable[[str], bool]) -> list[Finding]:
    """GPUs on the PCI bus that NVML does not count: gone from the driver (fallen off the bus and removed, or failed
    to initialise). Named by BDF; where NVML holds GPUs it cannot identify, only the count can be compared."""
    on_bus = sorted(set(on_bus))
    known = {g.pci for g in nvml_gpus if g.pci}
    unnamed = sum(1 for g in nvml_gpus if not g.pci)
    missing = [bdf for bdf in on_bus if bdf not in known]
    if len(missing) <= unnamed:
        return []  # each may be one of the GPUs NVML lists without an address
    if unnamed:
        return [Finding(CHECK_NAME, "gpu-missing-from-nvml", node_entity, Status.FAIL,
                        f"{len(on_bus)} GPUs on the PCI bus, NVML counts "
                        f"{len(nvml_gpus)}: {len(missing) - unnamed} of {', '.join(missing)} are gone from the driver; "
                        "reboot to recover them, and replace what stays missing", Action.REBOOT,
                        {"bdfs": missing, "nvml_gpus": len(nvml_gpus)})]
    out = []
    for bdf in missing:
        entity = Entity("gpu", bdf, pci=bdf)
        probed = driver_lists(bdf)
        out.append(Finding(CHECK_NAME, "gpu-missing-from-nvml", entity, Status.FAIL,
                           f"GPU {bdf} is on the PCI bus but NVML does not count it ("
                           + ("the NVIDIA driver probed it" if probed else "the NVIDIA driver does not list it")
                           + "): it is gone from the driver; reboot to recover it, replace it if it stays missing "
                           "(ignore_devices for a GPU passed through to a VM)", Action.REBOOT,
                           {"bdf": bdf, "driver_lists": probed, "nvml_gpus": len(nvml_gpus)}))
    return out


def _read_nvml(node: Any, gpu: Any) -> NvmlLink:
    link = node.nvml.pcie_link(gpu)
    try:
        idle: bool | None = bool(node.nvml.clocks_event_reasons(gpu) & NVML_GPU_IDLE)
    except NvmlError:
        idle = None
    return NvmlLink(link["gen"], link["max_gen"], link["width"], link["max_width"], link["replay"], idle)


def _affinity(node: Any, cfg: Mapping[str, Any], entity_of: Callable[[int], Entity], has_nic: bool) -> list[Finding]:
    sku = node.info.sku
    worst = cfg["gpu_nic_max_distance"]
    if not worst:
        level = sku_table(CHECK_NAME).get(sku, {}).get("gpu_nic_max_distance")  # 0 PIX .. 4 SYS
        worst = DISTANCE_NAMES[int(level)] if level is not None and 0 <= level < len(DISTANCE_NAMES) else ""
    here = Entity.node(node.hostname)
    if worst == "off":
        return []
    if not worst and sku_table(CHECK_NAME).get(sku, {}).get("gpus_on_c2c"):
        return [Finding(CHECK_NAME, "pcie-affinity-not-checked", here, Status.OK,
                        f"GPU<->NIC affinity not judged: on {sku} the GPUs attach to the Grace CPUs over NVLink-C2C, "
                        "each on a PCI domain of its own, so nvidia-smi topo -m reads SYS for every GPU-NIC pair: "
                        "there is no PCIe distance to judge (sources in checks/data/thresholds/pcie_link.toml)",
                        Action.NONE, {"sku": sku, "reason": "gpus-on-nvlink-c2c"})]
    if not worst:
        return [Finding(CHECK_NAME, "pcie-affinity-not-checked", here, Status.OK,
                        f"GPU<->NIC affinity not judged: no expectation for SKU {sku} (set gpu_nic_max_distance)")]
    if worst not in PCIE_DISTANCE:
        raise ConfigError(f"checks.{CHECK_NAME}.gpu_nic_max_distance: {worst!r} is not one of "
                          f"{', '.join(PCIE_DISTANCE)} or off")
    try:
        out = node.tools.run(TOPO_TOOL, list(TOPO_ARGV), cfg["topo_timeout_s"])
        if out.returncode != 0:
            last = next((ln.strip() for ln in reversed(out.output.splitlines()) if ln.strip()), "no output")
            raise ToolError(f"nvidia-smi topo -m exited {out.returncode}: {last}")
        matrix = parse_topo_matrix(out.output, "nvidia-smi topo -m")
    except ToolMissing as err:
        return [Finding(CHECK_NAME, "pcie-affinity-not-checked", here, Status.OK,
                        f"GPU<->NIC affinity not judged: {err}")]
    except (ToolError, ParseError) as err:
        return [Finding(CHECK_NAME, "pcie-affinity-unknown", here, Status.UNKNOWN,
                        f"GPU<->NIC affinity could not be read: {err}")]
    if not matrix.nics and not has_nic:
        # Nothing to place: without an RDMA NIC there is no GPUDirect RDMA path (a VM given a GPU and no HCA).
        return [Finding(CHECK_NAME, "pcie-affinity-not-checked", here, Status.OK,
                        "GPU<->NIC affinity not judged: this node has no RDMA NIC (none in nvidia-smi topo -m, none "
                        f"under {IB_CLASS}, no NVIDIA/Mellanox network function on the PCI bus)", Action.NONE,
                        {"sku": sku, "reason": "no-rdma-nic"})]
    return decide_affinity(matrix, worst, entity_of, here)


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    table = sku_table(CHECK_NAME).get(node.info.sku, {})
    # GPUs may drop their PCIe generation when idle (nvidia-smi: "may be reduced when the GPU is not in use"):
    # the generation of a GPU link is judged while the GPU is busy, or on SKUs seen to hold it at idle.
    stable_at_idle = bool(table.get("gen_stable_at_idle", False))
    ignore = set(cfg["ignore_devices"])
    readings: list[tuple[Any, NvmlLink]] = []
    problems: list[Finding] = []
    try:
        readings, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: _read_nvml(node, gpu))
    except NotApplicable:
        pass
    except SourceError as err:  # NVML itself unusable (no driver, no recorded nvml.json)
        problems = [Finding(CHECK_NAME, "pcie-nvml-unreadable", Entity.node(node.hostname), Status.UNKNOWN,
                            f"NVML could not be read ({err}): GPU link generation and replay counters not judged")]
    readings = [(g, r) for g, r in readings if g.pci not in ignore]
    here = Entity.node(node.hostname)
    if not node.sysfs.exists(PCI_DEVICES):  # no PCI tree at all: nothing was looked at, which is not "no device"
        yield from problems
        yield Finding(CHECK_NAME, "pcie-sysfs-missing", here, Status.UNKNOWN,
                      f"{node.sysfs.path(PCI_DEVICES)} is missing: the PCIe links of GPUs, NICs and switches are not "
                      "judged")
        return
    links, unreadable = read_links(node.sysfs, ignore)
    if problems and not any(lk.role == "gpu" for lk in links) and not readings:
        problems = [p for p in problems if p.code != "pcie-nvml-unreadable"]  # no GPU here to read
    nvml_gpus = _gpus(node)
    missing = [] if nvml_gpus is None else decide_missing(
        _gpus_on_bus(node.sysfs, ignore), nvml_gpus, here,
        lambda bdf: node.sysfs.exists(f"/proc/driver/nvidia/gpus/{bdf}"))
    if not links and not readings and not unreadable and not problems and not missing:
        raise NotApplicable(f"no NVIDIA or Mellanox PCIe device under {node.sysfs.path(PCI_DEVICES)}")
    by_pci = {g.pci: (g, r) for g, r in readings}
    gpu_at = {g.pci: g for g in nvml_gpus or () if g.pci}  # lost GPUs too: the driver's view names them
    yield from problems
    yield from missing
    yield from unreadable
    flagged: set[str] = set()
    for link in links:
        reading = by_pci.get(link.bdf, (None, None))[1]
        judge_speed = link.role != "gpu" or stable_at_idle or (reading is not None and reading.idle is False)
        gpu = gpu_at.get(link.bdf)
        entity = gpu.entity if gpu is not None else Entity("pcie", link.bdf, pci=link.bdf)
        found = decide_link(link, entity, judge_speed)
        if found and link.role == "gpu":
            flagged.add(link.bdf)  # NVML sees the same link: one finding per GPU
        yield from found
    for gpu, reading in readings:
        yield from decide_nvml(gpu.entity, reading, stable_at_idle or reading.idle is False, gpu.pci in flagged, cfg)
    by_index = {g.index: g.entity for g in gpu_at.values()}

    def entity_of(index: int) -> Entity:
        return by_index.get(index) or Entity("gpu", f"index-{index}", index)

    yield from _affinity(node, cfg, entity_of, bool(node.sysfs.listdir(IB_CLASS)) or _nic_on_bus(node.sysfs))


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="PCIe links of GPUs, NICs and switches at full speed and width; replays; GPU<->NIC affinity",
    run=run,
    defaults={
        # DCGM's PCIe diagnostic allows 80 replays per GPU over its stress run (nvvs/plugin_src/pcie/Pcie.cpp,
        # max_pcie_replays); here the count since the driver loaded, so a preflight after boot sees few.
        "replay_warn": 80,
        "ignore_devices": [],  # BDFs known to sit in a narrower slot by design
        "gpu_nic_max_distance": "",  # PIX | PXB | PHB | NODE | SYS | off; "" = the SKU table
        "topo_timeout_s": 20.0,
    },
    list_types={"ignore_devices": str},
    choices={"gpu_nic_max_distance": ("", *PCIE_DISTANCE, "off")},
    timeout_s=45,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="pcie_link", order=50, level="quick", look="CHECK",
)

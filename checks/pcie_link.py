"""PCIe links of GPUs, NICs and the switches above them: trained speed and width against what both ends support
(sysfs, and NVML for GPUs), the GPU's PCIe replay counter, and each GPU's distance to its nearest NIC against the
SKU's design (`nvidia-smi topo -m`). A downtrained link (x8 of x16, Gen4 of Gen5) is a finding naming the BDF."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec
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
from gpuwarden.agent.sources.pci import nvidia_pci_gpus
from gpuwarden.checks.parse_nvidia_smi_topo import DISTANCE_NAMES, PCIE_DISTANCE, TopoMatrix, parse_topo_matrix

CHECK_NAME = "pcie_link"
PCI_DEVICES = "/sys/bus/pci/devices"
VENDORS = {"0x10de": "NVIDIA", "0x15b3": "Mellanox"}
IB_CLASS = "/sys/class/infiniband"  # every RDMA device (InfiniBand or RoCE, any vendor)
TOPO_TOOL = "nvidia-smi-topo-m"  # the recorded tool's name (tools/nvidia-smi-topo-m.out)
TOPO_ARGV = ("nvidia-smi", "topo", "-m")
NVML_GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle
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

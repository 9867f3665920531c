"""Peer connectivity for every ordered GPU pair: NVML's P2P status (NVLink, read, write), a measured copy
bandwidth per pair (nvbandwidth, else torch copies), and the NVLink error counters' increase during the copies,
which names the link. A pair that falls back to PCIe on a SKU whose GPUs all share NVLink is a fault.

Findings about a pair are on the source GPU's entity (kind "gpu", so the node state and metrics key on GPUs as
everywhere else), with the peer in the evidence (peer_index, peer_uuid, peer_pci) and in the message; when one
GPU is in every failing pair the findings say so. Findings about a link are on Entity("nvlink", "<uuid>/link<n>").

On a recorded node nvml.json is one snapshot, so the counters "after" the copies come from tools/nvlink-after.json
({"<GPU index>": [{"link": n, "state": 1, "errors": {...}}, ...]}, the shape of nvml.json's "nvlinks"); without
that file the deltas are zero. A counter NVML does not offer on a link (NOT_SUPPORTED: absent from "errors", before
or after) is not judged there, and an OK note names those counters and links; one NVML failed to read ("unread") is
not judged either, and is UNKNOWN."""
from __future__ import annotations

import json
from dataclasses import replace
from itertools import permutations
from typing import Any, Iterable, Mapping

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
from gpuwarden.agent.core.per_gpu import device_error_finding, read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.thresholds import threshold
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.gemm import CopyMismatch, Gemm
from gpuwarden.checks.parse_nvbandwidth import parse_nvbandwidth

CHECK_NAME = "peer_p2p"
NVLINK_SKUS = ("H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX", "GB200-NVL72", "GB300-NVL72")  # every GPU on NVLink
COUNTERS = ("crc_flit", "crc_data", "replay", "recovery")
NVLINK_AFTER = "nvlink-after.json"


@dataclass(frozen=True)
class Bandwidth:
    method: str  # "nvbandwidth" | "torch"
    gbps: Mapping[tuple[int, int], float | None]  # (source, peer) NVML indices -> GB/s; None: could not copy
    mapping: str = "index"  # how tool device numbers became NVML indices: "pci" or "index"


def _pair(entities: Mapping[int, Entity], src: int, dst: int, code: str, status: Status, action: Action, msg: str,
          **evidence: Any) -> Finding:
    e, p = entities[src], entities[dst]
    return Finding(CHECK_NAME, code, e, status, f"{e.label()} -> GPU {dst} ({p.id}): {msg}", action,
                   {"peer_index": dst, "peer_uuid": p.id, "peer_pci": p.pci, **evidence})


def _common_endpoint(findings: list[Finding], n_gpus: int) -> list[Finding]:
    """Say so when one GPU is in every failing pair, or when every pair fails (the fabric, not one GPU)."""
    if len(findings) < 2:
        return findings
    pairs = {(f.entity.index, f.evidence["peer_index"]) for f in findings}
    if len(pairs) == n_gpus * (n_gpus - 1):
        hint = "every pair fails: suspect the NVLink fabric (NVSwitch, fabric manager), not one GPU"
        return [replace(f, message=f"{f.message} [{hint}]") for f in findings]
    common = set.intersection(*({a, b} for a, b in pairs))
    if len(common) == 1:
        (gpu,) = common
        return [replace(f, message=f"{f.message} [GPU {gpu} is in every failing pair]",
                        evidence={**f.evidence, "suspect_gpu": gpu}) for f in findings]
    return findings


def decide_p2p(matrices: Mapping[int, Mapping[str, Mapping[str, str]]], entities: Mapping[int, Entity],
               nvlink_expected: bool) -> list[Finding]:
    """NVML P2P status per ordered pair (matrices[src][str(peer)] = {"nvlink": "OK", "read": ..., ...})."""
    out = []
    for src, row in sorted(matrices.items()):
        for key, caps in sorted(row.items(), key=lambda kv: int(kv[0])):
            dst = int(key)
            if dst not in entities:
                continue  # a GPU NVML cannot read is already a finding of its own
            if nvlink_expected and caps.get("nvlink") != "OK":
                out.append(_pair(entities, src, dst, "p2p-no-nvlink", Status.FAIL, Action.DRAIN,
                                 f"no NVLink peer path (NVML: {caps.get('nvlink')}): traffic falls back to PCIe",
                                 **caps))
            bad = {cap: caps.get(cap) for cap in ("read", "write") if caps.get(cap) != "OK"}
            if bad:
                status, action = (Status.FAIL, Action.DRAIN) if nvlink_expected else (Status.WARN, Action.MONITOR)
                out.append(_pair(entities, src, dst, "p2p-disabled", status, action,
                                 "peer-to-peer " + ", ".join(f"{k} {v}" for k, v in bad.items()), **caps))
    return _common_endpoint(out, len(entities))


def decide_bandwidth(bw: Bandwidth, entities: Mapping[int, Entity], floor: float | None) -> list[Finding]:
    out, ev = [], {"method": bw.method, "mapping": bw.mapping}
    for src, dst in permutations(sorted(entities), 2):
        if (src, dst) not in bw.gbps:
            continue  # a GPU missing from the measurement is reported once, below
        value = bw.gbps[(src, dst)]
        if value is None:
            out.append(_pair(entities, src, dst, "p2p-bandwidth-missing", Status.FAIL, Action.DRAIN,
                             f"{bw.method} could not copy between the pair (no peer access)", **ev))
        elif floor is not None and value < floor:
            out.append(_pair(entities, src, dst, "p2p-bandwidth-low", Status.FAIL, Action.DRAIN,
                             f"copies at {value:.1f} GB/s, below the floor of {floor:g} GB/s", gbps=value,
                             floor_gbps=floor, **ev))
    out = _common_endpoint(out, len(entities))
    measured = {i for pair in bw.gbps for i in pair}
    for idx in sorted(set(entities) - measured):
        out.append(Finding(CHECK_NAME, "p2p-bandwidth-unmeasured", entities[idx], Status.UNKNOWN,
                           f"{entities[idx].label()}: not in the {bw.method} measurement (not visible to CUDA?)",
                           Action.NONE, ev))
    return out


def decide_nvlink(before: Mapping[int, list[dict[str, Any]]], after: Mapping[int, list[dict[str, Any]]],
                  entities: Mapping[int, Entity], policy: Mapping[str, Any], hostname: str = "") -> list[Finding]:
    """NVLink counter increases over the test, per link, against nvlink_<counter>_max; an active link that
    went down during the test. Only counters read both before and after are compared; the others are named, on the
    node (`hostname`): not offered (NOT_SUPPORTED) in an OK note, failed to read ("unread") as UNKNOWN."""
    out = []
    # GPU index -> counter -> the links where it was not compared
    unsupported: dict[int, dict[str, list[int]]] = {}
    unread: dict[int, dict[str, list[int]]] = {}
    for idx, links in sorted(after.items()):
        if idx not in entities:
            continue
        gpu, prior = entities[idx], {int(link["link"]): link for link in before.get(idx, [])}
        for link in links:
            n = int(link["link"])
            if n not in prior:
                continue
            entity = Entity("nvlink", f"{gpu.id}/link{n}", idx, gpu.pci, link=n)
            now, then = link.get("errors", {}), prior[n].get("errors", {})
            deltas = {c: max(0, int(now[c]) - int(then[c])) for c in COUNTERS if c in now and c in then}
            failed = {**(prior[n].get("unread") or {}), **(link.get("unread") or {})}
            for c in COUNTERS:
                if c not in deltas:
                    (unread if c in failed else unsupported).setdefault(idx, {}).setdefault(c, []).append(n)
            if int(prior[n]["state"]) == 1 and int(link["state"]) != 1:
                out.append(Finding(CHECK_NAME, "nvlink-down-during-test", entity, Status.FAIL,
                                   f"{entity.label()} ({gpu.id}): went down during the peer copies", Action.DRAIN,
                                   {"state_before": prior[n]["state"], "state_after": link["state"], **deltas}))
            over = {c: d for c, d in deltas.items() if d > policy[f"nvlink_{c}_max"]}
            if over:
                out.append(Finding(CHECK_NAME, "nvlink-errors-during-test", entity, Status.FAIL,
                                   f"{entity.label()} ({gpu.id}): error counters rose during the peer copies: "
                                   + ", ".join(f"{c} +{d}" for c, d in over.items()), Action.DRAIN, deltas))
    node = Entity.node(hostname)
    if unread:
        out.append(Finding(CHECK_NAME, "nvlink-counters-unread", node, Status.UNKNOWN,
                           f"NVLink counters NVML failed to read, not judged: {_where(unread)}", Action.NONE,
                           {"unread": {str(i): by for i, by in sorted(unread.items())}}))
    if unsupported:
        out.append(Finding(CHECK_NAME, "nvlink-counters-not-supported", node, Status.OK,
                           f"NVLink counters NVML does not offer (NOT_SUPPORTED), not judged: {_where(unsupported)}",
                           Action.NONE, {"not_supported": {str(i): by for i, by in sorted(unsupported.items())}}))
    return out


def _where(by_gpu: Mapping[int, Mapping[str, list[int]]]) -> str:
    """As 'GPU 0: crc_data on links 6-11; GPU 1: ...', the links as ranges."""
    def ranges(links: list[int]) -> str:
        runs: list[list[int]] = []
        for n in sorted(links):
            if runs and n == runs[-1][-1] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)

    return "; ".join(f"GPU {i}: " + ", ".join(f"{c} on link{'s' if len(ns) > 1 else ''} {ranges(ns)}"
                                              for c, ns in by.items()) for i, by in sorted(by_gpu.items()))


def _nvbandwidth(node: Any, cfg: Mapping[str, Any]) -> Bandwidth:
    testcase = cfg["nvbandwidth_testcase"]
    out = node.tools.run("nvbandwidth", ["nvbandwidth", "-t", testcase], cfg["nvbandwidth_timeout_s"])
    run = parse_nvbandwidth(out.output, "nvbandwidth")
    matrix = run.matrices.get(testcase)
    if matrix is None:
        why = run.errors.get(testcase) or ("waived" if testcase in run.waived else None)
        if why or out.returncode != 0:
            raise ToolError(f"nvbandwidth {testcase} failed (exit {out.returncode}): {why or out.output[-200:]}")
        raise ParseError(f"no {testcase} matrix in the output", "nvbandwidth")
    # nvbandwidth prints "Device 0: NAME (00000000:19:00)"; NVML's "0000:19:00.0" (lost GPUs included: their
    # address comes from sysfs, and leaving them out would break the match for the others).
    by_pci = {gpu.pci[:-2]: gpu.index for gpu in node.gpus() if gpu.pci}
    buses = {o: bus for o, (_, bus) in run.devices.items()}
    if buses and all(bus in by_pci for bus in buses.values()):
        index, mapping = {str(o): by_pci[bus] for o, bus in buses.items() if bus}, "pci"
    else:  # no PCI ids printed: CUDA ordinals, PCI-ordered like NVML's under CUDA_DEVICE_ORDER=PCI_BUS_ID
        index, mapping = {label: int(label) for label in matrix.columns}, "index"
    gbps = {(index[r], index[c]): v for (r, c), v in matrix.values.items()
            if r != c and r in index and c in index}
    return Bandwidth("nvbandwidth", gbps, mapping)


def _torch_copies(gemm: Gemm, cfg: Mapping[str, Any], gpus: list[Any]) -> tuple[Bandwidth, list[Finding]]:
    devices = {gpu.index: "cpu" if cfg["device"] == "cpu" else gemm.cuda_device(gpu) for gpu in gpus}
    entities = {gpu.index: gpu.entity for gpu in gpus}
    gbps: dict[tuple[int, int], float | None] = {}
    problems = []
    for src, dst in permutations(sorted(devices), 2):
        try:
            gbps[(src, dst)] = gemm.copy_bandwidth(devices[src], devices[dst], cfg["copy_bytes"], cfg["copy_seconds"])
        except CopyMismatch as err:
            problems.append(_pair(entities, src, dst, "p2p-copy-corrupt", Status.FAIL, Action.SERVICE, str(err)))
        except SourceError as err:
            problems.append(_pair(entities, src, dst, "p2p-copy-error", Status.UNKNOWN, Action.NONE, str(err)))
    return Bandwidth("torch", gbps, "torch device by PCI address"), problems


def _after(node: Any, gpus: list[Any]) -> tuple[dict[int, list[dict[str, Any]]], list[Finding]]:
    if not node.recorded:
        after, problems = {}, []
        for gpu in gpus:
            try:
                after[gpu.index] = node.nvml.nvlinks(gpu)
            except NvmlError as err:
                problems.append(device_error_finding(CHECK_NAME, gpu.entity, err))
        return after, problems
    path = node.root / "tools" / NVLINK_AFTER
    if not path.exists():
        return {}, []
    try:
        data = json.loads(confine.read_text(path, confine.scenario_prefix(node.root)))
        # A counter absent from "errors" is one NVML did not offer, as in nvml.json: left out, not malformed.
        after = {int(k): [{"link": int(link["link"]), "state": int(link["state"]),
                           "errors": {c: int(link["errors"][c]) for c in COUNTERS if c in link["errors"]},
                           "unread": {c: str(e) for c, e in (link.get("unread") or {}).items()}}
                          for link in v]
                 for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise SourceError(f"{path}: not NVLink counters by GPU index: {type(exc).__name__}: {exc}") from None
    return after, []


def expect_nvlink(setting: str, sku: str) -> bool:
    if setting not in ("auto", "yes", "no"):
        raise ConfigError(f"checks.peer_p2p.expect_nvlink must be auto, yes or no, got {setting!r}")
    return sku in NVLINK_SKUS if setting == "auto" else setting == "yes"


def run(node: Any, cfg: Mapping[str, Any], gemm: Gemm | None = None) -> Iterable[Finding]:
    readable, problems = read_each_gpu(node, CHECK_NAME,
                                       lambda gpu: (node.nvml.p2p_matrix(gpu), node.nvml.nvlinks(gpu)))
    yield from problems
    if len(readable) + len(problems) < 2:
        raise NotApplicable("fewer than two GPUs: no peer pairs")
    gpus = [gpu for gpu, _ in readable]
    entities = {gpu.index: gpu.entity for gpu in gpus}
    sku = node.info.sku
    yield from decide_p2p({g.index: m for g, (m, _) in readable}, entities, expect_nvlink(cfg["expect_nvlink"], sku))
    before = {g.index: links for g, (_, links) in readable}
    method, gemm = cfg["bandwidth_method"], gemm or Gemm.for_node(node)
    if method not in ("auto", "nvbandwidth", "torch", "none"):
        raise ConfigError(f"checks.peer_p2p.bandwidth_method must be auto, nvbandwidth, torch or none, got {method!r}")
    bw, why = None, ""
    try:
        if method in ("auto", "nvbandwidth"):
            try:
                bw = _nvbandwidth(node, cfg)
            except ToolMissing as exc:
                why = str(exc)
        if bw is None and method in ("auto", "torch"):
            reason = "not replayed on a recorded node" if gemm.recorded else gemm.why_unavailable(cfg["device"])
            if not reason:
                bw, copy_problems = _torch_copies(gemm, cfg, gpus)
                yield from copy_problems
            else:
                why = "; ".join(x for x in (why, f"torch copies: {reason}") if x)
    except (ToolError, ParseError, SourceError) as exc:
        yield Finding(CHECK_NAME, "p2p-bandwidth-error", Entity.node(node.hostname), Status.UNKNOWN,
                      f"peer bandwidth could not be measured: {exc}", Action.NONE, {"method": method})
        why = None  # said already
    if bw is not None:
        cpu = bw.method == "torch" and cfg["device"] == "cpu"
        floor = threshold(CHECK_NAME, "bandwidth_floor_gbps", "unknown" if cpu else sku, cfg)
        if floor is None:
            yield Finding(CHECK_NAME, "p2p-bandwidth-floor-unknown", Entity.node(node.hostname), Status.WARN,
                          f"no bandwidth floor for SKU {sku}: only pairs that could not copy were judged; set "
                          "checks.peer_p2p.bandwidth_floor_gbps", Action.NONE, {"sku": sku})
        yield from decide_bandwidth(bw, entities, floor)
    elif why is not None:
        yield Finding(CHECK_NAME, "p2p-bandwidth-not-measured", Entity.node(node.hostname), Status.WARN,
                      f"peer bandwidth was not measured ({why or 'bandwidth_method = none'}); only NVML's P2P "
                      "status was judged", Action.NONE, {"method": method})
    try:
        after, after_problems = _after(node, gpus)
    except SourceError as exc:  # a finding, not an exception: the findings above must not be lost with it
        yield Finding(CHECK_NAME, "nvlink-counters-unreadable", Entity.node(node.hostname), Status.UNKNOWN,
                      f"NVLink error counters after the test could not be read: {exc}")
        return
    yield from after_problems
    yield from decide_nvlink(before, after, entities, cfg, node.hostname)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="P2P status, copy bandwidth and NVLink errors for every ordered GPU pair",
    run=run,
    defaults={
        "expect_nvlink": "auto",  # auto: by SKU (every known SKU is all-NVLink) | yes | no
        "bandwidth_method": "auto",  # auto: nvbandwidth, else torch copies | nvbandwidth | torch | none
        "bandwidth_floor_gbps": 0.0,  # 0 = the SKU table (checks/data/thresholds/peer_p2p.toml)
        "nvbandwidth_testcase": "device_to_device_memcpy_read_ce",
        "nvbandwidth_timeout_s": 120.0,
        "device": "cuda",  # torch copies: cuda | cpu (CI)
        "copy_bytes": 256 * 2**20,  # torch copies: buffer per pair
        "copy_seconds": 0.5,  # torch copies: time per ordered pair
        # Allowed increase of each NVLink counter per link during the test. 0 as in Meta's GCM nvlink health
        # check defaults (--data/flit/recovery/replay_error_threshold 0).
        "nvlink_crc_flit_max": 0,
        "nvlink_crc_data_max": 0,
        "nvlink_replay_max": 0,
        "nvlink_recovery_max": 0,
    },
    choices={"expect_nvlink": ("auto", "yes", "no"), "bandwidth_method": ("auto", "nvbandwidth", "torch", "none"),
             "device": ("cuda", "cpu")},
    timeout_s=180,
    level="full",
    resources=("gpu",),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="peer_p2p", order=110, level="full", look="CHECK",
)

"""NVLink domains: this node's (from config or NVML GPU fabric info), and the fleet's, as the scheduler knows them,
written out as Slurm topology (topology.conf for topology/block, topology.yaml for Slurm >= 25.05) and as the
Kubernetes labels an agent publishes.

Decides:
- **This node's domain.** `[topology] domain` when set; else every GPU's NVML fabric info: registration COMPLETED
  with status SUCCESS and a non-zero cluster UUID gives `<clusterUuid>.<cliqueId>`, and every GPU must give the
  same one. A GPU still registering, failed, unreadable or in another domain means no domain (None, with the
  reason logged): a node is never put in a rack it may not belong to. A zero cluster UUID (HGX: NVLink stays
  inside the node) or fabric info NOT_SUPPORTED means the node is in no multi-node domain.
- **Blocks.** One Slurm block per domain, with every node that published it; nodes with no (or no valid) domain
  are listed in a comment and left out. Block names: the domain itself when it is a short name (a letter, then
  letters, digits, `-`, `_`; at most 32), else `nvl` + the first 12 hex digits of the domain's SHA-256 (an NVML
  domain is 47 characters). Each block's comment line names its domain. Blocks are written in the order of their
  first node (natural sort), since Slurm pairs neighbouring blocks into its higher-level blocks.
- **BlockSizes.** Slurm stops (fatal) on a block with fewer nodes than the base size, or on sizes that are not the
  base times a power of two (at most 2**15); given sizes are checked against those rules, and a block smaller than
  the base is left out with a comment. Without given sizes: the smallest block's size (so no block is refused),
  doubled until one size spans every block, as slurmctld does when BlockSizes is not set.
- Every input is hostile: a domain is at most 63 characters of letters, digits, `.`, `-`, `_`, starting and
  ending with a letter or digit (so it is also a valid Kubernetes label value); a node name at most 64 of
  letters, digits, `.`, `-`, `_`. Anything else never reaches a file: it is left out and counted.

Sources (facts, compared with in tests/test_topology.py):
- Slurm topology.conf(5), topology/block section, and src/plugins/topology/block/block_record.c (SchedMD/slurm):
  `BlockName=<name> Nodes=<hostlist>` lines and one `BlockSizes=<base>,<base*2^k>...`; the checks slurmctld makes
  (base size, power-of-two multiples up to level 15, every block at least the base size, unique names, aggregated
  block names parsed as a hostlist). The block plugin exists from Slurm 23.11.
- Slurm topology.yaml(5) (Slurm >= 25.05): a list of topologies, `topology` first, `cluster_default`, and
  `block: {block_sizes: [...], blocks: [{block, nodes}]}`; topology.conf is ignored when topology.yaml exists.
- Real block files: the topology/block example of topology.conf(5), and NVIDIA topograph's generated
  tests/ci/expected.slinky-dra-block.conf (12 NVLink domains, a `# name=domain` comment above each block);
  copies under fixtures/slurm/ with their source lines.
- `nvidia.com/gpu.clique` = `<clusterUUID>.<cliqueID>` (NVIDIA/k8s-device-plugin internal/lm/fabric.go), set only
  when every fabric-attached GPU agrees; a GPU is attached when its state is COMPLETED, its status SUCCESS and its
  cluster UUID not zero (NVIDIA/go-nvlib pkg/nvlib/device/device.go, IsFabricAttached).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, NvmlError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import AdapterError, NodeView

log = logs.get_logger("gpuwarden.topology")

MAX_DOMAIN = 63  # a Kubernetes label value's limit; an NVML domain is 36 + 1 + at most 10 characters
MAX_NODE_NAME = 64  # HOST_NAME_MAX
MAX_BLOCK_NAME = 32
MAX_FLEET = 65536  # nodes in one scheduler view
MAX_LEVEL = 15  # slurmctld: a higher-level block holds at most 2**15 base blocks
MAX_RANGE = 16384  # nodes in one hostlist range (Slurm's hostlist refuses a range of more than 65536)
MAX_BLOCK_SIZES = MAX_LEVEL + 1
MAX_BASE = 65535  # slurmctld keeps the base block size in 16 bits
COMPLETED = 3
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
ZERO_UUID = "00000000-0000-0000-0000-000000000000"

TOPOLOGY_NAME = "nvlink"  # the topology's name in topology.yaml (partitions may name it: Topology=nvlink)
CLIQUE_LABEL = "nvidia.com/gpu.clique"  # the GPU operator's label (GPU feature discovery)
DOMAIN_LABEL = "gpuwarden.io/nvlink-domain"
BLOCK_LABEL = "gpuwarden.io/nvlink-block"

EXIT_OK, EXIT_NO_DOMAIN, EXIT_ERROR = 0, 1, 2

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_NAME_CHARS = _ALNUM | frozenset("._-")
_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")


# -- names -------------------------------------------------------------------------------------------------------
def valid_domain(domain: Any) -> bool:
    """A domain that may reach a file Slurm parses and a Kubernetes label value."""
    return (isinstance(domain, str) and 0 < len(domain) <= MAX_DOMAIN and domain[0] in _ALNUM
            and domain[-1] in _ALNUM and all(c in _NAME_CHARS for c in domain))


def valid_node_name(name: Any) -> bool:
    """A node name Slurm's hostlist parser takes as one host (no brackets, commas, spaces, '#' or '=')."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NODE_NAME and name[0] in _ALNUM
            and all(c in _NAME_CHARS for c in name))


def is_nvml_domain(domain: str) -> bool:
    """`<clusterUuid>.<cliqueId>` as NVML fabric info gives it (lowercase UUID, decimal 32-bit clique)."""
    uuid, dot, clique = domain.rpartition(".")
    if not dot or len(uuid) != 36 or not clique or len(clique) > 10 or any(c not in _DIGITS for c in clique):
        return False
    if int(clique) > 0xFFFFFFFF:
        return False
    return all((c == "-") if i in (8, 13, 18, 23) else (c in _HEX) for i, c in enumerate(uuid))


def block_name(domain: str) -> str:
    """The Slurm block name of a domain: the domain itself when it is a short name, else `nvl` + 12 hex digits of
    its SHA-256 (48 bits: a clash is checked for, and refused, when a file is written)."""
    if not valid_domain(domain):
        raise ValueError(f"not a valid NVLink domain: {_shown(domain)}")
    if len(domain) <= MAX_BLOCK_NAME and domain[0].isalpha() and "." not in domain:
        return domain
    import hashlib  # here: OpenSSL's libcrypto is megabytes of the daemon's memory, for a name it may never need

    return "nvl" + hashlib.sha256(domain.encode()).hexdigest()[:12]


def kubernetes_labels(domain: str) -> dict[str, str]:
    """The node labels that publish `domain`: gpuwarden's own (the domain and its block name), and the GPU
    operator's `nvidia.com/gpu.clique` only for a domain read from NVML, whose value is then exactly what GPU
    feature discovery writes; a domain from config would fight GFD over that label, so it gets only ours."""
    if not valid_domain(domain):
        raise ValueError(f"not a valid NVLink domain: {_shown(domain)}")
    labels = {DOMAIN_LABEL: domain, BLOCK_LABEL: block_name(domain)}
    if is_nvml_domain(domain):
        labels[CLIQUE_LABEL] = domain
    return labels


def _shown(value: Any, limit: int = 80) -> str:
    """A hostile value, safe for a log line or an error message."""
    text = repr(value) if not isinstance(value, str) else ascii(value)
    return text if len(text) <= limit else text[:limit] + "..."


# -- this node ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DomainReading:
    domain: str | None
    source: str | None  # "config" | "nvml" | None
    reason: str  # where the domain came from, or why there is none
    fault: bool = False  # no domain although the node's GPUs say there should be one (disagree, unreadable, pending)


def _table(config: Any, name: str) -> Mapping[str, Any]:
    """The `[name]` table of a loaded Config (an attribute) or of a plain mapping; empty when absent."""
    table = getattr(config, name, None)
    if table is None and isinstance(config, Mapping):
        table = config.get(name)
    return table if isinstance(table, Mapping) else {}


def read_domain(node: Any, config: Any) -> DomainReading:
    """This node's NVLink domain and where it came from (see the module docstring). Raises ConfigError for a
    configured domain that is not valid."""
    configured = _table(config, "topology").get("domain", "")
    if configured:
        if not valid_domain(configured):
            raise ConfigError(f"[topology] domain {_shown(configured)}: must be 1 to {MAX_DOMAIN} letters, digits, "
                              "'.', '-' or '_', starting and ending with a letter or digit")
        return DomainReading(configured, "config", "set in [topology] domain")
    try:
        gpus = node.gpus()
    except NvmlError as exc:
        return DomainReading(None, None, f"could not read NVML: {exc}", fault=True)
    if not gpus:
        return DomainReading(None, None, "NVML reports no GPU")
    domains: dict[str, list[int]] = {}
    zero: list[int] = []
    unsupported: list[int] = []
    problems: list[str] = []
    for gpu in gpus:
        try:
            if gpu.error is not None:
                raise gpu.error
            info = node.nvml.fabric_info(gpu)
        except NvmlError as exc:
            if exc.not_supported:
                unsupported.append(gpu.index)
            else:
                problems.append(f"GPU {gpu.index}: could not read fabric info ({exc})")
            continue
        state, status = int(info.get("state", 0)), int(info.get("status", 0))
        if state == 0:
            unsupported.append(gpu.index)
        elif state != COMPLETED:
            problems.append(f"GPU {gpu.index}: fabric registration {FABRIC_STATES.get(state, f'state {state}')}")
        elif status != 0:
            problems.append(f"GPU {gpu.index}: fabric registration completed with NVML error {status}")
        elif str(info.get("cluster_uuid", "")).lower() == ZERO_UUID:
            zero.append(gpu.index)
        else:
            domain = f"{str(info.get('cluster_uuid', '')).lower()}.{int(info.get('clique_id', 0))}"
            if is_nvml_domain(domain):
                domains.setdefault(domain, []).append(gpu.index)
            else:
                problems.append(f"GPU {gpu.index}: fabric info is not a cluster UUID and clique: {_shown(domain)}")
    if problems:
        return DomainReading(None, None, "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else ""), fault=True)
    if len(domains) > 1 or (domains and (zero or unsupported)):
        parts = [f"{d} (GPU {_indices(i)})" for d, i in sorted(domains.items())]
        if zero:
            parts.append(f"zero cluster UUID (GPU {_indices(zero)})")
        if unsupported:
            parts.append(f"no fabric (GPU {_indices(unsupported)})")
        return DomainReading(None, None, "the GPUs disagree on the NVLink domain: " + ", ".join(parts), fault=True)
    if domains:
        (domain, indices), = domains.items()
        return DomainReading(domain, "nvml", f"NVML fabric info of GPU {_indices(indices)}")
    if zero:
        return DomainReading(None, None, "zero cluster UUID: NVLink stays inside this node (no multi-node domain)")
    return DomainReading(None, None, "no GPU takes part in an NVLink fabric (fabric info not supported)")


def _indices(indices: Sequence[int]) -> str:
    return ",".join(str(i) for i in indices)


def node_domain(node: Any, config: Any) -> str | None:
    """This node's NVLink domain, None when it has none or it cannot be told (the reason is logged)."""
    reading = read_domain(node, config)
    if reading.domain is None:
        (log.warning if reading.fault else log.info)("no NVLink domain", node=node.hostname, reason=reading.reason)
    return reading.domain


# -- hostlists ---------------------------------------------------------------------------------------------------
def _split(name: str) -> tuple[str, str | None]:
    """A name's prefix and trailing digits (None: no number to range over)."""
    i = len(name)
    while i > 0 and name[i - 1] in _DIGITS:
        i -= 1
    digits = name[i:]
    if not digits or i == 0 or len(digits) > 18:  # Slurm reads the number as an unsigned long
        return name, None
    return name[:i], digits


def _sort_key(name: str) -> tuple[str, int, int, int]:
    prefix, digits = _split(name)
    return (name, 0, 0, 0) if digits is None else (prefix, 1, len(digits), int(digits))


def natural_sorted(names: Iterable[str]) -> list[str]:
    return sorted(set(names), key=_sort_key)


def hostlist(names: Iterable[str]) -> str:
    """Slurm hostlist expression of `names` (valid node names): `node[01-18,20],gpu7`. After one sort, a single
    pass: a range takes consecutive numbers of one prefix and one digit count (so zero padding is kept exactly)."""
    out: list[str] = []
    prefix: str | None = None
    ranges: list[list[int]] = []  # [width, lo, hi]

    def flush() -> None:
        if prefix is None:
            return
        if len(ranges) == 1 and ranges[0][1] == ranges[0][2]:
            out.append(f"{prefix}{ranges[0][1]:0{ranges[0][0]}d}")
        else:
            out.append(prefix + "[" + ",".join(f"{lo:0{w}d}" if lo == hi else f"{lo:0{w}d}-{hi:0{w}d}"
                                               for w, lo, hi in ranges) + "]")

    for name in natural_sorted(names):
        pre, digits = _split(name)
        if digits is None:
            flush()
            prefix, ranges = None, []
            out.append(name)
            continue
        number, width = int(digits), len(digits)
        if pre != prefix:
            flush()
            prefix, ranges = pre, []
        last = ranges[-1] if ranges else None
        if last and last[0] == width and last[2] + 1 == number and number - last[1] < MAX_RANGE:
            last[2] = number
        else:
            ranges.append([width, number, number])
    flush()
    return ",".join(out)


# -- the fleet ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    name: str
    domain: str
    nodes: tuple[str, ...]  # natural order


@dataclass(frozen=True)
class FleetTopology:
    blocks: tuple[Block, ...]  # in file order
    block_sizes: tuple[int, ...]
    left_out: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (why, nodes), for the comments
    unnamed: int = 0  # nodes whose names no Slurm file may carry (only counted)


def check_block_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Block sizes as slurmctld accepts them: a base, then larger sizes that are the base times a power of two
    (at most 2**15), increasing. Raises ValueError naming what is wrong."""
    sizes = tuple(sizes)
    if not sizes or len(sizes) > MAX_BLOCK_SIZES:
        raise ValueError(f"block sizes: give 1 to {MAX_BLOCK_SIZES} sizes")
    if any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
        raise ValueError("block sizes must be integers")
    base = sizes[0]
    if not 0 < base <= MAX_BASE:
        raise ValueError(f"block sizes: the base size {base} must be from 1 to {MAX_BASE}")
    for prior, size in zip(sizes, sizes[1:], strict=False):
        if size <= prior:
            raise ValueError(f"block sizes: {size} after {prior}: each size must be larger than the one before")
        ratio, rest = divmod(size, base)
        if rest or ratio & (ratio - 1) or ratio > 1 << MAX_LEVEL:
            raise ValueError(f"block sizes: {size} is not the base {base} times a power of two up to 2^{MAX_LEVEL}")
    return sizes


def parse_block_sizes(text: str) -> tuple[int, ...]:
    """`--block-sizes 18,36,72`."""
    if len(text) > 256:
        raise ValueError("block sizes: too long")
    parts = [p.strip() for p in text.split(",")]
    if any(not p or len(p) > 6 or any(c not in _DIGITS for c in p) for p in parts):
        raise ValueError(f"block sizes {_shown(text)}: expected integers separated by commas, e.g. 18,36")
    return check_block_sizes([int(p) for p in parts])


def group_fleet(fleet: Sequence[NodeView], block_sizes: Sequence[int] | None) -> FleetTopology:
    """The fleet's blocks (see the module docstring). Raises ValueError when the fleet is too large, two domains
    get the same block name, the block sizes are not valid, or no block is left."""
    if len(fleet) > MAX_FLEET:
        raise ValueError(f"the scheduler lists {len(fleet)} nodes; at most {MAX_FLEET} are handled")
    sizes = check_block_sizes(block_sizes) if block_sizes is not None else None
    domain_of: dict[str, str | None] = {}
    invalid: set[str] = set()
    clashing: set[str] = set()
    unnamed = 0
    for view in fleet:
        name = getattr(view, "name", None)
        if not valid_node_name(name):
            unnamed += 1
            continue
        domain = getattr(view, "domain", None)
        if domain is not None and not valid_domain(domain):
            invalid.add(name)  # never in a block, whatever another entry of the same name says
        elif name in domain_of and domain_of[name] != domain:
            clashing.add(name)
        else:
            domain_of.setdefault(name, domain)
    clashing -= invalid
    groups: dict[str, list[str]] = {}
    no_domain: list[str] = []
    for name, domain in domain_of.items():
        if name in invalid or name in clashing:
            continue
        if domain is None:
            no_domain.append(name)
        else:
            groups.setdefault(domain, []).append(name)
    names: dict[str, str] = {}
    for domain in groups:
        bname = block_name(domain)
        if bname in names:
            raise ValueError(f"NVLink domains {names[bname]} and {domain} both map to block name {bname}: set a "
                             "distinct [topology] domain on one of them")
        names[bname] = domain
    blocks = sorted((Block(block_name(d), d, tuple(natural_sorted(n))) for d, n in groups.items()),
                    key=lambda b: _sort_key(b.nodes[0]))
    left_out: list[tuple[str, tuple[str, ...]]] = []
    if no_domain:
        left_out.append(("no NVLink domain published", tuple(natural_sorted(no_domain))))
    if invalid:
        left_out.append(("the published NVLink domain is not valid", tuple(natural_sorted(invalid))))
    if clashing:
        left_out.append(("listed twice with different NVLink domains", tuple(natural_sorted(clashing))))
    if sizes is not None:
        kept = []
        for b in blocks:
            if len(b.nodes) < sizes[0]:
                left_out.append((f"block {b.name} (NVLink domain {b.domain}): {len(b.nodes)} node(s), fewer than "
                                 f"the base block size {sizes[0]}", b.nodes))
            else:
                kept.append(b)
        blocks = kept
    if not blocks:
        raise ValueError("no NVLink domain has enough nodes for a block: nothing to write"
                         + (f" (base block size {sizes[0]})" if sizes else ""))
    if sizes is None:
        base = min(len(b.nodes) for b in blocks)
        levels = min((len(blocks) - 1).bit_length(), MAX_LEVEL)  # the top size covers every block
        sizes = tuple(base << k for k in range(levels + 1))
    return FleetTopology(tuple(blocks), sizes, tuple(left_out), unnamed)


def _comments(topo: FleetTopology) -> list[str]:
    lines = [f"left out, {why}: {hostlist(nodes)}" for why, nodes in topo.left_out]
    if topo.unnamed:
        lines.append(f"left out: {topo.unnamed} node(s) whose names a Slurm file cannot carry")
    return lines


_HEADER = ("One block per NVLink domain, from the domains the agents published to the scheduler; nodes",
           "without one are left out (listed below). Block name: the domain when it is a short name, else",
           "nvl + 12 hex digits of the domain's SHA-256. Written by `gpuwarden topology`.")


def topology_conf(fleet: Sequence[NodeView], block_sizes: Sequence[int] | None) -> str:
    """Slurm topology.conf for TopologyPlugin=topology/block (Slurm >= 23.11)."""
    return render_conf(group_fleet(fleet, block_sizes))


def topology_yaml(fleet: Sequence[NodeView], block_sizes: Sequence[int] | None) -> str:
    """Slurm topology.yaml (Slurm >= 25.05): one block topology, `nvlink`, the cluster's default."""
    return render_yaml(group_fleet(fleet, block_sizes))


def render_conf(topo: FleetTopology) -> str:
    lines = ["# Slurm topology.conf for TopologyPlugin=topology/block (Slurm >= 23.11).", *("# " + h for h in _HEADER)]
    for b in topo.blocks:
        lines.append(f"# {b.name}: NVLink domain {b.domain}, {len(b.nodes)} node(s)")
        lines.append(f"BlockName={b.name} Nodes={hostlist(b.nodes)}")
    lines += ["# " + c for c in _comments(topo)]
    lines.append("BlockSizes=" + ",".join(str(s) for s in topo.block_sizes))
    return "\n".join(lines) + "\n"


def render_yaml(topo: FleetTopology) -> str:
    doc = [{"topology": TOPOLOGY_NAME, "cluster_default": True,
            "block": {"block_sizes": list(topo.block_sizes),
                      "blocks": [{"block": b.name, "nodes": hostlist(b.nodes)} for b in topo.blocks]}}]
    lines = ["# Slurm topology.yaml (Slurm >= 25.05): topology.conf is ignored while this file exists.",
             *("# " + h for h in _HEADER),
             *(f"# {b.name}: NVLink domain {b.domain}, {len(b.nodes)} node(s)" for b in topo.blocks),
             *("# " + c for c in _comments(topo))]
    import yaml  # here: the one YAML this module writes; the daemon, which imports the module, never does

    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` so that a reader (slurmctld at reconfigure) sees the old file or the new one, never a
    part: a temporary file in the same folder, synced, then renamed over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the folder is synced
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


# -- the command -------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`gpuwarden topology` flags."""
    parser.add_argument("--root", type=Path, help="read a recorded node (scenario folder) instead of this machine")
    parser.add_argument("--config", type=Path, help="TOML config (default /etc/gpuwarden/gpuwarden.toml if present)")
    parser.add_argument("--node-name", help="this node's name at the scheduler (default: [remediation] node_name, "
                                            "else the hostname)")
    parser.add_argument("--publish", action="store_true",
                        help="publish this node's NVLink domain to the scheduler (Slurm node feature, k8s labels)")
    parser.add_argument("--slurm-conf", type=Path, metavar="PATH",
                        help="write Slurm topology.conf (topology/block) from the scheduler's view of the fleet")
    parser.add_argument("--slurm-yaml", type=Path, metavar="PATH",
                        help="write Slurm topology.yaml (Slurm >= 25.05) from the scheduler's view of the fleet")
    parser.add_argument("--block-sizes", metavar="N[,N…]",
                        help="Slurm BlockSizes: the base size, then the base times powers of two (e.g. 16,32); "
                             "default: the smallest block's size, doubled until one size spans every block")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace, config: Any, adapter: Any) -> int:
    """`gpuwarden topology`: 0 done; 1 this node has no known NVLink domain (nothing published); 2 a usage,
    config, scheduler or file error. Reads this node only when printing its domain or publishing it."""
    out: dict[str, Any] = {}
    code = EXIT_OK
    wants_files = bool(getattr(args, "slurm_conf", None) or getattr(args, "slurm_yaml", None))
    errors: list[str] = []
    try:
        sizes = parse_block_sizes(args.block_sizes) if getattr(args, "block_sizes", None) else None
        if (wants_files or args.publish) and adapter is None:
            raise ConfigError("no scheduler adapter: --publish, --slurm-conf and --slurm-yaml need one "
                              "([remediation] adapter)")
        if args.publish or not wants_files:
            code = _this_node(args, config, adapter, out)
        if wants_files:
            _write_files(args, adapter, sizes, out)
    except (ConfigError, ValueError, AdapterError, OSError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}" if isinstance(exc, AdapterError) else str(exc))
        code = EXIT_ERROR
    if errors:
        out["error"] = errors[0]
    _print(out, args.json)
    return code


def _this_node(args: argparse.Namespace, config: Any, adapter: Any, out: dict[str, Any]) -> int:
    from gpuwarden.agent.node.host import Node

    node = Node.recorded_at(args.root) if args.root is not None else Node.live()
    name = args.node_name or _table(config, "remediation").get("node_name") or node.hostname
    if not valid_node_name(name):
        raise ConfigError(f"node name {_shown(name)} is not a valid node name")
    reading = read_domain(node, config)
    out.update(node=name, domain=reading.domain, source=reading.source, reason=reading.reason)
    if reading.domain is None:
        (log.warning if reading.fault else log.info)("no NVLink domain", node=name, reason=reading.reason)
        return EXIT_NO_DOMAIN
    out.update(block=block_name(reading.domain), labels=kubernetes_labels(reading.domain))
    if args.publish:
        adapter.publish_domain(name, reading.domain)
        out["published"] = getattr(adapter, "name", "scheduler")
        log.info("published NVLink domain", node=name, domain=reading.domain, scheduler=out["published"])
    return EXIT_OK


def _write_files(args: argparse.Namespace, adapter: Any, sizes: tuple[int, ...] | None, out: dict[str, Any]) -> None:
    fleet = list(adapter.nodes())
    topo = group_fleet(fleet, sizes)  # every check before any file is touched
    texts = []
    if args.slurm_conf:
        texts.append((Path(args.slurm_conf), render_conf(topo)))
    if args.slurm_yaml:
        texts.append((Path(args.slurm_yaml), render_yaml(topo)))
    for path, text in texts:
        write_atomic(path, text)
    out["fleet"] = {"blocks": [{"block": b.name, "domain": b.domain, "nodes": hostlist(b.nodes), "count": len(b.nodes)}
                               for b in topo.blocks],
                    "block_sizes": list(topo.block_sizes),
                    "left_out": [{"why": why, "nodes": hostlist(nodes)} for why, nodes in topo.left_out]
                    + ([{"why": "names a Slurm file cannot carry", "count": topo.unnamed}] if topo.unnamed else []),
                    "wrote": [str(p) for p, _ in texts]}
    log.info("wrote Slurm topology", files=[str(p) for p, _ in texts], blocks=len(topo.blocks),
             block_sizes=list(topo.block_sizes))


def _print(out: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
        return
    lines = []
    if "node" in out:
        if out.get("domain"):
            lines.append(f"{out['node']}: NVLink domain {out['domain']} (from {out['source']}; Slurm block "
                         f"{out['block']})")
            if out.get("published"):
                lines.append(f"published to {out['published']}")
        else:
            lines.append(f"{out['node']}: no NVLink domain: {out['reason']}")
    fleet = out.get("fleet")
    if fleet:
        count = sum(b["count"] for b in fleet["blocks"])
        left = len(fleet["left_out"])
        for path in fleet["wrote"]:
            lines.append(f"wrote {path}: {len(fleet['blocks'])} block(s), {count} node(s), BlockSizes="
                         + ",".join(str(s) for s in fleet["block_sizes"])
                         + (f"; {left} group(s) of nodes left out (see the file's comments)" if left else ""))
    if out.get("error"):
        print(f"gpuwarden topology: error: {out['error']}", file=sys.stderr)
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")

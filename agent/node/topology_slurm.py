"""Slurm's block topology of the fleet's NVLink domains (agent/node/topology.py has the domains themselves): the
nodes grouped into one block per domain as the scheduler knows them, the BlockSizes checked as slurmctld checks them,
written as topology.conf (topology/block) or topology.yaml (Slurm >= 25.05), atomically. The rules and their
sources are agent/node/topology.py's docstring."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView
from gpuwarden.agent.node.topology import _DIGITS, _shown, block_name, valid_domain, valid_node_name

MAX_FLEET = 65536  # nodes in one scheduler view
MAX_LEVEL = 15  # slurmctld: a higher-level block holds at most 2**15 base blocks
MAX_RANGE = 16384  # nodes in one hostlist range (Slurm's hostlist refuses a range of more than 65536)
MAX_BLOCK_SIZES = MAX_LEVEL + 1
MAX_BASE = 65535  # slurmctld keeps the base block size in 16 bits
TOPOLOGY_NAME = "nvlink"  # the topology's name in topology.yaml (partitions may name it: Topology=nvlink)


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
    # at use: PyYAML is +120 ms (-X importtime) to `gpuwarden topology` runs that write no topology.yaml
    import yaml

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

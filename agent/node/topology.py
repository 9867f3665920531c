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

from typing import Any, Mapping, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, NvmlError
from gpuwarden.agent.core.records import dataclass

log = logs.get_logger("gpuwarden.topology")

MAX_DOMAIN = 63  # a Kubernetes label value's limit; an NVML domain is 36 + 1 + at most 10 characters
MAX_NODE_NAME = 64  # HOST_NAME_MAX
MAX_BLOCK_NAME = 32
COMPLETED = 3
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
ZERO_UUID = "00000000-0000-0000-0000-000000000000"

CLIQUE_LABEL = "nvidia.com/gpu.clique"  # the GPU operator's label (GPU feature discovery)
DOMAIN_LABEL = "gpuwarden.io/nvlink-domain"
BLOCK_LABEL = "gpuwarden.io/nvlink-block"


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
    # at use: OpenSSL's libcrypto is megabytes of the daemon's memory (and +6 ms to its start, -X importtime), for a
    # name it may never need
    import hashlib

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

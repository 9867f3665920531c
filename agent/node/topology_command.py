"""`gpuwarden topology`'s work (agent/cli/topology.py parses its flags): print this node's NVLink domain, publish
it to the scheduler, write Slurm's block topology of the fleet (agent/node/topology_slurm.py). Exit 0 done, 1 no
known domain, 2 a usage, config, scheduler or file error."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import AdapterError
from gpuwarden.agent.node.topology import (
    _shown,
    _table,
    block_name,
    kubernetes_labels,
    log,
    read_domain,
    valid_node_name,
)
from gpuwarden.agent.node.topology_slurm import (
    group_fleet,
    hostlist,
    parse_block_sizes,
    render_conf,
    render_yaml,
    write_atomic,
)

EXIT_OK, EXIT_NO_DOMAIN, EXIT_ERROR = 0, 1, 2


@dataclass(frozen=True)
class Options:
    """`gpuwarden topology`'s flags (agent/cli/topology.py parses them)."""

    root: Path | None = None
    node_name: str | None = None
    publish: bool = False
    slurm_conf: Path | None = None
    slurm_yaml: Path | None = None
    block_sizes: str | None = None
    json: bool = False


def run(args: Options, config: Any, adapter: Any) -> int:
    """`gpuwarden topology`: 0 done; 1 this node has no known NVLink domain (nothing published); 2 a usage,
    config, scheduler or file error. Reads this node only when printing its domain or publishing it."""
    out: dict[str, Any] = {}
    code = EXIT_OK
    wants_files = bool(args.slurm_conf or args.slurm_yaml)
    errors: list[str] = []
    try:
        sizes = parse_block_sizes(args.block_sizes) if args.block_sizes else None
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


def _this_node(args: Options, config: Any, adapter: Any, out: dict[str, Any]) -> int:
    # at use: the node and its sources (NVML, the kernel log) are +500 ms (-X importtime) to the runs that only
    # write Slurm's files from the scheduler's view
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


def _write_files(args: Options, adapter: Any, sizes: tuple[int, ...] | None, out: dict[str, Any]) -> None:
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

"""The defrag advisor, `gpuwarden plan defrag`: which preemptible jobs to move so that one rack (NVLink domain) has S
healthy free nodes for a pending slice, from Slurm's view (`squeue --json`, `sinfo --json`, `scontrol show partition`)
or from files of the same. Least disruptive: the fewest jobs moved, then the least work lost (node-hours: elapsed
time x nodes of each moved job), ties by rack name. It only advises: it never cancels or requeues anything.

Which jobs may be moved: running (or suspended) batch jobs of a preemptible partition (--preemptible-partitions, or by
default those whose PreemptMode requeues or cancels) or QOS (--preemptible-qos); never an interactive job (salloc,
srun: no batch script) nor one of an --interactive-partitions partition, nor a job of any other partition.

Exit codes: 0 a plan; 1 no rack can be freed without touching work that may not be moved (why, per rack); 2 bad
input or flags, or Slurm could not be asked."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from gpuwarden.agent.act.adapters.slurm import SlurmAdapter
from gpuwarden.agent.act.adapters.slurm_hostlist import valid_name
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.flag_values import parse_float, parse_int
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import Refused, Transient
from gpuwarden.agent.fleet.plan.defrag_model import MAX_SLICE, Job, Move, Node, Plan, Policy, RackPlan, plan
from gpuwarden.agent.fleet.plan.defrag_slurm import (
    MAX_FILE,
    nodes_from_sinfo,
    parse_partitions,
    parse_squeue_json,
    preemptible_partitions,
)

EXIT_PLAN, EXIT_NO_PLAN, EXIT_INPUT = 0, 1, 2
EXIT_CODES = (("0", "a plan: the rack, the nodes it frees, the jobs to move"),
              ("1", "no rack can be freed without moving work that may not be moved (why, per rack)"),
              ("2", "bad input or flags, or Slurm could not be asked"))


# -- the command -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """`gpuwarden plan defrag`'s flags as given (agent/cli/plan.py parses them): checked here."""

    slice: str
    squeue: Path | None = None
    sinfo: Path | None = None
    partitions: Path | None = None
    preemptible_partitions: Sequence[str] = ()
    preemptible_qos: Sequence[str] = ()
    interactive_partitions: Sequence[str] = ()
    use_spares: bool = False
    now: str | None = None
    slurm_conf: Path | None = None
    json: bool = False


def _names(values: Sequence[str], flag: str) -> frozenset[str]:
    out = set()
    for v in values:
        for name in v.split(","):
            name = name.strip()
            if not name:
                continue
            if not valid_name(name, 256):
                raise ConfigError(f"{flag}: {name[:40]!r} is not a partition or QOS name")
            out.add(name)
    return frozenset(out)


def _read(path: Path, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE:
        raise ConfigError(f"{flag} {path}: more than {MAX_FILE >> 20} MiB; not read")
    return data.decode(errors="replace")


def gather(args: Options, now: float) -> tuple[list[Node], list[Job], dict[str, set[str]] | None]:
    """The nodes, the jobs and (when known) each partition's PreemptMode: from the files given, else from Slurm."""
    if (args.squeue is None) != (args.sinfo is None):
        raise ConfigError("--squeue and --sinfo go together (both files, or neither to ask Slurm)")
    if args.squeue is not None:
        nodes = nodes_from_sinfo(_read(args.sinfo, "--sinfo"), str(args.sinfo))
        jobs = parse_squeue_json(_read(args.squeue, "--squeue"), str(args.squeue), now)
        modes = (parse_partitions(_read(args.partitions, "--partitions"), str(args.partitions))
                 if args.partitions is not None else None)
        return nodes, jobs, modes
    adapter = SlurmAdapter(slurm_conf=str(args.slurm_conf) if args.slurm_conf else None)
    try:
        nodes = nodes_from_sinfo(adapter.read("sinfo", ["--json"]), "Slurm could not be asked")
        jobs = parse_squeue_json(adapter.read("squeue", ["--json"]), "squeue --json", now)
        modes = (parse_partitions(adapter.read("scontrol", ["show", "partition", "-o"]), "scontrol show partition")
                 if args.partitions is None else
                 parse_partitions(_read(args.partitions, "--partitions"), str(args.partitions)))
    except (Transient, Refused) as exc:
        raise ConfigError(f"Slurm could not be asked: {exc}") from None
    return nodes, jobs, modes


def policy_from(args: Options, modes: dict[str, set[str]] | None) -> Policy:
    partitions = _names(args.preemptible_partitions, "--preemptible-partitions")
    qos = _names(args.preemptible_qos, "--preemptible-qos")
    if not partitions and not qos:
        if modes is None:
            raise ConfigError("which jobs may be moved? give --preemptible-partitions (or --preemptible-qos), or "
                              "--partitions FILE (`scontrol show partition -o`) to take those whose PreemptMode is "
                              "REQUEUE or CANCEL")
        partitions = preemptible_partitions(modes)
    return Policy(partitions, qos, _names(args.interactive_partitions, "--interactive-partitions"),
                  bool(args.use_spares))


def to_dict(p: Plan, policy: Policy) -> dict[str, Any]:
    def move(m: Move) -> dict[str, Any]:
        return {"job": m.job.id, "partition": m.job.partition, "qos": m.job.qos or None, "action": m.action,
                "nodes": list(m.job.nodes), "elapsed_s": round(m.job.elapsed_s, 1),
                "node_hours": round(m.node_hours, 4)}

    c = p.chosen
    return {
        "slice": p.slice_size,
        "plan": c is not None,
        "rack": c.rack if c else None,
        "nodes": list(c.slice_nodes) if c else [],
        "free_now": list(c.free_now) if c else [],
        "freed": list(c.freed) if c else [],
        "moves": [move(m) for m in c.moves] if c else [],
        "jobs_moved": c.cost[0] if c else None,
        "node_hours_lost": round(c.cost[1], 4) if c else None,
        "exact": c.exact if c else None,
        "commands": _commands(c) if c else [],
        "why": p.why or None,
        "racks": [{"rack": r.rack, "feasible": r.feasible, "chosen": c is not None and r.rack == c.rack,
                   "jobs_moved": r.cost[0] if r.feasible else None,
                   "node_hours_lost": round(r.cost[1], 4) if r.feasible else None,
                   "jobs": [m.job.id for m in r.moves], "why": r.why or None} for r in p.racks],
        "nodes_without_domain": list(p.no_domain),
        "preemptible_partitions": sorted(policy.preemptible_partitions),
        "preemptible_qos": sorted(policy.preemptible_qos),
        "use_spares": policy.use_spares,
        "advice_only": True,
    }


def _commands(c: RackPlan) -> list[str]:
    """What an operator would run to carry the plan out (never run here)."""
    out = []
    for action, verb in (("requeue", "scontrol requeue"), ("cancel", "scancel")):
        ids = [m.job.id for m in c.moves if m.action == action]
        if ids:
            out.append(f"{verb} {','.join(ids) if action == 'requeue' else ' '.join(ids)}")
    return out


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}-" if d else "") + f"{h}:{m:02d}:{s:02d}"


def render(p: Plan) -> str:
    lines = []
    c = p.chosen
    if c is None:
        lines.append(f"no rack can give a slice of {p.slice_size} nodes without moving work that may not be moved")
        for r in p.racks:
            lines.append(f"  {r.rack}: {r.why}")
        if not p.racks:
            lines.append(f"  {p.why}")
    else:
        lines.append(f"slice of {p.slice_size} nodes: rack {c.rack}, nodes {' '.join(c.slice_nodes)}")
        lines.append(f"  free now: {' '.join(c.free_now) or '-'}; freed by the moves: {' '.join(c.freed) or '-'}")
        if c.moves:
            jobs, hours = c.cost
            lines.append(f"  move {jobs} job(s), {hours:.2f} node-hours of work lost"
                         + ("" if c.exact else " (search bound reached: a good plan, not proven the best)"))
            rows = [("JOB", "PARTITION", "ACTION", "ELAPSED", "NODE-HOURS", "NODES")]
            rows += [(m.job.id, m.job.partition, m.action, _elapsed(m.job.elapsed_s), f"{m.node_hours:.2f}",
                      ",".join(m.job.nodes)) for m in c.moves]
            widths = [max(len(r[i]) for r in rows) for i in range(5)]
            for r in rows:
                lines.append("    " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[5])
            lines.append("  to carry it out (not done here): " + "; ".join(_commands(c)))
        else:
            lines.append("  nothing to move")
        others = [r for r in p.racks if r is not c]
        if others:
            lines.append("other racks:")
            lines += [f"  {r.rack}: {r.why}" for r in others]
    if p.no_domain:
        lines.append(f"nodes in no NVLink domain, not considered: {' '.join(p.no_domain[:20])}"
                     + (" ..." if len(p.no_domain) > 20 else ""))
    return "\n".join(lines)


def run(args: Options) -> int:
    size = parse_int(args.slice, "--slice", 1, MAX_SLICE)
    now = parse_float(args.now, "--now", 0, 1e11) if args.now is not None else time.time()
    nodes, jobs, modes = gather(args, now)
    policy = policy_from(args, modes)
    result = plan(nodes, jobs, size, policy)
    if args.json:
        print(json.dumps(to_dict(result, policy), indent=2))
    else:
        print(render(result))
    return EXIT_PLAN if result.chosen is not None else EXIT_NO_PLAN

"""`gpuwarden plan simulate`: what a placement policy (spares per rack, slice size) gives a fleet over simulated
days, with gpuwarden's own state machine, remediation engine, circuit breaker and spare swap deciding every
failure (agent/fleet/plan/sim_fleet.py). Reports usable node-hours, slice interruptions, the time slices waited for a
rack, spares consumed and breaker trips per policy, and the GPU-hours the slices' training jobs lost when a doomed job
waits for its NCCL watchdog against when gpuwarden ends it at once, as a table, JSON, and a plot of usable capacity
over time.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.flag_values import parse_float, parse_int, shown
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.fleet.plan.sim_config import Burst, Policy, SimConfig

if TYPE_CHECKING:  # the simulator (and the agent it drives) loads when a simulation runs, not with the CLI
    from gpuwarden.agent.fleet.plan.sim_report import Report

DEFAULT_POLICIES = ("spares=2,slice=16", "spares=0,slice=18")  # the comparison slice sizing turns on
MAX_NODES = 100_000
MAX_POLICIES = 8
MAX_BURSTS = 64
# Each failure costs a few milliseconds of real decisions and scheduler writes: a run is bounded by the failures
# it would expect (10,000 nodes for a year at 490 days a node: about 7,500).
MAX_EXPECTED_FAILURES = 20_000
JSON_VERSION = 1
RESPONSES = {"fast-abort": True, "watchdog": False}  # --job-response: the timeline simulated (SimConfig.job_response)


@dataclass(frozen=True)
class Options:
    """`gpuwarden plan simulate`'s flags as given (agent/cli/plan.py parses them): checked here."""

    racks: str
    nodes_per_rack: str
    days: str
    policy: Sequence[str]
    mtbi_days: str
    repair_hours: str
    repair_sigma: str
    restart_minutes: str
    breaker_reset_hours: str
    burst: Sequence[str]
    gpus_per_node: str
    checkpoint_minutes: str
    watchdog_minutes: str
    abort_seconds: str
    job_response: str
    seed: str
    plot: Path | None = None
    json: bool = False


def run(args: Options) -> int:
    config, policies = parse(args)
    # at use: the simulator loads the agent it drives (remediation engine, local adapter, sqlite3): +180 ms
    # (python -X importtime) to `plan simulate --help` and to every flag error, which load this module
    from gpuwarden.agent.fleet.plan.sim_fleet import simulate

    reports = [simulate(config, policy) for policy in policies]
    if args.json:
        print(json.dumps(to_json(config, reports), indent=2))
    else:
        print(render(config, reports))
    if args.plot is not None:
        plot(reports, args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


def parse_policy(text: Any, nodes_per_rack: int) -> Policy:
    """`spares=K,slice=S` (either order, both required)."""
    s = str(text)
    if len(s) > 64:
        raise ConfigError(f"--policy {shown(text)}: expected spares=K,slice=S")
    fields: dict[str, str] = {}
    for part in s.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("spares", "slice") or key in fields:
            raise ConfigError(f"--policy {shown(text)}: expected spares=K,slice=S (each once)")
        fields[key] = value
    if set(fields) != {"spares", "slice"}:
        raise ConfigError(f"--policy {shown(text)}: expected spares=K,slice=S (both)")
    spares = parse_int(fields["spares"], "--policy spares", 0, nodes_per_rack - 1)
    size = parse_int(fields["slice"], "--policy slice", 1, nodes_per_rack - spares)
    return Policy(spares, size)


def parse_burst(text: Any, racks: int, nodes_per_rack: int, days: float) -> Burst:
    """`RACK:NODES@HOURS`."""
    s = str(text)
    rack, colon, rest = s.partition(":")
    nodes, at, hours = rest.partition("@")
    if len(s) > 64 or not colon or not at:
        raise ConfigError(f"--burst {shown(text)}: expected RACK:NODES@HOURS (e.g. 3:6@24)")
    return Burst(parse_int(rack, "--burst RACK", 0, racks - 1), parse_int(nodes, "--burst NODES", 1, nodes_per_rack),
                 parse_float(hours, "--burst HOURS", 0.0, days * 24.0))


def parse(args: Options) -> tuple[SimConfig, list[Policy]]:
    racks = parse_int(args.racks, "--racks", 1, MAX_NODES)
    per_rack = parse_int(args.nodes_per_rack, "--nodes-per-rack", 1, 1024)
    if racks * per_rack > MAX_NODES:
        raise ConfigError(f"--racks {racks:,} × --nodes-per-rack {per_rack:,} = {racks * per_rack:,} nodes; "
                          f"at most {MAX_NODES:,}")
    days = parse_float(args.days, "--days", 0.0, 3650.0, lo_open=True)
    mtbi = parse_float(args.mtbi_days, "--mtbi-days", 1.0, 100_000.0)
    expected = racks * per_rack * days / mtbi
    if expected > MAX_EXPECTED_FAILURES:
        raise ConfigError(f"--days {days:g} on {racks * per_rack:,} nodes at --mtbi-days {mtbi:g}: about "
                          f"{expected:,.0f} failures to simulate; at most {MAX_EXPECTED_FAILURES:,} per run (fewer "
                          f"days or nodes)")
    texts = list(args.policy or DEFAULT_POLICIES)
    if len(texts) > MAX_POLICIES:
        raise ConfigError(f"--policy given {len(texts)} times; at most {MAX_POLICIES}")
    policies = [parse_policy(t, per_rack) for t in texts]
    if len(args.burst or []) > MAX_BURSTS:
        raise ConfigError(f"--burst given {len(args.burst)} times; at most {MAX_BURSTS}")
    bursts = tuple(parse_burst(b, racks, per_rack, days) for b in args.burst or [])
    config = SimConfig(
        racks=racks, nodes_per_rack=per_rack, days=days, mtbi_days=mtbi,
        repair_median_h=parse_float(args.repair_hours, "--repair-hours", 0.0, 8760.0, lo_open=True),
        repair_sigma=parse_float(args.repair_sigma, "--repair-sigma", 0.0, 3.0),
        restart_min=parse_float(args.restart_minutes, "--restart-minutes", 0.0, 1440.0),
        breaker_reset_h=parse_float(args.breaker_reset_hours, "--breaker-reset-hours", 0.0, 8760.0),
        bursts=bursts, seed=parse_int(args.seed, "--seed", 0, 2**63 - 1),
        gpus_per_node=parse_int(args.gpus_per_node, "--gpus-per-node", 1, 64),
        checkpoint_min=parse_float(args.checkpoint_minutes, "--checkpoint-minutes", 0.0, 10080.0, lo_open=True),
        watchdog_min=parse_float(args.watchdog_minutes, "--watchdog-minutes", 0.0, 1440.0),
        abort_s=parse_float(args.abort_seconds, "--abort-seconds", 0.0, 3600.0),
        job_response=parse_response(args.job_response))
    return config, policies


def parse_response(text: Any) -> bool:
    s = str(text).strip()
    if s not in RESPONSES:
        raise ConfigError(f"--job-response {shown(text)}: expected one of {', '.join(RESPONSES)}")
    return RESPONSES[s]


# -- output ---------------------------------------------------------------------------------------------------
def to_json(config: SimConfig, reports: Sequence[Report]) -> dict[str, Any]:
    return {"version": JSON_VERSION,
            "config": {"racks": config.racks, "nodes_per_rack": config.nodes_per_rack, "days": config.days,
                       "mtbi_days": config.mtbi_days, "repair_median_h": config.repair_median_h,
                       "repair_sigma": config.repair_sigma, "restart_min": config.restart_min,
                       "breaker_reset_h": config.breaker_reset_h, "seed": config.seed,
                       "gpus_per_node": config.gpus_per_node, "checkpoint_min": config.checkpoint_min,
                       "watchdog_min": config.watchdog_min, "abort_s": config.abort_s,
                       "job_response": "fast-abort" if config.job_response else "watchdog",
                       "bursts": [{"rack": b.rack, "nodes": b.nodes, "at_h": b.at_h} for b in config.bursts]},
            "policies": [r.to_dict() for r in reports]}


ROWS = (
    ("usable node-hours", lambda r: f"{r.usable_node_hours:,.0f}"),
    ("usable share", lambda r: f"{100 * r.usable_share:.2f} %"),
    ("mean usable nodes", lambda r: f"{r.usable_node_hours / (r.days * 24):,.1f}"),
    ("slices (backlog)", lambda r: f"{r.slices:,}"),
    ("node failures", lambda r: f"{r.failures:,}"),
    ("repairs done", lambda r: f"{r.repairs:,}"),
    ("slice interruptions", lambda r: f"{r.interruptions:,}"),
    ("waits for a rack", lambda r: f"{r.waits:,}"),
    ("slice-hours waited", lambda r: f"{r.wait_slice_hours:,.1f}"),
    ("longest wait (h)", lambda r: f"{r.max_wait_h:,.1f}"),
    ("spares consumed", lambda r: f"{r.spares_consumed:,}"),
    ("  of them for a failed spare", lambda r: f"{r.spares_for_spares:,}"),
    ("no spare left in the rack", lambda r: f"{r.slice_must_move:,}"),
    ("breaker trips", lambda r: f"{r.breaker_trips:,}"),
    ("idle node-hours", lambda r: f"{r.node_hours['idle']:,.0f}"),
    ("spare node-hours", lambda r: f"{r.node_hours['spare']:,.0f}"),
    ("out-of-service node-hours", lambda r: f"{r.node_hours['out']:,.0f}"),
    ("job GPUs (one job per slice)", lambda r: f"{r.jobs.job_gpus:,}"),
    ("jobs doomed by a failure", lambda r: f"{r.jobs.interrupted:,}"),
    ("  ended by gpuwarden / by watchdog", lambda r: f"{r.jobs.ended_by_gpuwarden:,} / {r.jobs.ended_by_watchdog:,}"),
    ("GPU-hours lost: job waits for watchdog", lambda r: f"{r.jobs.gpu_hours_lost_watchdog:,.1f}"),
    ("GPU-hours lost: gpuwarden ends it", lambda r: f"{r.jobs.gpu_hours_lost_fast_abort:,.1f}"),
    ("  in both: work since its checkpoint", lambda r: f"{r.jobs.checkpoint_gpu_hours:,.1f}"),
    ("GPU-hours saved by ending it", lambda r: f"{r.jobs.gpu_hours_saved:,.1f}"),
)


def render(config: SimConfig, reports: Sequence[Report]) -> str:
    c = config
    head = (f"{c.racks:,} racks × {c.nodes_per_rack} nodes ({c.racks * c.nodes_per_rack:,}), {c.days:g} days, "
            f"node MTBI {c.mtbi_days:g} days, repair median {c.repair_median_h:g} h (lognormal σ "
            f"{c.repair_sigma:g}), seed {c.seed}")
    if c.bursts:
        head += "; bursts: " + ", ".join(f"rack {b.rack} {b.nodes} nodes at {b.at_h:g} h" for b in c.bursts)
    jobs = (f"jobs: one per slice, {c.gpus_per_node} GPUs per node, a checkpoint every {c.checkpoint_min:g} min; "
            f"NCCL watchdog {c.watchdog_min:g} min, gpuwarden ends a doomed job in {c.abort_s:g} s")
    timeline = "simulated: " + ("gpuwarden ends each doomed job" if c.job_response else
                                "each doomed job waits for its watchdog") + "; the job rows charge each one both ways"
    names = [r.policy for r in reports]
    width = max(len(label) for label, _ in ROWS)
    cols = [max(len(n), 12) for n in names]
    lines = [head, jobs, timeline, "",
             f"{'':<{width}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, cols, strict=True))]
    for label, cell in ROWS:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{cell(r):>{w}}" for r, w in zip(reports, cols, strict=True)))
    return "\n".join(lines)


def plot(reports: Sequence[Report], out: Path) -> None:
    """Usable capacity (nodes in working slices) over time, one line per policy."""
    try:  # optional dependency: matplotlib, the `plot` extra, for --plot only
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency, as matplotlib above
    except ImportError:
        raise ConfigError("--plot needs matplotlib: install gpuwarden with the `plot` extra "
                          "(pip install 'gpuwarden[plot]')") from None
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
    try:
        for r in reports:
            xs = [t / 24.0 for t, _ in r.series]
            ys = [n for _, n in r.series]
            ax.step(xs, ys, where="post", label=f"{r.policy}: {r.usable_node_hours / (r.days * 24):,.0f} nodes "
                                                f"on average")
        first = reports[0] if reports else None
        if first is not None:
            ax.set_title(f"Usable nodes over time: {first.racks:,} racks, {first.nodes:,} nodes, seed {first.seed}")
        ax.set_xlabel("day")
        ax.set_ylabel("nodes in working slices")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left")
        fig.tight_layout()
        try:
            fig.savefig(out, format="png")
        except OSError as exc:
            raise ConfigError(f"--plot {out}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


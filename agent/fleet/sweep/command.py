"""The `gpuwarden sweep` command: reads [sweep], finds the idle nodes through the scheduler adapter, builds the
launcher (srun, or mpirun over --hosts where there is no scheduler) and the judge (agent/fleet/sweep/criteria.py with
its baselines), runs the sweep (agent/fleet/sweep/sweep.py), writes the verdicts and the report, and prints what it
found.

Exit codes: 0 every node tested passed; 1 a node or link at fault (named); 2 could not decide (nothing to test,
every group failed alike, a preempted or unstarted collective left nodes unresolved, a config or scheduler error);
130 / 143 interrupted by SIGINT / SIGTERM (every job it started was ended first; the partial report is written)."""
from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuwarden.agent.act.adapters import build
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, GpuwardenError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView, Service
from gpuwarden.agent.core.sweep_names import valid_name
from gpuwarden.agent.fleet.sweep import criteria
from gpuwarden.agent.fleet.sweep.history import SweepHistory
from gpuwarden.agent.fleet.sweep.launch_mpirun import MpirunLauncher
from gpuwarden.agent.fleet.sweep.launch_srun import SrunLauncher
from gpuwarden.agent.fleet.sweep.model import GroupRun, Outcome
from gpuwarden.agent.fleet.sweep.sweep import (
    EXIT_UNDECIDED,
    Report,
    Sweep,
    idle_nodes,
    new_sweep_id,
    plan_phases,
    write_results,
)

log = logs.get_logger("gpuwarden.sweep")

EXIT_CODES = (("0", "every node tested passed"),
              ("1", "a node or a link at fault (named in the report and in its verdict)"),
              ("2", "could not decide: nothing to test, every group failed alike, collectives preempted or not "
                    "started, or a config or scheduler error"),
              ("130, 143", "interrupted by SIGINT, SIGTERM: every job it started was ended; partial report written"))


@dataclass(frozen=True)
class Options:
    """`gpuwarden sweep`'s flags (agent/cli/sweep.py parses them and loads the config)."""

    nodes: Sequence[str] = ()
    hosts: Sequence[str] = ()
    plan: bool = False
    json: bool = False
    results_dir: Path | None = None
    state_dir: Path | None = None


def _names(values: Sequence[str]) -> list[str]:
    return [n for v in values for n in v.split(",") if n]


# -- judging ----------------------------------------------------------------------------------------------------------
def make_judge(settings: Mapping[str, Any], history: Any) -> Any:
    """judge(run, phase) -> (outcome, reasons, figures): the criteria with the baselines of config, the SKU table
    and the nodes' own history; a group size with no figure of its own borrows the nearest configured one."""
    policy = dict(settings)
    sku = settings["sku"] or "any"

    def judge(run: GroupRun, phase: str) -> tuple[Outcome, tuple[str, ...], dict[str, Any]]:
        baseline = nearest_baseline(criteria.baseline_for(sku, len(run.nodes), policy, history, run.nodes), sku,
                                    len(run.nodes), policy)
        judged = criteria.judge(run, baseline, policy)
        figures: dict[str, Any] = {k: v for k, v in (("latency_p95_us", judged.latency_p95_us),
                                                     ("transition_busbw_gbps", judged.transition_busbw_gbps),
                                                     ("busbw_gbps", judged.busbw_gbps)) if v is not None}
        for name in ("latency_p95_us", "busbw_gbps"):
            fig = getattr(baseline, name, None)
            if fig is not None:
                figures[f"baseline_{name}"] = {"value": fig.value, "source": fig.source}
        if history is not None and judged.outcome is Outcome.PASS:
            try:
                for node in run.nodes:
                    history.record(node, len(run.nodes), sku, judged)
            except Exception as exc:  # history is an aid: a full disk must not stop the sweep
                log.warning("sweep history not written", error=str(exc))
        return judged.outcome, tuple(judged.reasons), figures

    return judge


def nearest_baseline(baseline: Any, sku: str, nodes: int, policy: Mapping[str, Any]) -> Any:
    """Fills a figure `baseline` lacks from the configured or bundled figure of the nearest group size: bus
    bandwidth is normalised to the group (nccl-tests' busbw), so the nearest size's figure holds; latency grows with
    the group, so only a larger group's figure is borrowed (lenient, never a false SLOW)."""
    if baseline.latency_p95_us is not None and baseline.busbw_gbps is not None:
        return baseline
    entries: dict[int, dict[str, tuple[float, str]]] = {}
    for table, source in ((criteria.bundled_baselines(), criteria.TABLE_SOURCE),
                          (criteria.parse_baselines(policy.get(criteria.BASELINES_KEY) or {}, criteria.CONFIG_SOURCE),
                           criteria.CONFIG_SOURCE)):
        for (s, n), fields in table.items():
            if s == sku:
                entries.setdefault(n, {}).update({k: (v, source) for k, v in fields.items()})
    filled = {}
    for name, unit, sizes in (("busbw_gbps", "GB/s", sorted(entries, key=lambda n: (abs(n - nodes), -n))),
                              ("latency_p95_us", "us", sorted(n for n in entries if n > nodes))):
        if getattr(baseline, name) is not None:
            continue
        for n in sizes:
            if name in entries[n]:
                value, source = entries[n][name]
                filled[name] = criteria.Figure(value, unit, f"{source} '{sku}/{n}' (the nearest group size with a "
                                                            f"figure; this group has {nodes} nodes)")
                break
    return dataclasses.replace(baseline, **filled) if filled else baseline


# -- launching --------------------------------------------------------------------------------------------------------
def make_launcher(settings: Mapping[str, Any], adapter_name: str, hosts: bool, workdir: Path) -> Any:
    kind = settings["launcher"]
    if kind == "auto":
        kind = "mpirun" if hosts or adapter_name != "slurm" else "srun"
    if kind == "srun":
        return SrunLauncher(partition=settings["partition"] or None, qos=settings["qos"] or None,
                            ranks_per_node=int(settings["ranks_per_node"]),
                            extra_args=list(settings["launcher_args"]), job_name=settings["job_name"],
                            start_timeout_s=float(settings["start_timeout_s"]))
    return MpirunLauncher(ranks_per_node=int(settings["ranks_per_node"]),
                          extra_args=list(settings["launcher_args"]), workdir=workdir)


# -- the command -----------------------------------------------------------------------------------------------------
def run(args: Options, cfg: Any) -> int:
    """The sweep with the loaded config `cfg` ([sweep], [remediation] adapter, [agent] state_dir)."""
    settings = dict(cfg.sweep)  # checked when loaded, the criteria's keys by the criteria's own ranges
    results_dir = Path(args.results_dir or settings["results_dir"])
    hosts, only = _names(args.hosts), set(_names(args.nodes))
    adapter, adapter_name = None, cfg.remediation["adapter"]
    if hosts:
        bad = [h for h in hosts if not valid_name(h)]
        if bad:
            raise ConfigError(f"--hosts: {bad[0]!r} is not a host name")
        candidates = [NodeView(h, Service.IN_SERVICE, jobs=0) for h in dict.fromkeys(hosts)]
    else:
        state_dir = Path(args.state_dir or cfg.agent["state_dir"])
        adapter = build(adapter_name, cfg.remediation.get(adapter_name, {}), state_dir)
        try:
            views = adapter.nodes()
        except Exception as exc:
            raise GpuwardenError(f"the scheduler ({adapter_name}) could not list its nodes: {exc}") from None
        candidates = idle_nodes(views, bool(settings["include_spares"]) and adapter_name == "local")
    if only:
        candidates = [v for v in candidates if v.name in only]
    if settings["max_nodes"]:
        candidates = candidates[: int(settings["max_nodes"])]
    if args.plan:
        phases = plan_phases(candidates, int(settings["group_nodes"]), bool(settings["cross_domain"]))
        out = {"candidates": [v.name for v in candidates],
               "phases": [{"phase": p.name, "groups": [list(g) for g in p.groups]} for p in phases]}
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            for p in out["phases"]:
                print(f"{p['phase']}: " + "  ".join(",".join(g) for g in p["groups"]))
            if not phases:
                print(f"nothing to test: {len(candidates)} idle node(s) that can be grouped")
        return 0 if phases else EXIT_UNDECIDED

    history = SweepHistory(results_dir / "history.db", keep=int(settings["history_keep"]))
    launcher = make_launcher(settings, adapter_name, bool(hosts), results_dir / "work")
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        caught.append(signum)
        stop.set()
        threading.Thread(target=launcher.cancel_all, name="sweep-cancel", daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    sweep_id = new_sweep_id(time.time())
    holds = _hold(adapter, sweep_id, candidates, settings)
    try:
        sweep = Sweep(candidates, settings, launcher, make_judge(settings, history), stop=stop, sweep_id=sweep_id)
        report = sweep.run()
    finally:
        _release(adapter, holds)
        for s, h in previous.items():
            signal.signal(s, h)
    if caught:
        report.partial = f"interrupted by {signal.Signals(caught[0]).name}"
    blind = [t for t in report.tests if t.outcome is Outcome.PASS
             and not any(k.startswith("baseline_") for k in t.figures)]
    if blind:
        sizes = sorted({len(t.nodes) for t in blind})
        report.undecided.append(
            f"performance not judged for {len(blind)} collective(s): no baseline for "
            f"{settings['sku'] or 'any'}/{'|'.join(map(str, sizes))} nodes in [sweep.baselines], the bundled table or "
            f"the nodes' history (learning: {settings['history_min_samples']} passing sweeps make one); their nodes "
            "passed on correctness only")
    written = write_results(results_dir, report, settings["link_action"])
    log.info("sweep done", sweep=report.sweep_id, exit_code=report.exit_code, verdicts=len(written),
             report=str(results_dir / "reports" / f"{report.sweep_id}.json"))
    print(json.dumps(report.to_dict(), indent=1) if args.json else render(report), flush=True)
    return 128 + caught[0] if caught else report.exit_code


def _hold(adapter: Any, sweep_id: str, candidates: Sequence[Any], settings: Mapping[str, Any]) -> str | None:
    """On the local adapter, hold the nodes for the sweep, so none is taken as a spare mid-sweep (on Slurm the
    sweep's own jobs hold them, and a spare is a drained node no sweep runs on)."""
    hold = getattr(adapter, "hold_for_sweep", None)
    if hold is None or not candidates:
        return None
    hold(sweep_id, [v.name for v in candidates], float(settings["timeout_s"]) * (2 + int(settings["max_tests"])))
    return sweep_id


def _release(adapter: Any, sweep_id: str | None) -> None:
    if sweep_id is not None:
        try:
            adapter.release_sweep(sweep_id)
        except Exception as exc:  # the hold expires by itself
            log.warning("sweep hold not released", error=str(exc))


def render(report: Report) -> str:
    lines = [f"sweep {report.sweep_id}: {len(report.candidates)} idle node(s), {len(report.tests)} collective(s)"
             + (f" — partial: {report.partial}" if report.partial else "")]
    for t in report.tests:
        figs = ", ".join(f"{k} {v:g}" for k, v in t.figures.items() if isinstance(v, (int, float)))
        lines.append(f"  r{t.round:<2} {t.phase:<6} {t.purpose:<8} {t.outcome.value:<9} {','.join(t.nodes)}"
                     + (f"  [{figs}]" if figs else "") + (f"  {t.reasons[0]}" if t.reasons and t.outcome.bad else ""))
    if report.culprit_nodes:
        lines.append("bad nodes: " + ", ".join(f"{n} ({c})" for n, c in sorted(report.culprit_nodes.items())))
    if report.culprit_links:
        lines.append("bad links: " + ", ".join(f"{a}—{b}" for a, b in report.culprit_links))
    if report.unresolved:
        lines.append("unresolved: " + ", ".join(sorted(report.unresolved)))
    for why in report.undecided:
        lines.append(f"undecided: {why}")
    verdict = {0: "every node tested passed", 1: "fault found", 2: "undecided"}[report.exit_code]
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)

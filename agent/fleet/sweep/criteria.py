"""Judges one group's multi-node all_reduce_perf run by regime: small messages (LL/LL128, latency-bound) on the p95
of their time over the run's cycles (-N), large ones on bus bandwidth, the MB range between them (where NCCL
switches tree -> ring) reported on its own; wrong values, crashes, hangs and preemptions come before any of that.
Baselines per SKU and group size come from the config, the bundled table (thresholds/nccl_sweep.toml), or the
nodes' own past sweeps, and every figure carries where it came from."""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gpuwarden.agent.core.errors import ConfigError, ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.sweep_policy import (
    BASELINE_FIELDS,
    BASELINES_KEY,
    CONFIG_SOURCE,
    TABLE,
    TABLE_SOURCE,
    check_policy,
    parse_baselines,
)
from gpuwarden.agent.core.thresholds import sku_table
from gpuwarden.agent.fleet.sweep.history import SweepHistory, SweepHistoryError
from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, NOT_STARTED, PREEMPTED, TIMEOUT, GroupRun, Outcome
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests

if TYPE_CHECKING:  # at run time imported where used: gpuwarden.checks loads every check, which import the agent
    from gpuwarden.checks.parse_nccl_tests import Line, NcclTestsRun, Row

# An NCCL WARN line that reports a failure rather than a notice (e.g. "Cuda failure 'out of memory'").
_FAILING_WARN = re.compile(r"fail|error|abort|timeout|timed out", re.IGNORECASE)
_MAX_SIZES = 64  # per-size figures kept in the evidence (8 B .. 2 GiB by factor 2 is 29)


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str  # "config [sweep.baselines] 'H100-SXM-HGX/2'", "thresholds/nccl_sweep.toml 'H100-SXM-HGX/2'", ...


@dataclass(frozen=True)
class Baseline:
    latency_p95_us: Figure | None
    busbw_gbps: Figure | None
    key: str = "?"  # "<SKU>/<nodes>" it was looked up for
    notes: tuple[str, ...] = ()  # why a figure is missing (history too thin, unreadable), said in the reasons


@dataclass(frozen=True)
class Judged:
    outcome: Outcome
    reasons: tuple[str, ...]  # each names the figure and its source
    latency_p95_us: float | None  # small messages: median over sizes of each size's p95 over cycles (with fewer
    #                               than min_cycles cycles, of each size's median; evidence "latency_statistic")
    transition_busbw_gbps: float | None  # MB range: median over its sizes of each size's median busbw; not judged
    busbw_gbps: float | None  # large messages: median over cycles at the largest size >= large_min_bytes
    evidence: Mapping[str, Any] = field(default_factory=dict)


def bundled_baselines() -> dict[tuple[str, int], dict[str, float]]:
    """The bundled table: one section per SKU, keys "<field>_<n>_nodes" (the layout of every thresholds file:
    SKU sections of plain numbers), checked as strictly as the config's."""
    flat: dict[str, dict[str, Any]] = {}
    for sku, section in sku_table(TABLE).items():
        for key, value in (section.items() if isinstance(section, Mapping) else ()):
            name, _, nodes = key.removesuffix("_nodes").rpartition("_")
            if not key.endswith("_nodes") or name not in BASELINE_FIELDS:
                raise ConfigError(f"{TABLE_SOURCE} [{sku}]: key {key!r:.80} is not <field>_<nodes>_nodes with field "
                                  f"one of {', '.join(BASELINE_FIELDS)}")
            flat.setdefault(f"{sku}/{nodes}", {})[name] = value
    return parse_baselines(flat, TABLE_SOURCE)


def baseline_for(sku: str, nodes: int, policy: Mapping[str, Any], history: SweepHistory | None,
                 members: Sequence[str]) -> Baseline:
    """Each figure from the first place that has it: the config's [sweep.baselines], the bundled table, then the
    median of the members' own past figures at this group size (history). A figure none of them has stays None:
    that regime is then not judged, and the notes say what was looked at."""
    key = f"{sku}/{nodes}"
    found: dict[str, Figure] = {}
    for table, source in ((parse_baselines(policy.get(BASELINES_KEY) or {}, CONFIG_SOURCE), CONFIG_SOURCE),
                          (bundled_baselines(), TABLE_SOURCE)):
        for name, value in table.get((sku, nodes), {}).items():
            found.setdefault(name, Figure(value, BASELINE_FIELDS[name][0], f"{source} '{key}'"))
    notes: list[str] = []
    missing = [name for name in BASELINE_FIELDS if name not in found]
    if missing and history is None:
        notes.append("no sweep history")
    elif missing:
        need = check_policy(policy)["history_min_samples"]
        try:
            learned = [(m, history.learned(m, nodes, min_samples=need)) for m in members]
        except SweepHistoryError as err:
            learned = []
            notes.append(f"sweep history unreadable: {err}")
        except ValueError as err:  # a member name the history cannot hold: no learned figure, said
            learned = []
            notes.append(f"sweep history not consulted: {err}")
        for name in missing:
            have = [(m, got) for m, got in learned if getattr(got, name) is not None]
            if have:
                value = statistics.median(getattr(got, name) for _, got in have)
                found[name] = Figure(value, BASELINE_FIELDS[name][0], _history_source(have, nodes, len(members)))
            elif learned:
                notes.append(f"history: no member has {need} past {name} figures at {nodes} nodes")
    return Baseline(found.get("latency_p95_us"), found.get("busbw_gbps"), key, tuple(notes))


def _history_source(have: list[tuple[str, Any]], nodes: int, members: int) -> str:
    shown = ", ".join(f"{m}: {got.samples} since {time.strftime('%Y-%m-%d', time.gmtime(got.since))}"
                      for m, got in have[:4])
    more = f" and {len(have) - 4} more" if len(have) > 4 else ""
    return (f"history: median of {len(have)} of {members} members' own past figures at {nodes} nodes "
            f"({shown[:400]}{more})")


# -- judgement --------------------------------------------------------------------------------------------------------
@dataclass
class _SizeStats:
    size_bytes: int
    times_us: list[float]  # per cycle: the better half (min of out-of-place and in-place), as busbw takes the max
    busbw_gbps: list[float]  # per cycle: max of out-of-place and in-place


def judge(run: GroupRun, baseline: Baseline, policy: Mapping[str, Any]) -> Judged:
    """The outcome of one group's collective. Several may apply; the worst is taken (WRONG > HUNG > FAILED > SLOW).
    Wrong values count even in a run that was later preempted or hung: they were checked before it ended.

    How the figures are read (all_reduce_perf -N prints the table once per cycle; each row's time is already the
    mean over -n iterations, so the cycles are the samples):
    - a row's time is its better half (min of out-of-place and in-place), as its busbw is the better half (max):
      the worse half of one row is often a one-off (p5en, 8 B: 983.2 us out-of-place, 166.1 us in-place);
    - small messages: per size, the p95 over cycles; the group's figure is the median of those over the small
      sizes. A fault of a node or link (a slow NIC, PCIe, a congested port) adds latency at every small size, so
      the median over sizes shows it, while one size that stalled in a cycle or two does not fail a group whose
      other sizes are at baseline (its p95 is in the evidence). The p95 over cycles catches a node that stalls
      now and then, which a median over cycles hides;
    - fewer cycles than min_cycles: the median over the cycles there are (a p95 of 1-4 samples is their maximum),
      judged against the same baseline: lenient, it cannot fail a healthy group, and the reason says so;
    - large messages: the median over cycles of busbw at the largest size >= large_min_bytes, where busbw is
      nearest its plateau (2 x p5 H100: at 1 GiB two healthy runs differ by 29 %, at 2 GiB by 1.3 %);
    - the MB range between: the median over its sizes of each size's median busbw, reported, never judged;
    - a regime without a baseline figure is not judged, and the reasons say "not judged: no baseline for ...".
    """
    p = check_policy(policy)
    where = f"all_reduce_perf on {','.join(run.nodes)[:200]}"
    if run.ended in (NOT_STARTED, LAUNCH_ERROR):
        return Judged(Outcome.NOT_RUN, (f"not run ({run.ended}): {run.detail or 'no detail'}",), None, None, None,
                      {"ended": run.ended, "detail": run.detail[:500]})
    parsed, parse_error = None, None
    try:
        parsed = parse_nccl_tests(run.output, where)
    except ParseError as err:
        parse_error = str(err)
    stderr_lines = _stderr_lines(run.stderr, where)
    sizes = _sizes(parsed.rows if parsed else [])
    figures = _figures(sizes, p)
    evidence: dict[str, Any] = {
        "ended": run.ended, "returncode": run.returncode, "duration_s": round(run.duration_s, 3),
        "baseline": {"key": baseline.key,
                     "latency_p95_us": _shown(baseline.latency_p95_us), "busbw_gbps": _shown(baseline.busbw_gbps)},
        **figures["evidence"],
    }
    found: list[tuple[Outcome, str]] = []

    wrong_rows = [r for r in parsed.rows if r.wrong > 0] if parsed else []
    out_of_bounds = parsed.out_of_bounds if parsed else None
    if wrong_rows or (out_of_bounds or 0) > 0:
        shown = ", ".join(f"{r.size_bytes} B (line {r.line}): {r.wrong}" for r in wrong_rows[:5])
        found.append((Outcome.WRONG, f"wrong values: #wrong > 0 at {shown or 'no row shown'}; out of bounds values: "
                                     f"{out_of_bounds} (nccl-tests' own check): silent data corruption in the group"))
        evidence["wrong_rows"] = [{"size_bytes": r.size_bytes, "line": r.line,
                                   "out_of_place_wrong": r.out_of_place.wrong, "in_place_wrong": r.in_place.wrong}
                                  for r in wrong_rows[:20]]
        evidence["out_of_bounds"] = out_of_bounds
    corrupt = bool(found)

    failing = [*(parsed.errors if parsed else []),
               *(w for w in (parsed.warnings if parsed else []) if _FAILING_WARN.search(w.text)), *stderr_lines]
    evidence["error_lines"] = [f"{ln.line}: {ln.text[:300]}" for ln in failing[-5:]]
    notices = [w for w in (parsed.warnings if parsed else []) if not _FAILING_WARN.search(w.text)]
    if notices:
        evidence["warn_lines"] = [f"{ln.line}: {ln.text[:300]}" for ln in notices[-5:]]
    last = f"; last error: {failing[-1].text[:300]}" if failing else ""

    if run.ended == PREEMPTED:
        if not corrupt:
            return Judged(Outcome.PREEMPTED, (f"preempted: the scheduler took the nodes back after "
                                              f"{run.duration_s:.0f} s ({run.detail or 'no detail'}): no verdict",),
                          figures["latency"], figures["transition"], figures["busbw"], evidence)
    elif run.ended == TIMEOUT:
        reached = f"last size printed: {sizes[-1].size_bytes} B" if sizes else "no result row printed"
        found.append((Outcome.HUNG, f"hung: ran past its time limit ({run.duration_s:.0f} s, {reached}); the job was "
                                    f"ended ({run.detail or 'no detail'}){last}"))
    elif run.ended == EXITED:
        failed = _failure(run, parsed, parse_error, corrupt, failing)
        if failed:
            found.append((Outcome.FAILED, f"failed: {'; '.join(failed)}{last}"))
    else:
        found.append((Outcome.FAILED, f"failed: unknown ending {run.ended!r:.40} ({run.detail[:200]})"))

    slow, notes = _regimes(figures, baseline, p)
    if parsed and parsed.avg_busbw_failed:
        slow.append(f"nccl-tests' own average bus bandwidth check FAILED (avg {parsed.avg_busbw_gbps} GB/s)")
    found.extend((Outcome.SLOW, reason) for reason in slow)
    if parsed and parsed.elided:
        notes.append(f"table incomplete: {len(parsed.elided)} elided line(s) ('...' at line "
                     f"{parsed.elided[0]}): sizes in between were not seen")
    if parsed and parsed.problems:
        evidence["unparsed_lines"] = [str(e)[:300] for e in parsed.problems[:5]]
    order = (Outcome.WRONG, Outcome.HUNG, Outcome.FAILED, Outcome.SLOW)
    outcome = min((o for o, _ in found), key=order.index, default=Outcome.PASS)
    reasons = tuple(reason for _, reason in sorted(found, key=lambda f: order.index(f[0]))) + tuple(notes)
    return Judged(outcome, reasons, figures["latency"], figures["transition"], figures["busbw"], evidence)


def _failure(run: GroupRun, parsed: NcclTestsRun | None, parse_error: str | None, corrupt: bool,
             failing: list[Line]) -> list[str]:
    """Why a run that exited by itself failed ([] when it did not). nccl-tests prints 'Test failure' and exits
    non-zero after its own verdicts (wrong values, its average-bandwidth check): those explain the exit status."""
    if parsed is None:
        return [f"no result table ({parse_error}); exit status {run.returncode}"]
    explained = parsed.complete and (corrupt or parsed.avg_busbw_failed)
    reasons = []
    if not parsed.complete:
        reached = f"last size {parsed.rows[-1].size_bytes} B" if parsed.rows else "no result row"
        reasons.append(f"the output ends before the closing '# Avg bus bandwidth' line ({reached}): crashed or "
                       f"truncated")
    if run.returncode is None:
        reasons.append("no exit status")
    elif run.returncode != 0 and not explained:
        reasons.append(f"exit status {run.returncode}")
    if failing and not explained:
        reasons.append(f"{len(failing)} error line(s)")
    return reasons


def _stderr_lines(stderr: str, where: str) -> list[Line]:
    """Failure lines of the launcher's stderr (srun's 'error:' lines, NCCL WARN on stderr, a rank's abort)."""
    if not stderr.strip():
        return []
    try:
        parsed = parse_nccl_tests(stderr[-(64 << 10):], f"{where} (stderr)")
    except ParseError:
        return []
    return [*parsed.errors, *(w for w in parsed.warnings if _FAILING_WARN.search(w.text))]


def _sizes(rows: list[Row]) -> list[_SizeStats]:
    """Every size in order of first appearance, with one sample per cycle (-N prints the table again per cycle).
    0 B rows move no data and are left out."""
    by_size: dict[int, _SizeStats] = {}
    for row in rows:
        if row.size_bytes <= 0:
            continue
        stats = by_size.setdefault(row.size_bytes, _SizeStats(row.size_bytes, [], []))
        stats.times_us.append(min(row.out_of_place.time_us, row.in_place.time_us))
        stats.busbw_gbps.append(row.busbw_gbps)
    return list(by_size.values())


def p95(values: Sequence[float]) -> float:
    """95th percentile, linear between the closest ranks (numpy's default): 0.95 x (n - 1) along the sorted list."""
    ordered = sorted(values)
    pos = 0.95 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _figures(sizes: list[_SizeStats], p: Mapping[str, Any]) -> dict[str, Any]:
    small_max, large_min, min_cycles = int(p["small_max_bytes"]), int(p["large_min_bytes"]), int(p["min_cycles"])
    small = [s for s in sizes if s.size_bytes <= small_max]
    middle = [s for s in sizes if small_max < s.size_bytes < large_min]
    large = [s for s in sizes if s.size_bytes >= large_min]
    cycles = max((len(s.times_us) for s in sizes), default=0)
    fewest = min((len(s.times_us) for s in small), default=0)
    statistic = "p95" if small and fewest >= min_cycles else "median"

    def latency_of(s: _SizeStats) -> float:
        return p95(s.times_us) if statistic == "p95" else statistics.median(s.times_us)

    per_size = []
    for s in sizes[:_MAX_SIZES]:
        entry = {"size_bytes": s.size_bytes, "cycles": len(s.times_us),
                 "busbw_gbps": round(statistics.median(s.busbw_gbps), 3)}
        if s in small:
            entry[f"latency_{statistic}_us"] = round(latency_of(s), 3)
        per_size.append(entry)
    latency = statistics.median(latency_of(s) for s in small) if small else None
    top = max(large, key=lambda s: s.size_bytes) if large else None
    return {
        "latency": latency,
        "transition": statistics.median(statistics.median(s.busbw_gbps) for s in middle) if middle else None,
        "busbw": statistics.median(top.busbw_gbps) if top else None,
        "small_sizes": len(small), "fewest_small_cycles": fewest, "statistic": statistic, "cycles": cycles,
        "busbw_size": top.size_bytes if top else None, "busbw_cycles": len(top.busbw_gbps) if top else 0,
        "evidence": {"cycles": cycles, "latency_statistic": statistic, "sizes": per_size,
                     "busbw_size_bytes": top.size_bytes if top else None,
                     "short_sizes": [s.size_bytes for s in sizes if len(s.times_us) < cycles][:_MAX_SIZES]},
    }


def _regimes(fig: Mapping[str, Any], baseline: Baseline, p: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(slow reasons, other reasons): each regime judged against its baseline figure, or said to be not judged."""
    slow, notes = [], []
    why_missing = f"no baseline for {baseline.key} nodes"
    if baseline.notes:
        why_missing += f" ({'; '.join(baseline.notes)})"
    factor, fraction = float(p["latency_factor"]), float(p["busbw_fraction"])
    if fig["latency"] is None:
        notes.append(f"small-message latency not judged: no result row from 1 B to {p['small_max_bytes']} B")
    else:
        how = (f"median over {fig['small_sizes']} sizes <= {p['small_max_bytes']} B of each size's "
               + (f"p95 over {fig['fewest_small_cycles']}+ cycles" if fig["statistic"] == "p95" else
                  f"median over {fig['fewest_small_cycles']} cycle(s), fewer than the {p['min_cycles']} a p95 "
                  f"needs"))
        what = f"small-message latency {fig['latency']:.1f} us ({how})"
        b = baseline.latency_p95_us
        if b is None:
            notes.append(f"{what}: not judged: {why_missing}")
        elif fig["latency"] > factor * b.value:
            slow.append(f"{what} > {factor:g} x baseline {b.value:g} us ({b.source})")
        else:
            notes.append(f"{what} within {factor:g} x baseline {b.value:g} us ({b.source})")
    if fig["transition"] is not None:
        notes.append(f"MB range (tree -> ring): bus bandwidth {fig['transition']:.1f} GB/s (median over its sizes; "
                     f"reported, not judged)")
    if fig["busbw"] is None:
        notes.append(f"bus bandwidth not judged: no result row at or above {p['large_min_bytes']} B")
    else:
        what = (f"bus bandwidth {fig['busbw']:.1f} GB/s at {fig['busbw_size']} B (median over "
                f"{fig['busbw_cycles']} cycle(s))")
        b = baseline.busbw_gbps
        if b is None:
            notes.append(f"{what}: not judged: {why_missing}")
        elif fig["busbw"] < fraction * b.value:
            slow.append(f"{what} < {fraction:g} x baseline {b.value:g} GB/s ({b.source})")
        else:
            notes.append(f"{what} within {fraction:g} x baseline {b.value:g} GB/s ({b.source})")
    return slow, notes


def _shown(figure: Figure | None) -> dict[str, Any] | None:
    return None if figure is None else {"value": figure.value, "unit": figure.unit, "source": figure.source}

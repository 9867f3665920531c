"""Intra-node NCCL all-reduce over every GPU of the node (nccl-tests all_reduce_perf): wrong results (silent data
corruption), a crashed or truncated run, and bus bandwidth at large sizes under the SKU's floor."""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import Analyzer, CheckSpec, Concern
from gpuwarden.agent.core.errors import NotApplicable, ParseError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.sku import sku_from_gpu_name
from gpuwarden.agent.core.thresholds import threshold
from gpuwarden.checks.parse_nccl_tests import Line, NcclTestsRun, parse_nccl_tests

CHECK_NAME = "nccl_allreduce"
TOOL = "all_reduce_perf"
FLOOR_KEY = "busbw_floor_gbps"
# A NCCL WARN line that reports a failure rather than a notice (e.g. "Cuda failure 'out of memory'").
_FAILING_WARN = re.compile(r"fail|error|abort|timeout|timed out", re.IGNORECASE)
_DETECT = re.compile(r"#\s*size\s+count\s+type\b|# Avg bus bandwidth\s*:|#\s*nThread \d+ nGpus \d+"
                     r"|\b[nr]ccl-tests version\b|# Collective test starting:")


@dataclass(frozen=True)
class Floor:
    gbps: float | None
    origin: str  # where the figure comes from, or why there is none


def argv(n_gpus: int) -> list[str]:
    return [TOOL, "-b", "8", "-e", "2G", "-f", "2", "-g", str(n_gpus), "-c", "1"]


def floor_for(sku: str, cfg: Mapping[str, Any]) -> Floor:
    value = threshold(CHECK_NAME, FLOOR_KEY, sku, cfg)
    if value is None:
        return Floor(None, f"no floor for SKU {sku}: set [checks.{CHECK_NAME}] {FLOOR_KEY}")
    if (cfg.get(FLOOR_KEY) or 0) > 0:
        return Floor(value, f"[checks.{CHECK_NAME}] {FLOOR_KEY}")
    return Floor(value, f"SKU {sku} (thresholds/{CHECK_NAME}.toml)")


def _lines(lines: Iterable[Line], last: int = 5) -> list[str]:
    return [f"{ln.line}: {ln.text[:300]}" for ln in list(lines)[-last:]]


def decide(run: NcclTestsRun, entity: Entity, floor: Floor, policy: Mapping[str, Any],
           returncode: int | None = None) -> list[Finding]:
    """Findings for one all_reduce_perf run; `returncode` None when unknown (a saved output)."""
    def finding(code: str, status: Status, action: Action, msg: str, **evidence: Any) -> Finding:
        return Finding(CHECK_NAME, code, entity, status, msg, action, evidence)

    out: list[Finding] = []
    wrong = [r for r in run.rows if r.wrong > 0]
    corrupt = bool(wrong) or (run.out_of_bounds or 0) > 0
    if corrupt:
        rows = [{"size_bytes": r.size_bytes, "type": r.type, "redop": r.redop, "line": r.line,
                 "out_of_place_wrong": r.out_of_place.wrong, "in_place_wrong": r.in_place.wrong} for r in wrong]
        sizes = ", ".join(str(r.size_bytes) for r in wrong) or "(rows not shown)"
        out.append(finding("nccl-wrong-results", Status.FAIL, Action.DRAIN,
                           f"all-reduce returned wrong values (sizes {sizes} B; out of bounds: {run.out_of_bounds}):"
                           " silent data corruption on this node's GPUs or NVLink; drain it", rows=rows,
                           out_of_bounds=run.out_of_bounds))

    failing = sorted([*run.errors, *(w for w in run.warnings if _FAILING_WARN.search(w.text))], key=lambda ln: ln.line)
    # nccl-tests prints "Test failure" and exits non-zero after its own verdicts (wrong values, average bandwidth).
    explained = run.complete and (corrupt or run.avg_busbw_failed)
    reasons = []
    if not run.complete:
        reasons.append("the output ends before the closing '# Avg bus bandwidth' line (crashed or truncated)")
    if returncode not in (None, 0) and not explained:
        reasons.append(f"exit status {returncode}")
    if failing and not explained:
        reasons.append(f"{len(failing)} error line(s)")
    crashed = bool(reasons)
    if crashed:
        last = failing[-1] if failing else None
        tail = f"; last error (line {last.line}): {last.text[:300]}" if last else ""
        out.append(finding("nccl-crashed", Status.FAIL, Action.DRAIN,
                           f"{TOOL} failed: {'; '.join(reasons)}{tail}", returncode=returncode,
                           complete=run.complete, rows=len(run.rows),
                           last_size_bytes=run.rows[-1].size_bytes if run.rows else None,
                           error_lines=_lines(failing), warn_lines=_lines(run.warnings)))

    large = [r for r in run.rows if r.size_bytes >= policy["large_size_bytes"]]
    measured = [{"size_bytes": r.size_bytes, "busbw_gbps": r.busbw_gbps} for r in large]
    low = []
    if floor.gbps is not None:
        low = [{"size_bytes": r.size_bytes, "busbw_gbps": r.busbw_gbps, "floor_gbps": floor.gbps,
                "out_of_place_busbw_gbps": r.out_of_place.busbw_gbps, "in_place_busbw_gbps": r.in_place.busbw_gbps}
               for r in large if r.busbw_gbps < floor.gbps]
    if low or run.avg_busbw_failed:
        what = (f"bus bandwidth under the floor of {floor.gbps:g} GB/s ({floor.origin}) at "
                + ", ".join(f"{x['size_bytes']} B: {x['busbw_gbps']:g} GB/s" for x in low)) if low else \
            f"nccl-tests' own average bus bandwidth check FAILED (avg {run.avg_busbw_gbps})"
        out.append(finding("nccl-busbw-low", Status.FAIL, Action.DRAIN,
                           f"{what}: a degraded NVLink/NVSwitch path slows every collective; drain and check "
                           "nvidia-smi nvlink -s", low=low, floor_gbps=floor.gbps, floor_origin=floor.origin,
                           avg_busbw_gbps=run.avg_busbw_gbps, tool_avg_check_failed=run.avg_busbw_failed))
    elif not crashed and floor.gbps is None:
        out.append(finding("nccl-no-floor", Status.WARN, Action.NONE,
                           f"bus bandwidth not judged: {floor.origin}", large_sizes=measured,
                           avg_busbw_gbps=run.avg_busbw_gbps))
    elif not crashed and not large:
        out.append(finding("nccl-no-large-sizes", Status.WARN, Action.NONE,
                           f"bus bandwidth not judged: no result row at or above {policy['large_size_bytes']} B",
                           largest_size_bytes=max((r.size_bytes for r in run.rows), default=None)))

    notices = [w for w in run.warnings if not _FAILING_WARN.search(w.text)]
    if notices and not crashed:
        out.append(finding("nccl-warnings", Status.WARN, Action.MONITOR,
                           f"NCCL printed {len(notices)} warning(s); last: {notices[-1].text[:300]}",
                           warn_lines=_lines(notices)))
    return out


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    gpus = node.gpus()  # an NVML error propagates: UNKNOWN with its reason
    n = len(gpus)
    if n < 2:
        raise NotApplicable(f"{n} GPU(s): no intra-node all-reduce to test")
    entity = Entity("node", node.hostname)
    lost = [g for g in gpus if g.error is not None]
    if lost:
        # An all-reduce over a GPU NVML cannot open only fails, and says nothing new: the GPU checks
        # already report the lost GPU. Running on the rest would not test the node as it will be used.
        names = ", ".join(g.entity.label() for g in lost)
        yield Finding(CHECK_NAME, "nccl-not-run", entity, Status.UNKNOWN,
                      f"all-reduce not run: {names} cannot be opened ({lost[0].error})", Action.NONE,
                      {"unusable_gpus": [g.index for g in lost]})
        return
    result = node.tools.run(TOOL, argv(n), cfg["tool_timeout_s"])
    try:
        parsed = parse_nccl_tests(result.output, f"{TOOL} output")
    except ParseError as err:
        if result.returncode == 0:
            raise  # a tool that says it succeeded but printed no result: UNKNOWN with the reason
        last = next((ln for ln in reversed(result.output.splitlines()) if ln.strip()), "(no output)")
        yield Finding(CHECK_NAME, "nccl-crashed", entity, Status.FAIL,
                      f"{TOOL} failed: exit status {result.returncode} and no result table; last line: {last[:300]}",
                      Action.DRAIN, {"returncode": result.returncode, "parse_error": str(err)})
        return
    yield from decide(parsed, entity, floor_for(node.info.sku, cfg), cfg, result.returncode)
    if parsed.problems:
        yield Finding(CHECK_NAME, "nccl-unparsed-lines", entity, Status.WARN,
                      f"{len(parsed.problems)} line(s) of {TOOL} output looked like result rows but were not; "
                      f"first: {parsed.problems[0]}", Action.NONE, {"lines": [str(p) for p in parsed.problems[:10]]})


def analyze(text: str, source: str) -> tuple[list[Finding], list[ParseError]]:
    """`gpuwarden analyze` on a saved nccl-tests output: the same decision, with the floor of the GPU the device
    lines name (none for a multi-node run: the intra-node floor does not apply there)."""
    parsed = parse_nccl_tests(text, source)
    skus = {sku_from_gpu_name(d.name) for d in parsed.devices}
    hosts = parsed.hosts
    if parsed.collective not in (None, TOOL):
        floor = Floor(None, f"the output is {parsed.collective}, not {TOOL}: the all-reduce floor does not apply")
    elif len(hosts) > 1:
        floor = Floor(None, f"a run over {len(hosts)} nodes: the intra-node floor does not apply")
    elif len(skus) == 1 and "unknown" not in skus:
        floor = floor_for(skus.pop(), CHECK.defaults)
    else:
        floor = Floor(None, "the output names no GPU of a known SKU (no '#  Rank ... device' lines, or other GPUs)")
    entity = Entity("node", hosts[0] if len(hosts) == 1 else ",".join(hosts) or "unknown")
    return decide(parsed, entity, floor, CHECK.defaults), list(parsed.problems)


def detect(text: str) -> bool:
    return _DETECT.search(text[:1_000_000]) is not None


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="intra-node NCCL all-reduce: correct results, no crash, bus bandwidth above the SKU floor",
    run=run,
    defaults={
        FLOOR_KEY: 0.0,  # GB/s; 0 = the SKU's figure in thresholds/nccl_allreduce.toml
        "large_size_bytes": 1073741824,  # sizes judged on bandwidth (smaller ones are latency-bound)
        "tool_timeout_s": 570.0,  # all_reduce_perf's own limit, under the check's 600 s
    },
    timeout_s=600,
    level="full",
    resources=("gpu",),
    analyzers=(Analyzer("nccl-tests", detect, analyze),),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="nccl_allreduce", order=120, level="full", look="CHECK", analyze=("nccl-tests",),
)

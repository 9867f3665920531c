"""Burn-in: the same seeded GEMM on every GPU for a while. A GPU below the SKU floor or well below the node's
median is slow; a GPU whose result differs bit for bit from its peers of the same model computes wrong (silent
data corruption). Without PyTorch: DCGM's targeted_stress; without either the check does not apply."""
from __future__ import annotations

from collections import Counter, defaultdict
from statistics import median
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import ConfigError, NotApplicable, ParseError, SourceError, ToolError, ToolMissing
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.per_gpu import read_each_gpu
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.thresholds import sku_table, threshold
from gpuwarden.agent.sources.gemm import DTYPES, Gemm, GemmResult
from gpuwarden.checks.dcgm_diag import slug
from gpuwarden.checks.parse_dcgmi_diag import TestResult, parse_dcgmi_diag_json

CHECK_NAME = "burnin"
HALF_DTYPES = ("bfloat16", "float16")  # the SKU table's floors are for these (same Tensor Core peak)
DCGM_TOOL = "dcgmi-diag-targeted_stress"  # recorded as tools/dcgmi-diag-targeted_stress.out


@dataclass(frozen=True)
class GpuGemm:
    entity: Entity
    model: str  # checksums are compared only among GPUs of one model (cuBLAS: same architecture and SM count)
    result: GemmResult


def _finding(r: GpuGemm, code: str, status: Status, action: Action, msg: str, **evidence: Any) -> Finding:
    base = {"device": r.result.device, "checksum": r.result.checksum, "tflops": round(r.result.tflops, 3)}
    return Finding(CHECK_NAME, code, r.entity, status, f"{r.entity.label()}: {msg}", action, {**base, **evidence})


def decide(runs: list[GpuGemm], floor: float | None, policy: Mapping[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    groups: dict[tuple[str, int | None], list[GpuGemm]] = defaultdict(list)
    for r in runs:
        groups[(r.model, r.result.sm_count)].append(r)
    for (model, _), members in groups.items():
        counts = Counter(r.result.checksum for r in members)
        if len(counts) < 2:
            continue
        top, agree = counts.most_common(1)[0]
        if agree * 2 > len(members):  # a strict majority names the odd ones out
            out += [_finding(r, "gemm-checksum-mismatch", Status.FAIL, Action.SERVICE,
                             f"GEMM result differs from {agree} of {len(members)} {model} GPUs given the same "
                             "inputs: the GPU computes wrong (silent data corruption); take it out of service",
                             majority_checksum=top) for r in members if r.result.checksum != top]
        else:
            out += [_finding(r, "gemm-checksum-mismatch", Status.FAIL, Action.DRAIN,
                             f"{len(counts)} different GEMM results among {len(members)} {model} GPUs and no "
                             "majority: one of them computes wrong but which cannot be told here; drain and "
                             "rerun the burn-in, or compare with a known-good node",
                             results=dict(counts)) for r in members]
    out += [_finding(r, "gemm-result-unstable", Status.FAIL, Action.SERVICE,
                     "the same GEMM gave a different result at the end of the run than at the start: the GPU "
                     "computes wrong (silent data corruption)") for r in runs if not r.result.stable]
    drop = float(policy["relative_drop"])

    medians = {key: median(r.result.tflops for r in members) for key, members in groups.items()}
    for r in runs:
        med = medians[(r.model, r.result.sm_count)]
        reasons = []
        if floor is not None and r.result.tflops < floor:
            reasons.append(f"below the floor of {floor:g}")
        if drop > 0 and r.result.tflops < med * (1 - drop):
            reasons.append(f"{(1 - r.result.tflops / med) * 100:.0f}% below the node's median of {med:.1f}")
        if reasons:
            out.append(_finding(r, "gemm-slow", Status.FAIL, Action.DRAIN,
                                f"GEMM runs at {r.result.tflops:.1f} TFLOP/s, {' and '.join(reasons)}: a throttled "
                                "or failing GPU slows every job it joins", floor_tflops=floor,
                                median_tflops=round(med, 3), iterations=r.result.iterations))
    return out


def targeted_stress_results(text: str, source: str) -> list[TestResult]:
    """The targeted_stress results of `dcgmi diag -r targeted_stress -j` output (DCGM 3.x and 4.x, through the
    project's dcgmi parser). ParseError when the output holds none; ToolError when DCGM could not run the test."""
    run = parse_dcgmi_diag_json(text, source)
    if run.runtime_error:
        raise ToolError(f"dcgmi diag could not run targeted_stress: {run.runtime_error}")
    results = [r for r in run.results if slug(r.test) == "targeted-stress"]
    if not results:
        raise ParseError("no targeted_stress result in dcgmi JSON", source)
    return results


def _dcgm(node: Any, cfg: Mapping[str, Any], why: str) -> Iterable[Finding]:
    try:
        out = node.tools.run(DCGM_TOOL, ["dcgmi", "diag", "-r", "targeted_stress", "-j"], cfg["dcgm_timeout_s"])
    except ToolMissing as exc:
        raise NotApplicable(f"{why} and no DCGM ({exc})") from None
    try:
        results = targeted_stress_results(out.output, DCGM_TOOL)
    except ParseError:
        if out.returncode != 0:  # dcgmi failed before printing a diagnostic: say what it said
            raise ToolError(f"dcgmi diag exited {out.returncode}: {out.output.strip()[:200]}") from None
        raise
    gpus = {gpu.index: gpu.entity for gpu in node.gpus()}
    for result in results:
        if result.status not in ("fail", "warn"):
            continue
        entity = (gpus.get(result.gpu) if result.gpu is not None else None) or Entity.node(node.hostname)
        bad = result.status == "fail"
        detail = "; ".join(result.messages or result.info)[:300]
        yield Finding(CHECK_NAME, f"dcgm-targeted-stress-{result.status}", entity,
                      Status.FAIL if bad else Status.WARN, f"{entity.label()}: DCGM targeted_stress {result.status}: "
                      f"{detail}", Action.DRAIN if bad else Action.MONITOR,
                      {"dcgm_gpu_id": result.gpu, "detail": detail})


def _device(gemm: Gemm, gpu: Any, device: str) -> str:
    if device == "cpu":
        return "cpu"  # CI and development: the real code on the CPU, every "GPU" sharing it
    if device == "cuda":
        return gemm.cuda_device(gpu)
    raise ConfigError(f"checks.burnin.device must be 'cuda' or 'cpu', got {device!r}")


def run(node: Any, cfg: Mapping[str, Any], gemm: Gemm | None = None) -> Iterable[Finding]:
    gemm = gemm or Gemm.for_node(node, use_torch=cfg["use_torch"])
    why = gemm.why_unavailable(cfg["device"])
    if why:
        yield from _dcgm(node, cfg, why)
        return
    readable, problems = read_each_gpu(node, CHECK_NAME, lambda gpu: gpu)
    yield from problems
    devices = {gpu.index: _device(gemm, gpu, cfg["device"]) for gpu, _ in readable}
    try:
        results = gemm.run(list(devices.values()), cfg["matrix_size"], cfg["dtype"], cfg["seconds"], cfg["seed"])
    except SourceError as exc:  # a finding, so the per-GPU findings above are kept with it
        yield Finding(CHECK_NAME, "gemm-error", Entity.node(node.hostname), Status.UNKNOWN,
                      f"could not run the burn-in: {exc}")
        return
    runs = []
    for gpu, _ in readable:
        res = results[devices[gpu.index]]
        if isinstance(res, SourceError):
            yield Finding(CHECK_NAME, "gemm-error", gpu.entity, Status.UNKNOWN,
                          f"{gpu.entity.label()}: could not run the burn-in: {res}", Action.NONE,
                          {"device": devices[gpu.index]})
        else:
            runs.append(GpuGemm(gpu.entity, gpu.name or res.name or "unknown", res))
    sku = node.info.sku
    table_applies = cfg["device"] != "cpu" and cfg["dtype"] in HALF_DTYPES
    floor = threshold(CHECK_NAME, "tflops_floor", sku if table_applies else "unknown", cfg)
    if floor is None and runs:
        yield Finding(CHECK_NAME, "gemm-floor-unknown", Entity.node(node.hostname), Status.WARN,
                      f"no TFLOP/s floor for SKU {sku} with {cfg['dtype']} on {cfg['device']}: only the "
                      "node-relative rule judged speed; set checks.burnin.tflops_floor", Action.NONE,
                      {"sku": sku, "dtype": cfg["dtype"], "device": cfg["device"],
                       "bf16_dense_peak_tflops": sku_table(CHECK_NAME).get(sku, {}).get("bf16_dense_peak_tflops")})
    yield from decide(runs, floor, cfg)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="GEMM burn-in per GPU: TFLOP/s against the SKU floor and the node median, results bitwise equal",
    run=run,
    defaults={
        "seconds": 10.0,  # timed GEMM loop per GPU (all GPUs at once); raise the agent's check_timeout_s with it
        "matrix_size": 8192,  # n of the n x n x n multiply
        "dtype": "bfloat16",  # bfloat16 | float16 | float32 (the SKU floors hold for the first two)
        "relative_drop": 0.1,  # a GPU more than this fraction below the node's median is slow
        "tflops_floor": 0.0,  # 0 = the SKU table (checks/data/thresholds/burnin.toml)
        "device": "cuda",  # cuda | cpu (CI: the real torch code on the CPU with tiny sizes)
        "seed": 1234,  # inputs are generated from it on the CPU, identical on every GPU and node
        "use_torch": True,  # false: DCGM targeted_stress even where PyTorch is installed
        "dcgm_timeout_s": 240.0,
    },
    choices={"dtype": DTYPES, "device": ("cuda", "cpu")},
    timeout_s=300,
    level="full",
    resources=("gpu",),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="burnin", order=100, level="full", look="CHECK",
)

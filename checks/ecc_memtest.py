"""HBM integrity by DCGM's memory test (`dcgmi diag -r memory -j`) where DCGM is installed: a GPU whose memory
test fails on a memory fault is FAIL with the action DCGM documents for that error; an untested GPU is UNKNOWN."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import ParseError, SourceError, ToolError
from gpuwarden.agent.core.model import Action, Finding, Status
from gpuwarden.checks.dcgm_diag import (
    ERROR_ACTIONS,
    describe,
    error_ids,
    evidence,
    gpu_entity,
    require_ran,
    slug,
    targets,
)
from gpuwarden.checks.parse_dcgmi_diag import DiagRun, TestResult, parse_dcgmi_diag_json

CHECK_NAME = "ecc_memtest"
TOOL = "dcgmi-diag-memory"
# The memory plugin's canonical name is "memory" (DCGM docs, reference/diagnostics/plugins/memory.html;
# MEMORY_PLUGIN_NAME in nvvs/include/PluginStrings.h); DCGM 3.x shows it as "GPU Memory".
ARGV = ("dcgmi", "diag", "-r", "memory", "-j")
MEMORY_FAULTS = set(ERROR_ACTIONS) | {84}  # 84 UNCORRECTABLE_ROW_REMAP: rows remapped after DBE
EC_HARDWARE_MEMORY = 10  # DCGM_FR_EC_HARDWARE_MEMORY
# Software/setup categories (DCGM_FR_EC_SOFTWARE_* 3..8, INTERNAL 16) and setup codes: DCGM's docs say a Fail is
# "the named defect" or "could not complete because of a setup or execution error"; these are the second kind.
EC_SETUP = {3, 4, 5, 6, 7, 8, 16}
SETUP_ERRORS = {44, 47, 48, 51, 55, 56, 59, 60, 66, 73}  # INTERNAL, ABORTED, TEST_DISABLED, CUDA_API, ECC_DISABLED,
# MEMORY_ALLOC, CUDA_DEVICE, ECC_UNSUPPORTED, CUDA_CONTEXT, MEMORY_ALLOC_HOST


def classify(r: TestResult) -> tuple[str, Status, Action]:
    """A failed memory test: a memory fault (its documented action; SERVICE for an unlisted hardware-memory
    code), a setup error (UNKNOWN: memory not judged), or unclassified (FAIL/DRAIN: look before reuse)."""
    ids = error_ids(r)
    categories = {e.category for e in r.errors if e.category is not None}
    if any(i in MEMORY_FAULTS for i in ids) or EC_HARDWARE_MEMORY in categories:
        known = [ERROR_ACTIONS[i] for i in ids if i in ERROR_ACTIONS]
        return "hbm-memtest-fail", Status.FAIL, max(known, default=Action.SERVICE)
    if (ids and all(i in SETUP_ERRORS for i in ids)) or (categories and categories <= EC_SETUP):
        return "hbm-memtest-error", Status.UNKNOWN, Action.NONE
    return "hbm-memtest-fail", Status.FAIL, Action.DRAIN


def decide(run: DiagRun, gpus: Sequence[Any], policy: Mapping[str, Any], node: str = "node") -> list[Finding]:
    memory = [r for r in run.results if slug(r.test) == "memory"]
    out: list[Finding] = []
    for r in memory:
        if r.status == "fail":
            code, status, action = classify(r)
            verb = "failed"
        elif r.status == "warn":
            code, status, action, verb = "hbm-memtest-warn", Status.WARN, Action.MONITOR, "warned"
        elif r.status in ("skip", "not_run"):
            code, status, action, verb = "hbm-memtest-skipped", Status.UNKNOWN, Action.NONE, "was skipped"
        else:
            continue
        for entity in targets(r, gpus, node):
            note = "; HBM not judged" if status is Status.UNKNOWN else f"; recommended: {action.name}"
            out.append(Finding(CHECK_NAME, code, entity, status, f"{entity.label()}: {describe(r, verb)}{note}",
                               action, evidence(run, r)))
    expected = {g.index for g in gpus if g.index is not None} | set(run.gpus_listed)
    tested = {r.gpu for r in memory if r.gpu is not None}
    if not any(r.all_gpus for r in memory):
        for idx in sorted(expected - tested):
            entity = gpu_entity(idx, gpus)
            out.append(Finding(CHECK_NAME, "hbm-memtest-not-run", entity, Status.UNKNOWN,
                               f"{entity.label()}: DCGM's memory test reported no result for this GPU: HBM not "
                               "judged", Action.NONE, {"tested_gpu_ids": sorted(tested), "source": run.source}))
    return out


def read(node: Any, timeout_s: float) -> DiagRun:
    out = node.tools.run(TOOL, list(ARGV), timeout_s)  # ToolMissing (no dcgmi) -> SKIPPED
    try:
        diag = parse_dcgmi_diag_json(out.output, TOOL)
    except ParseError:
        if out.returncode != 0:
            raise ToolError(f"{' '.join(ARGV)} exited {out.returncode}: {out.output.strip()[:200]}") from None
        raise
    require_ran(diag, " ".join(ARGV))
    return diag


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    diag = read(node, float(cfg["timeout_s"]))
    try:
        gpus = list(node.gpus())
    except SourceError:
        gpus = []
    yield from decide(diag, gpus, cfg, node.hostname)


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="HBM integrity by DCGM's memory test (dcgmi diag -r memory), per GPU, where DCGM is installed",
    run=run,
    defaults={"timeout_s": 570.0},  # dcgmi's own limit, under the check's 600 s so its error wins
    timeout_s=600,
    level="full",
    resources=("gpu",),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="ecc_memtest", order=150, level="full", look="CHECK",
)

"""DCGM diagnostics (`dcgmi diag -r 2 -j`): every failing or warning test x GPU is a finding carrying DCGM's own
message and error id; a GPU DCGM reported no result for is UNKNOWN, never passed, and so is a diagnostic that tested
nothing (no test, no result, every test skipped or not run: the check is UNKNOWN, with the reason)."""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.check import Analyzer, CheckSpec, Concern
from gpuwarden.agent.core.errors import ConfigError, ParseError, SourceError, ToolError
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.checks.parse_dcgmi_diag import (
    DiagRun,
    TestResult,
    diag_from_json,
    looks_like_dcgmi_diag_json,
    parse_dcgmi_diag_json,
)
from gpuwarden.checks.parse_dcgmi_diag_text import looks_like_dcgmi_diag_text, parse_dcgmi_diag_text

CHECK_NAME = "dcgm_diag"

# A failed test is FAIL/DRAIN: DCGM's docs call level 2 "an epilogue on failure", and a Fail means either the
# defect the plugin looks for or a setup error, so the node leaves service until someone looks. These DCGM error
# ids ask for more; each from the next step DCGM attaches to the code (DCGM_FR_*_NEXT, dcgmlib/dcgm_errors.h):
ERROR_ACTIONS: dict[int, Action] = {
    4: Action.RESET_GPU,   # VOLATILE_DBE_DETECTED: "Drain the GPU and reset it or reboot the node."
    81: Action.RESET_GPU,  # UNCONTAINED_ERROR (XID 95): same next step as 4
    83: Action.RESET_GPU,  # DBE_PENDING_PAGE_RETIREMENTS: "Drain the GPU and reset it or reboot the node ..."
    85: Action.RESET_GPU,  # PENDING_ROW_REMAP: "... Reset GPU. Restart DCGM. Rerun diagnostics."
    # "Run a field diagnostic on the GPU." (TRIAGE_RUN_FIELD_DIAG_MSG): the hardware qualification / RMA path.
    7: Action.SERVICE,     # RETIRED_PAGES_LIMIT
    8: Action.SERVICE,     # RETIRED_PAGES_DBE_LIMIT
    52: Action.SERVICE,    # FAULTY_MEMORY
    57: Action.SERVICE,    # CUDA_DBE
    58: Action.SERVICE,    # MEMORY_MISMATCH
    79: Action.SERVICE,    # L1TAG_MISCOMPARE
    80: Action.SERVICE,    # ROW_REMAP_FAILURE
    111: Action.SERVICE,   # NAN_VALUE
}
SEVERITY_RESET = 6  # DCGM_ERROR_RESET, "Drain and reset GPU" (dcgmErrorSeverity_t)
SEVERITY_NAMES = {1: "MONITOR", 2: "ISOLATE", 3: "UNKNOWN", 4: "TRIAGE", 5: "CONFIG", 6: "RESET"}
# The text table carries no ids; DCGM's message templates (DCGM_FR_*_MSG) name the error instead.
_MESSAGE_IDS = [(re.compile(p, re.I), code) for p, code in (
    (r"volatile double-bit ECC error", 4), (r"uncontained error", 81), (r"page retirements together with a DBE", 83),
    (r"row remappings? (are|is) pending", 85), (r"retired pages due to DBEs", 8), (r"retired pages have been", 7),
    (r"faulty memory elements", 52), (r"double-bit ECC error has occur", 57), (r"memory mismatch was detected", 58),
    (r"miscompare failure in the L1 cache", 79), (r"row remapping failed", 80), (r"NaN-value memory elements", 111))]
# 3.x display names of the per-GPU plugins -> 4.x plugin names, so a finding's code is the same on both.
_ALIASES = {"gpu memory": "memory", "memory bandwidth": "memory_bandwidth", "targeted stress": "targeted_stress",
            "targeted power": "targeted_power", "sm stress": "sm_stress", "pulse test": "pulse_test",
            "eud test": "eud", "cpu eud test": "cpu_eud", "context create": "context_create"}


def slug(name: str) -> str:
    """"GPU Memory" and "memory" -> "memory"; "Page Retirement/Row Remap" -> "page-retirement-row-remap"."""
    key = name.strip().lower()
    return re.sub(r"[^a-z0-9]+", "-", _ALIASES.get(key, key)).strip("-")


def error_ids(result: TestResult) -> list[int]:
    """DCGM's error ids of a result; for the text form (no ids), the ids its messages are the template of."""
    ids = list(dict.fromkeys(result.error_ids))
    return ids or [code for e in result.errors for rx, code in _MESSAGE_IDS if rx.search(e.message)][:1]


def failure_action(result: TestResult, default: Action = Action.DRAIN) -> Action:
    actions = [default, *(ERROR_ACTIONS[i] for i in error_ids(result) if i in ERROR_ACTIONS)]
    if any(e.severity == SEVERITY_RESET for e in result.errors):
        actions.append(Action.RESET_GPU)
    return max(actions)


def gpu_entity(gpu_id: int, gpus: Sequence[Any]) -> Entity:
    """DCGM numbers GPUs in NVML's enumeration order, so its GPU id is the NVML index."""
    for gpu in gpus:
        if gpu.index == gpu_id:
            return gpu.entity
    return Entity("gpu", f"dcgm-gpu-{gpu_id}", gpu_id)


def targets(result: TestResult, gpus: Sequence[Any], node: str) -> list[Entity]:
    if result.gpu is not None:
        return [gpu_entity(result.gpu, gpus)]
    if result.gpu_ids:  # a system-wide test whose error names GPUs ("GPU 3 has ... row remappings are pending")
        return [gpu_entity(g, gpus) for g in result.gpu_ids]
    if result.all_gpus and gpus:
        return [g.entity for g in gpus]
    return [Entity.node(node)]


# The statuses of a test that ran on what it names. Skip and Not Run are tests that did not (a plugin DCGM could not
# load, a GPU it would not test: MIG mode, a missing EUD package); Info is a note, no verdict. None of them passes.
RAN = frozenset(("pass", "warn", "fail"))


def require_ran(run: DiagRun, what: str) -> None:
    """dcgmi answered, but the diagnostic did not run ("runtime_error") or tested nothing: could not look. A run
    whose every result is Skip or Not Run is not a pass: nothing in it was looked at."""
    if run.runtime_error:
        raise ToolError(f"{what}: DCGM did not run the diagnostic: {run.runtime_error[:300]}")
    if not run.results:
        listed = (f"it lists {run.tests} test(s), none with a result" if run.tests else
                  "it lists no test ('test_categories' is empty)" if run.schema != "text" else "it lists no test")
        raise ToolError(f"{what}: DCGM reported no test result ({listed}): nothing was tested, so nothing is known "
                        "healthy")
    if not any(r.status in RAN for r in run.results):
        counts: dict[str, int] = {}
        for r in run.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        said = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in sorted(counts.items()))
        raise ToolError(f"{what}: every result DCGM reported is a test that did not run ({said}): nothing was "
                        "tested, so nothing is known healthy")


def evidence(run: DiagRun, r: TestResult) -> dict[str, Any]:
    return {"test": r.test, "category": r.category, "dcgm_status": r.status, "dcgm_gpu_id": r.gpu,
            "entity": r.entity, "messages": list(r.messages), "error_ids": error_ids(r),
            "error_categories": [e.category for e in r.errors if e.category is not None],
            "error_severities": [SEVERITY_NAMES.get(e.severity, e.severity) for e in r.errors if e.severity],
            "info": list(r.info[:4]), "dcgm_version": run.version, "format": run.schema, "source": run.source}


def describe(r: TestResult, verb: str) -> str:
    what = "; ".join(r.messages) or "no message from DCGM"
    what = what if len(what) <= 400 else what[:397] + "..."
    ids = error_ids(r)
    return (f"DCGM {r.test or r.category or 'diag'} {verb}{' on ' + r.entity if r.entity else ''}: {what}"
            + (f" (DCGM error {', '.join(map(str, ids))})" if ids else ""))


def decide(run: DiagRun, gpus: Sequence[Any], policy: Mapping[str, Any], node: str = "node") -> list[Finding]:
    """One finding per failing (FAIL) or warning (WARN/MONITOR) test x GPU; pass/skip/info/not-run results are
    not findings. GPUs the node has (or DCGM listed) with no per-GPU result of a test that ran (pass, warn, fail)
    are UNKNOWN when the run has per-GPU tests (level >= 2, or any per-GPU result): not tested is not passed. With
    no GPU known (analyze of a file that lists none), a level >= 2 run in which no per-GPU test ran is UNKNOWN on
    the node."""
    ignored = {slug(t) for t in policy.get("ignore_tests", ())}
    out: dict[tuple[str, Entity], Finding] = {}
    for r in run.results:
        name = slug(r.test or r.category or "diag")
        if name in ignored or r.status not in ("fail", "warn"):
            continue
        status, action = (Status.FAIL, failure_action(r)) if r.status == "fail" else (Status.WARN, Action.MONITOR)
        for entity in targets(r, gpus, node):
            f = Finding(CHECK_NAME, f"dcgm-{name}", entity, status,
                        f"{entity.label()}: {describe(r, 'failed' if r.status == 'fail' else 'warned')}; "
                        f"recommended: {action.name}", action, evidence(run, r))
            old = out.get((f.code, entity))  # two results of one test on one GPU: keep the worse
            if old is None or (f.status.rank, f.action) > (old.status.rank, old.action):
                out[(f.code, entity)] = f
    return [*out.values(), *untested(run, gpus, policy, node)]


def untested(run: DiagRun, gpus: Sequence[Any], policy: Mapping[str, Any], node: str = "node") -> list[Finding]:
    expected = {g.index for g in gpus if g.index is not None} | set(run.gpus_listed)
    per_gpu = [r for r in run.results if r.gpu is not None or r.all_gpus]
    ran = [r for r in per_gpu if r.status in RAN]  # a GPU whose every test was skipped was not tested
    if not (per_gpu or int(policy.get("level", 2)) >= 2) or any(r.all_gpus for r in ran):
        return []
    if not expected:
        if ran:  # which GPUs the node has is not known: those DCGM tested are judged, no other can be named
            return []
        return [Finding(CHECK_NAME, "dcgm-no-gpu-result", Entity.node(node), Status.UNKNOWN,
                        f"DCGM reported no per-GPU result of a test that ran ({len(run.results)} system-wide or "
                        "skipped result(s): a level-1 run, or GPUs DCGM did not test): no GPU was tested, so none "
                        "is known healthy; a level-2 diagnostic tests each GPU",
                        Action.NONE, {"results": len(run.results), "per_gpu_results": len(per_gpu),
                                      "format": run.schema, "source": run.source})]
    tested = {r.gpu for r in ran}
    out = []
    for idx in sorted(expected - tested):
        entity = gpu_entity(idx, gpus)
        out.append(Finding(CHECK_NAME, "dcgm-gpu-not-tested", entity, Status.UNKNOWN,
                           f"{entity.label()}: DCGM reported no per-GPU result for this GPU (it tested GPU "
                           f"{', '.join(map(str, sorted(tested))) or 'none'}): not tested, so not known healthy",
                           Action.NONE, {"tested_gpu_ids": sorted(tested), "format": run.schema,
                                         "source": run.source}))
    return out


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    level = int(cfg["level"])
    if not 1 <= level <= 4:
        raise ConfigError(f"checks.{CHECK_NAME}.level must be 1..4, got {level}")
    what = f"dcgmi diag -r {level} -j"
    diag = diag_from_json(node.dcgm.diag(level, float(cfg["timeout_s"])), what)  # ToolMissing -> SKIPPED
    require_ran(diag, what)
    try:
        gpus = list(node.gpus())
    except SourceError:
        gpus = []  # DCGM's results still count, keyed by DCGM's GPU ids
    yield from decide(diag, gpus, cfg, node.hostname)


def unreadable(run: DiagRun) -> list[Finding]:
    """Rows of a text output that could not be read: what they said is not known (the other rows still count)."""
    if not run.problems:
        return []
    return [Finding(CHECK_NAME, "dcgm-unreadable-rows", Entity.node("-"), Status.UNKNOWN,
                    f"{len(run.problems)} row(s) of the dcgmi diag output could not be read; first: {run.problems[0]}",
                    Action.NONE, {"rows": [str(p)[:300] for p in run.problems[:10]], "source": run.source})]


def _analyze(parse: Any) -> Any:
    def analyze(text: str, source: str) -> tuple[list[Finding], list[ParseError]]:
        diag = parse(text, source)
        require_ran(diag, source)
        return decide(diag, (), CHECK.defaults, "-") + unreadable(diag), list(diag.problems)

    return analyze


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="DCGM diagnostics (dcgmi diag -r 2): failing and warning tests per GPU, with DCGM's message and code",
    run=run,
    defaults={
        "level": 2,  # dcgmi diag -r LEVEL, 1..4 (3 and 4 take 30 min to hours: raise both timeouts)
        "ignore_tests": [],  # test names ("pcie", "GPU Memory", "persistence mode") whose results are not judged
        "timeout_s": 870.0,  # dcgmi's own limit, under the check's 900 s so its error wins over the runner's
    },
    list_types={"ignore_tests": str},
    choices={"level": (1, 2, 3, 4)},
    timeout_s=900,
    level="full",
    resources=("gpu",),
    analyzers=(Analyzer("dcgmi-diag-json", looks_like_dcgmi_diag_json, _analyze(parse_dcgmi_diag_json)),
               Analyzer("dcgmi-diag-text", looks_like_dcgmi_diag_text, _analyze(parse_dcgmi_diag_text))),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="dcgm_diag", order=140, level="full", look="CHECK", analyze=("dcgmi-diag-json", "dcgmi-diag-text"),
)

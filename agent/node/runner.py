"""Runs checks concurrently, each with its own timeout, and turns every way a check can end into a result.

A check only yields findings. Here: an exception or a timeout -> UNKNOWN with the reason,
NotApplicable or a missing tool -> SKIPPED, and OK only for a check that ran to the end.

Each check runs in a tool scope (agent/sources/tools.py) whose deadline is the check's timeout, bounded by the run's
budget: its tools get no more time than the check has left. A check that times out has its scope cancelled and its
tools ended before its result is given and before its resources ("gpu", "network") are handed to the next check; an
interrupted run (SIGINT/SIGTERM reaching the caller as an exception) ends every tool before the exception goes on.
"""
from __future__ import annotations

import math
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.errors import GpuwardenError, NotApplicable, ToolMissing
from gpuwarden.agent.core.model import CheckResult, Finding, Status, fold_status
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.tools import Scope

log = logs.get_logger("gpuwarden.runner")

# progress(check_name, phase, result): phase is "start" or "done" (result set only on "done")
Progress = Callable[[str, str, "CheckResult | None"], None]


@dataclass
class _Outcome:
    findings: list[Finding] | None = None
    error: BaseException | None = None
    trace: str = ""


def _timeout_for(spec: CheckSpec, agent_cfg: Mapping[str, Any]) -> float:
    configured = float(agent_cfg.get("check_timeout_s", 0) or 0)
    return configured if configured > 0 else spec.timeout_s


def run_one(spec: CheckSpec, node: Any, cfg: Mapping[str, Any], timeout_s: float,
            parent: Scope | None = None, why: str = "") -> CheckResult:
    """Run one check within `timeout_s` (nested in `parent`, the run's scope). `why` is added to a timeout's
    error (e.g. that the budget ran out)."""
    outcome = _Outcome()
    start = time.monotonic()
    scope = Scope(start + timeout_s, parent)

    def target() -> None:
        found: list[Finding] = []
        outcome.findings = found  # findings yielded before a later failure are kept
        try:
            with scope.entered():
                for finding in spec.run(node, cfg):
                    found.append(finding)
        except BaseException as exc:  # noqa: BLE001 - every failure must become a result
            outcome.error = exc
            outcome.trace = traceback.format_exc()

    # A daemon thread: a check stuck in a driver call cannot be killed, but it must neither block the
    # other checks nor keep the process alive after the verdict. Its tools can be: they are ended here.
    thread = threading.Thread(target=target, name=f"check-{spec.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    # A tool ended at the check's deadline means the check ran out of time, even if its thread got to the end a
    # moment before the join did: one outcome, whichever thread saw the deadline first.
    timed_out = thread.is_alive() or scope.expired
    # A time cut by the budget is shown to a tenth (1.99803 -> 2), a configured one as given.
    shown = f"{timeout_s:.1f}".rstrip("0").rstrip(".") if why else f"{timeout_s:g}"
    error = f"timed out after {shown}s{why}"
    # Also after a normal end: a tool a check started and did not wait for goes with the check.
    left_running = scope.end_tools(f"its check {error}" if timed_out else "its check has ended")
    duration = time.monotonic() - start
    if timed_out:
        if left_running:
            error += "; " + "; ".join(left_running)
        # What the check found before its time ran out stands (a FAIL stays a FAIL); the rest is unknown.
        found = tuple(list(outcome.findings or ()))  # a copy: a thread stuck in a driver call may still append
        status = Status.FAIL if fold_status(found) is Status.FAIL else Status.UNKNOWN
        return CheckResult(spec.name, status, found, error=error, duration_s=duration)
    return _result(spec.name, outcome, duration)


def could_not_look(exc: BaseException, findings: tuple[Finding, ...] = ()) -> tuple[Status, str]:
    """The one mapping from "the check ended early" to a status, for preflight, the daemon and a retest alike:
    does not apply (NotApplicable, a tool not installed) is SKIPPED, anything else UNKNOWN with the reason; and
    findings always win: what was found before the end stands (a FAIL stays a FAIL)."""
    if isinstance(exc, (NotApplicable, ToolMissing)):
        return (fold_status(findings) if findings else Status.SKIPPED), str(exc)
    reason = str(exc) if isinstance(exc, GpuwardenError) else f"internal error: {type(exc).__name__}: {exc}"
    return (Status.FAIL if fold_status(findings) is Status.FAIL else Status.UNKNOWN), reason


def _result(name: str, outcome: _Outcome, duration: float) -> CheckResult:
    exc = outcome.error
    findings = tuple(outcome.findings or ())
    if exc is None:
        return CheckResult(name, fold_status(findings), findings, None, duration)
    if not isinstance(exc, GpuwardenError):
        log.error("check crashed", check=name, error=repr(exc), traceback=outcome.trace)
    status, error = could_not_look(exc, findings)
    return CheckResult(name, status, findings, error, duration)


def run_checks(node: Any, specs: Iterable[CheckSpec], config: Any, progress: Progress | None = None,
               budget_s: float | None = None) -> list[CheckResult]:
    """Run every spec concurrently, except that checks sharing a resource take turns; results come back in
    the order of `specs`. A check that has not started when `budget_s` runs out is UNKNOWN (not run).

    An exception in the calling thread while waiting (KeyboardInterrupt, or what a SIGTERM handler raises) ends
    every running tool, then propagates: nothing this run started is left running."""
    specs = list(specs)
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s >= 0):
        raise ValueError(f"budget_s must be a finite number >= 0, got {budget_s!r}")
    results: dict[str, CheckResult] = {}
    lock = threading.Lock()
    resource_locks = {r: threading.Lock() for s in specs for r in s.resources}
    deadline = None if budget_s is None else time.monotonic() + budget_s
    run_scope = Scope(deadline)
    not_run = f"not run: the overall time budget of {budget_s:g}s ran out" if budget_s is not None else ""

    def one(spec: CheckSpec) -> None:
        held = [resource_locks[r] for r in sorted(set(spec.resources))]  # one global order: no deadlock
        acquired: list[threading.Lock] = []
        try:
            for res_lock in held:
                wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
                if not res_lock.acquire(timeout=wait):
                    break
                acquired.append(res_lock)
            if run_scope.cancelled:
                result = CheckResult(spec.name, Status.UNKNOWN, error=f"not run: {run_scope.reason}")
            elif len(acquired) < len(held) or (deadline is not None and time.monotonic() >= deadline):
                result = CheckResult(spec.name, Status.UNKNOWN, error=not_run)
            else:
                if progress:
                    progress(spec.name, "start", None)
                timeout, why = _timeout_for(spec, config.agent), ""
                if deadline is not None and deadline - time.monotonic() < timeout:
                    timeout = max(0.0, deadline - time.monotonic())
                    why = f" (the overall time budget of {budget_s:g}s ran out)"
                # run_one returns once the check's tools are gone: only then may the next check take the resources.
                result = run_one(spec, node, config.for_check(spec.name), timeout, run_scope, why)
        finally:
            for res_lock in acquired:
                res_lock.release()
        with lock:
            results[spec.name] = result
        log.debug("check done", check=spec.name, status=result.status.value, duration_s=round(result.duration_s, 3))
        if progress:
            progress(spec.name, "done", result)

    threads = [threading.Thread(target=one, args=(s,), name=f"run-{s.name}", daemon=True) for s in specs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # run_one bounds each by its timeout
    except BaseException:
        left_running = run_scope.end_tools("the run was interrupted")
        if left_running:
            log.error("tools could not be ended", tools=left_running)
        raise
    return [results[s.name] for s in specs]

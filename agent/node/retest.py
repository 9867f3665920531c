"""The retest of a quarantined node: the quick preflight, judging the kernel log from the recovery on (the time its
faults cleared), so a fault that a GPU reset fixed does not fail every retest until the next reboot, while one that
comes back after the recovery does."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuwarden import checks
from gpuwarden.agent.core.config import extend
from gpuwarden.agent.core.model import EXIT_FAULT, EXIT_PASS, CheckResult, verdict_exit_code
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources.kmsg_cursor import Cursor


def run_retest(node: Any, config: Any, since: Cursor | None) -> tuple[bool | None, list[CheckResult]]:
    """(outcome, results) of the quick checks on `node`, its kernel log read after `since`. The outcome is True
    (passed), False (a check failed) or None (none failed, but one could not look: not a pass, and not a failure
    that counts toward retiring the node)."""
    quick = checks.chosen((), "quick")
    missing = [s.name for s in quick if s.name not in config.checks]
    if missing:  # the daemon's config holds the tables of what it runs: the defaults of the rest, on a copy
        config = replace(config, checks=dict(config.checks), list_types=dict(config.list_types),
                         shared=dict(config.shared))
        extend(config, checks.forms(missing))
    results = run_checks(node.kernel_log_after(since), quick, config)
    verdict = verdict_exit_code(results)  # preflight's own verdict: pass, fault, or could not decide
    return {EXIT_PASS: True, EXIT_FAULT: False}.get(verdict), results

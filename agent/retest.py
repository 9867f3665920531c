"""The retest of a quarantined node: the quick preflight, judging the kernel log from the recovery on (the time its
faults cleared), so a fault that a GPU reset fixed does not fail every retest until the next reboot, while one that
comes back after the recovery does."""
from __future__ import annotations

from typing import Any

from .model import EXIT_FAULT, EXIT_PASS, CheckResult, verdict_exit_code
from .runner import run_checks
from .sources.kmsg import Cursor


def run_retest(node: Any, config: Any, since: Cursor | None) -> tuple[bool | None, list[CheckResult]]:
    """(outcome, results) of the quick checks on `node`, its kernel log read after `since`. The outcome is True
    (passed), False (a check failed) or None (none failed, but one could not look: not a pass, and not a failure
    that counts toward retiring the node)."""
    from gpuwarden.checks import ALL  # checks import agent: import at use, not at load

    quick = [s for s in ALL if s.level == "quick"]
    results = run_checks(node.kernel_log_after(since), quick, config)
    verdict = verdict_exit_code(results)  # preflight's own verdict: pass, fault, or could not decide
    return {EXIT_PASS: True, EXIT_FAULT: False}.get(verdict), results

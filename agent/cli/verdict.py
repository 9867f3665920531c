"""A verdict printed: the report of `preflight` or `analyze` as a table or as JSON, and its exit code."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwarden.agent.core.model import Report


def emit(report: Report, as_json: bool) -> int:
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        # at use: the table's code (core.render) is loaded only for a table, 1.5 ms that --json does not spend
        from gpuwarden.agent.core.render import table

        sys.stdout.write(table(report))
    return report.exit_code

"""The file a benchmark writes with --json, as bench/run reads it: {"rows": [...], "load": {...}}, the machine's
load average from before the measurement to after it beside the figures (a figure taken under load is read as such).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence


def write_rows(path: str | Path, rows: Sequence[dict[str, Any]], loadavg_before: Sequence[float],
               **load: Any) -> None:
    """Writes `rows` with the load average before (taken by the caller as it began) and now, and any more facts
    about the machine (`nproc=...`) under "load"."""
    doc = {"rows": list(rows), "load": {"loadavg_before": list(loadavg_before),
                                        "loadavg_after": list(os.getloadavg()), **load}}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")

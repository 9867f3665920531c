"""The local adapter: records what it would do (cordon, drain, resume, ...) as JSON lines, and does nothing
else. Adapters for a real scheduler (Slurm, Kubernetes) are to replace it; the daemon's contract is the same:
`apply(action, detail)` is called from the daemon's action worker (never under the lock detection holds), one
intent at a time in the order the transitions happened, and must be idempotent, since a crash between the
intent's commit and its completion replays it at the next start (detail "replayed": true)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("gpuwarden.adapter")


class LocalAdapter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def apply(self, action: str, detail: dict[str, Any]) -> None:
        line = json.dumps({"action": action, "at": time.time(), **detail}, sort_keys=True)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
        log.info("would act", action=action, reason=detail.get("reason", ""))

    def actions(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

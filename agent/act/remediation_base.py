"""What the remediation engine's parts share: the state Engine.__init__ (agent/act/remediation.py) sets, named here
for the mixins that read it (the queue, the breaker gate, the spares, the recovery steps, the job intents, the
metrics; they call Engine._save_status after a change `status` shows)."""
from __future__ import annotations

import threading
from typing import Any, Callable


class EngineState:
    """Engine's attributes, set by Engine.__init__; each mixin of the engine reads and writes them."""

    adapter: Any
    settings: Any
    hooks: Any
    node: Any
    domain: str | None
    clock: Callable[[], float]
    lock: threading.RLock
    _judge: Callable[..., Any] | None
    _recovery: Any
    _spares: Any
    _deferred: list
    _queue: Any
    _job_progress: dict[str, dict[str, Any]]
    _out_of_service: bool
    _job_counts: dict[tuple[str, str], int]
    _job_latency: dict[str, float]
    _job_saved: dict[str, float]
    _latch: dict[str, Any] | None
    _confirming: str | None
    _reset_at: float | None
    _swap: dict[str, Any] | None
    _spare_quarantined: str | None
    _spare: bool
    _next_publish: float

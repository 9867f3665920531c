"""The metrics endpoint's worker pool (agent/daemon/http_endpoint.py): a fixed number of threads that build the
responses the I/O thread does not answer itself (a password check, prometheus-client's rendering, a store read).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from gpuwarden.agent.core import logs
from gpuwarden.agent.sources.systemd import name_this_thread

log = logs.get_logger("gpuwarden.http")


class Workers:
    """A fixed pool of threads running what the I/O thread hands over, each started at its first job (what
    concurrent.futures' executor does here, without its futures or the logging module it loads)."""

    def __init__(self, count: int, name: str):
        self._count, self._name = count, name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the endpoint's workers are stopped")
            self._jobs.put((fn, args))
            if self._idle == 0 and len(self._threads) < self._count:
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._idle = max(0, self._idle - 1)

    def _run(self) -> None:
        name_this_thread(self._name)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a defect costs its one job, never the worker
                log.error("metrics endpoint: a worker's job failed", error=repr(exc))
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Jobs not yet started are dropped; each worker ends after its current one (not waited for)."""
        with self._lock:
            self._stopped = True
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._jobs.put(None)

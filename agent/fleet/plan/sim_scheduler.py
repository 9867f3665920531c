"""The fleet simulator's scheduler and recovery world.

The scheduler: the local adapter (`agent/act/adapters/local.py`), its SQLite file in a temporary folder (in
memory-backed /dev/shm where there is one). Every write goes to it. The fleet view (`nodes()`) is served from
a copy of its rows, refreshed from the database after every write that touches a node (`mirror_matches()`
checks the copy against the database); reading 10,000 rows for each breaker judgement would cost more than
the rest of the simulation. The recovery steps (a ticket, a reset, a reboot) always succeed.
"""
from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.adapters.local_db import read_views
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView

if TYPE_CHECKING:
    from gpuwarden.agent.fleet.plan.sim_fleet import Fleet


def scratch_dir() -> Path:
    """Where the scheduler's SQLite file goes: memory-backed /dev/shm where there is one (a write costs a quarter
    of one on disk), else the temporary folder."""
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="gpuwarden-sim-", dir=base))


class MirroredScheduler:
    """The local adapter, every call passed through; the fleet view served from a copy of its rows that is read
    back from the database after each write that names a node."""

    def __init__(self, real: LocalAdapter, fleet: "Fleet"):
        self.real, self.fleet = real, fleet
        self.name, self.timeout_s = real.name, real.timeout_s
        self.views: dict[str, NodeView] = {}
        self._db: sqlite3.Connection | None = None

    def reread(self, *names: str) -> None:
        if self._db is None:
            self._db = sqlite3.connect(str(self.real.db), isolation_level=None)
        for view in read_views(self._db, names):
            old = self.views.get(view.name)
            self.views[view.name] = view
            if old != view:
                self.fleet.view_changed(view.name)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def nodes(self) -> list[NodeView]:
        return list(self.views.values())

    def node(self, node: str) -> NodeView:
        view = self.real.node(node)
        self.reread(node)
        return view

    def spares(self, domain: str) -> list[str]:
        return self.real.spares(domain)

    def _write(self, call: str, node: str, *args: Any) -> Any:
        result = getattr(self.real, call)(node, *args)
        self.reread(node)
        return result

    def cordon(self, node: str, reason: str) -> None:
        self._write("cordon", node, reason)

    def drain(self, node: str, reason: str) -> None:
        self._write("drain", node, reason)

    def quarantine(self, node: str, reason: str) -> None:
        self._write("quarantine", node, reason)

    def resume(self, node: str) -> None:
        self._write("resume", node)

    def publish_domain(self, node: str, domain: str) -> None:
        self._write("publish_domain", node, domain)

    def return_to_pool(self, node: str, domain: str) -> None:
        self._write("return_to_pool", node, domain)

    def set_jobs(self, node: str, jobs: int | None) -> None:
        self._write("set_jobs", node, jobs)

    # A job's calls name no node row: nothing to read back.
    def job(self, job: Any) -> Any:
        return self.real.job(job)

    def mark_job(self, job: Any, reason: str) -> None:
        self.real.mark_job(job, reason)

    def signal_job(self, job: Any, signal: str) -> None:
        self.real.signal_job(job, signal)

    def requeue_job(self, job: Any) -> None:
        self.real.requeue_job(job)

    def cancel_job(self, job: Any) -> None:
        self.real.cancel_job(job)

    def set_job(self, job: Any, state: str, requeueable: bool | None = None) -> None:
        self.real.set_job(job, state, requeueable)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        spare = self.real.take_spare(domain, for_node)
        self.reread(for_node, *([spare] if spare else []))
        if spare is not None:
            self.fleet.spare_taken(spare, for_node)
        return spare

    def mirror_matches(self) -> bool:
        return {v.name: v for v in self.real.nodes()} == self.views


class SimRecovery:
    """The recovery steps' outside world: a ticket is opened, a reset or reboot is accepted (the node's fault is
    a repair's, which the repair time models)."""

    @dataclass(frozen=True)
    class _Outcome:
        ok: bool
        detail: str

    def reset_gpus(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated")

    def reboot(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated")

    def open_ticket(self, *args: Any) -> Any:
        return self._Outcome(True, "simulated ticket")


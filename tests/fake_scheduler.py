"""A scheduler for the remediation engine's tests: the SchedulerAdapter protocol (agent/core/scheduler.py) over a
dict in memory, whose faults a test sets at will (the embedded local adapter stands for a scheduler that outlives
the agent's process). It keeps its own record of every call that changed something (`changes`), which is what the
tests count: an intent done twice shows as two changes.

Faults are set from the test: `outage` (every call raises Transient), `refuse` (action -> message: Refused),
`block` (an Event each call waits on)."""
from __future__ import annotations

import threading
import time
from typing import Any

from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, NodeView, Refused, Service, Transient


class DictScheduler:
    name = "dict"

    def __init__(self, nodes: dict[str, dict[str, Any]] | None = None, timeout_s: float = 5.0, clock=time.time):
        self.timeout_s, self.clock = timeout_s, clock
        self._lock = threading.RLock()
        self.outage: str | None = None
        self.refuse: dict[str, str] = {}
        self.block: threading.Event | None = None
        self.calls: list[tuple[str, str]] = []  # every call, reads included (this process only)
        self._data: dict[str, Any] = {"nodes": {}, "changes": [], "taken": {}}
        for name, fields in (nodes or {}).items():
            self._data["nodes"][name] = {"service": "in_service", "reason": None, "reason_since": None,
                                         "ours": False, "quarantined": False, "domain": None, "spare": False,
                                         "jobs": 0, **fields}

    # -- the store ---------------------------------------------------------------------------------------------
    def _call(self, what: str, node: str) -> dict[str, Any]:
        self.calls.append((what, node))
        if self.block is not None:
            assert self.block.wait(60), "never released"
        if self.outage:
            raise Transient(self.outage)
        if what in self.refuse:
            raise Refused(self.refuse[what])
        if node and node not in self._data["nodes"]:
            raise Refused(f"unknown node {node}")
        return self._data["nodes"].get(node, {})

    def _change(self, what: str, node: str, **fields: Any) -> None:
        self._data["nodes"][node].update(fields)
        self._data["changes"].append((what, node))

    # Read without the lock: a test looks while a call hangs inside it.
    @property
    def changes(self) -> list[tuple[str, str]]:
        return list(self._data["changes"])

    def state(self, node: str) -> dict[str, Any]:
        return dict(self._data["nodes"][node])

    # -- the protocol --------------------------------------------------------------------------------------------
    def nodes(self):
        with self._lock:
            self._call("nodes", "")
            return [self._view(n) for n in self._data["nodes"]]

    def node(self, node: str) -> NodeView:
        with self._lock:
            self._call("node", node)
            return self._view(node)

    def _view(self, name: str) -> NodeView:
        n = self._data["nodes"][name]
        return NodeView(name, Service(n["service"]), n["reason"], n["reason_since"], n["ours"], n["quarantined"],
                        n["domain"], n["spare"], n["jobs"])

    def cordon(self, node: str, reason: str) -> None:
        with self._lock:
            n = self._call("cordon", node)
            assert reason.startswith(REASON_PREFIX), reason
            if n["service"] == "in_service":
                self._change("cordon", node, service="cordoned", reason=reason, reason_since=self.clock(), ours=True)

    def drain(self, node: str, reason: str) -> None:
        with self._lock:
            n = self._call("drain", node)
            if n["service"] != "drained":
                self._change("drain", node, service="drained", reason=reason, ours=True,
                             reason_since=n["reason_since"] or self.clock())

    def quarantine(self, node: str, reason: str) -> None:
        with self._lock:
            n = self._call("quarantine", node)
            if not n["quarantined"]:
                self._change("quarantine", node, service="drained", reason=reason, ours=True, quarantined=True,
                             reason_since=n["reason_since"] or self.clock())

    def resume(self, node: str) -> None:
        with self._lock:
            n = self._call("resume", node)
            if n["service"] == "in_service":
                return
            if not n["ours"]:
                raise Refused(f"{node}: drained by someone else ({n['reason']}); not ours to resume")
            self._change("resume", node, service="in_service", reason=None, reason_since=None, ours=False,
                         quarantined=False, spare=False)

    def publish_domain(self, node: str, domain: str) -> None:
        with self._lock:
            n = self._call("publish_domain", node)
            if n["domain"] != domain:
                self._change("publish_domain", node, domain=domain)

    def spares(self, domain: str) -> list[str]:
        with self._lock:
            self._call("spares", "")
            return sorted(k for k, n in self._data["nodes"].items() if n["spare"] and n["domain"] == domain)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        with self._lock:
            self._call("take_spare", for_node)
            if for_node in self._data["taken"]:
                return self._data["taken"][for_node]
            free = sorted(k for k, n in self._data["nodes"].items() if n["spare"] and n["domain"] == domain)
            if not free:
                return None
            self._data["taken"][for_node] = free[0]
            self._change("take_spare", free[0], spare=False, service="in_service", reason=None, ours=False)
            return free[0]

    def return_to_pool(self, node: str, domain: str) -> None:
        with self._lock:
            n = self._call("return_to_pool", node)
            if not n["spare"]:
                self._change("return_to_pool", node, spare=True, domain=domain, service="drained",
                             reason=SPARE_REASON, ours=True, quarantined=False)

"""The last judgements of the xid check, kept so that judging the next batch from one's state costs what the batch
touched, not what the node holds (checks/xid.py's judge uses them).
"""
from __future__ import annotations

import heapq
import threading
from typing import Any, Mapping

from gpuwarden.agent.core.model import Action, Entity
from gpuwarden.agent.core.passive import Judgement
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.xid_catalog import XidInfo
from gpuwarden.checks.xid_findings import _SHOWN, SOURCES, _shown


@dataclass
class _Last:
    """The last judgement and what judging the next batch from its state reuses (see _judge_touched)."""

    state: dict[str, Any]
    judgement: Judgement
    hold: bool
    cfg: tuple[set[int], set[int], float]
    nvml_error: str | None
    gpus: list[Any]
    entities: dict[str, Entity]  # by PCI address, as judged
    xids_on: dict[str, set[int]]  # the XIDs each GPU's incidents hold
    pos: dict[str, int]  # each incident's place in the findings (and in each run of samples)
    held: dict[str, float]  # the incidents that stand for hold_s, by their last event
    heap: list[tuple[float, str]]  # (last event, key) of `held`, the earliest first; an entry `held` moved on is stale
    shown: dict[int, tuple[Any, ...]]


# The last judgements' reuse, by the id of the state they made (each holds its state, so the id is not reused while
# kept); taken by the judgement that uses it. A few: the daemon judges from the state it last got, and a retest or a
# preflight judging from scratch in between must not cost it its reuse.
_LAST: dict[int, _Last] = {}
_LAST_KEPT = 4
_LAST_LOCK = threading.Lock()


def _keep(last: _Last) -> None:
    with _LAST_LOCK:
        _LAST[id(last.state)] = last
        while len(_LAST) > _LAST_KEPT:
            del _LAST[next(iter(_LAST))]  # the oldest


def _judge_touched(last: _Last, incidents: dict[str, dict[str, Any]], touched: set[str], now: float,
                   catalog: Mapping[int, XidInfo], force: set[int], hold_s: float) -> _Last | None:
    """The judgement of a batch that only counted onto incidents the last judgement held (none begun or ended, the
    GPUs, their names and the policy as they were): the last findings and samples with the touched incidents' own
    replaced in place, so its cost is what the batch touched, not what the node holds. None when an incident's hold
    has run out (the whole judgement then says which stand)."""
    findings, metrics = list(last.judgement.findings), list(last.judgement.metrics)
    n, width = len(last.pos), len(SOURCES)
    shown, held, heap, hold = last.shown, last.held, last.heap, last.hold
    before = last.state["incidents"]
    for key in touched:
        inc = incidents[key]
        shown.pop(id(before[key]), None)
        action, finding, events_sample, source_samples = _shown(inc, last.entities[inc["pci"]], last.xids_on, catalog,
                                                                force, shown)
        if hold and action < Action.REBOOT:
            if now - inc["last_at"] > hold_s:
                return None
            held[key] = inc["last_at"]
            heapq.heappush(heap, (inc["last_at"], key))
        else:
            held.pop(key, None)
        i = last.pos[key]
        findings[i] = finding
        metrics[i] = events_sample[0]
        metrics[n + width * i:n + width * (i + 1)] = source_samples
    while heap and held.get(heap[0][1]) != heap[0][0]:
        heapq.heappop(heap)  # stale: its incident moved on or stopped holding by time
    if len(heap) > 2 * len(held) + 64:
        heap[:] = [(at, key) for key, at in held.items()]
        heapq.heapify(heap)
    wake_at = None
    if heap:
        if now - heap[0][0] > hold_s:
            return None  # the earliest incident's hold ran out
        wake_at = heap[0][0] + hold_s
    new_state = {**last.state, "incidents": incidents}
    _SHOWN[0] = shown
    last.state, last.judgement = new_state, Judgement(new_state, tuple(findings), tuple(metrics), wake_at=wake_at)
    return last

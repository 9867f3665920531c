"""`gpuwarden run`: the daemon. Each passive check polls in its own thread at its own interval; the kernel log is
followed by one thread that hands new records to every kernel-log consumer. After every judgement the check's
state, its findings, the node record (and a transition with its remediation intents, if any) are committed in
one SQLite transaction, then the actions are handed to the adapter. A sample that hangs is UNKNOWN and never
blocks the other checks; a scrape of /metrics reads only memory.

This module holds the records and the one commit path; the loops that feed it are mixins: agent/daemon_polls.py
(passive checks, watchdog) and agent/daemon_events.py (kernel log, NVML XID events).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from .adapters.local import LocalAdapter
from .daemon_events import EventLoops
from .daemon_polls import PollLoops, InFlight
from .metrics import DaemonCollector, Snapshot
from .model import CheckResult, Finding, Status, fold_status
from .passive import Judgement, KernelConsumer, PassiveSpec
from .state import DEFAULT_POLICY, NodeRecord, Transition, next_state, wants_retest
from .store import CheckRecord, Store
from .systemd import name_this_thread

log = structlog.get_logger("gpuwarden.daemon")


@dataclass
class DaemonOptions:
    kmsg_tick_s: float = 0.02  # poll interval of a kernel log that can be neither select()ed nor inotify-watched
    idle_tick_s: float = 30.0  # consumers get an empty batch this often, so time-based rules (hold_s) advance
    policy: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    retest: Callable[[], bool] | None = None  # runs a retest (the quick preflight); True = passed
    intervals: dict[str, float] = field(default_factory=dict)  # per-check poll interval overrides (tests)
    skipped_retry_s: float = 60.0  # a check that is not applicable on this node is asked again this often
    clock: Callable[[], float] = time.time


class Daemon(PollLoops, EventLoops):
    def __init__(self, node: Any, passive: list[PassiveSpec], consumers: list[KernelConsumer], config: Any,
                 store: Store, adapter: LocalAdapter, collector: DaemonCollector, options: DaemonOptions | None = None):
        self.node, self.passive, self.consumers = node, passive, consumers
        self.config, self.store, self.adapter, self.collector = config, store, adapter, collector
        self.opt = options or DaemonOptions()
        self.stop_event = threading.Event()
        # Loops sleep in select() on this pipe, which stop() makes readable: one system call per sleep, where an
        # Event's timed wait runs a dozen lines of Condition bookkeeping (and a wake-up on an idle machine finds
        # every cache cold, so each line counts).
        self._stop_r, self._stop_w = os.pipe()
        self._lock = threading.RLock()  # in-memory results + the node record: one observation at a time
        self._threads: list[threading.Thread] = []
        self._record = store.node() or NodeRecord(since=self.opt.clock())
        self._records: dict[str, CheckRecord] = {r.name: r for r in store.checks()}
        self._samples: dict[str, tuple] = {}
        self._inflight: dict[str, InFlight] = {}  # samples running now, for the watchdog
        self._durable = {s.name: s.durable for s in passive if s.durable is not None}
        self._unflushed: set[str] = set()  # checks whose in-memory state is ahead of the store (not durably)
        self._last_judged: dict[str, tuple[Any, float]] = {}  # the last judged sample of a check with `quiet`
        self._quiet_specs = {s.name: s.quiet for s in passive if s.quiet is not None}
        self._quiet_records: dict[str, bool] = {}  # whether each such check's current record is quiet
        self._transitions = 0
        self._kmsg_records = 0
        self._kmsg_lost = 0
        self._retesting = False
        self._meta: dict | None = None  # the last persisted meta (kernel-log cursor)
        self._publish()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.adapter.replay_pending(self.store)  # intents a crash left half-done are applied again (idempotent)
        for spec in self.passive:
            self._spawn(f"poll-{spec.name}", self._poll_loop, spec)
        if self.passive:
            self._spawn("watchdog", self._watchdog_loop)
        if self.consumers:
            self._spawn("kmsg", self._kmsg_loop)
            self._spawn("nvml-xid", self._nvml_xid_loop)  # NVML's XID events, where the node has them

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops every loop; waits at most `timeout_s` in all (a poll thread stuck in a hung driver call is a
        daemon thread and is left behind)."""
        self.stop_event.set()
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")  # never read: every sleep from now on returns at once
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads) and self._stop_w >= 0:
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        self.flush()

    def flush(self) -> None:
        """Writes the state changes that were kept in memory (outside a check's durable part)."""
        with self._lock:
            pending = [self._records[n] for n in sorted(self._unflushed) if n in self._records]
            if pending:
                self.store.commit(pending)
            self._unflushed.clear()

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            name_this_thread(f"gw-{name.removeprefix('poll-')}")
            target(*args)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- one observation --------------------------------------------------------------------------------------------
    def _observe(self, name: str, judgement: Judgement | None, status: Status | None, error: str | None,
                 duration_s: float) -> None:
        now = self.opt.clock()
        with self._lock:
            self._commit([self._record_for(name, judgement, status, error, duration_s, now)], None, now)

    def _record_for(self, name: str, judgement: Judgement | None, status: Status | None, error: str | None,
                    duration_s: float, now: float) -> CheckRecord:
        previous = self._records.get(name, CheckRecord(name))
        if judgement is None:
            # Could not look: the state is kept as it was (an accumulator must not be reset by a failed read);
            # the findings of the last good look are dropped, the status says why.
            return CheckRecord(name, previous.state, status or Status.UNKNOWN, error, (), now, duration_s)
        self._samples[name] = judgement.metrics
        findings = tuple(judgement.findings)
        return CheckRecord(name, judgement.state, status or fold_status(findings), error, findings, now, duration_s)

    def _commit(self, updates: list[CheckRecord], meta: dict | None, now: float, retest: bool | None = None) -> None:
        changed: list[CheckRecord] = []
        for rec in updates:
            old = self._records.get(rec.name)
            if _differs(old, rec, self._durable.get(rec.name)):
                changed.append(rec)
                self._unflushed.discard(rec.name)
            elif old is not None and old.state != rec.state:
                self._unflushed.add(rec.name)  # a change only outside the durable part: written later
            self._records[rec.name] = rec
            quiet = self._quiet_specs.get(rec.name)
            if quiet is not None:
                self._quiet_records[rec.name] = rec.status is Status.OK and not rec.findings and quiet(rec.state)
        record, transition = next_state(self._record, self._active(), self._unknown(), now, self.opt.policy,
                                        retest)
        intents = _intents(transition) if transition else []
        new_keys: list[str] = []
        if changed or transition or record != self._record or (meta and meta != self._meta):
            # Only what moved is written: an idle tick that changed nothing costs no disk write.
            new_keys = self.store.commit(changed, meta, record, transition, intents)
            self._meta = meta or self._meta
        self._record = record
        if transition:
            self._transitions += 1
            log.info("node state", frm=transition.frm.value, to=transition.to.value, reason=transition.reason,
                     actions=list(transition.actions))
        self._publish()
        for key, action, detail in intents:
            if key in new_keys:
                self.adapter.apply(action, detail)
                self.store.mark_done(key, self.opt.clock())
        if wants_retest(self._record, now, self.opt.policy) and not self._retesting and self.opt.retest:
            self._retesting = True
            self._spawn("retest", self._retest)

    def _retest(self) -> None:
        passed = False
        try:
            passed = bool(self.opt.retest and self.opt.retest())
        finally:
            with self._lock:
                self._retesting = False
                # The same path as every observation: the outcome's transition is logged, counted, journalled and
                # its intents marked done once applied (so a restart does not replay a resume).
                self._commit([], None, self.opt.clock(), retest=passed)

    def _active(self) -> list[Finding]:
        return [f for r in self._records.values() for f in r.findings]

    def _unknown(self) -> list[str]:
        return [r.name for r in self._records.values() if r.status is Status.UNKNOWN]

    def _publish(self) -> None:
        results = {n: CheckResult(n, r.status, r.findings, r.error, r.duration_s) for n, r in self._records.items()}
        self.collector.update(Snapshot(self.node.hostname, self._record, results, dict(self._samples),
                                       self._transitions, self._kmsg_records, self._kmsg_lost))

    # -- for `status` and tests -----------------------------------------------------------------------------------
    @property
    def record(self) -> NodeRecord:
        with self._lock:
            return self._record

    def results(self) -> dict[str, CheckRecord]:
        with self._lock:
            return dict(self._records)

    def reload(self, config: Any) -> None:
        with self._lock:
            self.config = config


def _differs(old: CheckRecord | None, new: CheckRecord, durable: Callable[[Any], Any] | None = None) -> bool:
    """Whether a check's record changed in what must be written now: its status, error, findings, or the durable
    part of its state (all of it unless the check says otherwise). Timestamps alone never count."""
    if old is None or (old.status, old.error, old.findings) != (new.status, new.error, new.findings):
        return True
    if durable is None:
        return old.state != new.state
    return durable(old.state) != durable(new.state)


def _intents(t: Transition) -> list[tuple[str, str, dict[str, Any]]]:
    # The key is the transition itself: a crash between commit and apply replays the same key, never a new one.
    return [(f"{t.at:.6f}:{t.frm.value}->{t.to.value}:{a}", a, {"at": t.at, "from": t.frm.value, "to": t.to.value,
                                                              "reason": t.reason}) for a in t.actions]


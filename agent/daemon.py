"""`gpuwarden run`: the daemon. Each passive check polls in its own thread at its own interval; the kernel log is
followed by one thread that hands new records to every kernel-log consumer. After every judgement the check's
state, its findings, the node record (and a transition with its remediation intents, if any) are committed in
one SQLite transaction, then the actions are handed to the adapter. A sample that hangs is UNKNOWN and never
blocks the other checks; a scrape of /metrics reads only memory.
"""
from __future__ import annotations

import math
import os
import re
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from .adapters.local import LocalAdapter
from .errors import GpuwardenError, NotApplicable, ToolMissing
from .metrics import DaemonCollector, Snapshot
from .model import CheckResult, Finding, Status, fold_status
from .passive import Judgement, KernelBatch, KernelConsumer, PassiveSpec
from .sources.kmsg import Cursor
from .state import DEFAULT_POLICY, NodeRecord, Transition, next_state, wants_retest
from .store import CheckRecord, Store
from .systemd import name_this_thread

log = structlog.get_logger("gpuwarden.daemon")
KMSG_CHECK = "kmsg"  # the follower itself, reported like a check so "could not read the log" is visible


@dataclass
class DaemonOptions:
    kmsg_tick_s: float = 0.02  # poll interval of a kernel log that can be neither select()ed nor inotify-watched
    idle_tick_s: float = 30.0  # consumers get an empty batch this often, so time-based rules (hold_s) advance
    policy: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    retest: Callable[[], bool] | None = None  # runs a retest (the quick preflight); True = passed
    intervals: dict[str, float] = field(default_factory=dict)  # per-check poll interval overrides (tests)
    skipped_retry_s: float = 60.0  # a check that is not applicable on this node is asked again this often
    clock: Callable[[], float] = time.time


class Daemon:
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
        self._inflight: dict[str, _InFlight] = {}  # samples running now, for the watchdog
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

    def _sleep(self, seconds: float) -> None:
        """Sleeps `seconds`, or until stop()."""
        if not self.stop_event.is_set():
            select.select([self._stop_r], [], [], max(0.0, seconds))

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

    # -- passive checks ---------------------------------------------------------------------------------------
    def _poll_loop(self, spec: PassiveSpec) -> None:
        # The sample runs in this thread: a worker thread per tick cost more CPU than the checks themselves at
        # idle. A sample that hangs (a driver call that never returns) holds only this thread; the watchdog
        # reports it UNKNOWN meanwhile, so nothing else waits on it.
        interval = self.opt.intervals.get(spec.name, spec.interval_s)
        probe = None
        try:
            while not self.stop_event.is_set():
                started = time.monotonic()
                if spec.change_probe is not None:
                    probe = probe or spec.change_probe(self.node)
                    if self._quiet(spec, started) and not probe.changed():
                        self._wait_aligned(interval)
                        continue
                    probe.rearm()
                self._sample_once(spec, started)
                record = self._records.get(spec.name)
                # Not applicable here (no IB port, no AER statistics): asked again only now and then, in case a
                # driver loads late, rather than at the check's own pace.
                skipped = record is not None and record.status is Status.SKIPPED
                self._wait_aligned(max(interval, self.opt.skipped_retry_s) if skipped else interval)
        finally:
            if probe is not None:
                probe.close()

    def _wait_aligned(self, interval: float) -> None:
        # Every loop wakes on multiples of its interval on the one monotonic clock, so the checks due at the same
        # moment run in one burst: on an idle machine a wake-up finds the caches cold, and one burst pays for that
        # once instead of once per check.
        now = time.monotonic()
        self._sleep((math.floor(now / interval) + 1) * interval - now)

    def _sample_once(self, spec: PassiveSpec, started: float) -> None:
        cfg = self.config.for_check(spec.name)
        with self._lock:
            state = dict(self._records.get(spec.name, CheckRecord(spec.name)).state)
            self._inflight[spec.name] = _InFlight(started + spec.timeout_s, spec.timeout_s)
        try:
            sample, error = spec.sample(self.node, cfg, state), None
        except BaseException as exc:  # noqa: BLE001 - becomes UNKNOWN / SKIPPED with the reason
            sample, error = None, exc
        took = time.monotonic() - started
        with self._lock:
            flight = self._inflight.pop(spec.name)
            if flight.reported:
                # The watchdog already said UNKNOWN; what a sample that late read is stale: not judged.
                log.warning("late sample discarded", check=spec.name, took_s=round(took, 3))
                return
            if error is not None:
                status = Status.SKIPPED if isinstance(error, (NotApplicable, ToolMissing)) else Status.UNKNOWN
                reason = (str(error) if isinstance(error, GpuwardenError)
                          else f"internal error: {type(error).__name__}: {error}")
                self._observe(spec.name, None, status, reason, took)
                return
            # Judged against the state as it is now, not as it was when the sample began: a kernel-log consumer
            # of the same name (pcie_aer) may have moved it meanwhile.
            record = self._records.get(spec.name, CheckRecord(spec.name))
            current = record.state
            if self._unchanged_and_quiet(spec, record, sample, started):
                return
            try:
                judgement = spec.judge(current, sample, cfg, self.opt.clock())
            except Exception as exc:  # noqa: BLE001 - a bug in a judge must not stop the daemon
                log.error("judge failed", check=spec.name, error=repr(exc))
                self._observe(spec.name, None, Status.UNKNOWN, f"internal error: {type(exc).__name__}: {exc}", took)
            else:
                self._observe(spec.name, judgement, None, None, took)

    def _quiet(self, spec: PassiveSpec, now: float) -> bool:
        """Whether the check's state is quiet (PassiveSpec.quiet), without findings, judged < quiet_rejudge_s ago.
        The verdict on the record is taken when the record changes (_commit), not at every poll."""
        last = self._last_judged.get(spec.name)
        return (last is not None and now - last[1] < spec.quiet_rejudge_s
                and self._quiet_records.get(spec.name, False))

    def _unchanged_and_quiet(self, spec: PassiveSpec, record: CheckRecord, sample: Any, started: float) -> bool:
        """Whether this sample can go unjudged: equal to the last judged one while quiet. Otherwise it becomes the
        new reference."""
        last = self._last_judged.get(spec.name)
        if last is not None and last[0] == sample and self._quiet(spec, started):
            return True
        if spec.quiet is not None:
            self._last_judged[spec.name] = (sample, started)
        return False

    def _watchdog_loop(self) -> None:
        """Reports a sample that overran its timeout as UNKNOWN while it is still running. It wakes every shortest
        timeout, so an overrun is reported at most two timeouts after the sample began."""
        period = max(0.01, min(s.timeout_s for s in self.passive))
        while not self.stop_event.is_set():
            self._wait_aligned(period)
            now = time.monotonic()
            with self._lock:
                for name, flight in self._inflight.items():
                    if not flight.reported and now >= flight.deadline:
                        flight.reported = True
                        self._observe(name, None, Status.UNKNOWN,
                                      f"sample timed out after {flight.timeout_s:g}s (still running)",
                                      now - flight.deadline + flight.timeout_s)

    # -- kernel log ----------------------------------------------------------------------------------------------
    def _kmsg_loop(self) -> None:
        cursor = self.store.meta("kmsg_cursor")
        follower = self.node.kmsg_follower(Cursor(**cursor) if cursor else None, _keep(self.consumers))
        next_idle = 0.0
        while not self.stop_event.is_set():
            try:
                records = follower.poll()
                error = None
            except GpuwardenError as exc:
                records, error = [], str(exc)
            now_mono = time.monotonic()
            tick = self.opt.idle_tick_s
            if records or error or now_mono >= next_idle:
                self._feed(records, follower, error)
                next_idle = (math.floor(now_mono / tick) + 1) * tick  # aligned with the polls (_wait_aligned)
            # Sleep until a record may have arrived (select on /dev/kmsg, inotify on a recorded file), at the
            # latest until the next idle tick: an idle kernel log costs no wake-up beyond that tick.
            follower.wait(max(0.0, next_idle - time.monotonic()), self.opt.kmsg_tick_s, wake_fd=self._stop_r)

    def _feed(self, records: list, follower: Any, error: str | None) -> None:
        now = self.opt.clock()
        try:
            gpus = list(self.node.gpus())
        except GpuwardenError:
            gpus = []  # XIDs still count, named by the PCI address the driver printed
        batch = KernelBatch(records, gpus, follower.cursor.boot_id)
        with self._lock:
            self._kmsg_records = follower.advanced
            self._kmsg_lost = follower.lost
            meta = {"kmsg_cursor": {"boot_id": follower.cursor.boot_id, "seq": follower.cursor.seq}}
            kmsg_status = Status.UNKNOWN if error else Status.OK
            updates = [self._record_for(KMSG_CHECK, Judgement({}), kmsg_status, error, 0.0, now),
                       *self._judge_consumers(batch, now, error and f"kernel log: {error}")]
            self._commit(updates, meta, now)

    def _judge_consumers(self, batch: KernelBatch, now: float, source_error: str | None = None) -> list[CheckRecord]:
        """Every kernel-log consumer's record after `batch` (call with the lock held). A consumer whose judge
        raises is UNKNOWN with the reason; `source_error` (the log could not be read) is carried as the error."""
        updates = []
        for consumer in self.consumers:
            state = self._records.get(consumer.name, CheckRecord(consumer.name)).state
            try:
                judgement = consumer.judge(state, batch, self.config.for_check(consumer.name), now)
            except Exception as exc:  # noqa: BLE001 - a bug in a judge must not stop the daemon
                updates.append(self._record_for(consumer.name, None, Status.UNKNOWN,
                                                f"internal error: {type(exc).__name__}: {exc}", 0.0, now))
            else:
                updates.append(self._record_for(consumer.name, judgement, None, source_error, 0.0, now))
        return updates

    def _nvml_xid_loop(self) -> None:
        """NVML's XID events, the second XID source (docs/daemon.md): each batch goes to the kernel-log consumers,
        which count an XID once whichever sources saw it. Where the node has no events it says so once and ends.
        An NVML error makes xid_watch UNKNOWN (kept in its state, so kernel-log ticks do not hide it) and the
        subscription is rebuilt after a backoff (without a GPU that fell off the bus); incidents are kept."""

        def feed(xids: list, error: str | None) -> None:
            now = self.opt.clock()
            try:
                gpus = list(self.node.gpus())
            except GpuwardenError:
                gpus = []
            batch = KernelBatch([], gpus, self.node.kmsg.boot_id, nvml_xids=xids, source="nvml", nvml_error=error)
            with self._lock:
                # No cursor meta: NVML has no backlog to resume from, it delivers only what happens from now on.
                self._commit(self._judge_consumers(batch, now), None, now)

        # The wait's timeout: idle, the thread wakes once per wait and never spins; short, because a wait inside
        # NVML cannot be interrupted and stop() waits for it.
        tick = min(self.opt.idle_tick_s, 2.0)
        first_backoff, max_backoff = min(5 * tick, 5.0), min(60 * tick, 60.0)
        events, backoff = None, first_backoff
        try:
            while not self.stop_event.is_set():
                try:
                    if events is None or events.closed:
                        # The same subscription object is re-subscribed: it knows which events it handed over.
                        events = self.node.xid_events() if events is None else events.subscribe()
                        if not events.available:
                            log.info("NVML XID events not available; XIDs come from the kernel log alone",
                                     reason=events.reason)
                            feed([], None)  # clears an NVML error an earlier run left in the state
                            return
                        if events.unsubscribed:
                            log.warning("NVML XID events: GPUs not subscribed",
                                        gpus={i: str(e) for i, e in events.unsubscribed.items()})
                        feed([], None)
                    xids = events.wait(tick)
                    backoff = first_backoff
                    if xids:
                        feed(xids, None)
                except Exception as exc:  # noqa: BLE001 - an NvmlError or a bug: say why, retry, never end
                    reason = str(exc) if isinstance(exc, GpuwardenError) else (
                        f"internal error: {type(exc).__name__}: {exc}")
                    log.warning("NVML XID events failed", error=reason, retry_in_s=backoff)
                    feed([], reason)
                    if events is not None:
                        events.close()
                    self._sleep(backoff)
                    backoff = min(2 * backoff, max_backoff)
        finally:
            if events is not None:
                events.close()

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


@dataclass
class _InFlight:
    deadline: float  # time.monotonic() by which the sample should have returned
    timeout_s: float
    reported: bool = False  # the watchdog has reported it UNKNOWN: its late result is discarded


def _differs(old: CheckRecord | None, new: CheckRecord, durable: Callable[[Any], Any] | None = None) -> bool:
    """Whether a check's record changed in what must be written now: its status, error, findings, or the durable
    part of its state (all of it unless the check says otherwise). Timestamps alone never count."""
    if old is None or (old.status, old.error, old.findings) != (new.status, new.error, new.findings):
        return True
    if durable is None:
        return old.state != new.state
    return durable(old.state) != durable(new.state)


def _keep(consumers: list[KernelConsumer]) -> Callable[[str], object] | None:
    """One substring test over every consumer's interest; None (keep all) when a consumer reads everything."""
    if any(not c.interest for c in consumers):
        return None
    needles = dict.fromkeys(n for c in consumers for n in c.interest)
    # One compiled alternation: measured ~3x faster per message than any() over the substrings.
    return re.compile("|".join(re.escape(n) for n in needles)).search


def _intents(t: Transition) -> list[tuple[str, str, dict[str, Any]]]:
    # The key is the transition itself: a crash between commit and apply replays the same key, never a new one.
    return [(f"{t.at:.6f}:{t.frm.value}->{t.to.value}:{a}", a, {"at": t.at, "from": t.frm.value, "to": t.to.value,
                                                              "reason": t.reason}) for a in t.actions]


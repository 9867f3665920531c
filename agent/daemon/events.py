"""The daemon's event loops (a mixin of agent.daemon.Daemon): the kernel-log follower and NVML's XID events,
each in its own thread, hand batches to every kernel-log consumer (docs/daemon.md).
"""
from __future__ import annotations

import math
import time
from typing import Any

from gpuwarden.agent.core import logs, memory
from gpuwarden.agent.core.backoff import Backoff
from gpuwarden.agent.core.errors import GpuwardenError, NvmlError
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.core.passive import Judgement, KernelBatch, KernelConsumer, event_clock
from gpuwarden.agent.sources.kmsg_cursor import Cursor, resume_cursor
from gpuwarden.agent.sources.kmsg_scan import Interest
from gpuwarden.agent.state.check_record import CheckRecord

log = logs.get_logger("gpuwarden.daemon")
# A hold ends when `now - last_at > hold_s`: judged this long after the end, it has ended whatever the rounding.
WAKE_AFTER_S = 0.05
KMSG_CHECK = "kmsg"  # the follower itself, reported like a check so "could not read the log" is visible
NVML_EVENTS_META = "nvml_events"  # where a recorded node's XID event list was handed over up to (None live)


class EventLoops:
    """Needs from the daemon: node, config, opt, consumers, store, stop_event, _stop_r, _lock, _records, _meta,
    _kmsg_records, _kmsg_lost, _kmsg_wake_at, _kmsg_first, _kernel_log_error(), _record_for(), _commit(), _sleep(),
    _beat(), _beat_off() and _fail_loop()."""

    def _kmsg_loop(self) -> None:
        follower, next_idle, flooded = None, 0.0, False
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)
        while not self.stop_event.is_set():
            tick = self.opt.idle_tick_s
            self._beat("kmsg", tick)
            try:
                if follower is None:
                    # This run's own cursor, else after the records the store says were counted (by identity).
                    cursor = self._meta.get("kmsg_cursor")
                    start = Cursor(**cursor) if cursor else resume_cursor(
                        self.store.meta("kmsg_cursor"), self.store.counted(), self.node.kmsg.boot_id)
                    follower = self.node.kmsg_follower(start, _keep(self.consumers))
                try:
                    records = follower.poll()
                    error = None
                except GpuwardenError as exc:
                    records, error = [], str(exc)
                now_mono = time.monotonic()
                if records or error or now_mono >= next_idle:
                    if records or error or not self._consumers_quiet():
                        self._feed(records, follower, error)
                        self._kmsg_first.set()
                    else:
                        # An idle tick where nothing the consumers hold moves with time: they are not judged; the
                        # node's own state still moves on (a quarantine or a retest that falls due).
                        with self._lock:
                            self._commit([], None, self.opt.clock())
                    next_idle = (math.floor(now_mono / tick) + 1) * tick  # aligned with the polls (_wait_aligned)
                    # An incident whose hold ends before the next tick is judged again when it ends, so the node's
                    # state follows at once (a quarantined node's retest waits for its faults to clear).
                    with self._lock:
                        wake_at = self._kmsg_wake_at
                    if wake_at is not None and (left := wake_at - self.opt.clock()) > 0:
                        next_idle = min(next_idle, now_mono + left + WAKE_AFTER_S)
                backoff.succeeded()
            except Exception as exc:  # noqa: BLE001 - no loop dies: the follower is UNKNOWN, tried again later
                self._fail_loop("kmsg", KMSG_CHECK, exc)
                self._kmsg_first.set()  # UNKNOWN is said: NVML's events need not wait for a log that cannot be read
                wait = backoff.failed()
                self._beat("kmsg", wait)
                self._sleep(wait)
                continue
            if getattr(follower, "more", False):
                flooded = True
                continue  # the poll stopped at its budget with more to read: no wake-up would say so
            if flooded:
                # A backlog or a flood read to its end: what its batches allocated and freed goes back to the
                # system (the allocator keeps freed pages otherwise, and the daemon's RSS would stay at the flood's).
                flooded = False
                memory.trim()
            # Sleep until a record may have arrived (select on /dev/kmsg, inotify on a recorded file), at the
            # latest until the next idle tick: an idle kernel log costs no wake-up beyond that tick.
            follower.wait(max(0.0, next_idle - time.monotonic()), self.opt.kmsg_tick_s, wake_fd=self._stop_r)
        self._beat_off("kmsg")

    def _consumers_quiet(self) -> bool:
        """Whether an empty batch would change nothing: the log was read, no hold is due, and every consumer's record
        is OK without findings on a state it calls quiet (KernelConsumer.quiet)."""
        with self._lock:
            log_record = self._records.get(KMSG_CHECK)
            if self._kmsg_wake_at is not None or log_record is None or log_record.status is not Status.OK:
                return False
            for consumer in self.consumers:
                rec = self._records.get(consumer.name)
                if (consumer.quiet is None or rec is None or rec.status is not Status.OK or rec.findings or rec.error
                        or not consumer.quiet(rec.state)):
                    return False
            return True

    def _feed(self, records: list, follower: Any, error: str | None) -> None:
        now = self.opt.clock()
        try:
            gpus = list(self.node.gpus())
        except GpuwardenError:
            gpus = []  # XIDs still count, named by the PCI address the driver printed
        # Each record at the time it was logged, as preflight judges it: a backlog read at start (the boot's log, or
        # what came while the daemon was down) is not taken as happening now.
        clock = event_clock(now, self.node.uptime_usec(), records) if records else None
        batch = KernelBatch(records, gpus, follower.cursor.boot_id, event_time=clock)
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
        raises is UNKNOWN with the reason; `source_error` (the log could not be read) is carried as the error, and
        the consumer is UNKNOWN unless a finding it holds FAILs. Keeps the consumers' earliest hold ending, for the
        kernel-log loop's next wake-up."""
        updates, ends = [], []
        for consumer in self.consumers:
            state = self._records.get(consumer.name, CheckRecord(consumer.name)).state
            try:
                judgement = consumer.judge(state, batch, self.config.for_check(consumer.name), now)
            except Exception as exc:  # noqa: BLE001 - a bug in a judge must not stop the daemon
                updates.append(self._record_for(consumer.name, None, Status.UNKNOWN,
                                                f"internal error: {type(exc).__name__}: {exc}", 0.0, now))
            else:
                updates.append(self._record_for(consumer.name, judgement, None, None, 0.0, now, source_error))
                if judgement.wake_at is not None:
                    ends.append(judgement.wake_at)
        self._kmsg_wake_at = min(ends, default=None)
        return updates

    def _nvml_xid_loop(self) -> None:
        """NVML's XID events, the second XID source (docs/daemon.md): each batch goes to the kernel-log consumers,
        which count an XID once whichever sources saw it. Where the node has no events it says so once and ends.
        A wait that fails because a GPU fell off the bus rebuilds the subscription at once without that GPU (found
        by reading each GPU); any other NVML error makes xid UNKNOWN (kept in its state, so kernel-log ticks
        do not hide it) and the subscription is rebuilt after a backoff; incidents are kept."""

        def feed(xids: list, error: str | None, events: Any = None) -> None:
            while not self._kmsg_first.wait(0.5):  # the kernel log's backlog is judged first (see Daemon.__init__)
                if self.stop_event.is_set():
                    return
                self._beat("nvml-xid", 1.0)
            now = self.opt.clock()
            try:
                gpus = list(self.node.gpus())
            except GpuwardenError:
                gpus = []
            batch = KernelBatch([], gpus, self.node.kmsg.boot_id, nvml_xids=xids, source="nvml", nvml_error=error)
            # Live NVML has no backlog and no position (token None). A recorded node's list is one: its position is
            # written with the counts, in one transaction, so a restart neither repeats nor skips an entry.
            token = events.resume_token() if xids and events is not None else None
            with self._lock:
                # While the kernel log cannot be read, NVML's events alone do not make the checks OK.
                self._commit(self._judge_consumers(batch, now, self._kernel_log_error()),
                             {NVML_EVENTS_META: token} if token else None, now)

        # The wait's timeout: idle, the thread wakes once per wait and never spins; short, because a wait inside
        # NVML cannot be interrupted and stop() waits for it.
        tick = min(self.opt.idle_tick_s, 2.0)
        events, backoff = None, Backoff(min(5 * tick, 5.0), min(60 * tick, 60.0))
        try:
            while not self.stop_event.is_set():
                self._beat("nvml-xid", tick)
                try:
                    if events is None or events.closed:
                        # The same subscription object is re-subscribed: it knows which events it handed over.
                        if events is None:
                            resume = self._meta.get(NVML_EVENTS_META) or self.store.meta(NVML_EVENTS_META)
                            events = self.node.xid_events()
                            events.resume(resume)
                        else:
                            events.subscribe()
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
                    backoff.succeeded()
                    if xids:
                        feed(xids, None, events)
                except Exception as exc:  # noqa: BLE001 - an NvmlError or a bug: say why, retry, never end
                    try:
                        if self._recover_events(events, exc, backoff.next_wait, feed):
                            continue
                    except Exception as inner:  # noqa: BLE001 - handling the error must not end the loop either
                        self._fail_loop("nvml-xid", None, inner)
                    wait = backoff.failed()
                    self._beat("nvml-xid", wait)
                    self._sleep(wait)
        finally:
            self._beat_off("nvml-xid")
            if events is not None:
                events.close()

    def _recover_events(self, events: Any, exc: Exception, backoff: float, feed: Any) -> bool:
        """After a failed subscribe or wait: True when GPUs off the bus were found and left out (rebuild at once);
        else the error is fed to the consumers (UNKNOWN) and the caller backs off."""
        if events is not None:
            events.close()
        lost = self._lost_gpus(events) if isinstance(exc, NvmlError) and exc.gpu_lost else {}
        if lost:
            # Not a could-not-look: the GPU is gone (its XID 79 and the polls say so); the others are watched
            # again at once.
            log.warning("NVML XID events: GPUs off the bus left out", gpus=sorted(lost))
            events.leave_out(lost)
            return True
        reason = str(exc) if isinstance(exc, GpuwardenError) else f"internal error: {type(exc).__name__}: {exc}"
        log.warning("NVML XID events failed", error=reason, retry_in_s=backoff)
        feed([], reason)
        return False

    def _lost_gpus(self, events: Any) -> dict[int, NvmlError]:
        """The GPUs of the failed subscription (and those left out before) that answer GPU_IS_LOST to a read, since
        NVML's wait does not say which GPU is lost; empty unless one of the subscribed GPUs is among them (then
        leaving GPUs out would not help). Read through the node, so a recorded node's current file counts."""
        if events is None:
            return {}
        subscribed = {g.index for g in events.subscribed}
        lost: dict[int, NvmlError] = {}
        try:
            nvml = self.node.nvml
            for gpu in nvml.gpus():
                if gpu.index in subscribed or gpu.index in events.left_out:
                    try:
                        nvml.memory_total_bytes(gpu)
                    except NvmlError as exc:
                        if exc.gpu_lost:
                            lost[gpu.index] = exc
        except GpuwardenError:
            return {}  # NVML (or a recorded file caught half-written) cannot say now: back off and try again
        return lost if subscribed & set(lost) else {}


def _keep(consumers: list[KernelConsumer]) -> Interest | None:
    """Every consumer's interest as one filter; None (keep all) when a consumer reads everything."""
    if any(not c.interest for c in consumers):
        return None
    return Interest([n for c in consumers for n in c.interest])

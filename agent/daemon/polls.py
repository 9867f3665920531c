"""The daemon's passive-check loops (a mixin of agent.daemon.Daemon): one thread per check samples at the check's
interval, on ticks aligned across checks; one watchdog reports a sample that overran its timeout. While a check
is quiet, an unchanged sample is not judged and a change probe may stand in for the sample (docs/daemon.md).
"""
from __future__ import annotations

import math
import os
import select
import time
from typing import Any, Sequence

from gpuwarden.agent.core import logs, memory
from gpuwarden.agent.core.backoff import Backoff
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.core.passive import PassiveSpec
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.node.runner import could_not_look
from gpuwarden.agent.sources.tools import Scope
from gpuwarden.agent.state.check_record import CheckRecord

log = logs.get_logger("gpuwarden.daemon")


class PollLoops:
    """Needs from the daemon: node, config, opt, stop_event, _stop_r, _lock, _records, _inflight, _last_judged,
    _quiet_records, _observe(), _beat(), _beat_off() and _fail_loop()."""

    def _poll_loop(self, spec: PassiveSpec) -> None:
        # The sample runs in this thread: a worker thread per tick cost more CPU than the checks themselves at
        # idle. A sample that hangs (a driver call that never returns) holds only this thread; the watchdog
        # reports it UNKNOWN meanwhile, so nothing else waits on it.
        interval = self.opt.intervals.get(spec.name, spec.interval_s)
        loop = f"poll-{spec.name}"
        probe = None
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)
        # A device event (agent/daemon/devices.py) wakes this loop at once through this pipe.
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        self._wakers[spec.name] = wake_w
        sleeper = Sleeper(self._stop_r, wake_r)
        woken = False
        try:
            while not self.stop_event.is_set():
                started = time.monotonic()
                self._beat(loop, spec.timeout_s)
                try:
                    if spec.change_probe is not None:
                        probe = probe or spec.change_probe(self.node)
                        if not woken and self._quiet(spec, started) and not probe.changed():
                            # Where the probe's source says when to look (IB port events), a quiet check is
                            # looked at only now and then besides.
                            events = probe.event_fds()
                            look = max(interval, spec.event_look_s or 0.0) if events else interval
                            sleeper.watch(events)
                            self._beat(loop, look)
                            woken = self._wait_aligned(look, sleeper)
                            continue
                        probe.rearm()
                    self._sample_once(spec, started)
                    record = self._records.get(spec.name)
                    # Not applicable here (no IB port, no AER statistics): asked again only now and then, in case a
                    # driver loads late, rather than at the check's own pace.
                    skipped = record is not None and record.status is Status.SKIPPED
                    wait = max(interval, self.opt.skipped_retry_s) if skipped else interval
                    backoff.succeeded()
                except Exception as exc:  # noqa: BLE001 - no loop dies: the check is UNKNOWN, asked again later
                    self._fail_loop(loop, spec.name, exc)
                    wait = max(interval, backoff.failed())
                    if probe is not None:
                        probe.close()
                        probe = None  # a probe that failed is built again
                sleeper.watch(probe.event_fds() if probe is not None else ())
                self._beat(loop, wait)
                woken = self._wait_aligned(wait, sleeper)
        finally:
            self._beat_off(loop)
            self._wakers.pop(spec.name, None)
            for fd in (wake_r, wake_w):
                os.close(fd)
            if probe is not None:
                probe.close()

    def _wait_aligned(self, interval: float, sleeper: Sleeper) -> bool:
        """Sleeps to the next multiple of `interval`; True when the sleeper's wake pipe (a device event) cut the
        sleep short."""
        # Every loop wakes on multiples of its interval on the one monotonic clock, so the checks due at the same
        # moment run in one burst: on an idle machine a wake-up finds the caches cold, and one burst pays for that
        # once instead of once per check.
        if self.stop_event.is_set():
            return False
        now = time.monotonic()
        return sleeper.sleep((math.floor(now / interval) + 1) * interval - now)

    def wake(self, names: Any) -> None:
        """Cuts the sleep of these checks' polls short: a device they read came or went (a udev event)."""
        for name in names:
            fd = self._wakers.get(name)
            if fd is not None:
                try:
                    os.write(fd, b"x")
                except (BlockingIOError, OSError):
                    pass  # already woken (pipe full) or the loop just ended

    def _sample_once(self, spec: PassiveSpec, started: float) -> None:
        cfg = self.config.for_check(spec.name)
        with self._lock:
            state = dict(self._records.get(spec.name, CheckRecord(spec.name)).state)
            self._inflight[spec.name] = InFlight(started + spec.timeout_s, spec.timeout_s)
        # The sample's tools (fabric's systemctl) are bounded by the sample's own time and ended with their group.
        scope = Scope(deadline=started + spec.timeout_s)
        try:
            with scope.entered():
                sample, error = spec.sample(self.node, cfg, state), None
        except BaseException as exc:  # noqa: BLE001 - becomes UNKNOWN / SKIPPED with the reason
            sample, error = None, exc
        finally:
            scope.end_tools("the sample ended")
        took = time.monotonic() - started
        with self._lock:
            flight = self._inflight.pop(spec.name)
            if flight.reported:
                # The watchdog already said UNKNOWN; what a sample that late read is stale: not judged.
                log.warning("late sample discarded", check=spec.name, took_s=round(took, 3))
                return
            if error is not None:
                status, reason = could_not_look(error)  # the runner's one mapping, as in preflight
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
        """Reports a sample that overran its timeout as UNKNOWN while it is still running. It wakes every two
        shortest timeouts, so an overrun is reported at most three timeouts after the sample began: in production
        every 10 s (ib_port's 5 s timeout), at the 10 s polls' own instants (_wait_aligned), so that an idle node
        wakes once for both rather than also halfway between (a quarter of the daemon's wake-ups were the
        watchdog's)."""
        period = 2 * max(0.01, min(s.timeout_s for s in self.passive))
        trim_at: float | None = time.monotonic() + TRIM_AFTER_S
        sleeper = Sleeper(self._stop_r)
        try:
            while not self.stop_event.is_set():
                self._beat("watchdog", period)
                self._wait_aligned(period, sleeper)
                if trim_at is not None and time.monotonic() >= trim_at:
                    trim_at = None
                    memory.trim()  # once: what start-up and the first samples freed goes back to the system
                try:
                    self._report_overruns()
                except Exception as exc:  # noqa: BLE001 - the reporter must outlive its own bugs
                    self._fail_loop("watchdog", None, exc)
        finally:
            self._beat_off("watchdog")

    def _report_overruns(self) -> None:
        now = time.monotonic()
        with self._lock:
            for name, flight in self._inflight.items():
                if not flight.reported and now >= flight.deadline:
                    flight.reported = True
                    self._observe(name, None, Status.UNKNOWN,
                                  f"sample timed out after {flight.timeout_s:g}s (still running)",
                                  now - flight.deadline + flight.timeout_s)

    def _sleep(self, seconds: float) -> None:
        """Sleeps `seconds`, or until stop(): a loop's backoff after an error (rare: a sleeper made for it)."""
        if not self.stop_event.is_set():
            Sleeper(self._stop_r).sleep(seconds)


class Sleeper:
    """One loop's sleep: until a timeout, until stop() writes the stop pipe, until the loop's own wake pipe is
    written, or until one of the descriptors it was last told to `watch` (a change probe's events) is readable. The
    descriptors are registered once in a poll object: a select() of descriptor lists built at every call cost about
    a quarter of an idle wake-up on the benchmark machine (bench/README.md, daemon idle). A poll object is not
    shared between threads: one a loop."""

    def __init__(self, stop_fd: int, wake_fd: int | None = None):
        self._poll = select.poll()
        self._poll.register(stop_fd, select.POLLIN)
        self._wake_fd = wake_fd
        if wake_fd is not None:
            self._poll.register(wake_fd, select.POLLIN)
        self._watched: tuple[int, ...] = ()  # as asked for
        self._broken: set[int] = set()  # of those, the ones that reported an error: no longer waited on

    def watch(self, fds: Sequence[int]) -> None:
        """Wakes on these descriptors too, in place of those watched before (their owner reads them)."""
        fds = tuple(fds)
        if fds == self._watched:
            return
        for fd in self._watched:
            if fd not in self._broken:
                self._poll.unregister(fd)
        for fd in fds:
            self._poll.register(fd, select.POLLIN)
        self._watched, self._broken = fds, set()

    def sleep(self, seconds: float) -> bool:
        """True when the wake pipe (it is drained) or a watched descriptor cut the sleep short; False at the
        timeout or at stop()."""
        # poll() takes milliseconds and rounds a timeout up: the loop wakes at, never before, its tick.
        ready = self._poll.poll(max(0.0, seconds) * 1000.0)
        woken = False
        for fd, flags in ready:
            if fd == self._wake_fd:
                woken = True
                try:
                    while os.read(fd, 64):
                        pass
                except BlockingIOError:
                    pass
            elif fd in self._watched:
                woken = True
                if flags & _FAILED and fd not in self._broken:
                    # Readable for ever (a closed descriptor, a device gone): waiting on it again would spin. Its
                    # owner finds the failure when it reads it, and the loop looks at its own pace meanwhile.
                    self._poll.unregister(fd)
                    self._broken.add(fd)
        return woken


_FAILED = select.POLLERR | select.POLLHUP | select.POLLNVAL


@dataclass
class InFlight:
    deadline: float  # time.monotonic() by which the sample should have returned
    timeout_s: float
    reported: bool = False  # the watchdog has reported it UNKNOWN: its late result is discarded


TRIM_AFTER_S = 15.0  # start-up is over and every poll has sampled once (the longest interval's first tick aside)

"""`gpuwarden run`: the daemon. Each passive check polls in its own thread at its own interval; the kernel log is
followed by one thread that hands new records to every kernel-log consumer. After every judgement the check's
record, the node record (and a transition with its remediation intents, if any) change in memory under one lock;
nothing slow happens under it. Two workers carry the changes out of it:
- the **writer** writes each consistent cut of that memory to SQLite in one transaction (agent/state/store.py), retries
  a write that failed (disk full, database locked) after a backoff (1 s doubling to 30 s, however many
  observations come meanwhile) while detection goes on in memory, and recreates a state folder deleted under it
  or a database file truncated or overwritten under it (the damaged file set aside);
- the **action worker** runs the remediation engine (agent/act/remediation.py), which carries intents out against the
  scheduler adapter in order, each once, reconciled against the scheduler's state, and marks them done with their
  outcome: a scheduler that hangs delays actions, never detection.
A sample that hangs is UNKNOWN and never blocks the other checks; a scrape of /metrics reads only memory. Every
loop stamps a heartbeat; `stalled()` names the loops that have not come back within their deadline, and the
systemd watchdog is fed only while there are none (agent/cli/run.py), so a stuck loop gets the agent restarted.

This module holds the daemon's options, its records, its lifecycle and heartbeats; the rest are mixins: the one
commit path (agent/daemon/turn.py), the two workers (agent/daemon/writer.py, agent/daemon/actions.py) and the loops
that feed it (agent/daemon/polls.py: passive checks, sample watchdog; agent/daemon/events.py: kernel log, NVML XID
events; agent/daemon/devices.py: udev).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import field, replace
from typing import Any, Callable

from gpuwarden.agent.act.intents import Intent
from gpuwarden.agent.act.remediation import Engine, Hooks, Settings
from gpuwarden.agent.core import logs, memory
from gpuwarden.agent.core.model import CheckResult, Status
from gpuwarden.agent.core.passive import KernelConsumer, MetricSample, PassiveSpec
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import SchedulerAdapter
from gpuwarden.agent.daemon.actions import ActionWorker
from gpuwarden.agent.daemon.devices import DeviceLoop
from gpuwarden.agent.daemon.events import KMSG_CHECK, EventLoops
from gpuwarden.agent.daemon.metrics import DaemonCollector, Snapshot
from gpuwarden.agent.daemon.polls import InFlight, PollLoops
from gpuwarden.agent.daemon.status_socket import StatusSocket
from gpuwarden.agent.daemon.turn import Turn
from gpuwarden.agent.daemon.writer import StoreWriter
from gpuwarden.agent.jobs.guard import JobGuard
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.systemd import name_this_thread
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.store_errors import StoreError
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeRecord, Transition

log = logs.get_logger("gpuwarden.daemon")
STORE_CHECK = "store"  # the state store, reported like a check on /metrics (never an input of the node state)
ARENAS = 2  # malloc arenas for the daemon's dozen threads: they allocate little and rarely at the same time


@dataclass
class DaemonOptions:
    kmsg_tick_s: float = 0.02  # poll interval of a kernel log that can be neither select()ed nor inotify-watched
    idle_tick_s: float = 30.0  # consumers get an empty batch this often, so time-based rules (hold_s) advance
    policy: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    # Runs a retest (agent/node/retest.py: the quick preflight on the kernel log after the given cursor, the recovery):
    # True = passed, False = failed, None = could not decide (something could not look): asked again later.
    retest: "Callable[[Cursor | None], bool | None] | None" = None
    intervals: dict[str, float] = field(default_factory=dict)  # per-check poll interval overrides (tests)
    skipped_retry_s: float = 60.0  # a check that is not applicable on this node is asked again this often
    clock: Callable[[], float] = time.time
    # A loop that has not come back to its own wait this long past when it should have is stalled (a deadlock, a
    # driver call that never returns): the watchdog is no longer fed and systemd restarts the agent.
    stall_after_s: float = 120.0
    # Errors: a loop whose turn failed, a store write or an adapter call that failed, is retried after a
    # backoff that starts at error_backoff_s and doubles up to retry_max_s.
    error_backoff_s: float = 1.0
    retry_max_s: float = 30.0
    # The writer looks at the state folder this often when nothing is written (a folder deleted under an idle
    # daemon is noticed within this).
    store_check_s: float = 30.0
    # What the remediation engine does with intents ([remediation]); None: dry-run, actions.jsonl in the state folder.
    remediation: Settings | None = None
    domain: str | None = None  # this node's NVLink domain (agent/node/topology.py), None when not known
    holders_every_s: float = 10.0  # a quarantined node's GPU holders are read this often (the reset waits on them)
    # The circuit breaker's judge and the recovery steps, when not agent/act/breaker.py's and agent/act/recovery.py's.
    judge: Callable[..., Any] | None = None
    recovery: Any = None


class Daemon(Turn, StoreWriter, ActionWorker, PollLoops, EventLoops, DeviceLoop):
    def __init__(self, node: Any, passive: list[PassiveSpec], consumers: list[KernelConsumer], config: Any,
                 store: Store, adapter: SchedulerAdapter | None, collector: DaemonCollector,
                 options: DaemonOptions | None = None):
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
        self._beats: dict[str, float] = {}  # loop -> time.monotonic() by which it must beat again
        self._record = store.node() or NodeRecord(since=self.opt.clock())
        # Records of the checks this daemon runs; those of checks it no longer runs (a name an older version used,
        # such as xid_watch) are dropped, or their last findings would hold the node's state for ever.
        known = {s.name for s in passive} | {c.name for c in consumers} | {KMSG_CHECK, STORE_CHECK}
        stored = store.checks()
        self._records: dict[str, CheckRecord] = {r.name: r for r in stored if r.name in known}
        stale = sorted(r.name for r in stored if r.name not in known)
        if stale:
            log.info("dropping the state of checks no longer run", checks=stale)
            try:
                store.forget(stale)
            except StoreError as exc:  # kept on disk, ignored in memory; dropped at the next start
                log.warning("could not drop the state of checks no longer run", error=str(exc))
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
        self._kmsg_wake_at: float | None = None  # the consumers' earliest hold ending (opt.clock), if any
        # Set once the kernel-log loop has judged what the log held at start (or said why it could not): NVML's
        # events wait for it, so the first verdict of the kernel-log checks is never one made before the log was read.
        self._kmsg_first = threading.Event()
        self._consumer_names = {c.name for c in consumers}
        self._wakers: dict[str, int] = {}  # poll loop -> the write end of its wake-up pipe (agent/daemon/devices.py)
        self._retesting = False
        self._next_retest_at = 0.0  # a retest that could not decide is asked again after retest_after_s
        # What memory holds that the store does not yet (the writer takes it in one cut, under the lock).
        self._dirty: set[str] = set()
        self._meta: dict[str, Any] = {}  # every meta value this run set (a recreated store gets them all)
        recovery = store.meta("recovery_cursor")  # a restart between the recovery and the retest keeps it
        if recovery is not None:
            self._meta["recovery_cursor"] = recovery
        self._meta_dirty: set[str] = set()
        self._node_dirty = False
        self._new_transitions: list[Transition] = []
        self._new_intents: list[Intent] = []
        self._done: list[tuple[str, float]] = []
        self._write_wanted = threading.Event()
        self._write_mutex = threading.Lock()  # one cut written at a time, in the order they were taken
        self._store_error: str | None = None
        self._store_error_since: float | None = None
        self._store_failures = 0
        self._status_socket: StatusSocket | None = None  # answers `gpuwarden status` (agent/daemon/status_socket.py)
        settings = self.opt.remediation or Settings(node_name=node.hostname)
        if settings.actions_path is None:
            settings = replace(settings, actions_path=store.path.parent / "actions.jsonl")
        self._held: bool | None = None  # a process holds a GPU of the fault (None: not known)
        self._holders_at = 0.0
        self.engine = Engine(adapter, settings, Hooks(done=self._intent_done, set_meta=self._set_meta_locked,
                                                      fault_clear=self._fault_clear, read_meta=self._read_meta),
                             node=node, domain=self.opt.domain, clock=self.opt.clock, lock=self._lock,
                             judge=self.opt.judge, recovery=self.opt.recovery)
        self._actions_wanted = self.engine.wanted
        # The job response (agent/jobs/guard.py): the journal's job keys are known, so a restart acts on none twice.
        # An NVL72 rack is one NVLink domain across its nodes: a job spanning them crosses NVLink off this node too.
        self._jobs_read: tuple[Any, list[Any]] = (None, [])  # the jobs check's state, and its jobs as read from it
        self._guard = JobGuard(settings.node_name, "NVL72" in str(getattr(node.info, "sku", "")),
                               (i["key"] for i in store.intents()))
        collector.live(self._live_samples)
        if store.set_aside:
            log.error("state store set aside", detail=store.set_aside)
            self._set_meta("store_set_aside", {"at": self.opt.clock(), "detail": store.set_aside})
        self._publish()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        # Intents a crash left pending go first; the engine reconciles each against the scheduler's state before
        # it calls the scheduler (an effect already there is marked done, not done again).
        self.engine.enqueue([(i["key"], i["action"], {**i["detail"], "replayed": True})
                             for i in self.store.intents(pending_only=True)])
        with self._lock:
            started = self.engine.start(self.opt.clock())
            self._new_intents.extend(started)
            self.engine.enqueue(started)
            self._write_wanted.set()
        memory.limit_arenas(ARENAS)  # before the loops' threads exist (agent/core/memory.py)
        try:
            self._status_socket = StatusSocket(self.store.path.parent, self._status_answer)
            self._status_socket.start()
        except OSError as exc:  # status then cannot say how the writes go, and says it has no daemon to ask
            self._status_socket = None
            log.warning("cannot make the status socket; `gpuwarden status` cannot ask this daemon", error=str(exc))
        self._spawn("writer", self._writer_loop)
        self._spawn("actions", self._action_loop)
        for spec in self.passive:
            self._spawn(f"poll-{spec.name}", self._poll_loop, spec)
        if self.passive:
            self._spawn("watchdog", self._watchdog_loop)
            self._spawn("udev", self._device_loop)  # device add/remove wakes the polls that read it
        if self.consumers:
            self._spawn("kmsg", self._kmsg_loop)
            self._spawn("nvml-xid", self._nvml_xid_loop)  # NVML's XID events, where the node has them

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops every loop; waits at most `timeout_s` in all (a poll thread stuck in a hung driver call, or an
        adapter call that hangs, is a daemon thread and is left behind), then writes what memory holds."""
        self.stop_event.set()
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")  # never read: every sleep from now on returns at once
        self._write_wanted.set()
        with self._lock:
            self._actions_wanted.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads) and self._stop_w >= 0:
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        self.flush()
        if self._status_socket is not None:
            self._status_socket.stop()
            self._status_socket = None

    def flush(self) -> bool:
        """Writes everything memory holds that the store does not, the changes outside a check's durable part
        included. False when the write failed (it stays pending)."""
        with self._lock:
            self._dirty |= {n for n in self._unflushed if n in self._records}
            self._unflushed.clear()
        return self._write_once()

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            name_this_thread(f"gw-{name.removeprefix('poll-')}")
            target(*args)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- heartbeats -----------------------------------------------------------------------------------------------
    def _beat(self, loop: str, back_within_s: float) -> None:
        """`loop` is making progress and will beat again within `back_within_s` (plus stall_after_s)."""
        self._beats[loop] = time.monotonic() + back_within_s + self.opt.stall_after_s

    def _beat_off(self, loop: str) -> None:
        """`loop` has ended on purpose (or waits on something outside the agent): no deadline."""
        self._beats.pop(loop, None)

    def stalled(self) -> list[str]:
        """The loops past their deadline; empty while every loop makes progress (feed the watchdog then)."""
        now = time.monotonic()
        return sorted(loop for loop, deadline in list(self._beats.items()) if now > deadline)

    def _fail_loop(self, loop: str, check: str | None, exc: BaseException) -> str:
        """A loop's turn raised (a bug, never an expected source error): logged with its traceback, the check it
        serves UNKNOWN with the reason (in memory and on /metrics); the loop goes on after a backoff."""
        reason = f"internal error: {type(exc).__name__}: {exc}"
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        log.error("loop failed; retrying", loop=loop, check=check, error=reason, traceback=trace)
        if check is not None:
            try:
                with self._lock:
                    previous = self._records.get(check, CheckRecord(check))
                    self._records[check] = CheckRecord(check, previous.state, Status.UNKNOWN, reason, (),
                                                       self.opt.clock(), 0.0)
                    self._publish()
            except Exception:  # noqa: BLE001 - the log above already says what went wrong
                pass
        return reason


    def _publish(self) -> None:
        results = {n: CheckResult(n, r.status, r.findings, r.error, r.duration_s) for n, r in self._records.items()}
        results[STORE_CHECK] = CheckResult(STORE_CHECK, Status.UNKNOWN if self._store_error else Status.OK, (),
                                           self._store_error, 0.0)
        samples = dict(self._samples)
        samples[STORE_CHECK] = self._own_samples()
        self.collector.update(Snapshot(self.node.hostname, self._record, results, samples,
                                       self._transitions, self._kmsg_records, self._kmsg_lost))

    def _live_samples(self) -> tuple[MetricSample, ...]:
        error, _since = self._store_health()
        return (MetricSample("gpuwarden_loops_stalled", "The daemon's loops past their deadline (a deadlock, a driver "
                             "call that never returns): while above 0 the systemd watchdog is not fed and the agent "
                             "is restarted.", {}, float(len(self.stalled()))),
                MetricSample("gpuwarden_store_ok", "1 while the state store's writes succeed and its file is the one "
                             "the daemon writes, 0 if a write failed or the file was deleted, truncated or overwritten "
                             "(detection goes on in memory; the write is retried with a backoff, a damaged file set "
                             "aside).", {}, 0.0 if error else 1.0))


    def _own_samples(self) -> tuple[MetricSample, ...]:
        return (
            MetricSample("gpuwarden_node_info", "1, with the node's name at the scheduler and its NVLink domain (\"\" "
                         "when not known) as labels: join on instance to group any series by node or domain.",
                         {"node": self.engine.settings.node_name, "domain": self.opt.domain or ""}, 1.0),
            MetricSample("gpuwarden_store_write_failures", "State store writes that failed since start.", {},
                         float(self._store_failures), "counter"),
            MetricSample("gpuwarden_actions_pending", "Remediation intents not yet carried out by the adapter.", {},
                         float(len(self.engine.pending()))),
            *self.engine.samples(),
        )

    # -- for `status` and tests -----------------------------------------------------------------------------------
    @property
    def record(self) -> NodeRecord:
        with self._lock:
            return self._record

    def results(self) -> dict[str, CheckRecord]:
        with self._lock:
            return dict(self._records)

    @property
    def store_error(self) -> str | None:
        return self._store_error

    def pending_actions(self) -> int:
        return len(self.engine.pending())

    def reload(self, config: Any) -> None:
        with self._lock:
            self.config = config

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

This module holds the records, the one commit path and the two workers; the loops that feed it are mixins:
agent/daemon/polls.py (passive checks, sample watchdog) and agent/daemon/events.py (kernel log, NVML XID events).
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import field, replace
from typing import Any, Callable

from gpuwarden.agent.act.intents import Intent, fault_gpus, transition_intents
from gpuwarden.agent.act.remediation import Engine, Hooks, Settings
from gpuwarden.agent.core import logs, memory
from gpuwarden.agent.core.backoff import Backoff
from gpuwarden.agent.core.config import JOBS_DEFAULTS
from gpuwarden.agent.core.job import jobs_in
from gpuwarden.agent.core.model import CheckResult, Finding, Status, fold_status
from gpuwarden.agent.core.passive import Judgement, KernelConsumer, MetricSample, PassiveSpec
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import SchedulerAdapter
from gpuwarden.agent.daemon.devices import DeviceLoop
from gpuwarden.agent.daemon.events import KMSG_CHECK, EventLoops
from gpuwarden.agent.daemon.metrics import DaemonCollector, Snapshot
from gpuwarden.agent.daemon.polls import InFlight, PollLoops
from gpuwarden.agent.daemon.status_socket import StatusSocket
from gpuwarden.agent.jobs.guard import JobGuard
from gpuwarden.agent.sources.kmsg import Cursor
from gpuwarden.agent.sources.systemd import name_this_thread
from gpuwarden.agent.state.store import CheckRecord, Store, StoreError
from gpuwarden.agent.state.transitions import (
    DEFAULT_POLICY,
    NodeRecord,
    NodeState,
    Transition,
    next_state,
    wants_retest,
)

log = logs.get_logger("gpuwarden.daemon")
STORE_CHECK = "store"  # the state store, reported like a check on /metrics (never an input of the node state)
JOBS_CHECK = "jobs"  # the check that knows which job uses what (checks/jobs.py): the doom rules read its state
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


class Daemon(PollLoops, EventLoops, DeviceLoop):
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
        self._wakers: dict[str, int] = {}  # poll loop -> the write end of its wake-up pipe (daemon_devices.py)
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

    # -- one observation --------------------------------------------------------------------------------------------
    def _observe(self, name: str, judgement: Judgement | None, status: Status | None, error: str | None,
                 duration_s: float) -> None:
        now = self.opt.clock()
        with self._lock:
            # A check that is also a kernel-log consumer (pcie_aer) shares its record with the log's half: its poll
            # must not make it OK while the log cannot be read.
            log_error = self._kernel_log_error() if name in self._consumer_names else None
            self._commit([self._record_for(name, judgement, status, error, duration_s, now, log_error)], None, now)

    def _kernel_log_error(self) -> str | None:
        """Why the kernel log cannot be read now (the follower's record is UNKNOWN), else None. With the lock held."""
        rec = self._records.get(KMSG_CHECK)
        return f"kernel log: {rec.error}" if rec is not None and rec.status is Status.UNKNOWN else None

    def _record_for(self, name: str, judgement: Judgement | None, status: Status | None, error: str | None,
                    duration_s: float, now: float, log_error: str | None = None) -> CheckRecord:
        """The check's record after an observation. `log_error`: the kernel log the check also reads could not be
        read; what it holds still stands (a FAIL stays FAIL), but it cannot say that nothing else happened: UNKNOWN,
        never OK, with the reason."""
        previous = self._records.get(name, CheckRecord(name))
        if judgement is None:
            # Could not look: the state is kept as it was (an accumulator must not be reset by a failed read);
            # the findings of the last good look are dropped, the status says why.
            return CheckRecord(name, previous.state, status or Status.UNKNOWN, error, (), now, duration_s)
        self._samples[name] = judgement.metrics
        findings = tuple(judgement.findings)
        status = status or fold_status(findings)
        if log_error is not None:
            error = error or log_error
            if status is not Status.FAIL:
                status = Status.UNKNOWN
        return CheckRecord(name, judgement.state, status, error, findings, now, duration_s)

    def _commit(self, updates: list[CheckRecord], meta: dict | None, now: float, retest: bool | None = None) -> None:
        """Applies one observation to memory (call with the lock held): the records, the node state, and what the
        writer and the action worker are to carry out. Never waits on the disk or the scheduler."""
        # A check's own hooks (durable, quiet) run first: one that raises leaves memory as it was, never a record
        # that /metrics and the node's state have not seen.
        weighed = []
        for rec in updates:
            old = self._records.get(rec.name)
            quiet = self._quiet_specs.get(rec.name)
            quiet_now = None if quiet is None else rec.status is Status.OK and not rec.findings and quiet(rec.state)
            weighed.append((rec, old, _differs(old, rec, self._durable.get(rec.name)), quiet_now))
        for rec, old, differs, quiet_now in weighed:
            if differs:
                self._dirty.add(rec.name)
                self._unflushed.discard(rec.name)
            elif old is not None and old.state != rec.state:
                self._unflushed.add(rec.name)  # a change only outside the durable part: written later
            self._records[rec.name] = rec
            if quiet_now is not None:
                self._quiet_records[rec.name] = quiet_now
        for key, value in (meta or {}).items():
            self._set_meta(key, value)
        doomed, job_intents = self._jobs_doomed(now)
        record, transition = next_state(self._record, self._active(), self._unknown(), now, self.opt.policy,
                                        retest, self._held, doomed)
        if record.clear_since is not None and self._record.clear_since is None:
            # The faults have cleared: a retest judges the kernel log from here on (agent/node/retest.py), so what was
            # fixed (a GPU reset after an XID 48) is not held against the node, and what comes back is.
            self._set_meta("recovery_cursor", self._meta.get("kmsg_cursor"))
        if record != self._record:
            self._node_dirty = True
        self._record = record
        intents = job_intents
        if transition:
            self._transitions += 1
            self._new_transitions.append(transition)
            intents = self._intents(transition)
            # A doomed job is acted on right after its node stops taking work (the cordon, which the circuit breaker
            # gates), before the drain, a spare's swap or the ladder's steps: a drain may wait on the scheduler (a
            # PodDisruptionBudget holds a Kubernetes eviction), and the job's GPUs idle meanwhile.
            after = next((i + 1 for i, it in enumerate(intents) if it[1] == "cordon"), 0)
            intents[after:after] = job_intents
            log.info("node state", frm=transition.frm.value, to=transition.to.value, reason=transition.reason,
                     actions=list(transition.actions))
        if intents:
            self._new_intents.extend(intents)
            self.engine.enqueue(intents)
        if self._dirty or self._meta_dirty or self._node_dirty or self._new_transitions:
            # Only what moved is written: an idle tick that changed nothing costs no disk write.
            self._write_wanted.set()
        self._publish()
        if (wants_retest(self._record, now, self.opt.policy) and not self._retesting and self.opt.retest
                and now >= self._next_retest_at):
            self._retesting = True
            self._spawn("retest", self._retest)

    def _jobs_doomed(self, now: float) -> tuple[bool, list[Intent]]:
        """Whether a fault dooms a job on the node now, and the intents of the jobs it newly dooms (lock held)."""
        rec = self._records.get(JOBS_CHECK)
        if rec is None or not rec.state.get("jobs"):
            return False, []
        if self._jobs_read[0] is not rec.state:  # read again only when the jobs check judged anew (every 10 s)
            self._jobs_read = (rec.state, jobs_in(rec.state))
        settings = getattr(self.config, "jobs", None) or JOBS_DEFAULTS
        return self._guard.observe(self._active(), self._jobs_read[1], settings, self.node.info.boot_id, now)

    def _intents(self, t: Transition) -> list[Intent]:
        return transition_intents(t, self._active(), self.opt.domain, self.engine.settings.swap,
                                  self.node.info.boot_id)

    def _intent_done(self, key: str, at: float, outcome: str) -> None:
        with self._lock:
            self._done.append((key, at, outcome))
            self._write_wanted.set()
            self._publish()

    def _set_meta_locked(self, key: str, value: Any) -> None:
        with self._lock:
            self._set_meta(key, value)
            self._publish()

    def _read_meta(self, key: str) -> Any:
        """A meta value as the store holds it now: what another process (`gpuwarden breaker reset`) wrote."""
        try:
            return self.store.meta(key)
        except StoreError as exc:
            log.warning("could not read the state store", key=key, error=str(exc))
            return None

    def _fault_clear(self) -> bool:
        with self._lock:
            return self._record.clear_since is not None

    def _set_meta(self, key: str, value: Any) -> None:
        if self._meta.get(key, _MISSING) != value:
            self._meta[key] = value
            self._meta_dirty.add(key)
            self._write_wanted.set()

    def recovery_cursor(self) -> Cursor | None:
        """Where the kernel log stood when the node's faults last cleared: what a retest judges from."""
        with self._lock:
            saved = self._meta.get("recovery_cursor")
        return Cursor(saved.get("boot_id"), int(saved["seq"])) if isinstance(saved, dict) and "seq" in saved else None

    def _retest(self) -> None:
        passed: bool | None = None
        try:
            passed = self.opt.retest(self.recovery_cursor()) if self.opt.retest else None
        except Exception as exc:  # noqa: BLE001 - logged; could not decide, asked again later
            log.error("retest failed to run", error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._retesting = False
                if passed is None:
                    # Could not decide (a check could not look): neither a pass nor a failure that counts toward
                    # retiring the node; asked again after retest_after_s.
                    log.warning("retest could not decide; asked again later")
                    self._next_retest_at = self.opt.clock() + float(self.opt.policy["retest_after_s"])
                # The same path as every observation: the outcome's transition is logged, counted, journalled and
                # its intents marked done once applied (so a restart does not replay a resume).
                self._commit([], None, self.opt.clock(), retest=passed)

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

    def _active(self) -> list[Finding]:
        return [f for r in self._records.values() for f in r.findings]

    def _unknown(self) -> list[str]:
        return [r.name for r in self._records.values() if r.status is Status.UNKNOWN]

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

    def _store_health(self) -> tuple[str | None, float | None]:
        """Why the store is failing now and since when, or (None, None): the last write's error, else what is wrong
        with the file (it can be truncated under a daemon whose writes, into SQLite's WAL, still succeed). Read at
        each scrape and by `status` (the socket), so both say what the file is now; lock-free: a stat and a 16-byte
        read of a local file, never the daemon's lock. A fault found here wakes the writer, which sets it aside."""
        error, since = self._store_error, self._store_error_since
        if error is not None:
            return error, since
        fault = self.store.file_fault()
        if fault is None:
            return None, None
        self._write_wanted.set()
        return f"{self.store.path} {fault}", self.opt.clock()

    def _status_answer(self) -> dict[str, Any]:
        error, since = self._store_health()
        return {"pid": os.getpid(), "store": {"ok": error is None, "error": error, "since": since,
                                              "failed_writes": self._store_failures}}

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

    # -- the writer: memory to SQLite, outside the lock --------------------------------------------------------------
    def _writer_loop(self) -> None:
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)  # the retries of a failed write
        while not self.stop_event.is_set():
            failing = self._store_error is not None
            wait = backoff.next_wait if failing else self.opt.store_check_s
            self._beat("writer", wait + 2 * _BUSY_S)
            if failing:
                # The retry waits out its backoff however many observations come meanwhile: each is kept in memory
                # and goes in the next cut, and a full disk is not asked again at every XID.
                self._sleep(wait)
            else:
                self._write_wanted.wait(wait)
            if self.stop_event.is_set():
                break  # stop() writes the last cut itself
            self._write_wanted.clear()
            try:
                ok = self._write_once()
            except Exception as exc:  # noqa: BLE001 - a bug in the writer must not end it
                self._fail_loop("writer", None, exc)
                ok = False
            if ok:
                backoff.succeeded()
            elif failing:  # the first failure is retried after `first`: it was not waited for
                backoff.failed()
        self._beat_off("writer")

    def _write_once(self) -> bool:
        """Writes one cut of what memory holds and the store does not; False (kept pending) when it failed."""
        with self._write_mutex:
            cut = None
            try:
                if self.store.moved():
                    self._recreate_store()
                elif (fault := self.store.file_fault()) is not None:
                    self._recreate_store(fault)
                with self._lock:
                    cut = self._take_cut()
                if cut is not None:
                    self.store.commit(*cut)
            except Exception as exc:  # noqa: BLE001 - StoreError, or an OSError from a vanished folder
                with self._lock:
                    if cut is not None:
                        self._put_back(cut)
                    self._store_failed(exc)
                return False
            with self._lock:
                if self._store_error is not None:
                    self._store_recovered()
            return True

    def _take_cut(self) -> tuple | None:
        if not (self._dirty or self._meta_dirty or self._node_dirty or self._new_transitions or self._new_intents
                or self._done):
            return None
        checks = [self._records[n] for n in sorted(self._dirty) if n in self._records]
        meta = {k: self._meta[k] for k in sorted(self._meta_dirty)}
        node = self._record if self._node_dirty else None
        cut = (checks, meta, node, list(self._new_transitions), list(self._new_intents), list(self._done))
        self._dirty, self._meta_dirty, self._node_dirty = set(), set(), False
        self._new_transitions, self._new_intents, self._done = [], [], []
        return cut

    def _put_back(self, cut: tuple) -> None:
        """A cut that could not be written goes back before what came since (the next cut takes both)."""
        checks, meta, node, transitions, intents, done = cut
        self._dirty |= {c.name for c in checks}
        self._meta_dirty |= set(meta)
        self._node_dirty = self._node_dirty or node is not None
        self._new_transitions[:0] = transitions
        self._new_intents[:0] = intents
        self._done[:0] = done

    def _recreate_store(self, damaged: str | None = None) -> None:
        """A fresh database from what memory holds: the state folder was deleted or replaced (`damaged` None), or the
        file was damaged under the daemon (`damaged` says how; the file is set aside and named)."""
        if damaged is None:
            log.error("state folder deleted or replaced while running; recreating it", path=str(self.store.path))
        else:
            log.error("state store damaged while running; setting it aside, writing a fresh one from memory",
                      path=str(self.store.path), damage=damaged)
        try:
            self.store.reopen(damaged)
        finally:
            if damaged is None and self._status_socket is not None:
                try:
                    self._status_socket.rebind()  # it went with the folder
                except OSError as exc:
                    log.warning("cannot make the status socket again", error=str(exc))
        if self.store.set_aside:
            log.error("state store set aside", detail=self.store.set_aside)
        with self._lock:
            # The new database starts empty: everything memory holds is written again, the intents not yet done
            # included (a restart must still find them).
            self._dirty |= set(self._records)
            self._meta_dirty |= set(self._meta)
            self._node_dirty = True
            done = {k for k, *_ in self._done}
            journalled = {k for k, _, _ in self._new_intents}
            self._new_intents.extend(i for i in self.engine.pending() if i[0] not in done and i[0] not in journalled)
            if self.store.set_aside:
                self._set_meta("store_set_aside", {"at": self.opt.clock(), "detail": self.store.set_aside})
            self._store_failed(RuntimeError(f"state store {damaged}; set aside and recreated" if damaged
                                            else "state folder was deleted or replaced; recreated"))

    def _store_failed(self, exc: BaseException) -> None:
        reason = str(exc) if str(exc) else type(exc).__name__
        self._store_failures += 1
        if self._store_error != reason:
            log.error("state store write failed; detection goes on in memory, retrying", error=reason)
        if self._store_error is None:
            self._store_error_since = self.opt.clock()
        self._store_error = reason
        self._publish()

    def _store_recovered(self) -> None:
        log.warning("state store writable again; pending state written", error_was=self._store_error)
        self._set_meta("store_fault", {"error": self._store_error, "since": self._store_error_since,
                                       "until": self.opt.clock()})
        self._store_error = self._store_error_since = None
        self._publish()

    # -- the action worker: the remediation engine, outside the lock ------------------------------------------------
    def _action_loop(self) -> None:
        backoff = Backoff(self.opt.error_backoff_s, self.opt.retry_max_s)
        while not self.stop_event.is_set():
            # Waiting on the scheduler is waiting on something outside the agent: a restart would not help, so a
            # call that hangs does not starve the watchdog (actions_pending and scheduler_reachable show it).
            self._beat_off("actions")
            try:
                self._refresh_holders()
                wait = self.engine.step()
                backoff.succeeded()
            except Exception as exc:  # noqa: BLE001 - a bug in the engine must not end the worker
                self._fail_loop("actions", None, exc)
                wait = backoff.failed()
            if wait <= 0:
                continue
            wait = min(wait, self.opt.store_check_s)
            self._beat("actions", wait)
            with self._lock:
                if self.stop_event.is_set() or self.engine.ready(self.opt.clock()):
                    continue
                self._actions_wanted.wait(wait)
        self._beat_off("actions")

    def _refresh_holders(self) -> None:
        """Whether a process still holds a GPU of a quarantined node's fault: a GPU reset waits until none does
        (agent/state/transitions.py). Read only while the ladder has yet to take its first step."""
        with self._lock:
            rec, gpus = self._record, fault_gpus(self._active())
        now = self.opt.clock()
        if rec.state is not NodeState.QUARANTINED or rec.step or now < self._holders_at:
            return
        self._holders_at = now + self.opt.holders_every_s
        held: bool | None = None
        try:
            recovery = self.opt.recovery
            if recovery is None:
                from gpuwarden.agent.act import recovery  # noqa: PLC0415 - the ladder's actions
            held = any(recovery.gpu_holders(self.node, gpus).values()) if gpus else None
        except Exception as exc:  # noqa: BLE001 - could not look: not known, never "free"
            log.warning("could not read the processes holding the GPUs", gpus=gpus, error=str(exc))
        with self._lock:
            if held != self._held:
                self._held = held
                self._commit([], None, self.opt.clock())

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


_MISSING = object()
_BUSY_S = 5.0  # a write may wait this long on a database another process has locked (store.BUSY_TIMEOUT_S)


def _differs(old: CheckRecord | None, new: CheckRecord, durable: Callable[[Any], Any] | None = None) -> bool:
    """Whether a check's record changed in what must be written now: its status, error, findings, or the durable
    part of its state (all of it unless the check says otherwise). Timestamps alone never count."""
    if old is None or (old.status, old.error, old.findings) != (new.status, new.error, new.findings):
        return True
    if durable is None:
        return old.state != new.state
    return durable(old.state) != durable(new.state)

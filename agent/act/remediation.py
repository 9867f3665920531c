"""The remediation engine: carries the node's intents (cordon, drain, quarantine, resume, the recovery steps, a
spare's swap, the NVLink domain's publication) out against the scheduler adapter, one at a time, in the order the
journal holds them, and records each one's outcome.

- **Idempotent and durable.** Every intent is journalled (agent/state/store.py) with its key before it is carried out,
  and marked done with its outcome after. Before each scheduler call the node's actual state is read
  (`adapter.node`): an intent whose effect is already there (a drain a crash left unmarked, a call that timed out
  after it took effect) is marked done without calling again, so a restart reconciles instead of replaying.
- **Outages delay, never lose.** `Transient` keeps the intent at the head of the queue and retries it after a
  backoff that doubles up to retry_max_s; the intents behind it wait, in order. `Busy` (a scheduler that answered
  "later": a PodDisruptionBudget, pods still terminating, work still running before a reboot) is retried the same
  way, but the scheduler counts as reachable and `status` says what the intent waits for. `Refused` ends the
  intent with outcome "refused: ..." (logged and counted): retrying would not help.
- **Dry run** (the default, `[remediation] mode = "dry-run"`): each intent is logged and written to
  actions.jsonl, and nothing reaches the scheduler or the node (no reads either).
- **Circuit breaker.** Before a cordon, drain or quarantine of a node that is in service, the fleet is read from
  the scheduler and agent/act/breaker.py judges it. A refusal latches: the intent and those behind it wait (neither
  lost nor done) until `gpuwarden breaker reset` records a reset time in the state store, which the engine reads
  at its next turn; drains before that time no longer count. The node is always judged as one more on top of the
  fleet's other drains (never by its own place among them: that order is the scheduler's reason time, which Slurm
  moves when our reason changes).
- **A spare only for a node the agent took out.** take_spare runs only while the scheduler shows this node
  quarantined by the agent; after a refused quarantine (an administrator's drain) it ends "refused: no spare
  taken ...".
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gpuwarden.agent.act import recovery as recovery_steps
from gpuwarden.agent.act import spares as spare_policy
from gpuwarden.agent.act.breaker import BreakerPolicy
from gpuwarden.agent.act.breaker import judge as breaker_judge
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.backoff import doubling_delay
from gpuwarden.agent.core.model import finding_text
from gpuwarden.agent.core.passive import MetricSample
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import REASON_PREFIX, Busy, Refused, SchedulerAdapter, Service, Transient
from gpuwarden.agent.jobs import respond as job_response
from gpuwarden.agent.jobs.respond import JOB_ACTION

log = logs.get_logger("gpuwarden.remediation")

ACTIONS = ("cordon", "drain", "quarantine", "uncordon", "resume", "retire", "reset_gpu", "reboot", "ticket",
           "take_spare", "return_to_pool", "publish_domain", JOB_ACTION)
GATED = ("cordon", "drain", "quarantine")  # take capacity out of the fleet: the breaker is asked first
# Carried out (or found already so), these leave the node out of service: a doomed job on it may then be ended.
OUT_OF_SERVICE = ("cordon", "drain", "quarantine", "retire")
MODES = ("dry-run", "act")
RESET_AT_KEY = "breaker_reset_at"  # meta key `gpuwarden breaker reset` writes, the engine reads
STATUS_KEY = "remediation"  # meta key the engine keeps for `gpuwarden status`
OUTCOME_KINDS = ("done", "already", "refused", "failed", "dry_run", "superseded")
# Intents that take a node out of service or act on it for a fault. One still waiting (a breaker holding it, a
# scheduler outage) when a later transition of the node back to healthy is queued is superseded, not carried out:
# a node that recovered in the meantime must not be cordoned, quarantined, swapped, reset or ticketed after the fact.
SUPERSEDABLE = ("cordon", "drain", "quarantine", "take_spare", "reset_gpu", "reboot", "ticket", "retire")


@dataclass(frozen=True)
class Settings:
    """The [remediation] table, resolved."""
    mode: str = "dry-run"
    adapter: str = "local"
    node_name: str = ""
    retry_min_s: float = 1.0
    retry_max_s: float = 300.0
    publish_every_s: float = 600.0  # the NVLink domain is re-asserted this often (slurmctld forgets it)
    latch_poll_s: float = 5.0  # a latched breaker looks for a reset this often
    breaker: Mapping[str, Any] = field(default_factory=dict)  # agent/act/breaker.py BreakerPolicy keywords
    spares: Mapping[str, Any] = field(default_factory=dict)  # "swap" (bool) + agent/act/spares.py SparePolicy keywords
    reboot_command: tuple[str, ...] = ("systemctl", "reboot")
    ticket_command: tuple[str, ...] = ()
    step_timeout_s: float = 600.0  # a recovery step (reset, reboot command, ticket hook) is ended after this
    actions_path: Path | None = None  # actions.jsonl: every intent as the dry run (and the act mode) saw it

    @property
    def acting(self) -> bool:
        return self.mode == "act"

    @property
    def swap(self) -> bool:
        return bool(self.spares.get("swap", True))

    @classmethod
    def from_table(cls, table: Mapping[str, Any], node_name: str, actions_path: Path | None) -> "Settings":
        ladder = table.get("ladder", {})
        return cls(mode=table.get("mode", "dry-run"), adapter=table.get("adapter", "local"),
                   node_name=table.get("node_name") or node_name, retry_min_s=float(table.get("retry_min_s", 1.0)),
                   retry_max_s=float(table.get("retry_max_s", 300.0)),
                   publish_every_s=float(table.get("publish_every_s", 600.0)),
                   breaker=dict(table.get("breaker", {})), spares=dict(table.get("spares", {})),
                   reboot_command=tuple(ladder.get("reboot_command", ("systemctl", "reboot"))),
                   ticket_command=tuple(ladder.get("ticket_command", ())),
                   step_timeout_s=float(ladder.get("step_timeout_s", 600.0)), actions_path=actions_path)


class _Latched(Exception):
    """The breaker is open: the intent waits for a reset."""


@dataclass
class _Item:
    key: str
    action: str
    detail: dict[str, Any]
    attempts: int = 0
    not_before: float = 0.0


@dataclass
class Hooks:
    """What the engine asks of the daemon that runs it (each takes the daemon's lock itself)."""
    done: Callable[[str, float, str], None]  # the intent is carried out: journal (key, at, outcome)
    set_meta: Callable[[str, Any], None]  # a meta value for `status`
    fault_clear: Callable[[], bool] = lambda: False  # the node's faults have cleared (a reset is moot)
    read_meta: Callable[[str], Any] = lambda key: None  # a meta value as the store holds it now (breaker reset)


def _transition(key: str) -> str:
    """The transition an intent's key belongs to (`<at>:<from>-><to>:<action>` less the action): the intents of one
    transition share it."""
    return key.rsplit(":", 1)[0]


class Engine:
    def __init__(self, adapter: SchedulerAdapter | None, settings: Settings, hooks: Hooks, node: Any = None,
                 domain: str | None = None, clock: Callable[[], float] = time.time,
                 lock: threading.RLock | None = None, judge: Callable[..., Any] | None = None,
                 recovery: Any = None, spares: Any = None):
        self.adapter, self.settings, self.hooks, self.node, self.domain = adapter, settings, hooks, node, domain
        self.clock = clock
        self.lock = lock or threading.RLock()
        self.wanted = threading.Condition(self.lock)  # enqueue() wakes the worker
        self._judge = judge  # agent/act/breaker.py's unless given (tests)
        self._recovery = recovery if recovery is not None else recovery_steps
        self._spares = spares if spares is not None else spare_policy
        self._queue: deque[_Item] = deque()
        self._queued: set[str] = set()
        # Job intents waiting out `[jobs] signal_before_s` between their signal and their requeue: out of the queue, so
        # the intents behind them go on; back at its head when their time comes. What each has done is kept in the
        # status meta (`job_progress`), so a restart does not signal again.
        self._deferred: list[_Item] = []
        self._job_progress: dict[str, dict[str, Any]] = {}
        self._out_of_service = False  # this engine took the node out (cordon, drain, quarantine) and has not resumed it
        self._job_counts: dict[tuple[str, str], int] = {}  # (action, rule) -> job actions since start
        self._job_latency: dict[str, float] = {}  # action -> seconds from the fault to the last such action
        self._job_saved: dict[str, float] = {}  # action -> estimated GPU-seconds its actions saved since start
        self._counts = dict.fromkeys(OUTCOME_KINDS, 0)
        self._latch: dict[str, Any] | None = None  # the breaker's refusal while it holds
        self._confirming: str | None = None  # the intent whose drain landed and is not judged again yet
        self._reset_at: float | None = None
        self._swap: dict[str, Any] | None = None  # the last spare swap: taken, or the slice must move
        # The transition whose quarantine found this node held in its domain's spare pool: a spare that fails in the
        # pool ran no slice, so nothing is to be replaced (the take_spare of that transition takes no spare).
        self._spare_quarantined: str | None = None
        self._spare = False  # the scheduler showed this node in its domain's spare pool when it last read it
        self._error: str | None = None  # the scheduler's last error while it lasts
        self._error_since: float | None = None
        self._waiting: str | None = None  # what the scheduler, reached, asked to wait for (Busy), while it lasts
        self._waiting_since: float | None = None
        self._next_publish = 0.0
        self._status: dict[str, Any] = {}
        saved = hooks.read_meta(STATUS_KEY)
        if isinstance(saved, dict):  # a latch survives a restart: the breaker stays open until reset
            self._latch = saved.get("breaker") if isinstance(saved.get("breaker"), dict) else None
            self._swap = saved.get("swap") if isinstance(saved.get("swap"), dict) else None
            found = saved.get("spare_quarantined")
            self._spare_quarantined = found if isinstance(found, str) else None
            progress = saved.get("job_progress")
            self._job_progress = {k: v for k, v in progress.items() if isinstance(v, dict)} \
                if isinstance(progress, dict) else {}
        reset = hooks.read_meta(RESET_AT_KEY)
        self._reset_at = float(reset) if isinstance(reset, (int, float)) else None

    # -- the queue (enqueue with the daemon's lock held) -----------------------------------------------------------
    def enqueue(self, intents: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        with self.lock:
            for key, action, detail in intents:
                if key not in self._queued:
                    self._queued.add(key)
                    self._queue.append(_Item(key, action, dict(detail)))
            self.wanted.notify_all()

    def pending(self) -> list[tuple[str, str, dict[str, Any]]]:
        with self.lock:
            return [(i.key, i.action, i.detail) for i in (*self._queue, *self._deferred)]

    # -- one turn of the worker ------------------------------------------------------------------------------------
    def step(self) -> float:
        """Carries out (or tries) the intent at the head of the queue. Returns how long to wait before the next
        turn is worth taking (0: at once; the worker also wakes when an intent is queued)."""
        now = self.clock()
        waits = [self._publish_turn(now)]
        with self.lock:
            self._undefer(now)
            item = self._queue[0] if self._queue else None
            healthy_after = item is not None and self._healthy_after(item)
            waits += [d.not_before - now for d in self._deferred]
        if item is None:
            return min(waits)
        if healthy_after:
            why = "the breaker held it" if self._latch else "it waited for the scheduler"
            self._finish(item, f"superseded: {self.settings.node_name} was healthy again before this {item.action} "
                               f"was carried out ({why})")
            return 0.0
        if item.not_before > now:
            return min([*waits, item.not_before - now])
        try:
            outcome = self._carry_out(item, now)
        except _Latched:
            return min([*waits, self.settings.latch_poll_s])
        except job_response.Deferred as exc:  # a job signalled first: its requeue waits, the intents behind it go on
            self._scheduler_ok(now)
            self._defer(item, exc)
            return 0.0
        except Busy as exc:  # reached, and asked to come back later: the same backoff, the scheduler is fine
            return min([*waits, self._retry(item, now, f"{exc}", busy=True)])
        except Transient as exc:
            return min([*waits, self._retry(item, now, f"{exc}")])
        except Refused as exc:
            outcome = f"refused: {exc}"
            log.error("the scheduler refused an intent", action=item.action, key=item.key, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug or an unexpected library error: kept, retried, logged
            return min([*waits, self._retry(item, now, f"{type(exc).__name__}: {exc}")])
        self._scheduler_ok(now)
        self._finish(item, outcome)
        return 0.0

    def _defer(self, item: _Item, exc: job_response.Deferred) -> None:
        with self.lock:
            if self._queue and self._queue[0] is item:
                self._queue.popleft()
            item.not_before, item.attempts = exc.until, 0
            self._deferred.append(item)
            if item.key not in self._job_progress:  # its first action, the signal: what the time to act measures
                self._count_job(item, "signal", ended=False)
            self._job_progress[item.key] = exc.progress
        log.info("job signalled; its requeue waits", key=item.key, until=exc.until)
        self._save_status()

    def _undefer(self, now: float) -> None:
        """Deferred job intents whose time has come go back to the head of the queue (lock held)."""
        due = [d for d in self._deferred if d.not_before <= now]
        for d in reversed(due):
            self._deferred.remove(d)
            self._queue.appendleft(d)

    def _healthy_after(self, item: _Item) -> bool:
        """Whether `item` acts on a fault and a later transition of the node back to healthy is queued behind it
        (called with the lock held)."""
        if item.action not in SUPERSEDABLE or item.detail.get("to") in (None, "healthy"):
            return False
        mine = _transition(item.key)
        return any(later.detail.get("to") == "healthy" and _transition(later.key) != mine
                   and float(later.detail.get("at") or 0) >= float(item.detail.get("at") or 0)
                   for later in list(self._queue)[1:])

    def _retry(self, item: _Item, now: float, error: str, busy: bool = False) -> float:
        delay = doubling_delay(self.settings.retry_min_s, self.settings.retry_max_s, item.attempts)
        item.attempts += 1
        item.not_before = now + delay
        if busy:
            if self._waiting is None:
                self._waiting_since = now
            if self._waiting != error:
                log.warning("intent waits: the scheduler asks to come back later", action=item.action,
                            key=item.key, waiting_for=error, retry_in_s=delay, attempt=item.attempts)
            self._waiting, self._error, self._error_since = error, None, None
            self._save_status()
            return delay
        if self._error is None:
            self._error_since = now
        if self._error != error:
            log.error("intent not carried out yet; retrying", action=item.action, key=item.key, error=error,
                      retry_in_s=delay, attempt=item.attempts)
        self._error = error
        self._save_status()
        return delay

    def _scheduler_ok(self, now: float) -> None:
        if self._error is not None:
            log.warning("carrying out intents again", error_was=self._error, since=self._error_since)
        elif self._waiting is not None:
            log.info("the wait is over; carrying out intents again", waited_for=self._waiting,
                     since=self._waiting_since)
        if self._error is not None or self._waiting is not None:
            self._error = self._error_since = self._waiting = self._waiting_since = None
            self._save_status()

    def _finish(self, item: _Item, outcome: str) -> None:
        kind = outcome.split(":", 1)[0].split(" ", 1)[0]
        kind = {"dry-run": "dry_run", "done": "done", "refused": "refused", "failed": "failed",
                "already": "already", "superseded": "superseded"}.get(kind, "done")
        with self.lock:
            if self._queue and self._queue[0] is item:
                self._queue.popleft()
            self._queued.discard(item.key)
            self._counts[kind] += 1
            if item.action == JOB_ACTION:
                job_action = "dry_run" if kind == "dry_run" else job_response.action_taken(outcome)
                if job_action is not None:
                    self._count_job(item, job_action)
        if item.action == JOB_ACTION and self._job_progress.pop(item.key, None) is not None:
            self._save_status()
        log.info("intent carried out" if self.settings.acting else "would act", action=item.action, key=item.key,
                 outcome=outcome, reason=item.detail.get("reason", ""))
        self.hooks.done(item.key, self.clock(), outcome)

    # -- carrying one intent out -------------------------------------------------------------------------------
    def _carry_out(self, item: _Item, now: float) -> str:
        action, detail = item.action, item.detail
        if not self.settings.acting:
            self._write_action(item, now)
            return "dry-run: logged, not carried out"
        if action in ("reset_gpu", "reboot", "ticket"):
            return self._recovery_step(action, detail, item.key)
        adapter = self._adapter()
        me = self.settings.node_name
        if action == JOB_ACTION:
            return self._job(adapter, item, now)
        if action == "publish_domain":
            domain = str(detail.get("domain") or "")
            view = adapter.node(me)
            self._spare = view.spare
            if view.domain == domain:
                return "already published"
            adapter.publish_domain(me, domain)
            return "done"
        if action == "take_spare":
            return self._take_spare(adapter, detail, _transition(item.key))
        if action == "drain" and detail.get("to") == "quarantined":
            # The drain that quarantines: drained and marked as held for recovery, in one call (never taken as
            # a spare, never resumed by another agent).
            action = "quarantine"
        view = adapter.node(me)
        self._spare = view.spare
        if action == "quarantine" and view.spare and view.service is not Service.IN_SERVICE:
            self._spare_quarantined = _transition(item.key)
            self._save_status()
        if action in GATED and self._latch is not None:
            self._held(adapter, view)  # every drain of this node waits while the breaker holds
        if _present(action, view):
            if self._confirming == item.key:  # it landed, and the read that judges it again failed: judged now
                self._confirm(adapter, now)
            self._confirming = None
            self._out_of_service = action in OUT_OF_SERVICE
            return f"already so at the scheduler ({view.service.value}{', ours' if view.ours else ''}" \
                   f"{', quarantined' if view.quarantined else ''}{', spare' if view.spare else ''})"
        reason = _reason(detail)
        gated = action in GATED and view.service is Service.IN_SERVICE
        if gated:
            self._gate(adapter, now)
            self._confirming = item.key
        outcome = self._act(adapter, action, detail, reason)
        if gated:
            self._confirm(adapter, now)
        self._confirming = None
        return outcome

    def _job(self, adapter: SchedulerAdapter, item: _Item, now: float) -> str:
        """A doomed job (agent/jobs/respond.py), only where the node's own quarantine passed the circuit breaker: while
        the breaker holds, the job waits with the node's intents; a node the scheduler still has in service (its
        quarantine superseded, never carried out) could take a requeued job straight back, and ends no job."""
        self._still_latched()
        if not self._out_of_service:
            view = adapter.node(self.settings.node_name)
            self._spare = view.spare
            if view.service is Service.IN_SERVICE:
                raise Refused(f"{self.settings.node_name} is in service at the scheduler: a job is ended only where "
                              "its node was taken out first (a requeued job would land back on it)")
        return job_response.carry_out(adapter, item.detail, self.settings.node_name, now,
                                      self._job_progress.get(item.key))

    def _count_job(self, item: _Item, action: str, ended: bool = True) -> None:
        """The job metrics of a job intent that took `action` (one of job_response.JOB_ACTION_KINDS; lock held), when
        it ended or (`ended` False) when it signalled its job first and waits for the requeue: what was done, how long
        after the fault (of the first action: a requeue that waited out signal_before_s after its signal took its time
        at the signal), and the GPU-seconds it is estimated to have saved ((the job's watchdog timeout - the time to
        the end of the job) x its GPUs)."""
        d = item.detail
        rule = str(d.get("rule") or "")
        signalled = item.key in self._job_progress  # counted at its signal: a job that then ended is no second one
        if not (ended and signalled and action == "signal"):
            self._job_counts[(action, rule)] = self._job_counts.get((action, rule), 0) + 1
        fault_at = d.get("fault_at")
        if action == "dry_run" or not isinstance(fault_at, (int, float)):
            return
        took = max(0.0, self.clock() - float(fault_at))
        if not signalled:  # no signal before this action (the progress is kept from the signal)
            self._job_latency[action] = took
        if not ended:
            return  # the job goes on until its requeue: what it saved is counted then
        watchdog, gpus = d.get("watchdog_s"), d.get("gpus_total")
        if action != "notify" and isinstance(watchdog, (int, float)) and isinstance(gpus, (int, float)):
            self._job_saved[action] = self._job_saved.get(action, 0.0) + max(0.0, float(watchdog) - took) * float(gpus)

    def _act(self, adapter: SchedulerAdapter, action: str, detail: Mapping[str, Any], reason: str) -> str:
        me = self.settings.node_name
        if action == "cordon":
            adapter.cordon(me, reason)
        elif action == "drain":
            adapter.drain(me, reason)
        elif action in ("quarantine", "retire"):
            adapter.quarantine(me, reason if action == "quarantine" else f"{REASON_PREFIX} retired: "
                               f"{detail.get('reason', '')}")
        elif action == "uncordon":
            adapter.resume(me)
        elif action == "resume":
            return self._back_in_service(adapter)
        elif action == "return_to_pool":
            adapter.return_to_pool(me, str(detail.get("domain") or self.domain))
        else:
            return f"failed: unknown action {action!r}"
        self._spare = action == "return_to_pool"
        self._out_of_service = action in OUT_OF_SERVICE
        return "done"

    def _adapter(self) -> SchedulerAdapter:
        if self.adapter is None:
            raise Transient("no scheduler adapter configured")
        return self.adapter

    def _write_action(self, item: _Item, now: float) -> None:
        path = self.settings.actions_path
        if path is None:
            return
        line = json.dumps({"action": item.action, "at": now, "key": item.key, **item.detail}, sort_keys=True)
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:  # the state folder is gone or full: kept, retried (the writer recreates it)
            raise Transient(f"{path}: cannot write: {exc.strerror or exc}") from None

    # -- the circuit breaker -----------------------------------------------------------------------------------
    def _gate(self, adapter: SchedulerAdapter, now: float) -> None:
        self._still_latched()
        judge, policy = self._breaker()
        me = self.settings.node_name
        # Judged as one more on top of the others' drains, never ranked by its own start among them (a stale mark
        # of ours on a node back in service must not make it "already drained"): as the judgement after the cordon.
        verdict = judge([v for v in adapter.nodes() if v.name != me], me, self.domain, now, policy, self._reset_at)
        if verdict.allow:
            return
        self._trip(verdict, now)
        raise _Latched()

    def _still_latched(self) -> None:
        """Raises _Latched while the breaker holds; closes it when the operator reset it since it opened."""
        reset = self.hooks.read_meta(RESET_AT_KEY)
        if isinstance(reset, (int, float)) and (self._reset_at is None or reset > self._reset_at):
            self._reset_at = float(reset)
        if self._latch is not None and self._reset_at is not None \
                and self._reset_at >= float(self._latch.get("since") or 0.0):
            # Reset after the latch (while running, or while the agent was down): judged again from here on.
            log.warning("circuit breaker reset by the operator; judging the fleet again", was=self._latch.get("reason"))
            self._latch = None
            self._save_status()
        if self._latch is not None:
            raise _Latched()

    def _confirm(self, adapter: SchedulerAdapter, now: float) -> None:
        """After taking a node out of service: agents on nodes that failed at the same moment each judged a fleet
        without the others' drains. So the fleet is read again, now with theirs, and this node judged as if it
        were still in service; past the limit, its drain (ours) is undone and the breaker latches. An agent that
        keeps its drain has seen every drain kept before its own, so no more than the limit are ever kept (when
        several raced, all of them may let go: the brake errs on the side of the fleet)."""
        me = self.settings.node_name
        judge, policy = self._breaker()
        verdict = judge([v for v in adapter.nodes() if v.name != me], me, self.domain, now, policy, self._reset_at)
        if verdict.allow:
            return
        self._trip(verdict, now, undo=True)
        self._undo(adapter)
        raise _Latched()

    def _held(self, adapter: SchedulerAdapter, view: Any) -> None:
        """The breaker holds (unless reset): a drain it refused after the fact is undone if that did not happen
        yet, and the intent waits."""
        if self._latch is not None and self._latch.get("undo") and view.ours and not view.quarantined \
                and not view.spare and view.service is not Service.IN_SERVICE:
            self._undo(adapter)
        self._still_latched()

    def _undo(self, adapter: SchedulerAdapter) -> None:
        adapter.resume(self.settings.node_name)  # our own drain: back in service
        log.warning("drain undone: the circuit breaker holds", node=self.settings.node_name)
        if self._latch is not None:
            self._latch = {**self._latch, "undo": False}
            self._save_status()

    def _trip(self, verdict: Any, now: float, undo: bool = False) -> None:
        self._latch = {"open": True, "since": now, "reason": verdict.reason, "cluster": list(verdict.cluster),
                       "domain": list(verdict.domain) if verdict.domain is not None else None, "undo": undo}
        log.error("circuit breaker open: cordons held until `gpuwarden breaker reset`", reason=verdict.reason,
                  cluster=verdict.cluster, domain=verdict.domain)
        self._save_status()

    def _breaker(self) -> tuple[Callable[..., Any], Any]:
        if self._judge is not None:
            return self._judge, dict(self.settings.breaker)
        return breaker_judge, BreakerPolicy(**self.settings.breaker)

    @property
    def breaker_open(self) -> bool:
        return self._latch is not None

    # -- spares ----------------------------------------------------------------------------------------------------
    def _spare_policy(self) -> Any:
        return self._spares.SparePolicy(**{k: v for k, v in self.settings.spares.items() if k != "swap"})

    def _take_spare(self, adapter: SchedulerAdapter, detail: Mapping[str, Any], transition: str = "") -> str:
        """The scheduler is the arbiter (take_spare is atomic there); the plan (agent/act/spares.py) says beforehand
        whether the domain has a spare at all, and which domains could host the slice if not.

        A spare replaces only a node the agent itself took out of service: when this node's quarantine was refused
        (an administrator's drain, another health checker's) or undone since, the scheduler does not show it
        quarantined, and no spare is taken. The scheduler's view decides, not the journal's, so a restart between
        the quarantine and the swap reaches the same answer."""
        me, domain = self.settings.node_name, str(detail.get("domain") or "")
        if transition and transition == self._spare_quarantined:
            log.info("no spare taken: this node was itself a spare, held in the pool", node=me, domain=domain)
            return f"done: no spare taken: {me} was a spare of {domain} held in the pool (no slice ran on it)"
        fleet = list(adapter.nodes())
        mine = next((v for v in reversed(fleet) if v.name == me), None) or adapter.node(me)
        if not mine.quarantined:
            held = f"held by someone else: {mine.reason}" if mine.reason and not mine.ours else mine.service.value
            log.warning("no spare taken: this node is not quarantined by the agent", node=me, state=held)
            return f"refused: no spare taken: {me} is not quarantined by gpuwarden ({held}); the agent did not " \
                   "take it out of service, so it takes no spare in its place"
        plan = self._spares.plan_swap(fleet, me, self._spare_policy())
        spare = None if plan.slice_must_move else adapter.take_spare(domain, me)
        reason = plan.reason
        if spare is None:
            hosts = list(plan.hosts)
            self._swap = {"domain": domain, "spare": None, "slice_must_move": True, "hosts": hosts,
                          "reason": reason, "at": self.clock()}
            log.error("no spare left in the NVLink domain: the slice must move", domain=domain, hosts=hosts,
                      reason=reason)
            self._save_status()
            return f"done: no spare in {domain}; the slice must move (domains that could host it: " \
                   f"{', '.join(hosts) or 'none known'})"
        self._swap = {"domain": domain, "spare": spare, "slice_must_move": False, "hosts": [], "reason": reason,
                      "at": self.clock()}
        log.info("spare taken into service", domain=domain, spare=spare, for_node=me)
        self._save_status()
        return f"done: spare {spare} of {domain} taken into service"

    def _back_in_service(self, adapter: SchedulerAdapter) -> str:
        me = self.settings.node_name
        self._out_of_service = False
        if self.domain and self.settings.swap:
            if self._spares.wants_back_in_pool(list(adapter.nodes()), me, self._spare_policy()):
                adapter.return_to_pool(me, self.domain)
                self._spare = True
                return f"done: returned to the spare pool of {self.domain}"
        adapter.resume(me)
        self._spare = False
        return "done"

    @property
    def slice_must_move(self) -> bool:
        return bool(self._swap and self._swap.get("slice_must_move"))

    # -- the recovery steps on this node -----------------------------------------------------------------------
    def _recovery_step(self, action: str, detail: Mapping[str, Any], key: str) -> str:
        timeout = self.settings.step_timeout_s
        if action == "reset_gpu":
            if self.hooks.fault_clear():
                return "already clear: the fault cleared before the reset"
            gpus = [int(g) for g in detail.get("gpus", [])]
            return self._run_step("reset_gpus", self.node, gpus, timeout)
        if action == "reboot":
            before, now_boot = detail.get("boot_id"), getattr(getattr(self.node, "info", None), "boot_id", None)
            if before and now_boot and before != now_boot:
                return f"done: rebooted (boot {before} -> {now_boot})"
            if self.adapter is not None:
                jobs = self.adapter.node(self.settings.node_name).jobs
                if jobs:  # the drain lets work finish: a reboot now would kill it
                    raise Busy(f"{jobs} job(s) still running on the node; the reboot waits for the drain")
            log.warning("rebooting the node", command=list(self.settings.reboot_command), reason=detail.get("reason"))
            return self._run_step("reboot", list(self.settings.reboot_command), timeout)
        if not self.settings.ticket_command:
            return "done: no ticket command configured ([remediation.ladder] ticket_command); waiting for repair"
        finding = {"finding": detail.get("finding"), "node": self.settings.node_name, "domain": self.domain,
                   "reason": detail.get("reason", ""), "idempotency_key": key}
        return self._run_step("open_ticket", list(self.settings.ticket_command), finding, timeout)

    def _run_step(self, name: str, *args: Any) -> str:
        return _step_outcome(getattr(self._recovery, name)(*args))

    # -- the NVLink domain, re-asserted --------------------------------------------------------------------------
    def _publish_turn(self, now: float) -> float:
        """Re-asserts the node's domain at the scheduler every publish_every_s (Slurm forgets features set by
        scontrol when slurmctld restarts). Idempotent and not journalled: a failure is retried next period."""
        if not (self.settings.acting and self.domain and self.adapter is not None and self.settings.publish_every_s):
            return float("inf")
        if now < self._next_publish:
            return self._next_publish - now
        try:
            self.adapter.publish_domain(self.settings.node_name, self.domain)
            # Another node's agent may have taken this spare into service since: the fleet view follows.
            self._spare = self.adapter.node(self.settings.node_name).spare
            self._next_publish = now + self.settings.publish_every_s
        except Exception as exc:  # noqa: BLE001 - logged, tried again
            log.warning("could not re-assert the NVLink domain", domain=self.domain, error=str(exc))
            self._next_publish = now + min(self.settings.retry_max_s, self.settings.publish_every_s)
        return self._next_publish - now

    # -- what status and /metrics show ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {"mode": self.settings.mode, "adapter": self.settings.adapter, "node_name": self.settings.node_name,
                "domain": self.domain, "breaker": self._latch, "breaker_reset_at": self._reset_at,
                "swap": self._swap, "spare_quarantined": self._spare_quarantined,
                "scheduler_error": self._error, "scheduler_error_since": self._error_since,
                "scheduler_waiting": self._waiting, "scheduler_waiting_since": self._waiting_since,
                "job_progress": dict(self._job_progress)}

    def _save_status(self) -> None:
        status = self.status()
        if status != self._status:
            self._status = status
            self.hooks.set_meta(STATUS_KEY, status)

    def start(self, now: float) -> list[tuple[str, str, dict[str, Any]]]:
        """Writes the engine's status once (what `status` shows before the first intent), and returns the intents
        a start makes: the node's NVLink domain published (when known), journalled like every other intent."""
        self._save_status()
        if not self.domain:
            return []
        self._next_publish = now + self.settings.publish_every_s  # the periodic re-assertion starts after it
        return [(f"{now:.6f}:publish_domain", "publish_domain", {"at": now, "domain": self.domain,
                                                                 "reason": f"NVLink domain {self.domain}"})]

    def ready(self, now: float) -> bool:
        """An intent can be tried now (call with the lock held): the worker must not sleep."""
        return bool(self._queue) and self._queue[0].not_before <= now and self._latch is None

    def samples(self) -> tuple[MetricSample, ...]:
        with self.lock:
            counts = dict(self._counts)
        out = [
            MetricSample("gpuwarden_remediation_acting", "1 if intents are carried out ([remediation] mode = "
                         "\"act\"), 0 in dry-run (logged only).", {}, 1.0 if self.settings.acting else 0.0),
            MetricSample("gpuwarden_breaker_open", "1 while the circuit breaker holds this node's cordons (until "
                         "`gpuwarden breaker reset`), 0 otherwise.", {}, 1.0 if self._latch else 0.0),
            MetricSample("gpuwarden_scheduler_reachable", "0 while the last scheduler call failed for now (retried "
                         "with a backoff; detection goes on), 1 otherwise, also while the scheduler answers "
                         "\"later\" (a PodDisruptionBudget, pods still terminating, work still running).", {},
                         0.0 if self._error else 1.0),
            MetricSample("gpuwarden_node_spare", "1 while the scheduler holds this node in its NVLink domain's spare "
                         "pool, as it showed when last read (at each action and every publish_every_s; 0 before the "
                         "first read and in dry-run, which never reads it).", {}, 1.0 if self._spare else 0.0),
            MetricSample("gpuwarden_slice_must_move", "1 when this node's NVLink domain had no spare left to take "
                         "its place (the slice must move to another domain).", {},
                         1.0 if self.slice_must_move else 0.0),
        ]
        out += [MetricSample("gpuwarden_intents_carried_out", "Intents ended since start, by outcome (done, already "
                             "so at the scheduler, refused, failed, dry_run, superseded by a recovery).",
                             {"outcome": k}, float(v), "counter")
                for k, v in counts.items()]
        out += self._job_samples()
        return tuple(out)

    def _job_samples(self) -> list[MetricSample]:
        with self.lock:
            counts, latency, saved = dict(self._job_counts), dict(self._job_latency), dict(self._job_saved)
        out = [MetricSample("gpuwarden_job_actions", "Doomed jobs acted on since start, by what was done (notify, "
                            "signal, requeue, cancel; dry_run: logged only) and the doom rule (xid, gpu-lost, "
                            "nvlink-down, nvswitch-fatal, ib-port-down).", {"action": a, "reason": r}, float(n),
                            "counter") for (a, r), n in sorted(counts.items())]
        out += [MetricSample("gpuwarden_job_fault_to_action_seconds", "Seconds from the fault's first sign (the kernel "
                             "line; for a port, the moment its outage passed the job's NCCL IB timeout) to the last "
                             "job action of this kind.", {"action": a}, round(v, 3))
                for a, v in sorted(latency.items())]
        out += [MetricSample("gpuwarden_job_gpu_seconds_saved_estimate", "An estimate, not a measurement: GPU-seconds "
                             "the job actions saved since start, (the job's watchdog timeout - the time to act) x the "
                             "job's GPUs, assuming each job would have idled until PyTorch's watchdog fired.",
                             {"action": a}, round(v, 3), "counter") for a, v in sorted(saved.items())]
        return out


def _present(action: str, view: Any) -> bool:
    """Whether the scheduler already shows the effect of `action` (what a restart reconciles against)."""
    if action == "cordon":
        return view.service in (Service.CORDONED, Service.DRAINED)
    if action == "drain":
        return view.service is Service.DRAINED or view.quarantined
    if action in ("quarantine", "retire"):
        return view.quarantined
    if action == "uncordon":
        return view.service is Service.IN_SERVICE
    if action == "resume":
        return view.service is Service.IN_SERVICE or view.spare
    if action == "return_to_pool":
        return view.spare
    return False


def _reason(detail: Mapping[str, Any]) -> str:
    """The scheduler's reason: the finding that drove the transition in the compact form operators grep for
    (`gpuwarden: xid 79 GPU3 0000:1b:00.0`), else the transition's own reason (an intent journalled without it)."""
    text = finding_text(detail.get("finding")) or str(detail.get("reason", ""))
    return f"{REASON_PREFIX} {' '.join(text.split())[:200]}".rstrip()


def _step_outcome(outcome: Any) -> str:
    ok = getattr(outcome, "ok", None)
    text = str(getattr(outcome, "detail", ""))[:500]
    if ok is True:
        return f"done: {text}" if text else "done"
    if ok is False:
        return f"failed: {text}"
    return f"failed: could not run: {text}"  # never taken as done: the ladder's next step follows


def read_actions(path: Path) -> list[dict[str, Any]]:
    """actions.jsonl as written in dry-run: one object per intent."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

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

The parts: the queue, the intents carried out and the status here; the breaker gate in remediation_breaker.py, the
spares and the domain in remediation_spares.py, the recovery steps in remediation_steps.py, the job intents in
remediation_jobs.py, the queue in remediation_queue.py, the metrics in remediation_metrics.py.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuwarden.agent.act import recovery as recovery_steps
from gpuwarden.agent.act import spares as spare_policy
from gpuwarden.agent.act.remediation_breaker import RESET_AT_KEY, BreakerGate, _Latched
from gpuwarden.agent.act.remediation_jobs import JobIntents
from gpuwarden.agent.act.remediation_metrics import EngineMetrics
from gpuwarden.agent.act.remediation_queue import IntentQueue, _Item, _transition
from gpuwarden.agent.act.remediation_spares import SpareSwap
from gpuwarden.agent.act.remediation_steps import RecoverySteps
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.model import finding_text
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
STATUS_KEY = "remediation"  # meta key the engine keeps for `gpuwarden status`
OUTCOME_KINDS = ("done", "already", "refused", "failed", "dry_run", "superseded")
# Intents that take a node out of service or act on it for a fault. One still waiting (a breaker holding it, a


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


@dataclass
class Hooks:
    """What the engine asks of the daemon that runs it (each takes the daemon's lock itself)."""
    done: Callable[[str, float, str], None]  # the intent is carried out: journal (key, at, outcome)
    set_meta: Callable[[str, Any], None]  # a meta value for `status`
    fault_clear: Callable[[], bool] = lambda: False  # the node's faults have cleared (a reset is moot)
    read_meta: Callable[[str], Any] = lambda key: None  # a meta value as the store holds it now (breaker reset)


class Engine(IntentQueue, JobIntents, SpareSwap, RecoverySteps, BreakerGate, EngineMetrics):
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


def read_actions(path: Path) -> list[dict[str, Any]]:
    """actions.jsonl as written in dry-run: one object per intent."""
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

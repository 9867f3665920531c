"""One observation of the daemon (a mixin of agent.daemon.loop.Daemon): a check's judgement becomes its record, the
node's state moves (agent/state/transitions.py), and what the writer and the action worker are to carry out is
queued; all in memory, under the daemon's lock, never waiting on the disk or the scheduler. The retest a
recovering node asks for runs here too, its outcome applied the same way.
"""
from __future__ import annotations

from typing import Any, Callable

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.model import Finding, Status, fold_status
from gpuwarden.agent.core.passive import Judgement
from gpuwarden.agent.daemon.events import KMSG_CHECK
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.state.check_record import CheckRecord
from gpuwarden.agent.state.transitions import next_state, wants_retest

log = logs.get_logger("gpuwarden.daemon")


class Turn:
    """Needs from the daemon: node, config, opt, engine, _lock, _records, _record, _samples, _meta, _dirty,
    _unflushed, _meta_dirty, _node_dirty, _new_transitions, _new_intents, _durable, _quiet_specs, _quiet_records,
    _consumer_names, _transitions, _retesting, _next_retest_at, _write_wanted, _held, _jobs_doomed(), _intents(),
    _publish() and _spawn()."""

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

    def _active(self) -> list[Finding]:
        return [f for r in self._records.values() for f in r.findings]

    def _unknown(self) -> list[str]:
        return [r.name for r in self._records.values() if r.status is Status.UNKNOWN]


_MISSING = object()


def _differs(old: CheckRecord | None, new: CheckRecord, durable: Callable[[Any], Any] | None = None) -> bool:
    """Whether a check's record changed in what must be written now: its status, error, findings, or the durable
    part of its state (all of it unless the check says otherwise). Timestamps alone never count."""
    if old is None or (old.status, old.error, old.findings) != (new.status, new.error, new.findings):
        return True
    if durable is None:
        return old.state != new.state
    return durable(old.state) != durable(new.state)

"""The Slurm adapter's job actions (agent/jobs/respond.py): a job read with `squeue --json`, marked in its
AdminComment, signalled, requeued or cancelled with scontrol and scancel. A mixin of SlurmAdapter
(agent/act/adapters/slurm.py)."""
from __future__ import annotations

from typing import Any

from gpuwarden.agent.act.adapters.slurm_json import parse_squeue_job
from gpuwarden.agent.act.adapters.slurm_tools import MAX_REASON, SlurmTools, _clean
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import JobView, Refused, Transient

log = logs.get_logger("gpuwarden.adapter.slurm")


def _check_job(job: Any) -> str:
    ident = str(getattr(job, "id", ""))
    if getattr(job, "scheduler", "") != "slurm" or not ident.isdigit() or len(ident) > 12:
        raise Refused(f"{ident!r}: not a Slurm job id")
    return ident


class JobActions(SlurmTools):
    """A job's state, its mark, and ending it."""

    # -- jobs (agent/jobs/respond.py) ------------------------------------------------------------------------------
    def job(self, job: Any) -> JobView | None:
        ident = _check_job(job)
        try:
            out = self._run("squeue", ["--json", f"--jobs={ident}"])
        except Refused as exc:
            if "invalid job id" in str(exc).lower():
                return None  # ended and purged (MinJobAge): not known any more
            raise
        return parse_squeue_job(out, ident)

    def mark_job(self, job: Any, reason: str) -> None:
        # AdminComment, not Comment: the job's owner reads it (`scontrol show job`, `sacct -o AdminComment`) and
        # cannot change it, and the user's own Comment (often a tracking id) is left alone.
        text = _clean(reason)[:4 * MAX_REASON]
        self._scontrol("mark job", ["update", f"JobId={_check_job(job)}", f"AdminComment={text}"])
        log.info("job marked", job=job.id, reason=text)

    def signal_job(self, job: Any, signal: str) -> None:
        ident = _check_job(job)
        name = str(signal).upper().removeprefix("SIG")
        if not (name.isalnum() and len(name) <= 8):
            raise Refused(f"{signal!r}: not a signal name")
        # --full: every process of the job, the batch script's shell included (without it only the steps').
        self._run("scancel", [f"--signal={name}", "--full", ident], "signal job")
        log.info("job signalled", job=ident, signal=name)

    def requeue_job(self, job: Any) -> bool:
        ident = _check_job(job)
        try:
            self._scontrol("requeue job", ["requeue", ident])
        except (Refused, Transient) as exc:
            if "is pending execution" not in str(exc).lower():
                raise
            log.info("job pending already (requeued by another)", job=ident)
            return False  # "Job is pending execution": another agent (or the job itself) requeued it first
        log.info("job requeued", job=ident)
        return True

    def cancel_job(self, job: Any) -> None:
        ident = _check_job(job)
        try:
            self._run("scancel", [ident], "cancel job")
        except (Refused, Transient) as exc:
            if "already completing or completed" not in str(exc).lower():
                raise
        log.info("job cancelled", job=ident)

"""`gpuwarden analyze` of one job log: the explanation `gpuwarden explain` gives of that file alone (no node
evidence), as a check result under the name `job_log`, so a job log reads like every other file analyze takes.

A named culprit is a FAIL finding on it (the GPU, IB port or link, NVLink, node or rank), with the explanation's
summary, action and evidence; an undecided failure a WARN on the job (what the log shows and what it does not); a
log with no failure no finding; an undecided one is UNKNOWN (exit 2, as explain).
Recommended action: DRAIN for a GPU, port or node the hardware or the fabric
failed (keep it out of the next run until it is tested), RESTART_APP for a rank that failed on its own."""
from __future__ import annotations

import time
from pathlib import Path

from gpuwarden.agent.core.model import Action, CheckResult, Entity, Finding, Status, fold_status
from gpuwarden.agent.jobs.explain import CULPRIT, NO_FAILURE, explain
from gpuwarden.agent.jobs.joblog import JobLog, read_job_log
from gpuwarden.agent.jobs.joblog_lines import NEEDLES

CHECK = "job_log"
# Texts that make a file's head a job's log rather than a kernel log or a tool's output.
_MARKERS = ("ProcessGroupNCCL", "NCCL INFO", "NCCL WARN", "torch.distributed", "ChildFailedError", "srun: error",
            "slurmstepd", "Watchdog caught", "[rank", "[default")


def looks_like_job_log(head: str) -> bool:
    return any(m in head for m in _MARKERS)


def holds_job_lines(log: JobLog) -> bool:
    return bool(log.events)


def analyze_job_log(path: Path, log: JobLog | None = None) -> CheckResult:
    start = time.monotonic()
    log = log if log is not None else read_job_log(path)
    source = f"{path} (job-log)"
    if log.error:
        return CheckResult(CHECK, Status.UNKNOWN, error=log.error, duration_s=time.monotonic() - start,
                           source=source)
    x = explain([log])
    evidence = x.to_dict()
    if x.verdict == NO_FAILURE:
        findings: tuple[Finding, ...] = ()
    elif x.verdict == CULPRIT:
        c = x.culprit
        kind = {"gpu": "gpu", "ib_port": "ib_port", "nvlink": "nvlink"}.get(c["kind"], "node")
        ident = (c.get("gpu") or c.get("port") or (" <-> ".join(c["link"]) if c.get("link") else None)
                 or (f"rank {c['rank']}" if c.get("rank") is not None else None)
                 or (f"local rank {c['local_rank']}" if c.get("local_rank") is not None else None)
                 or c.get("host") or "unknown")
        if c.get("host") and ident != c["host"]:
            ident = f"{c['host']} {ident}"
        entity = Entity(kind, ident, pci=c.get("gpu") if kind == "gpu" else None)
        action = Action.DRAIN if x.cause in ("hardware", "fabric") else Action.RESTART_APP
        findings = (Finding(CHECK, f"culprit-{c['kind'].replace('_', '-')}", entity, Status.FAIL,
                            f"{x.summary} What to do: {x.action}", action, evidence),)
    else:
        findings = (Finding(CHECK, "failed-undecided", Entity.node("job"), Status.UNKNOWN,
                            x.summary + (" " + " ".join(f"[{s.source}:{s.line}]" for s in x.evidence[:3])
                                         if x.evidence else ""), Action.MONITOR, evidence),)
    return CheckResult(CHECK, fold_status(findings), findings, None, time.monotonic() - start, source=source,
                       notes=log.notes)


__all__ = ["analyze_job_log", "looks_like_job_log", "holds_job_lines", "NEEDLES"]

"""The jobs on this node, and whether their NCCL settings ride out this node's InfiniBand outages.

- The daemon polls which job uses which GPU and IB port (checks/job_discovery.py) and keeps them in its state, so the
  doom rules (agent/jobs/doom.py) know whose collectives a fault ends, also once the faulty GPU can no longer be read
  (a GPU that fell off the bus lists no processes; the job it ran stays known while its processes live).
- Its findings: a job whose effective IB timeout is shorter than the outages of the ports it uses (the daemon's port
  history) is a WARN (checks/job_settings.py); a GPU whose processes NVML could not list is UNKNOWN for the jobs
  (could not look is not "no job").
- preflight judges the same in one look, with the port history of the daemon's store when one runs on the node.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping

from gpuwarden.agent.core.check import CheckSpec, Concern
from gpuwarden.agent.core.errors import NotApplicable, SourceError
from gpuwarden.agent.core.job import GpuUse, JobOnNode, jobs_in
from gpuwarden.agent.core.model import Finding
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.per_gpu import device_error_finding
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.state import outages
from gpuwarden.checks import job_discovery as discover
from gpuwarden.checks import job_settings as settings
from gpuwarden.checks.ib_port import read_ports

CHECK_NAME = "jobs"
INTERVAL_S = 10.0
# A job last listed on a GPU that can no longer be read is kept while its processes live, at most this long after NVML
# last listed it: its processes may hang in the driver for ever.
KEEP_UNREADABLE_S = 3600.0


@dataclass(frozen=True)
class JobsSample:
    found: discover.Discovery
    ib_state: Mapping[str, Any] | None  # the daemon's ib_port state (None: none to be had)
    ib_source: str
    alive: frozenset[int]  # of the pids the state holds on GPUs that cannot be read now, those that still run


def _ports(node: Any) -> list[tuple[str, bool]]:
    try:
        ports, _unreadable = read_ports(node.sysfs, detail=False)
    except SourceError:
        return []
    return [(p.port, p.state == "ACTIVE") for p in ports]


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> JobsSample:
    found = discover.discover(node, lambda: _ports(node), 0.0)
    if not found.jobs and not found.unreadable and not node.gpus():
        raise NotApplicable("NVML reports no GPU on this node")
    held = {pid for job in state.get("jobs", {}).values() for pid in job.get("pids", ())}
    alive = frozenset(pid for pid in held if node.sysfs.exists(f"/proc/{pid}/stat")) if found.unreadable else \
        frozenset()
    ib_state, source = (None, "no job uses the network")
    if any(j.multi_node is not False and j.ports for j in found.jobs):
        ib_state, source = outages.read_ib_state(cfg["state_dir"]) if cfg.get("state_dir") else (None, "")
    return JobsSample(found, ib_state, source, alive)


def judge(state: Mapping[str, Any], s: JobsSample, cfg: Mapping[str, Any], now: float) -> Judgement:
    before = {j.job.key: j for j in jobs_in(state)}
    listed_before = state.get("listed_at") if isinstance(state.get("listed_at"), dict) else {}
    listed: dict[str, float] = {}  # job -> when NVML last listed a process of it
    jobs: dict[str, JobOnNode] = {}
    for job in s.found.jobs:
        listed[job.job.key] = now
        old = before.get(job.job.key)
        # A GPU that cannot be read now lists no processes: the job keeps the GPUs it was seen on there.
        kept = tuple(g for g in (old.gpus if old else ()) if g.index in s.found.unreadable
                     and g.index not in job.gpu_indices)
        seen = old.seen_at if old is not None and old.seen_at is not None else now
        jobs[job.job.key] = _with(job, kept, seen)
    for key, old in before.items():
        on_unreadable = [g for g in old.gpus if g.index in s.found.unreadable]
        if key in jobs or not on_unreadable or not set(old.pids) & s.alive:
            continue
        # Last listed before a restart that lost the time (kept in memory only): from now on.
        at = listed_before.get(key)
        at = float(at) if isinstance(at, (int, float)) else now
        if now - at > KEEP_UNREADABLE_S:
            continue
        jobs[key] = old  # its GPUs cannot be read and its processes live: still this job's
        listed[key] = at
    # A GPU whose processes NVML cannot list is judged as every NVML check judges one (agent/core/per_gpu.py): lost is
    # FAIL gpu-lost (its jobs stay known from the last look), any other error UNKNOWN; NOT_SUPPORTED (a board that
    # lists no processes) is no finding, and `gpuwarden jobs` says the GPU was not looked at.
    findings = [device_error_finding(CHECK_NAME, gpu.entity, err) for gpu, err in s.found.errors
                if not err.not_supported]
    history = settings.outages(s.ib_state, now) if s.ib_state else {}
    findings += settings.decide(list(jobs.values()), history)
    metrics = [MetricSample("gpuwarden_jobs_on_node", "Jobs whose processes hold a GPU of this node.", {},
                            float(len(jobs)))]
    for job in jobs.values():
        labels = {"job": job.job.key}
        metrics.append(MetricSample("gpuwarden_job_gpus", "GPUs of this node a job's processes hold.", labels,
                                    float(len(job.gpus))))
        timeout = job.effective_ib_timeout_s.value
        if isinstance(timeout, (int, float)) and timeout != float("inf"):
            metrics.append(MetricSample("gpuwarden_job_ib_timeout_seconds", "How long the job's NCCL waits on a "
                                        "silent InfiniBand rail before it fails (4.096 us x 2^NCCL_IB_TIMEOUT x "
                                        "NCCL_IB_RETRY_CNT, by its NCCL version).", labels, round(float(timeout), 3)))
    new_state = {"jobs": {key: job.to_dict() for key, job in sorted(jobs.items())},
                 "unreadable": {str(k): v for k, v in s.found.unreadable.items()}, "listed_at": listed}
    return Judgement(new_state, tuple(findings), tuple(metrics))


def durable(state: Mapping[str, Any]) -> dict[str, Any]:
    """All of the state but when each job was last listed: that moves at every poll while a job runs, and losing it to
    a kill -9 only makes a job on an unreadable GPU stand an hour from the restart."""
    return {k: v for k, v in state.items() if k != "listed_at"}


def _with(job: JobOnNode, kept: tuple[GpuUse, ...], seen: float) -> JobOnNode:
    return replace(job, gpus=tuple(sorted((*job.gpus, *kept), key=lambda g: g.index)), seen_at=seen)


def run(node: Any, cfg: Mapping[str, Any]) -> tuple[Finding, ...]:
    return judge({}, sample(node, cfg, {}), cfg, time.time()).findings


DEFAULTS: dict[str, Any] = {}

CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="the jobs using this node's GPUs, and whether their NCCL IB timeout rides out this node's port outages",
    run=run,
    defaults=DEFAULTS,
    timeout_s=20,
)

SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary=CHECK.summary,
    sample=sample,
    judge=judge,
    interval_s=INTERVAL_S,
    defaults=DEFAULTS,
    timeout_s=20.0,
    durable=durable,
    # No job on the node: the same look again (no process on any GPU) would judge the same. An idle node's poll is
    # then NVML's process lists alone, with no judgement or commit (a job appearing is a different sample).
    quiet=lambda state: not state.get("jobs") and not state.get("unreadable"),
    quiet_rejudge_s=60.0,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="jobs", order=90, level="quick", look="CHECK", poll="SPEC", poll_order=9,
)

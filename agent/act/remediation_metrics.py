"""What the remediation engine shows on /metrics: whether it acts, the breaker, the scheduler's reach, the spare
and the slice, the intents' outcomes, and the job actions. A mixin of Engine (agent/act/remediation.py)."""
from __future__ import annotations

from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.core.passive import MetricSample


class EngineMetrics(EngineState):
    """The engine's samples."""

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

"""The job-level response: which faults doom a job's collectives, and what is done to a doomed job (notify its owner,
signal it, requeue or cancel it) through the scheduler adapter; and explaining a failed job.

- `doom`: the doom rules (doom_rules.toml, data), pure: which findings end which job's collectives;
- `guard`: the daemon's side (jobs known, rules applied at each observation, one intent per job and incident);
- `respond`: the engine's side (carrying a job intent out through the adapter, reconciled against the scheduler);
- explaining a failed job (`gpuwarden explain`): `joblog_lines` (what each line of a job's log means, pure, with
  `joblog_prefix`: where and when a line was written; their patterns, each with its source, are data:
  data/joblog_patterns.toml, read by `joblog_patterns`) and `joblog`
  (reading a log, bounded), `explain` (the verdict, pure) with `explain_steps` (its lines of reasoning) and
  `explain_places` (where each rank ran), `node_evidence` (one node's evidence over a window, read from its
  endpoint), `evidence_saved` (the same from saved stores and recordings), `evidence_window` (what the daemon serves
  at /api/v1/findings), `prometheus_evidence` (the same from Prometheus' series: `prometheus_api` asks, and
  `prometheus_series` turns the series into evidence), `analyze_job_log` (`gpuwarden analyze` of a job log).

What a job on this node is (`JobOnNode`, `agent/core/job.py`) and NCCL's settings (`agent/core/nccl_env.py`) are in
the core; finding the jobs on this node and judging their NCCL settings is the `jobs` check
(`checks/jobs.py`, `checks/job_discovery.py`, `checks/job_settings.py`); a Slurm job's nodes, window and output files
are the Slurm adapter's (`agent/act/adapters/slurm_job.py`).

It may import the core, the sources, the state, the checks and the node; the remediation engine, the daemon and the
command line import it, never the other way round.
"""

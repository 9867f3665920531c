"""The job-level response: which job uses which GPU, NVLink and InfiniBand port of this node, which faults doom a job's
collectives, and what is done to a doomed job (notify its owner, signal it, requeue or cancel it) through the
scheduler adapter.

- `model`: what a job on this node is (`JobOnNode`), each figure with where it came from (`Figure`);
- `nccl`: NCCL's settings and defaults (IB timeout and retries by NCCL version, NCCL_IB_HCA), pure;
- `discover`: the only reading here: NVML's processes, /proc/<pid>/{cgroup,environ,maps}, `scontrol pidinfo`, all
  through the node's sources (so a recorded node replays it);
- `doom`: the doom rules (doom_rules.toml, data), pure: which findings end which job's collectives;
- `guard`: the daemon's side (jobs known, rules applied at each observation, one intent per job and incident);
- `respond`: the engine's side (carrying a job intent out through the adapter, reconciled against the scheduler);
- `settings`: the NCCL settings check (a job whose IB timeout is shorter than this node's port outages), pure;
- `cli`: `gpuwarden jobs`;
- explaining a failed job (`gpuwarden explain`): `joblog_lines` (what each line of a job's log means, pure) and
  `joblog` (reading a log, bounded), `explain` (the reasoning, pure), `node_evidence` (one node's evidence over a
  window, read from its endpoint or saved stores), `evidence_window` (what the daemon serves at /api/v1/findings),
  `prometheus_evidence` (the same from Prometheus' series), `slurm_job` (a job's nodes, window and output files
  from sacct/scontrol), `analyze_job_log` (`gpuwarden analyze` of a job log), `explain_cli`.

It may import the agent's model, records, errors, logs, config, the sources (through a node), the adapters' base
and (slurm_job only) the Slurm adapter's readers; the daemon and the remediation engine import it, never the other
way round.
"""

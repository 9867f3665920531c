"""`gpuwarden jobs`: the jobs using this node's GPUs (or a recorded node's, --root), what of the node each uses (GPUs,
ranks, IB ports), and the figures that decide how a fault ends it (its effective NCCL IB timeout and PyTorch's
watchdog timeout), each with where it came from; and the NCCL settings warnings of the `jobs` check.

Exit codes: 0 listed (none is a list too), 2 could not look (NVML, or a GPU whose processes could not be listed)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gpuwarden import checks
from gpuwarden.agent.cli.flags import CONFIG_HELP, log_flags
from gpuwarden.agent.cli.node import node as node_at
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.job import JobOnNode, jobs_in
from gpuwarden.agent.core.model import EXIT_PASS, EXIT_UNDECIDED, Status
from gpuwarden.agent.core.render import seconds_text
from gpuwarden.checks import jobs as jobs_check

DESCRIPTION = ("List the jobs whose processes hold this node's GPUs (NVML's compute processes): each job's "
               "scheduler and id (from the process's cgroup: a Slurm job, a Kubernetes pod; scontrol pidinfo "
               "where the cgroup does not say), its ranks, GPUs and the InfiniBand ports its NCCL may use, its "
               "effective NCCL IB timeout (4.096 us x 2^NCCL_IB_TIMEOUT x NCCL_IB_RETRY_CNT, by its NCCL "
               "version) and PyTorch's watchdog timeout, each figure with where it came from. A job whose IB "
               "timeout is shorter than this node's port outages (the daemon's history) is warned about.")
EPILOG = ("examples:\n"
          "  gpuwarden jobs\n"
          "  gpuwarden jobs --json\n"
          "  gpuwarden jobs --root ./node17    (a folder written by gpuwarden record)\n\n"
          "exit codes:\n"
          "  0  listed (also when no job runs)\n"
          "  2  could not look (NVML, a GPU whose processes could not be listed, a bad config)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, metavar="DIR",
                   help="a recorded node (gpuwarden record) instead of this machine")
    p.add_argument("--json", action="store_true", help="print the jobs as JSON instead of a table")
    p.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the daemon's state folder, for its port outage history (default: [agent] state_dir)")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(checks.forms(["jobs"]), args.config, explicit=args.config is not None, names=checks.NAMES,
                          forms=checks.forms)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    if args.state_dir is not None:
        cfg.agent["state_dir"] = str(args.state_dir)
    node = node_at(args.root)
    table = cfg.for_check("jobs")
    now = time.time()
    try:
        sample = jobs_check.sample(node, table, {})
    except NotApplicable as exc:
        sample, skipped = None, str(exc)
    else:
        skipped = None
    judgement = jobs_check.judge({}, sample, table, now) if sample is not None else None
    listed = jobs_in(judgement.state) if judgement else []
    findings = list(judgement.findings) if judgement else []
    unreadable = dict(sample.found.unreadable) if sample else {}
    code = EXIT_UNDECIDED if any(f.status is Status.UNKNOWN for f in findings) else EXIT_PASS
    source = str(args.root) if args.root else "live"
    if args.json:
        sys.stdout.write(json.dumps({
            "node": node.hostname, "source": source, "exit_code": code, "skipped": skipped,
            "jobs": [j.to_dict() for j in listed], "unreadable_gpus": {str(k): v for k, v in unreadable.items()},
            "port_history": sample.ib_source if sample else None,
            "problems": list(sample.found.problems) if sample else [],
            "findings": [f.to_dict() for f in findings]}, indent=2) + "\n")
        return code
    out = [f"gpuwarden jobs: {node.hostname}  ({source})", ""]
    if skipped:
        out.append(f"no jobs looked at: {skipped}")
    elif not listed:
        out.append("no job holds a GPU of this node")
    for job in listed:
        out += _job_lines(job)
    for index, why in sorted(unreadable.items()):
        out.append(f"GPU {index}: processes not listed: {why}")
    for problem in (sample.found.problems if sample else ()):
        out.append(f"note: {problem}")
    for f in findings:
        out += ["", f"{f.status.value.upper()} {f.code}: {f.message}"]
    sys.stdout.write("\n".join(out) + "\n")
    return code


def _span(values: tuple[int, ...]) -> str:
    if not values:
        return "-"
    if list(values) == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _job_lines(job: JobOnNode) -> list[str]:
    gpus = ",".join(str(g.index) for g in job.gpus) or "-"
    head = (f"{job.job.label()}: ranks {_span(job.ranks)}, GPUs {gpus}, ports {' '.join(job.ports) or '-'}; "
            f"IB timeout {seconds_text(job.effective_ib_timeout_s.value)}, "
            f"watchdog {seconds_text(job.watchdog_s.value)}")
    rows = [
        ("job", f"{job.job.key}: {job.job.source}"),
        ("ranks", f"{_span(job.ranks)} (local {_span(job.local_ranks)}): {job.ranks_source}"),
        ("nodes", f"{job.nodes.value if job.nodes.value is not None else 'not known'}: {job.nodes.source}"),
        ("GPUs", f"{job.gpus_total.value} in all: {job.gpus_total.source}"),
        ("ports", f"{' '.join(job.ports) or 'none'}: {job.ports_source}"),
        ("IB timeout", f"{seconds_text(job.effective_ib_timeout_s.value)}: {job.effective_ib_timeout_s.source}"),
        ("", f"NCCL_IB_TIMEOUT {job.ib_timeout.value}: {job.ib_timeout.source}"),
        ("", f"NCCL_IB_RETRY_CNT {job.ib_retry_cnt.value}: {job.ib_retry_cnt.source}"),
        ("NCCL", f"{job.nccl_version.value or 'not known'}: {job.nccl_version.source}"),
        ("watchdog", f"{seconds_text(job.watchdog_s.value)}: {job.watchdog_s.source}"),
        ("heartbeat", f"{seconds_text(job.heartbeat_s.value)}: {job.heartbeat_s.source}"),
        ("async errors", f"TORCH_NCCL_ASYNC_ERROR_HANDLING {job.async_error_handling.value}: "
                         f"{job.async_error_handling.source}"),
    ]
    return [head] + [f"  {name:<13} {text}" for name, text in rows] + [""]

"""The srun launcher: each group of a sweep as its own Slurm job, the way a user's job runs: `srun` with the group's
exact node list in a (low-priority, preemptible) partition, with --immediate so a group whose nodes are not free is
given up rather than queued behind real work. How a run ended is read from what srun and slurmstepd print (Slurm
22.05):

  "srun: job 16 queued and waiting for resources"                                 queued (the job id)
  "srun: job 16 has been allocated resources"                                     started after waiting
  "srun: error: Unable to allocate resources: Requested nodes are busy"           not started (--immediate passed)
  "slurmstepd-n1: error: *** STEP 2.0 ON n1 CANCELLED AT <time> DUE TO PREEMPTION ***"    preempted
  "slurmstepd-n1: error: *** STEP 4.0 ON n1 CANCELLED AT <time> ***"  with only "task N: Terminated" after it:
                                                                                  cancelled by someone else
  "srun: error: n2: task 1: Exited with exit code 1" then the step's CANCELLED line: a rank failed and
                                                                                  --kill-on-bad-exit ended the rest
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from gpuwarden.agent.fleet.sweep.launch import (
    INT_GRACE_S,
    KILL_WAIT_S,
    MAX_LINE,
    POLL_S,
    Launcher,
    Run,
    finish_run,
    live_runs,
    signal_group,
    start_run,
    wait_all,
)
from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, NOT_STARTED, PREEMPTED, TIMEOUT, GroupRun

MAX_SRUN_LINES = 4096  # srun's error and slurmstepd's cancel lines kept to classify the ending (one per node or so)
CANCEL_GRACE_S = 10.0  # after scancel: slurmstepd signals the tasks (KillWait later SIGKILL) and srun returns
TOOL_TIMEOUT_S = 30.0  # squeue / scancel: a hung slurmctld must not hold the sweep for ever
JOB_ID_LOOKUP_EVERY_S = 2.0

# Slurm variables of this process passed on to srun: the client's settings. The others describe a job this process
# may run in (SLURM_JOB_ID, SLURM_NTASKS, ... set by sbatch/salloc): srun would read them as its own options and
# start a step of that job instead of a job per group.
SLURM_KEEP = frozenset({"SLURM_CONF", "SLURM_CLUSTERS", "SLURM_ACCOUNT", "SLURM_WCKEY", "SLURM_TIME_FORMAT"})

# Linear patterns over single bounded lines.
_RANK_LABEL = re.compile(r"^[0-9]{1,6}: ")
_QUEUED = re.compile(r"^srun: job ([0-9]{1,12}) queued and waiting for resources")
_ALLOCATED = re.compile(r"^srun: job ([0-9]{1,12}) has been allocated resources")
_STEP_ID = re.compile(r"\b(?:StepId=|STEP |JOB |jobid )([0-9]{1,12})\b")
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) [0-9.]{1,30}+ ON \S{1,256}+ CANCELLED AT \S{1,64}+(.{0,200}+)")
# A task that ended by itself (its status, a signal it was not sent by the cancel): the run failed on its own.
_TASK_FAILED = re.compile(r"^srun: error: [^\s:]{1,256}+: tasks? [0-9,-]{1,64}+: (?!Terminated$|Killed$)")
_TASK_LINE = re.compile(r"^srun: error: [^\s:]{1,256}+: tasks? [0-9,-]{1,64}+: ")
_NOT_STARTED = ("Requested nodes are busy", "Required node not available", "Nodes required for job are DOWN",
                "job has been revoked", "Job violates accounting/QOS policy",
                "Job/step already completing or completed")  # the last: cancelled while it waited for its nodes


def read_srun_line(run: Run, line: str) -> None:
    """One line of srun's stderr: the job id it names, and the lines that tell how the run ended."""
    line = _RANK_LABEL.sub("", line[:MAX_LINE].rstrip())
    with run.lock:
        if (m := _QUEUED.match(line)) is not None:
            run.queued, run.job_id = True, m.group(1)
        elif (m := _ALLOCATED.match(line)) is not None:
            run.allocated_at, run.job_id = time.monotonic(), m.group(1)
        elif run.job_id is None and (m := _STEP_ID.search(line)) is not None:
            run.job_id = m.group(1)
        if len(run.lines) < MAX_SRUN_LINES and (line.startswith("srun: error: ") or "CANCELLED AT" in line
                                                  or "execve(): " in line):
            run.lines.append(line)


def classify_srun(returncode: int | None, lines: Sequence[str]) -> tuple[str, str]:
    """How an srun that returned by itself ended, from its exit status and its own and slurmstepd's lines (rank
    labels removed): (ending, detail)."""
    if returncode == 0:
        return EXITED, ""
    for line in lines:
        if "Unable to allocate resources" in line:
            busy = any(s in line for s in _NOT_STARTED)
            return (NOT_STARTED if busy else LAUNCH_ERROR), line
    cancelled, failed, tasks = None, False, False
    for line in lines:
        if (m := _CANCELLED.search(line)) is not None:
            if "DUE TO PREEMPTION" in m.group(1):
                return PREEMPTED, line
            if "DUE TO TIME LIMIT" in m.group(1):
                return TIMEOUT, line
            cancelled = cancelled or line
        elif _TASK_FAILED.match(line) is not None:
            failed = True
        tasks |= _TASK_LINE.match(line) is not None
    if cancelled and not failed:
        return PREEMPTED, cancelled  # someone (an admin, the scheduler) cancelled it; its ranks did not fail
    for line in lines:
        if "execve(): " in line:
            return LAUNCH_ERROR, line  # the program could not be run there: says nothing of the nodes
    errors = [line for line in lines if line.startswith("srun: error: ")]
    if not tasks and errors:
        return LAUNCH_ERROR, errors[0]  # srun gave up before any task ran (no controller, no step)
    return EXITED, ""


class SrunLauncher(Launcher):
    """Each group as a Slurm job of its own: srun --nodelist=<group> in `partition`, started together."""
    name = "slurm"
    stopped_detail = "the sweep was stopped; its job was cancelled"

    def __init__(self, *, partition: str | None = None, qos: str | None = None, ranks_per_node: int = 1,
                 extra_args: Sequence[str] = (), job_name: str = "gpuwarden-sweep", srun: str = "srun",
                 scancel: str = "scancel", squeue: str = "squeue", start_timeout_s: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        """`env`: variables set for srun (and so for the tasks, srun's --export=ALL) over this process's own, less
        the Slurm job's own (a sweep started inside a job still runs each group as a job of its own)."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node}: at least 1")
        self.partition, self.qos, self.ranks_per_node = partition, qos, ranks_per_node
        self.extra_args, self.job_name = list(extra_args), job_name
        self.srun, self.scancel, self.squeue = srun, scancel, squeue
        self.start_timeout_s = start_timeout_s
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k in SLURM_KEEP},
                    **(env or {})}
        self.sweep_id = f"{os.getpid()}-{secrets.token_hex(3)}"
        super().__init__()

    def argv(self, nodes: Sequence[str], name: str, argv: Sequence[str]) -> list[str]:
        cmd = [self.srun, f"--job-name={name}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
               f"--ntasks-per-node={self.ranks_per_node}"]
        if self.partition:
            cmd.append(f"--partition={self.partition}")
        if self.qos:
            cmd.append(f"--qos={self.qos}")
        cmd += [f"--immediate={max(1, round(self.start_timeout_s))}", "--kill-on-bad-exit=1", "--label",
                *self.extra_args, *argv]
        return cmd

    def run_groups(self, groups: Sequence[Sequence[str]], argv: Sequence[str], timeout_s: float) -> list[GroupRun]:
        """One srun per group, all at once (groups are disjoint), in group order; returns when every one ended.
        A group's time limit counts from when its nodes were allocated."""
        runs = self._batch(groups, lambda batch, i: f"{self.job_name}-{self.sweep_id}-{batch}.{i}")
        for r in runs:
            if r.ended is None:
                start_run(r, self.argv(r.nodes, r.name, argv), self.env, read_srun_line)
        try:
            self._watch(runs, timeout_s)
        finally:
            self._done(runs)
        return [finish_run(r, classify_srun) for r in runs]

    def _watch(self, runs: list[Run], timeout_s: float) -> None:
        next_lookup = time.monotonic() + 0.5
        while True:
            live = live_runs(runs)
            if not live:
                return
            now = time.monotonic()
            late = []
            for r in live:
                since = r.running_since()
                limit = (since + timeout_s if since is not None
                         else r.launched + self.start_timeout_s + timeout_s + CANCEL_GRACE_S)  # --immediate's backstop
                if now > limit and r.ended is None:
                    late.append(r)
            if late:
                states = self._lookup_ids(late)
                for r in late:
                    r.ended, r.detail = self._late(r, states, timeout_s)
                self._end(late)
            elif now >= next_lookup and any(r.job_id is None for r in live):
                self._lookup_ids(live)
                next_lookup = now + JOB_ID_LOOKUP_EVERY_S
            time.sleep(POLL_S)

    def _tool(self, argv: list[str]) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=self.env,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def _lookup_ids(self, runs: Sequence[Run]) -> dict[str, str] | None:
        """The job ids of `runs` from squeue, by their job names (unique to this launcher and batch); returns each
        found job's state by name (None: squeue did not answer)."""
        names = {r.name: r for r in runs}
        if not names:
            return {}
        proc = self._tool([self.squeue, "-h", f"--name={','.join(names)}", "-o", "%j %i %T"])
        if proc is None or proc.returncode != 0:
            return None
        states = {}
        for line in proc.stdout.splitlines()[:len(names) * 4]:
            name, job, state = (line.split() + ["", "", ""])[:3]
            r = names.get(name)
            if r is not None and job.isdigit() and len(job) <= 12:
                states[name] = state[:32]
                with r.lock:
                    r.job_id = r.job_id or job
        return states

    def _late(self, run: Run, states: dict[str, str] | None, timeout_s: float) -> tuple[str, str]:
        """How a run past its time ends: hung if its job ran (the controller says so, or it printed something);
        else it never got its nodes, or the controller could not be asked: neither says anything of the nodes."""
        state = (states or {}).get(run.name, "")
        if state in ("RUNNING", "COMPLETING", "SUSPENDED") or run.out.head:
            return TIMEOUT, f"ran past its time limit of {timeout_s:g} s; the job was cancelled"
        if states is None:
            return LAUNCH_ERROR, f"no output in {timeout_s:g} s and squeue did not answer; the job was cancelled"
        return NOT_STARTED, (f"not running after {timeout_s:g} s (job state {state or 'unknown to squeue'}); "
                             f"the job was cancelled")

    def _end(self, runs: Sequence[Run]) -> None:
        """Cancel the jobs of `runs` (scancel by id), then end each srun: its own abort (SIGINT twice), then
        SIGKILL to its process group."""
        self._lookup_ids([r for r in runs if r.job_id is None])
        ids = sorted({r.job_id for r in runs if r.job_id})
        if ids:
            self._tool([self.scancel, *ids])
        for r in runs:  # not seen in the queue (yet): a job by that name that appears now is still ours to end
            if not r.job_id:
                self._tool([self.scancel, f"--name={r.name}"])  # one name a call: scancel takes no list here
        wait_all(runs, CANCEL_GRACE_S)
        left = [r for r in runs if r.proc is not None and r.proc.poll() is None]
        for r in left:
            signal_group(r, signal.SIGINT)
        time.sleep(0.3)
        for r in left:
            signal_group(r, signal.SIGINT)  # the second within a second: srun aborts the step
        wait_all(left, INT_GRACE_S)
        for r in left:
            signal_group(r, signal.SIGKILL)
        wait_all(left, KILL_WAIT_S)


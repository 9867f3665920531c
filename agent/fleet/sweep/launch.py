"""Launchers of a sweep's collectives: one multi-node run per group of nodes, every group at once, each ended as it
must be (finished, past its time, taken back by the scheduler, never started), and nothing left running.

SrunLauncher runs each group as its own Slurm job, the way a user's job runs: `srun` with the group's exact node
list in a (low-priority, preemptible) partition, with --immediate so a group whose nodes are not free is given up
rather than queued behind real work. How a run ended is read from what srun and slurmstepd print (Slurm 22.05):

  "srun: job 16 queued and waiting for resources"                                 queued (the job id)
  "srun: job 16 has been allocated resources"                                     started after waiting
  "srun: error: Unable to allocate resources: Requested nodes are busy"           not started (--immediate passed)
  "slurmstepd-n1: error: *** STEP 2.0 ON n1 CANCELLED AT <time> DUE TO PREEMPTION ***"    preempted
  "slurmstepd-n1: error: *** STEP 4.0 ON n1 CANCELLED AT <time> ***"  with only "task N: Terminated" after it:
                                                                                  cancelled by someone else
  "srun: error: n2: task 1: Exited with exit code 1" then the step's CANCELLED line: a rank failed and
                                                                                  --kill-on-bad-exit ended the rest
srun's own exit status is 143 in all three of the last cases, so it is not what tells them apart.

MpirunLauncher, where no scheduler runs: `mpirun --hostfile <one per group> -np N --map-by ppr:R:node
--tag-output`, in a process group of its own, ended (SIGTERM, then SIGKILL) past its time.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, NOT_STARTED, PREEMPTED, TIMEOUT, GroupRun

STDERR_KEEP = 64 << 10  # the last 64 KiB of a launcher's stderr
OUTPUT_HEAD = 1 << 20  # stdout: the first MiB (banner, devices, the first rows) ...
OUTPUT_TAIL = 7 << 20  # ... and the last 7 MiB (the summary); a cut between them is marked as nccl-tests' "..."
MAX_LINE = 4096  # srun's lines read for their meaning: longer ones are cut there
MAX_SRUN_LINES = 4096  # srun's error and slurmstepd's cancel lines kept to classify the ending (one per node or so)
POLL_S = 0.1
CANCEL_GRACE_S = 10.0  # after scancel: slurmstepd signals the tasks (KillWait later SIGKILL) and srun returns
INT_GRACE_S = 5.0  # after srun's double SIGINT (its own abort: it cancels the step and waits for it)
KILL_WAIT_S = 5.0
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


class _Tail:
    """The last `keep` bytes written."""

    def __init__(self, keep: int) -> None:
        self.keep, self.data = keep, bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.keep:
            del self.data[:-self.keep]

    def text(self) -> str:
        return bytes(self.data[-self.keep:]).decode(errors="replace")


class _HeadTail:
    """The first `head` and last `tail` bytes written; what fell between them is marked by a line of "...",
    which nccl-tests' parser takes for an elision."""

    def __init__(self, head: int, tail: int) -> None:
        self.head, self.head_max, self.rest, self.rest_total = bytearray(), head, _Tail(tail), 0

    def add(self, chunk: bytes) -> None:
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.rest.add(chunk)
            self.rest_total += len(chunk)

    def text(self) -> str:
        head = bytes(self.head).decode(errors="replace")
        if self.rest_total <= self.rest.keep:
            return head + bytes(self.rest.data).decode(errors="replace")
        return head.rpartition("\n")[0] + "\n...\n" + self.rest.text().partition("\n")[2]


class _Run:
    """One group's launcher process while it runs."""

    def __init__(self, nodes: tuple[str, ...], name: str) -> None:
        self.nodes, self.name = nodes, name
        self.proc: subprocess.Popen | None = None
        self.out = _HeadTail(OUTPUT_HEAD, OUTPUT_TAIL)
        self.err = _Tail(STDERR_KEEP)
        self.readers: list[threading.Thread] = []
        self.launched = time.monotonic()
        self.queued = False
        self.allocated_at: float | None = None
        self.job_id: str | None = None
        self.exited_at: float | None = None
        self.ended: str | None = None  # set when the sweep ended it (TIMEOUT, PREEMPTED by cancel_all)
        self.detail = ""
        self.lines: list[str] = []  # the stderr lines that tell how it ended (bounded)
        self.lock = threading.Lock()

    def on_stderr_line(self, line: str) -> None:
        line = _RANK_LABEL.sub("", line[:MAX_LINE].rstrip())
        with self.lock:
            if (m := _QUEUED.match(line)) is not None:
                self.queued, self.job_id = True, m.group(1)
            elif (m := _ALLOCATED.match(line)) is not None:
                self.allocated_at, self.job_id = time.monotonic(), m.group(1)
            elif self.job_id is None and (m := _STEP_ID.search(line)) is not None:
                self.job_id = m.group(1)
            if len(self.lines) < MAX_SRUN_LINES and (line.startswith("srun: error: ") or "CANCELLED AT" in line
                                                      or "execve(): " in line):
                self.lines.append(line)

    def running_since(self) -> float | None:
        """When the collective started (None: still waiting for its nodes)."""
        with self.lock:
            if self.queued:
                return self.allocated_at
            return self.launched


def _read(stream, sink, on_line=None) -> None:
    pending = b""
    try:
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            sink.add(chunk)
            if on_line is not None:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                pending = pending[-MAX_LINE:]
                for line in lines:
                    on_line(line.decode(errors="replace"))
        if on_line is not None and pending:
            on_line(pending.decode(errors="replace"))
    except (OSError, ValueError):
        pass
    finally:
        stream.close()


def _start(run: _Run, argv: list[str], env: Mapping[str, str] | None, srun_lines: bool) -> None:
    try:
        run.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=dict(env) if env is not None else None, start_new_session=True)
    except OSError as err:
        run.ended, run.detail = LAUNCH_ERROR, f"{argv[0]}: {err}"
        return
    run.launched = time.monotonic()
    run.readers = [threading.Thread(target=_read, args=(run.proc.stdout, run.out), daemon=True),
                   threading.Thread(target=_read, args=(run.proc.stderr, run.err,
                                                        run.on_stderr_line if srun_lines else None), daemon=True)]
    for t in run.readers:
        t.start()


def _signal_group(run: _Run, sig: int) -> None:
    if run.proc is not None and run.proc.poll() is None:
        try:
            os.killpg(run.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_all(runs: Sequence[_Run], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for r in runs:
        if r.proc is not None:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _live(runs: Sequence[_Run]) -> list[_Run]:
    """The runs whose launcher has not exited; the others get the time they were seen to end."""
    live = []
    for r in runs:
        if r.proc is not None and r.proc.poll() is None:
            live.append(r)
        elif r.exited_at is None:
            r.exited_at = time.monotonic()
    return live


def _finish(run: _Run) -> GroupRun:
    for t in run.readers:
        t.join(10.0)
    duration = (run.exited_at or time.monotonic()) - run.launched
    rc = run.proc.returncode if run.proc is not None else None
    if run.ended is not None:
        return GroupRun(run.nodes, run.out.text(), run.err.text(), None, run.ended, duration, run.job_id, run.detail)
    ended, detail = classify_srun(rc, run.lines)
    return GroupRun(run.nodes, run.out.text(), run.err.text(), rc, ended, duration, run.job_id, detail)


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


class _Launcher:
    """What both launchers share: the runs in flight (for cancel_all, which may come from a signal handler of the
    thread in run_groups), one batch of runs per run_groups, and what is ended how when the sweep stops."""
    stopped_detail = "the sweep was stopped"

    def __init__(self) -> None:
        self._runs: list[_Run] = []
        self._lock = threading.RLock()
        self._cancelled = False
        self._batches = 0

    def _batch(self, groups: Sequence[Sequence[str]], name: Callable[[int, int], str]) -> list[_Run]:
        """The runs of one run_groups call, registered; those that must not start (the sweep stopped, an empty
        group) already ended. `name(batch, index)` names each run."""
        with self._lock:
            self._batches += 1
            runs = [_Run(tuple(g), name(self._batches, i)) for i, g in enumerate(groups)]
            self._runs += runs
            cancelled = self._cancelled
        for r in runs:
            if cancelled:
                r.ended, r.detail = PREEMPTED, "the sweep was stopped before this group started"
            elif not r.nodes:
                r.ended, r.detail = LAUNCH_ERROR, "an empty group"
        return runs

    def _done(self, runs: Sequence[_Run]) -> None:
        with self._lock:
            self._runs = [r for r in self._runs if r not in runs]

    def _end(self, runs: Sequence[_Run]) -> None:
        raise NotImplementedError

    def cancel_all(self) -> None:
        """End every run this launcher started and has not seen end (the sweep is being stopped): those groups end
        PREEMPTED (no verdict); no later run_groups starts anything."""
        with self._lock:
            self._cancelled = True
            runs = [r for r in self._runs if r.proc is not None and r.proc.poll() is None]
        for r in runs:
            if r.ended is None:
                r.ended, r.detail = PREEMPTED, self.stopped_detail
        if runs:
            self._end(runs)


class SrunLauncher(_Launcher):
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
                _start(r, self.argv(r.nodes, r.name, argv), self.env, srun_lines=True)
        try:
            self._watch(runs, timeout_s)
        finally:
            self._done(runs)
        return [_finish(r) for r in runs]

    def _watch(self, runs: list[_Run], timeout_s: float) -> None:
        next_lookup = time.monotonic() + 0.5
        while True:
            live = _live(runs)
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

    def _lookup_ids(self, runs: Sequence[_Run]) -> dict[str, str] | None:
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

    def _late(self, run: _Run, states: dict[str, str] | None, timeout_s: float) -> tuple[str, str]:
        """How a run past its time ends: hung if its job ran (the controller says so, or it printed something);
        else it never got its nodes, or the controller could not be asked: neither says anything of the nodes."""
        state = (states or {}).get(run.name, "")
        if state in ("RUNNING", "COMPLETING", "SUSPENDED") or run.out.head:
            return TIMEOUT, f"ran past its time limit of {timeout_s:g} s; the job was cancelled"
        if states is None:
            return LAUNCH_ERROR, f"no output in {timeout_s:g} s and squeue did not answer; the job was cancelled"
        return NOT_STARTED, (f"not running after {timeout_s:g} s (job state {state or 'unknown to squeue'}); "
                             f"the job was cancelled")

    def _end(self, runs: Sequence[_Run]) -> None:
        """Cancel the jobs of `runs` (scancel by id), then end each srun: its own abort (SIGINT twice), then
        SIGKILL to its process group."""
        self._lookup_ids([r for r in runs if r.job_id is None])
        ids = sorted({r.job_id for r in runs if r.job_id})
        if ids:
            self._tool([self.scancel, *ids])
        for r in runs:  # not seen in the queue (yet): a job by that name that appears now is still ours to end
            if not r.job_id:
                self._tool([self.scancel, f"--name={r.name}"])  # one name a call: scancel takes no list here
        _wait_all(runs, CANCEL_GRACE_S)
        left = [r for r in runs if r.proc is not None and r.proc.poll() is None]
        for r in left:
            _signal_group(r, signal.SIGINT)
        time.sleep(0.3)
        for r in left:
            _signal_group(r, signal.SIGINT)  # the second within a second: srun aborts the step
        _wait_all(left, INT_GRACE_S)
        for r in left:
            _signal_group(r, signal.SIGKILL)
        _wait_all(left, KILL_WAIT_S)



class MpirunLauncher(_Launcher):
    """Each group as one mpirun over a hostfile of its nodes (no scheduler): `host slots=R` lines."""
    name = "mpirun"
    stopped_detail = "the sweep was stopped; mpirun was ended"

    def __init__(self, *, ranks_per_node: int = 1, extra_args: Sequence[str] = (), mpirun: str = "mpirun",
                 workdir: Path, env: Mapping[str, str] | None = None) -> None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node}: at least 1")
        self.ranks_per_node, self.extra_args, self.mpirun = ranks_per_node, list(extra_args), mpirun
        self.workdir = Path(workdir)
        self.env = {**os.environ, **env} if env is not None else None
        super().__init__()

    def argv(self, hostfile: Path, nodes: Sequence[str], argv: Sequence[str]) -> list[str]:
        cmd = [self.mpirun, "--hostfile", str(hostfile), "-np", str(len(nodes) * self.ranks_per_node),
               "--map-by", f"ppr:{self.ranks_per_node}:node", "--tag-output"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")  # Open MPI refuses root without it (containers, admin nodes)
        return cmd + [*self.extra_args, *argv]

    def run_groups(self, groups: Sequence[Sequence[str]], argv: Sequence[str], timeout_s: float) -> list[GroupRun]:
        """One mpirun per group, all at once, in group order; returns when every one ended."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        runs = self._batch(groups, lambda batch, i: f"{batch}.{i}")
        for r in runs:
            if r.ended is not None:
                continue
            hostfile = self.workdir / f"hostfile-{os.getpid()}-{r.name}"
            hostfile.write_text("".join(f"{n} slots={self.ranks_per_node}\n" for n in r.nodes))
            _start(r, self.argv(hostfile, r.nodes, argv), self.env, srun_lines=False)
        try:
            while True:
                live = _live(runs)
                if not live:
                    break
                late = [r for r in live if time.monotonic() > r.launched + timeout_s and r.ended is None]
                for r in late:
                    r.ended = TIMEOUT
                    r.detail = f"ran past its time limit of {timeout_s:g} s; mpirun was ended"
                if late:
                    self._end(late)
                time.sleep(POLL_S)
        finally:
            self._done(runs)
        results = []
        for r in runs:
            result = _finish(r)
            if result.ended == EXITED and result.returncode not in (0, None) and not _ranks_ran(result):
                result = GroupRun(result.nodes, result.output, result.stderr, result.returncode, LAUNCH_ERROR,
                                  result.duration_s, None, _launch_detail(result.stderr, result.output))
            results.append(result)
            (self.workdir / f"hostfile-{os.getpid()}-{r.name}").unlink(missing_ok=True)
        return results

    def _end(self, runs: Sequence[_Run]) -> None:
        """SIGTERM to mpirun's group (mpirun passes it to its ranks and their daemons), SIGKILL after a grace."""
        for r in runs:
            _signal_group(r, signal.SIGTERM)
        _wait_all(runs, INT_GRACE_S)
        for r in runs:
            _signal_group(r, signal.SIGKILL)
        _wait_all(runs, KILL_WAIT_S)


_TAGGED = re.compile(r"^\[[0-9]{1,9},[0-9]{1,9}\]<std(?:out|err)>:", re.MULTILINE)


def _ranks_ran(run: GroupRun) -> bool:
    """Some rank printed (mpirun --tag-output's label): the program ran; else mpirun failed to start it."""
    return _TAGGED.search(run.output) is not None or _TAGGED.search(run.stderr) is not None


def _launch_detail(stderr: str, output: str) -> str:
    """mpirun's own message: the first line of words in its stderr (its boxes are drawn with dashes)."""
    for line in (stderr + "\n" + output).splitlines():
        if line.strip() and not line.startswith("---"):
            return line.strip()[:MAX_LINE]
    return "mpirun exited before any rank ran"

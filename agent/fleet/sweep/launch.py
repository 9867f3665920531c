"""What both launchers of a sweep's collectives share: one multi-node run per group of nodes, every group at once,
each ended as it must be (finished, past its time, taken back by the scheduler, never started), and nothing left
running. The launchers: `srun` (agent/fleet/sweep/launch_srun.py) and `mpirun` (agent/fleet/sweep/launch_mpirun.py).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, PREEMPTED, GroupRun

STDERR_KEEP = 64 << 10  # the last 64 KiB of a launcher's stderr
OUTPUT_HEAD = 1 << 20  # stdout: the first MiB (banner, devices, the first rows) ...
OUTPUT_TAIL = 7 << 20  # ... and the last 7 MiB (the summary); a cut between them is marked as nccl-tests' "..."
MAX_LINE = 4096  # srun's lines read for their meaning: longer ones are cut there
POLL_S = 0.1
INT_GRACE_S = 5.0  # after srun's double SIGINT (its own abort: it cancels the step and waits for it)
KILL_WAIT_S = 5.0


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


class Run:
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


def start_run(run: Run, argv: list[str], env: Mapping[str, str] | None,
              on_err_line: Callable[[Run, str], None] | None = None) -> None:
    """Starts the run's launcher; `on_err_line(run, line)` reads each line of its stderr (srun's own lines)."""
    try:
        run.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=dict(env) if env is not None else None, start_new_session=True)
    except OSError as err:
        run.ended, run.detail = LAUNCH_ERROR, f"{argv[0]}: {err}"
        return
    run.launched = time.monotonic()
    run.readers = [threading.Thread(target=_read, args=(run.proc.stdout, run.out), daemon=True),
                   threading.Thread(target=_read, args=(run.proc.stderr, run.err,
                                                        None if on_err_line is None else partial(on_err_line, run)),
                                    daemon=True)]
    for t in run.readers:
        t.start()


def signal_group(run: Run, sig: int) -> None:
    if run.proc is not None and run.proc.poll() is None:
        try:
            os.killpg(run.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_all(runs: Sequence[Run], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for r in runs:
        if r.proc is not None:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def live_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs whose launcher has not exited; the others get the time they were seen to end."""
    live = []
    for r in runs:
        if r.proc is not None and r.proc.poll() is None:
            live.append(r)
        elif r.exited_at is None:
            r.exited_at = time.monotonic()
    return live


def finish_run(run: Run, classify: Callable[[int | None, Sequence[str]], tuple[str, str]] | None = None) -> GroupRun:
    """The run's result; `classify(returncode, lines)` tells how a launcher that returned by itself ended (its
    stderr lines that on_err_line kept; none: EXITED)."""
    for t in run.readers:
        t.join(10.0)
    duration = (run.exited_at or time.monotonic()) - run.launched
    rc = run.proc.returncode if run.proc is not None else None
    if run.ended is not None:
        return GroupRun(run.nodes, run.out.text(), run.err.text(), None, run.ended, duration, run.job_id, run.detail)
    ended, detail = classify(rc, run.lines) if classify is not None else (EXITED, "")
    return GroupRun(run.nodes, run.out.text(), run.err.text(), rc, ended, duration, run.job_id, detail)



class Launcher:
    """What both launchers share: the runs in flight (for cancel_all, which may come from a signal handler of the
    thread in run_groups), one batch of runs per run_groups, and what is ended how when the sweep stops."""
    stopped_detail = "the sweep was stopped"

    def __init__(self) -> None:
        self._runs: list[Run] = []
        self._lock = threading.RLock()
        self._cancelled = False
        self._batches = 0

    def _batch(self, groups: Sequence[Sequence[str]], name: Callable[[int, int], str]) -> list[Run]:
        """The runs of one run_groups call, registered; those that must not start (the sweep stopped, an empty
        group) already ended. `name(batch, index)` names each run."""
        with self._lock:
            self._batches += 1
            runs = [Run(tuple(g), name(self._batches, i)) for i, g in enumerate(groups)]
            self._runs += runs
            cancelled = self._cancelled
        for r in runs:
            if cancelled:
                r.ended, r.detail = PREEMPTED, "the sweep was stopped before this group started"
            elif not r.nodes:
                r.ended, r.detail = LAUNCH_ERROR, "an empty group"
        return runs

    def _done(self, runs: Sequence[Run]) -> None:
        with self._lock:
            self._runs = [r for r in self._runs if r not in runs]

    def _end(self, runs: Sequence[Run]) -> None:
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

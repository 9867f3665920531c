"""External tools (nccl-tests, perftest, dcgmi, nvbandwidth): run with no shell, each in a process group of its own,
and never left running.

Time: a tool runs for at most min(its own timeout, what is left of its check's time and of the overall budget). The
runner gives every check a `Scope` (a deadline and a cancel flag, nested in the run's scope that carries the budget)
and enters it in the check's thread (`scope.entered()`, a contextvar); `ToolRunner.run` reads it with
`current_scope()` to bound the tool and registers the tool's process in it. When the check times out, the budget
runs out or the run is interrupted (SIGINT/SIGTERM), the runner calls `scope.end_tools(reason)`: the scope (and every
scope nested in it) is cancelled, no new tool starts in it, and every tool still running is ended; it returns once
they are gone. A call with no scope entered (the daemon, `record`'s always-captured tools) is bounded by its own
timeout only, and is still ended as a group.

Ending a tool: SIGTERM to its process group, SIGKILL to the group after TERM_GRACE_S, then the group's processes are
reaped until none is left. The agent makes itself the child subreaper (Linux), so the orphaned grandchildren of a
tool come back to it and are reaped here, not left as zombies under an init that may not reap. A tool that exits by
itself has the rest of its group ended the same way: nothing a tool started outlives the call.

On a recorded node the same call reads tools/<name>.out (+ .rc); tools/<name>.hang makes the call behave like a
tool that never returns: it waits out the tool's bounded timeout, or less if its check is cancelled, so the timeout
path is exercised without a real hang.
"""
from __future__ import annotations

import contextvars
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import SourceError, ToolError, ToolMissing
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources import confine

log = logs.get_logger("gpuwarden.tools")

# Between SIGTERM and SIGKILL to a tool's group: long enough for a tool that stops cleanly on TERM (dcgmi asks the
# host engine to stop its diagnostic; mpirun forwards TERM to its ranks), short enough for a Slurm Prolog.
TERM_GRACE_S = 5.0
# After SIGKILL: a process in uninterruptible sleep (a call stuck in the driver) may never go; the caller is told.
KILL_WAIT_S = 5.0
MAX_OUTPUT_BYTES = 64 << 20  # a tool that prints more is not read (nothing the checks parse comes near it)


class ToolTimeout(ToolError):
    """A tool did not finish in its time (its own timeout, its check's time, the budget) or its check was cancelled;
    it was ended."""


@dataclass(frozen=True)
class ToolOutput:
    name: str
    argv: tuple[str, ...]
    output: str  # stdout and stderr, interleaved as the tool wrote them
    returncode: int
    duration_s: float


_current: contextvars.ContextVar["Scope | None"] = contextvars.ContextVar("gpuwarden_tool_scope", default=None)


def current_scope() -> "Scope | None":
    """The scope entered in this thread (the running check's), or None."""
    return _current.get()


class Scope:
    """The time and the cancel flag of one check (or of one run: the budget), and the tools running under it."""

    def __init__(self, deadline: float | None = None, parent: "Scope | None" = None):
        if parent is not None and parent.deadline is not None:
            deadline = parent.deadline if deadline is None else min(deadline, parent.deadline)
        self.deadline = deadline  # time.monotonic() value, None = no limit
        self.reason = ""  # why it was cancelled
        self.expired = False  # a tool was ended because this scope's deadline came (the check ran out of time)
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._tools: set[ToolProcess] = set()
        self._children: list[Scope] = []
        if parent is not None:
            parent._adopt(self)

    def _adopt(self, child: "Scope") -> None:
        with self._lock:
            self._children.append(child)
            cancelled = self._cancelled.is_set()
        if cancelled:
            child.cancel(self.reason)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def left(self) -> float | None:
        """Seconds until the deadline (0 once passed), None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def bound(self, timeout_s: float) -> tuple[float, bool]:
        """(the timeout a tool gets here, whether the scope's deadline is what bounds it)."""
        left = self.left()
        return (left, True) if left is not None and left < timeout_s else (timeout_s, False)

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds` or until cancelled; True when cancelled."""
        return self._cancelled.wait(max(0.0, seconds))

    def cancel(self, reason: str) -> None:
        with self._lock:
            if not self._cancelled.is_set():
                self.reason = reason
                self._cancelled.set()
            children = list(self._children)
        for child in children:
            child.cancel(reason)

    @contextmanager
    def entered(self) -> Iterator["Scope"]:
        """Make this the scope of the tools the current thread runs."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def end_tools(self, reason: str, grace_s: float | None = None) -> list[str]:
        """Cancel, end every tool still running here or in a nested scope (all at once), and return once they are
        gone. Returns what could not be ended (a process stuck in the kernel), [] normally."""
        self.cancel(reason)
        return end_all(self._all_tools(), grace_s)

    def _all_tools(self) -> list["ToolProcess"]:
        with self._lock:
            tools, children = list(self._tools), list(self._children)
        for child in children:
            tools += child._all_tools()
        return tools

    def _unregister(self, tool: "ToolProcess") -> None:
        with self._lock:
            self._tools.discard(tool)

    def _start(self, tool: "ToolProcess", spawn: "Callable[[], subprocess.Popen]") -> subprocess.Popen:
        """Start under the lock: end_tools either sees the new tool or the tool never starts."""
        with self._lock:
            if self._cancelled.is_set():
                raise ToolTimeout(f"{tool.argv[0]}: not started: {self.reason}")
            popen = spawn()
            self._tools.add(tool)
            return popen


_subreaper_lock = threading.Lock()
_subreaper: bool | None = None
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    """Linux: orphans of our tools' processes are re-parented to us (and reaped by ToolProcess.end)."""
    global _subreaper
    with _subreaper_lock:
        if _subreaper is None:
            _subreaper = False
            if sys.platform.startswith("linux"):
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    _subreaper = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
                except (OSError, AttributeError):
                    pass
            if not _subreaper:
                log.warning("cannot become the child subreaper: a tool's orphaned processes are reaped by init")
        return _subreaper


class ToolProcess:
    """One external command in a new session (so a process group of its own, pgid = its pid), ended as a group."""

    def __init__(self, argv: Sequence[str], stdout: IO[bytes] | int, scope: Scope | None,
                 stdin: IO[bytes] | int = subprocess.DEVNULL):
        _become_subreaper()
        self.argv = tuple(argv)
        self.scope = scope
        self._gone = False  # no process of the group is left (reaped)
        try:
            spawn = partial(subprocess.Popen, self.argv, stdout=stdout, stderr=subprocess.STDOUT,
                            stdin=stdin, start_new_session=True)
            self.popen = spawn() if scope is None else scope._start(self, spawn)
        except OSError as exc:
            raise ToolError(f"{self.argv[0]}: cannot run: {exc.strerror or exc}") from None
        self.pgid = self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float) -> bool:
        """Wait for the group's first process to exit; True when it did within `timeout_s`."""
        try:
            self.popen.wait(timeout=max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:
            return False

    def end(self, grace_s: float | None = None) -> str | None:
        """SIGTERM the group, SIGKILL it after `grace_s` (default TERM_GRACE_S), reap. None once no process of the
        group is left (at once for a tool whose group is already gone), else what is still there."""
        problems = end_all([self], grace_s)
        return problems[0] if problems else None

    def _signal(self, sig: signal.Signals) -> None:
        if self._empty():
            return
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # a member changed its user (setuid helper): nothing more can be done from here
            log.warning("cannot signal a tool's process group", tool=self.argv[0], pgid=self.pgid)

    def _empty(self) -> bool:
        """Reap what can be reaped, then whether any process of the group is left. Called from several threads at
        once (the tool's own and the runner's, ending it together): each step is safe to repeat."""
        if self._gone:
            return True
        if self.popen.poll() is not None:  # the first process through Popen, so its exit status is kept
            while True:  # then the group's other processes that are our children (orphans come back to us)
                try:
                    pid, _ = os.waitpid(-self.pgid, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            self._gone = True
            if self.scope is not None:
                self.scope._unregister(self)
            return True
        except PermissionError:
            return False
        return False


def end_all(tools: Sequence[ToolProcess], grace_s: float | None = None) -> list[str]:
    """End several tools at once: SIGTERM to every group, SIGKILL to those still there after `grace_s` (default
    TERM_GRACE_S), then wait until they are gone. Returns what could not be ended."""
    grace_s = TERM_GRACE_S if grace_s is None else grace_s
    left = list(tools)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        for tool in left:
            tool._signal(sig)
        end = time.monotonic() + wait_s
        pause = 0.002
        while True:
            left = [t for t in left if not t._empty()]
            now = time.monotonic()
            if not left or now >= end:
                break
            time.sleep(min(pause, end - now))
            pause = min(pause * 2, 0.05)
        if not left:
            return []
    return [f"{t.argv[0]} (process group {t.pgid}) could not be ended" for t in left]


def read_output(f: IO[bytes], what: str) -> str:
    f.seek(0)
    data = f.read(MAX_OUTPUT_BYTES + 1)
    if len(data) > MAX_OUTPUT_BYTES:
        raise ToolError(f"{what}: printed more than {MAX_OUTPUT_BYTES >> 20} MiB; not read")
    return data.decode(errors="replace")


class ToolRunner:
    def __init__(self, recorded_dir: Path | None = None):
        self.recorded_dir = recorded_dir

    def run(self, name: str, argv: Sequence[str], timeout_s: float, stdin: bytes | None = None) -> ToolOutput:
        """Run argv (argv[0] is looked up on PATH); `name` keys the recorded output. `stdin`: what the tool reads on
        its standard input (from a file, so a tool that never reads it cannot block on a full pipe); nothing when
        None. Raises ToolMissing when argv[0] is not installed, ToolTimeout when it was ended before it finished,
        ToolError when it could not run."""
        scope = current_scope()
        limit, cut = scope.bound(timeout_s) if scope is not None else (timeout_s, False)
        if self.recorded_dir is not None:
            return self._replay(name, tuple(argv), limit, cut, scope)
        exe = shutil.which(argv[0])
        if exe is None:
            raise ToolMissing(f"{argv[0]}: not installed (not on PATH)")
        start = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as given:
            if stdin is not None:
                given.write(stdin)
                given.seek(0)
            tool = ToolProcess([exe, *argv[1:]], out, scope, subprocess.DEVNULL if stdin is None else given)
            try:
                finished = tool.wait(limit)
            finally:
                problem = tool.end()  # the rest of its group; all of it when it did not finish
            if scope is not None and scope.cancelled:
                raise ToolTimeout(f"{argv[0]}: ended: {scope.reason}")
            if not finished:
                if scope is not None and cut:
                    scope.expired = True
                raise ToolTimeout(_no_answer(argv[0], limit, cut) + (f"; {problem}" if problem else ""))
            if problem:
                log.warning("tool left processes running", problem=problem)
            text = read_output(out, argv[0])
        assert tool.returncode is not None
        return ToolOutput(name, tuple(argv), text, tool.returncode, time.monotonic() - start)

    def _replay(self, name: str, argv: tuple[str, ...], limit: float, cut: bool, scope: Scope | None) -> ToolOutput:
        assert self.recorded_dir is not None
        base = self.recorded_dir / name
        if base.with_suffix(".hang").exists():
            cancelled = scope.sleep(limit) if scope is not None else threading.Event().wait(limit)
            if cancelled and scope is not None:
                raise ToolTimeout(f"{argv[0]}: ended: {scope.reason} [recorded hang]")
            if scope is not None and cut:
                scope.expired = True
            raise ToolTimeout(_no_answer(argv[0], limit, cut) + " [recorded hang]")
        out = base.with_suffix(".out")
        if not out.exists():
            # Scenario-relative: the message lands in findings, which must not depend on where a scenario lives.
            raise ToolMissing(f"{argv[0]}: not installed (no recorded tools/{out.name})")
        rc_file = base.with_suffix(".rc")
        inside = confine.scenario_prefix(self.recorded_dir.parent)  # a scenario's tools/: nothing outside it is read
        try:
            with os.fdopen(confine.open_file(out, inside), "rb") as f:
                text = read_output(f, f"tools/{out.name}")
            rc = 0
            if rc_file.exists():
                with os.fdopen(confine.open_file(rc_file, inside), "rb") as f:
                    rc = int(f.read(16).strip())
                if not -128 <= rc <= 255:  # an exit status, or minus the signal that ended the tool (Popen's form)
                    raise ValueError(rc)
        except OSError as exc:
            raise ToolError(f"tools/{name}: cannot read: {exc.strerror or exc}") from None
        except SourceError as exc:  # refused: a link out of the scenario
            raise ToolError(str(exc)) from None
        except ValueError:
            raise ToolError(f"{rc_file}: not an exit status") from None
        return ToolOutput(name, argv, text, rc, 0.0)


def _no_answer(tool: str, limit: float, cut: bool) -> str:
    if cut:
        return f"{tool}: no answer within {limit:.3g}s, when its check's time ran out (killed)"
    return f"{tool}: no answer within {limit:g}s (killed)"

"""The node's process table: /proc/<pid>/comm and cmdline under the node's root (/ live, the scenario folder on a
recorded node), read through Sysfs so a recorded process table runs the same code.

Only the host (initial) PID namespace shows the processes of every container, and it is the only one that shows
kernel threads: kthreadd is PID 2 there and nowhere else. A table without it (an agent in a container without
hostPID, /proc mounted with hidepid, a recording without processes) cannot tell that a process is absent, so it is
a SourceError, never "not running".
"""
from __future__ import annotations

import os

from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.sysfs import Sysfs

COMM_LEN = 15  # TASK_COMM_LEN (16) less the NUL: comm holds the first 15 characters of the executable's name


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    argv0: str | None  # None: no cmdline to read (a recording that keeps only comm)


def find_processes(sysfs: Sysfs, name: str) -> list[Process]:
    """The live processes running the executable `name` (as `nv-fabricmanager`), by comm (truncated by the kernel)
    confirmed by argv[0] where cmdline is there: a script `nv-fabricmanager-start.sh` has the same 15-character
    comm but runs under its interpreter. Raises SourceError when the table is not the host's."""
    table = sysfs.path("/proc")
    pids = sorted(int(e) for e in sysfs.listdir("/proc") if e.isdigit())
    if not pids:
        raise SourceError(f"{table}: no process table (no /proc/<pid> entries)")
    pid2 = _read(sysfs, "/proc/2/comm")
    if pid2 != "kthreadd":
        seen = f"PID 2 is {pid2!r}" if pid2 is not None else "no PID 2"
        raise SourceError(f"{table}: not the host's process table ({seen}, not kthreadd): processes in containers are "
                          "not visible; run the agent in the host PID namespace (hostPID: true) without hidepid")
    return [p for p in (_running(sysfs, pid, name) for pid in pids) if p is not None]


def still_running(sysfs: Sysfs, name: str, pids: "tuple[int, ...] | list[int]") -> tuple[int, ...]:
    """Those of `pids` that still run the executable `name`, as find_processes tells it: a PID the kernel gave to
    another program since is not one. Two small reads a PID where find_processes reads the whole table: for
    processes it found before, on the same table."""
    return tuple(pid for pid in pids if _running(sysfs, pid, name) is not None)


def _running(sysfs: Sysfs, pid: int, name: str) -> Process | None:
    comm = _read(sysfs, f"/proc/{pid}/comm")  # None: exited since the listing
    if comm is None or comm not in (name, name[:COMM_LEN]):
        return None
    cmdline = _read(sysfs, f"/proc/{pid}/cmdline")
    argv0 = None if cmdline is None else cmdline.split("\0", 1)[0]
    if argv0 is None or os.path.basename(argv0) == name:  # a zombie's cmdline is empty: not running
        return Process(pid, comm, argv0)
    return None


def _read(sysfs: Sysfs, path: str) -> str | None:
    try:
        return sysfs.read(path)
    except SourceError:
        return None

"""`gpuwarden analyze`'s read-ahead: the readers of a large kernel log given first, started before the command line is
parsed and the CLI loaded (what the installed command does first: agent/cli/command.py), so that the CLI's start and
theirs overlap; analyze_file takes them up (agent/cli/analyze.py, _take_ahead), drop_ahead ends those it did not.
This module and analyze.py load only what the read-ahead needs before it starts: the rest loads at use."""
from __future__ import annotations

import os
import stat
import time
from typing import Sequence

from gpuwarden.agent.cli.analyze import (
    _AHEAD,
    KERNEL_INTEREST,
    STDIN,
    _head_votes,
    _kernel_lines_lead,
    _open_nonblocking,
)
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.kernel_log import format_of_votes
from gpuwarden.agent.node import kernel_scan


def read_ahead(args: Sequence[str]) -> None:
    """Starts the readers of the first FILE of `gpuwarden analyze ARGS` if it is a large kernel log. Only a
    command line of the plain forms is looked at (FILEs, --json, --log-format/--log-level with a value, --): any
    other option, or a file that cannot be opened, leaves every file to analyze_file."""
    arg = _first_file(args)
    if arg is None or arg == STDIN or arg in _AHEAD:
        return
    started = time.monotonic()

    def large(st: os.stat_result) -> bool:  # a pipe's or a device's bytes read here would be lost to analyze_file
        return stat.S_ISREG(st.st_mode) and st.st_size >= kernel_scan.PARALLEL_MIN

    try:
        if not large(os.stat(arg)):
            return
        f = _open_nonblocking(arg)  # kept open for analyze_file, or closed here or by drop_ahead
    except (OSError, ValueError):  # analyze_file says what is wrong with it
        return
    readers = None
    try:
        if large(os.fstat(f.fileno())):
            head, _, _, votes = _head_votes(f)
            if _kernel_lines_lead(votes):
                fmt = format_of_votes(votes)
                readers = kernel_scan.start_readers(f, fmt == "kmsg", KERNEL_INTEREST, first=head)
    except (OSError, GpuwardenError):  # analyze_file reads it again and says what is wrong with it
        readers = None
    if readers is None:
        f.close()
        return
    _AHEAD[arg] = (f, head, fmt, readers, started)


def _first_file(args: Sequence[str]) -> str | None:
    it = iter(args)
    for arg in it:
        if arg == "--":
            return next(it, None)
        if arg in ("--log-format", "--log-level"):
            next(it, None)
        elif arg != "--json" and not arg.startswith(("--log-format=", "--log-level=")):
            return None if arg.startswith("-") else arg
    return None


def drop_ahead() -> None:
    """Ends the readers started ahead that analyze did not take up (the command line was refused)."""
    while _AHEAD:
        f, _, _, readers, _ = _AHEAD.popitem()[1]
        readers.close()
        f.close()

"""The installed `gpuwarden` command: what it does before the CLI (agent/cli/main.py) is loaded, and how it ends.

- `gpuwarden analyze FILE ...`: the readers of a large kernel log given first start before the CLI loads and parses
  the command line (analyze_ahead.read_ahead), so that the CLI's start and theirs overlap.
- The commands that end at their verdict (preflight, analyze, slurm) end there: stdout is flushed and the process
  exits without the interpreter's teardown (a full collection over every object the run made, then each module's),
  which changes nothing outside the process and took 15-50 ms of a 0.2-0.3 s run. Their threads are daemon
  threads, and every tool they start is waited for or ended before the verdict.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

ENDS_AT_ITS_VERDICT = frozenset(("preflight", "analyze", "slurm"))
EXIT_SIGPIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away


def console(main: Callable[[Sequence[str]], int] | None = None) -> None:
    """`gpuwarden ARGS`: main() (cli.main, or the one given) with this process's arguments, and its exit status."""
    argv = sys.argv[1:]
    command = argv[0] if argv and not argv[0].startswith("-") else None  # the top-level parser takes no value
    ahead = None
    if command == "analyze":
        # at use: analyze's readers and the kernel-log formats: +87 ms to every other command's start (least of
        # five runs after cli.main, python -X importtime, at load average 11 on 2 cores)
        from gpuwarden.agent.cli import analyze_ahead as ahead

        ahead.read_ahead(argv[1:])
    try:
        if main is None:
            # at use: after the read-ahead has started, so that its readers and the CLI's load (the parser and its
            # command, 30 ms and up; python -X importtime) overlap
            from gpuwarden.agent.cli.main import main
        code = main(argv)
    except BrokenPipeError:
        # The reader went away (`gpuwarden checks | head`): no traceback, and no second error when Python
        # flushes stdout at exit; the status a shell reports for a command killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_SIGPIPE
    finally:
        if ahead is not None:
            ahead.drop_ahead()
    if command not in ENDS_AT_ITS_VERDICT:
        sys.exit(code)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away before the last of the output (`... | head`), as above
        code = EXIT_SIGPIPE
    except OSError:  # stdout could not take it (a full disk): a verdict not written is no clean verdict
        from gpuwarden.agent.core.model import EXIT_UNDECIDED  # at use: +6 ms to a start without it

        code = code or EXIT_UNDECIDED
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)

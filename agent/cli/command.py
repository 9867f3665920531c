"""The installed `gpuwarden` command: what it does before the CLI (agent/cli/main.py) is loaded, and how it ends.

- `gpuwarden analyze FILE ...`: the readers of a large kernel log given first start before the CLI loads and parses
  the command line (analyze.read_ahead), so that the CLI's start and theirs overlap.
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
EXIT_SIGPIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away (cli.main says it too)


def console(main: Callable[[Sequence[str]], int] | None = None) -> None:
    """`gpuwarden ARGS`: main() (cli.main, or the one given) with this process's arguments, and its exit status."""
    argv = sys.argv[1:]
    command = argv[0] if argv and not argv[0].startswith("-") else None  # the top-level parser takes no value
    if command == "analyze":
        from gpuwarden.agent.cli.analyze import read_ahead

        read_ahead(argv[1:])
    try:
        if main is None:
            from gpuwarden.agent.cli.main import main
        code = main(argv)
    finally:
        if command == "analyze":
            from gpuwarden.agent.cli.analyze import drop_ahead

            drop_ahead()
    if command not in ENDS_AT_ITS_VERDICT:
        sys.exit(code)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away before the last of the output (`... | head`), as main() says
        code = EXIT_SIGPIPE
    except OSError:  # stdout could not take it (a full disk): a verdict not written is no clean verdict
        from gpuwarden.agent.core.model import EXIT_UNDECIDED

        code = code or EXIT_UNDECIDED
    try:
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code)

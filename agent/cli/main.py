"""The `gpuwarden` command: its parser and its table of commands.

Exit codes of `preflight` and `analyze` (for Slurm's HealthCheckProgram / Prolog / Epilog: `gpuwarden slurm`):
  0  every check passed, or only warned
  1  a fault that needs action (at least one FAIL)
  2  could not decide: a check could not look (UNKNOWN), or the command itself was wrong (bad config, bad
     flags, unreadable scenario)
  130 / 143  interrupted by SIGINT / SIGTERM: every tool it had started was ended first, no verdict

Each command is a module of agent/cli/ with `DESCRIPTION` (and `EPILOG` where it has examples or exit codes),
`add_arguments(parser)` and `run(args) -> int`. A command's module is imported when that command is chosen, and
only the chosen command's options are built: `gpuwarden preflight` does not load the daemon, the sweeps or fleet
planning, and `--version` loads nothing of the agent.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.version import VERSION

log = logs.get_logger("gpuwarden")

# Every command in the order of `gpuwarden --help`: its name, its one-line help, and its module (agent/cli/MODULE.py).
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("preflight", "run the health checks once and print a verdict", "preflight"),
    ("analyze", "find faults in saved logs and tool outputs (post-mortem)", "analyze"),
    ("record", "write a scenario (recorded node) from this machine", "record"),
    ("run", "the daemon: passive checks, node state, Prometheus endpoint", "run"),
    ("status", "the node state and recent findings, from the daemon's store", "status"),
    ("breaker", "the circuit breaker that holds cordons when too many nodes are drained", "breaker"),
    ("topology", "this node's NVLink domain; publish it; write Slurm topology.conf / topology.yaml from the "
                 "scheduler's view", "topology"),
    ("checks", "list the checks and their config keys", "checks"),
    ("explain", "name the node, GPU, IB port or rank behind a failed job, from its logs and its nodes' gpuwarden",
     "explain"),
    ("jobs", "the jobs using this node's GPUs, their ranks, GPUs and IB ports, and how long a fault takes to end "
             "them", "jobs"),
    ("slurm", "run the quick preflight as Slurm's HealthCheckProgram, Prolog or Epilog, and drain or resume this "
              "node in Slurm", "slurm"),
    ("sweep", "multi-node NCCL collectives over idle nodes; find the bad node or link", "sweep"),
    ("plan", "fleet planning: slice-size capacity, failure risk, simulation, defrag", "plan"),
)
EVERY = "*"  # _parser(EVERY): every command's options (the man page, tests)


class _HelpFormatter(argparse.HelpFormatter):
    """Descriptions and help are filled to the terminal's width; a text written in lines (the epilogs: examples, the
    exit code table) keeps them."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=28)

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        # argparse measures subcommand names two columns left of where it prints them, and so wraps the longest.
        for choice in getattr(action, "_choices_actions", ()):
            width = len(choice.metavar or choice.dest) + self._current_indent + 4
            self._action_max_length = max(self._action_max_length, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _chosen(argv: Sequence[str]) -> list[str]:
    """The command words of a command line (`plan`, `capacity`): the words before the first option. The top-level
    parser has no option that takes a value, so the first word is the command; what follows an option is left to
    argparse."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return words


def _module(name: str) -> ModuleType:
    """The module of the command `name`: the one deliberate lazy load of the command table. `gpuwarden preflight`
    loads agent/cli/preflight.py alone; every command's module with it (the daemon, the store, the sweeps, fleet
    planning, the adapters) took 2.2 s more (least of three after cli.main, at load average 11 on 2 cores)."""
    return importlib.import_module(f"gpuwarden.agent.cli.{dict((n, m) for n, _, m in COMMANDS)[name]}")


def _parser(command: str | None = EVERY, part: str | None = EVERY) -> argparse.ArgumentParser:
    """The parser with the options of `command` (EVERY: of all of them; None: of none, as for `--version` or
    `--help`); the other commands are there with their help line only, so that argparse lists them and takes
    their names. `part`: the plan part to build (see cli.plan.add_arguments)."""
    raw = _HelpFormatter
    p = argparse.ArgumentParser(
        prog="gpuwarden", formatter_class=raw,
        description="GPU node health agent: checks a GPU node before it takes work (preflight), watches it while work "
                    "runs (the daemon, run), and tells the scheduler what to do about a faulty node.",
        epilog="examples:\n"
               "  gpuwarden preflight                 quick checks of this node, a verdict and an exit code\n"
               "  gpuwarden preflight --level full    also the checks that load the GPUs and the network (minutes)\n"
               "  gpuwarden checks                    the checks, where they run, their config keys\n"
               "  gpuwarden status                    the daemon's view: node state and recent findings\n"
               "  gpuwarden COMMAND --help            a command's options\n\n"
               "The daemon runs as the systemd unit gpuwarden.service; its config is /etc/gpuwarden/gpuwarden.toml.\n"
               "Manual: gpuwarden(1); documentation: /usr/share/doc/gpuwarden/.")
    p.add_argument("--version", action="version", version=f"gpuwarden {VERSION}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for name, summary, _ in COMMANDS:
        if command not in (EVERY, name):
            sub.add_parser(name, help=summary, formatter_class=raw)
            continue
        module = _module(name)
        cp = sub.add_parser(name, help=summary, formatter_class=raw, description=module.DESCRIPTION,
                            epilog=getattr(module, "EPILOG", None))
        if name == "plan":  # only the chosen part's module is loaded (cli.plan)
            module.add_arguments(cp, part)
        else:
            module.add_arguments(cp)
        cp.set_defaults(run=module.run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    words = _chosen(argv)
    command = words[0] if words and words[0] in {n for n, _, _ in COMMANDS} else None
    args = _parser(command, words[1] if command == "plan" and len(words) > 1 else None).parse_args(argv)
    # Not at load: --version and --help load nothing of the agent but what tests/test_cli_startup.py lists (this
    # module adds 2 ms to them; python -X importtime, least of three).
    from gpuwarden.agent.cli.interrupt import Interrupted

    try:
        return args.run(args)
    except GpuwardenError as exc:
        from gpuwarden.agent.core.model import EXIT_UNDECIDED  # at use: the model is +100 ms to --version

        print(f"gpuwarden {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNDECIDED
    except Interrupted as exc:
        print(f"gpuwarden {args.command}: interrupted by {exc}; the tools it had started were ended", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130

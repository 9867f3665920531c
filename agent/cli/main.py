"""The `gpuwarden` command.

Exit codes of `preflight` and `analyze` (for Slurm's HealthCheckProgram / Prolog / Epilog: `gpuwarden slurm`):
  0  every check passed, or only warned
  1  a fault that needs action (at least one FAIL)
  2  could not decide: a check could not look (UNKNOWN), or the command itself was wrong (bad config, bad
     flags, unreadable scenario)
  130 / 143  interrupted by SIGINT / SIGTERM: every tool it had started was ended first, no verdict

A command's module is imported when that command runs, and only the chosen command's options are built: `gpuwarden
preflight` does not load the daemon, the sweeps or fleet planning, and `--version` loads nothing of the agent.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.version import VERSION

if TYPE_CHECKING:
    from gpuwarden.agent.core.model import Report

log = logs.get_logger("gpuwarden")

# Every command in the order of `gpuwarden --help`, with its one-line help. The four whose options live in their own
# module (topology, slurm, sweep, plan) are built from it only when chosen; their help here is the one their module
# gives (tests/test_cli_startup.py holds the two together).
COMMANDS: tuple[tuple[str, str], ...] = (
    ("preflight", "run the health checks once and print a verdict"),
    ("analyze", "find faults in saved logs and tool outputs (post-mortem)"),
    ("record", "write a scenario (recorded node) from this machine"),
    ("run", "the daemon: passive checks, node state, Prometheus endpoint"),
    ("status", "the node state and recent findings, from the daemon's store"),
    ("breaker", "the circuit breaker that holds cordons when too many nodes are drained"),
    ("topology", "this node's NVLink domain; publish it; write Slurm topology.conf / topology.yaml from the "
                 "scheduler's view"),
    ("checks", "list the checks and their config keys"),
    ("explain", "name the node, GPU, IB port or rank behind a failed job, from its logs and its nodes' gpuwarden"),
    ("jobs", "the jobs using this node's GPUs, their ranks, GPUs and IB ports, and how long a fault takes to end "
             "them"),
    ("slurm", "run the quick preflight as Slurm's HealthCheckProgram, Prolog or Epilog, and drain or resume this "
              "node in Slurm"),
    ("sweep", "multi-node NCCL collectives over idle nodes; find the bad node or link"),
    ("plan", "fleet planning: slice-size capacity, failure risk, simulation, defrag"),
)
EVERY = "*"  # _parser(EVERY): every command's options (the man page, tests)


# Exit codes of `preflight` and `analyze`: the --help epilogs and the man page's EXIT STATUS are written from this
# table (the README's table says the same; tests/test_manpage.py holds them together).
EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "every check passed, or only warned"),
    ("1", "a fault that needs action (at least one FAIL)"),
    ("2", "could not decide: a check could not look (UNKNOWN), or the command was wrong (bad config or flags)"),
    ("130, 143", "interrupted by SIGINT, SIGTERM: no verdict; every tool it had started was ended first"),
)
_CONFIG_HELP = "TOML config (default: /etc/gpuwarden/gpuwarden.toml if present; see gpuwarden(1), FILES)"


def _exit_codes_epilog() -> str:
    width = max(len(code) for code, _ in EXIT_CODES)
    return "exit codes:\n" + "\n".join(f"  {code:<{width}}  {meaning}" for code, meaning in EXIT_CODES)


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


def _parser(command: str | None = EVERY, part: str | None = EVERY) -> argparse.ArgumentParser:
    """The parser with the options of `command` (EVERY: of all of them; None: of none, as for `--version` or
    `--help`); the other commands are there with their help line only, so that argparse lists them and takes
    their names. `part`: the plan part to build (see plan_command.add_parser)."""
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
    builders: dict[str, Callable[[], None]] = {
        "preflight": lambda: _preflight_parser(sub), "analyze": lambda: _analyze_parser(sub),
        "record": lambda: _record_parser(sub), "run": lambda: _run_parser(sub),
        "status": lambda: _status_parser(sub), "breaker": lambda: _breaker_parser(sub),
        "topology": lambda: _topology_parser(sub), "checks": lambda: _checks_parser(sub),
        "jobs": lambda: _jobs_parser(sub), "explain": lambda: _explain_parser(sub),
        "slurm": lambda: _slurm_parser(sub), "sweep": lambda: _sweep_parser(sub),
        "plan": lambda: _plan_parser(sub, part),
    }
    for name, summary in COMMANDS:
        if command in (EVERY, name):
            builders[name]()
        else:
            sub.add_parser(name, help=summary, formatter_class=raw)
    return p


def _help(name: str) -> str:
    return dict(COMMANDS)[name]


def _preflight_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    pre = sub.add_parser(
        "preflight", help=_help("preflight"), formatter_class=raw,
        description="Run the health checks once, on this machine or on a recorded node (--root), and print a verdict: "
                    "a table, or JSON with --json. The exit code says what to do with the node (for Slurm's health "
                    "check, Prolog and Epilog, which also drain the node: gpuwarden slurm). A check that cannot look "
                    "is UNKNOWN, never OK.",
        epilog="examples:\n"
               "  gpuwarden preflight\n"
               "  gpuwarden preflight --level full --budget 900\n"
               "  gpuwarden preflight --checks xid,ecc,ib_port --json\n"
               "  gpuwarden preflight --root ./h100-node    (a folder written by gpuwarden record)\n\n"
               + _exit_codes_epilog())
    pre.add_argument("--root", type=Path, metavar="DIR",
                     help="run on a recorded node (a scenario folder, see gpuwarden record) instead of this machine")
    pre.add_argument("--checks", action="append", default=[], metavar="NAME[,NAME…]",
                     help="run only these checks, whatever their level (repeatable or comma-separated; "
                          "gpuwarden checks lists them); default: [agent] checks, else every check of the level")
    pre.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    pre.add_argument("--config", type=Path, metavar="FILE", help=_CONFIG_HELP)
    pre.add_argument("--check-timeout", type=float, metavar="SECONDS",
                     help="per-check timeout (default: [agent] check_timeout_s; 0 = each check's own)")
    pre.add_argument("--level", choices=("quick", "full"),
                     help="quick: non-disturbing checks, seconds; full: also the checks that load GPUs "
                          "and network (burn-in, NCCL, RDMA, DCGM diag), minutes (default: [agent] level, quick)")
    pre.add_argument("--budget", type=float, metavar="SECONDS",
                     help="overall time budget; checks not started in time are UNKNOWN "
                          "(default: [agent] budget_s; 0 = none)")
    _log_flags(pre)


def _analyze_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    ana = sub.add_parser(
        "analyze", help=_help("analyze"), formatter_class=raw,
        description="Judge saved files with the decision code the live checks use: kernel logs (dmesg, journalctl, "
                    "syslog or raw kmsg: XIDs, NVSwitch SXids) and the outputs of dcgmi diag (text or JSON), "
                    "nccl-tests and perftest (ib_write_bw). Nothing on this machine is read.",
        epilog="examples:\n"
               "  gpuwarden analyze dmesg.txt\n"
               "  gpuwarden analyze --json node17/*.log\n"
               "  ssh node17 dmesg | gpuwarden analyze -\n\n"
               + _exit_codes_epilog())
    ana.add_argument("files", nargs="+", metavar="FILE",  # a str: Path("./-") would be "-", standard input
                     help="saved kernel log or tool output, a regular file (a FIFO or device is refused); the format "
                          "is recognised from the content. - reads standard input, up to 1 GiB and for 300 s")
    ana.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    _log_flags(ana)


def _record_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    rec = sub.add_parser(
        "record", help=_help("record"), formatter_class=raw,
        description="Write what the checks read on this machine (NVML, sysfs, the kernel log; with --with-tools the "
                    "tools' outputs) to a folder: a support bundle, and a recorded node that preflight --root and "
                    "run --root replay.",
        epilog="examples:\n"
               "  gpuwarden record --out /tmp/node17\n"
               "  gpuwarden record --out /tmp/node17 --with-tools --budget 1200")
    rec.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (required)")
    rec.add_argument("--root", type=Path, metavar="DIR",
                     help="re-record an existing scenario instead of this machine")
    rec.add_argument("--with-tools", action="store_true",
                     help="also run the full-level checks' tools (DCGM diag, NCCL, nvbandwidth, ib_write_bw, burn-in) "
                          "and record their outputs: minutes, loads the GPUs and the network")
    rec.add_argument("--config", type=Path, metavar="FILE",
                     help="TOML config: the tools' options and timeouts (default: /etc/gpuwarden/gpuwarden.toml if "
                          "present)")
    rec.add_argument("--budget", type=float, metavar="SECONDS",
                     help="with --with-tools: checks not started in time are not recorded (default: none)")
    _log_flags(rec)


def _run_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    run = sub.add_parser(
        "run", help=_help("run"), formatter_class=raw,
        description="The daemon (systemd unit gpuwarden.service): runs the passive checks continuously, follows the "
                    "kernel log, keeps the node's state (healthy, suspect, cordoned, quarantined, retired) in its "
                    "store, asks the scheduler to act when [remediation] mode = \"act\" (dry-run by default), and "
                    "serves Prometheus metrics on /metrics. SIGHUP reloads the config.",
        epilog="examples:\n"
               "  gpuwarden run\n"
               "  gpuwarden run --listen 127.0.0.1:9456 --state-dir /tmp/gw-state\n"
               "  systemctl enable --now gpuwarden.service")
    run.add_argument("--root", type=Path, metavar="DIR",
                     help="run on a recorded node (followed and re-read as if live)")
    run.add_argument("--state-dir", type=Path, metavar="DIR",
                     help="SQLite state and action journal (default: [agent] state_dir, /var/lib/gpuwarden)")
    run.add_argument("--listen", metavar="HOST:PORT",
                     help="serve /metrics here (default: [agent] listen, 0.0.0.0:9456)")
    run.add_argument("--config", type=Path, metavar="FILE", help=_CONFIG_HELP)
    run.add_argument("--web.config.file", dest="web_config_file", type=Path, metavar="FILE",
                     help="TLS and basic auth for /metrics: exporter-toolkit's YAML web config "
                          "(default: [agent] web_config_file; none: plain HTTP)")
    run.add_argument("--textfile", type=Path, metavar="FILE",
                     help="also write metrics for node_exporter's textfile collector (default: [agent] textfile; "
                          "none)")
    _log_flags(run)


def _status_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    st = sub.add_parser(
        "status", help=_help("status"), formatter_class=raw,
        description="Print what the daemon recorded in its store: the node's state and its last transitions, each "
                    "check's last result and findings, and the remediation intents (pending and recent). Read-only: "
                    "it works while the daemon runs.",
        epilog="examples:\n"
               "  gpuwarden status\n"
               "  gpuwarden status --json")
    st.add_argument("--state-dir", type=Path, metavar="DIR", help="the daemon's state folder (default: "
                                                                  "/var/lib/gpuwarden)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")


def _breaker_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    brk = sub.add_parser(
        "breaker", help=_help("breaker"), formatter_class=raw,
        description="The circuit breaker: when too large a share of the fleet or of one NVLink domain is drained "
                    "within a window ([remediation.breaker]), the daemon holds new cordons and latches open.")
    brk_sub = brk.add_subparsers(dest="breaker_command", required=True, title="commands", metavar="COMMAND")
    reset = brk_sub.add_parser("reset", help="close a latched breaker: the running daemon judges the fleet again, "
                                             "counting only drains after now",
                               formatter_class=raw,
                               description="Close a latched breaker: the running daemon judges the fleet again, "
                                           "counting only drains after now.")
    reset.add_argument("--state-dir", type=Path, metavar="DIR", help="the daemon's state folder (default: "
                                                                     "/var/lib/gpuwarden)")


def _topology_parser(sub: argparse._SubParsersAction) -> None:
    from gpuwarden.agent.node import topology

    raw = _HelpFormatter
    topo = sub.add_parser("topology", help=_help("topology"), formatter_class=raw,
                          description="Print this node's NVLink domain (from NVML's GPU fabric info, or [topology] "
                                      "domain), publish it to the scheduler (a Slurm node feature, Kubernetes "
                                      "labels), or write Slurm's block topology from the scheduler's view of the "
                                      "fleet.",
                          epilog="examples:\n"
                                 "  gpuwarden topology\n"
                                 "  gpuwarden topology --publish\n"
                                 "  gpuwarden topology --slurm-conf /etc/slurm/topology.conf\n\n"
                                 "exit codes:\n"
                                 "  0  done\n"
                                 "  1  no NVLink domain known for this node\n"
                                 "  2  usage, config, scheduler or file error")
    topology.add_arguments(topo)
    # What the command needs besides topology's own flags (each added unless topology already has it).
    for flag, kwargs in (("--config", dict(type=Path, metavar="FILE", help=_CONFIG_HELP)),
                         ("--state-dir", dict(type=Path, metavar="DIR", help="the local adapter's folder (default: "
                                                                             "/var/lib/gpuwarden)")),
                         ("--log-format", dict(choices=("auto", "json", "console"), help="log format (default: "
                                                                                         "[agent] log_format, auto)")),
                         ("--log-level", dict(choices=("debug", "info", "warning", "error"),
                                              help="log level (default: [agent] log_level, info)"))):
        if flag not in topo._option_string_actions:
            topo.add_argument(flag, **kwargs)


def _checks_parser(sub: argparse._SubParsersAction) -> None:
    raw = _HelpFormatter
    sub.add_parser("checks", help=_help("checks"), formatter_class=raw,
                   description="List every check: where it runs (preflight level quick or full, the daemon's poll "
                               "interval, or kmsg for the followed kernel log), what it looks at, and its config "
                               "table [checks.NAME] with each key's default.")


def _jobs_parser(sub: argparse._SubParsersAction) -> None:
    from gpuwarden.agent.cli import jobs as jobs_cli

    jobs_cli.add_parser(sub, _HelpFormatter, _CONFIG_HELP, _log_flags)


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    from gpuwarden.agent.cli import explain as explain_cli

    explain_cli.add_parser(sub, _HelpFormatter, _log_flags)


def _slurm_parser(sub: argparse._SubParsersAction) -> None:
    from gpuwarden.agent.cli import slurm_healthcheck

    slurm_healthcheck.add_parser(sub, _HelpFormatter, _CONFIG_HELP, _log_flags)


def _sweep_parser(sub: argparse._SubParsersAction) -> None:
    from gpuwarden.agent.fleet.sweep import command as sweep_command

    sweep_command.add_parser(sub, _HelpFormatter, _CONFIG_HELP, _log_flags)


def _plan_parser(sub: argparse._SubParsersAction, part: str | None) -> None:
    from gpuwarden.agent.fleet.plan import command as plan_command

    plan_command.add_parser(sub, _HelpFormatter, _log_flags, part)


def _log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=("auto", "json", "console"),
                   help="auto: console on a terminal, JSON lines otherwise (default: [agent] log_format, auto)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="log level (default: [agent] log_level, info)")


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached a command that runs tools: raised in the main thread, so the runner ends every tool
    it started on the way out (BaseException: no `except Exception` on the way may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _tools_end_on_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise Interrupted; a second signal while the tools are being ended is ignored, so the ending
    (bounded: a grace, then SIGKILL) is not cut short and no tool outlives the command (a Slurm Prolog's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _node(root: Path | None):
    from gpuwarden.agent.node.host import Node

    return Node.recorded_at(root) if root is not None else Node.live()


def _emit(report: Report, as_json: bool) -> int:
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        from gpuwarden.agent.core.render import table  # the table's code is loaded only for a table

        sys.stdout.write(table(report))
    return report.exit_code


def cmd_preflight(args: argparse.Namespace) -> int:
    from gpuwarden import checks
    from gpuwarden.agent.core import config as config_mod
    from gpuwarden.agent.core.model import Report
    from gpuwarden.agent.core.render import Progress
    from gpuwarden.agent.node.runner import run_checks

    # Only the checks this run needs are imported: those it runs, and those whose table the config file sets.
    cfg = config_mod.load((), args.config, explicit=args.config is not None, names=checks.NAMES, forms=checks.forms)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    if args.check_timeout is not None:
        config_mod.set_flag(cfg, "check_timeout_s", args.check_timeout, "--check-timeout")
    if args.budget is not None:
        config_mod.set_flag(cfg, "budget_s", args.budget, "--budget")
    level = args.level or cfg.agent["level"]
    names = [n for arg in args.checks for n in arg.split(",") if n] or cfg.agent["checks"]
    try:
        # Named checks run whatever their level; otherwise the level picks them.
        specs = checks.chosen(names, level)
    except ValueError as exc:
        raise GpuwardenError(str(exc)) from None
    config_mod.extend(cfg, checks.forms(s.name for s in specs))
    node = _node(args.root)
    progress = Progress() if not args.json else None
    try:
        with _tools_end_on_signals():
            results = run_checks(node, specs, cfg, progress, budget_s=cfg.agent["budget_s"] or None)
    finally:
        if progress:
            progress.close()
    report = Report(node.hostname, tuple(results), str(args.root) if args.root else "live")
    log.debug("preflight done", node=node.hostname, status=report.status.value, exit_code=report.exit_code)
    return _emit(report, args.json)


def cmd_analyze(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.analyze import STDIN, analyze

    if args.files.count(STDIN) > 1:
        raise GpuwardenError(f"{STDIN} (standard input) is given more than once: it can be read only once")
    logs.setup(args.log_format or "auto", args.log_level or "info")
    return _emit(analyze(STDIN if f == STDIN else Path(f) for f in args.files), args.json)


def cmd_record(args: argparse.Namespace) -> int:
    from gpuwarden.agent.core import config as config_mod
    from gpuwarden.agent.node.record import record
    from gpuwarden.checks import all_specs

    cfg = config_mod.load(all_specs(), args.config, explicit=args.config is not None)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    budget = None
    if args.budget is not None:  # checked as agent.budget_s is, but only this flag bounds a recording
        budget = config_mod.coerce("agent.budget_s", args.budget, 0.0, "command line", name="--budget") or None
    with _tools_end_on_signals():
        problems = record(_node(args.root), args.out, cfg, with_tools=args.with_tools, budget_s=budget)
    for problem in problems:
        log.warning("could not record", problem=problem)
    log.info("recorded", out=str(args.out), problems=len(problems))
    print(f"recorded {args.out}" + (f" ({len(problems)} part(s) could not be read; see log)" if problems else ""))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.run import run_daemon

    return run_daemon(args)


def cmd_status(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.run import print_status

    return print_status(args)


def cmd_breaker(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.run import breaker_reset

    return breaker_reset(args)


def cmd_topology(args: argparse.Namespace) -> int:
    from gpuwarden.agent.act.adapters import build
    from gpuwarden.agent.core import config as config_mod
    from gpuwarden.agent.node import topology
    from gpuwarden.checks import all_specs

    cfg = config_mod.load(all_specs(), args.config, explicit=args.config is not None)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    name = cfg.remediation["adapter"]
    state_dir = Path(args.state_dir or cfg.agent["state_dir"])
    return topology.run(args, cfg, build(name, cfg.remediation.get(name, {}), state_dir))


def cmd_checks(args: argparse.Namespace) -> int:
    """Every check once, with where it runs (preflight level quick|full; the daemon's poll interval or "kmsg" for
    the followed kernel log) and its one config table, which every form of the check reads."""
    from gpuwarden.agent.core import config as config_mod
    from gpuwarden.checks import ALL, KERNEL_CONSUMERS, PASSIVE, all_specs

    tables = config_mod.defaults(all_specs())
    modes: dict[str, list[str]] = {}
    summaries: dict[str, str] = {}
    for spec in ALL:
        modes.setdefault(spec.name, []).append(spec.level)
        summaries.setdefault(spec.name, spec.summary)
    for p in PASSIVE:
        modes.setdefault(p.name, []).append(f"{p.interval_s:g}s")
        summaries.setdefault(p.name, p.summary)
    for c in KERNEL_CONSUMERS:
        if c.name not in {p.name for p in PASSIVE}:
            modes.setdefault(c.name, []).append("kmsg")
        summaries.setdefault(c.name, c.summary)
    width = max(len(name) for name in modes)
    for name, where in modes.items():
        keys = ", ".join(f"{k}={v!r}" for k, v in tables.checks[name].items()) or "-"
        borrowed = ", ".join(f"{owner}.{k}" for k, owner in tables.shared.get(name, {}).items())
        print(f"{name:<{width}} {'+'.join(where):<10} {summaries[name]}\n{'':<{width + 12}}[checks.{name}] {keys}"
              + (f"; reads {borrowed}" if borrowed else ""))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.jobs import run

    return run(args)


def cmd_explain(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.explain import run

    return run(args)


def cmd_slurm(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.slurm_healthcheck import run

    return run(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from gpuwarden.agent.fleet.plan.command import run

    return run(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    from gpuwarden.agent.fleet.sweep.command import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    words = _chosen(argv)
    command = words[0] if words and words[0] in dict(COMMANDS) else None
    args = _parser(command, words[1] if command == "plan" and len(words) > 1 else None).parse_args(argv)
    handler = {"preflight": cmd_preflight, "analyze": cmd_analyze, "record": cmd_record, "checks": cmd_checks,
               "run": cmd_run, "status": cmd_status, "breaker": cmd_breaker, "topology": cmd_topology,
               "slurm": cmd_slurm, "sweep": cmd_sweep, "plan": cmd_plan, "jobs": cmd_jobs,
               "explain": cmd_explain}
    try:
        return handler[args.command](args)
    except GpuwardenError as exc:
        from gpuwarden.agent.core.model import EXIT_UNDECIDED

        print(f"gpuwarden {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNDECIDED
    except Interrupted as exc:
        print(f"gpuwarden {args.command}: interrupted by {exc}; the tools it had started were ended", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpuwarden checks | head`): no traceback, and no second error when Python
        # flushes stdout at exit; the status a shell reports for a command killed by SIGPIPE.
        from gpuwarden.agent.cli.command import EXIT_SIGPIPE

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    from gpuwarden.agent.cli.command import console

    console(main)

"""`gpuwarden preflight`: the health checks once, on this machine or on a recorded node, and a verdict with its
exit code."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpuwarden.agent.cli.flags import CONFIG_HELP, exit_codes_epilog, log_flags
from gpuwarden.agent.cli.interrupt import tools_end_on_signals
from gpuwarden.agent.cli.verdict import emit
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError

log = logs.get_logger("gpuwarden")

DESCRIPTION = ("Run the health checks once, on this machine or on a recorded node (--root), and print a verdict: "
               "a table, or JSON with --json. The exit code says what to do with the node (for Slurm's health "
               "check, Prolog and Epilog, which also drain the node: gpuwarden slurm). A check that cannot look "
               "is UNKNOWN, never OK.")
EPILOG = ("examples:\n"
          "  gpuwarden preflight\n"
          "  gpuwarden preflight --level full --budget 900\n"
          "  gpuwarden preflight --checks xid,ecc,ib_port --json\n"
          "  gpuwarden preflight --root ./h100-node    (a folder written by gpuwarden record)\n\n"
          + exit_codes_epilog())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, metavar="DIR",
                   help="run on a recorded node (a scenario folder, see gpuwarden record) instead of this machine")
    p.add_argument("--checks", action="append", default=[], metavar="NAME[,NAME…]",
                   help="run only these checks, whatever their level (repeatable or comma-separated; "
                        "gpuwarden checks lists them); default: [agent] checks, else every check of the level")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--check-timeout", type=float, metavar="SECONDS",
                   help="per-check timeout (default: [agent] check_timeout_s; 0 = each check's own)")
    p.add_argument("--level", choices=("quick", "full"),
                   help="quick: non-disturbing checks, seconds; full: also the checks that load GPUs "
                        "and network (burn-in, NCCL, RDMA, DCGM diag), minutes (default: [agent] level, quick)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="overall time budget; checks not started in time are UNKNOWN "
                        "(default: [agent] budget_s; 0 = none)")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    # At run, not at load: `preflight --help` loads no check and no config (tests/test_cli_startup.py). Each line's
    # figure is what it adds after the ones above it (python -X importtime, least of three on a loaded machine).
    from gpuwarden import checks  # +21 ms
    from gpuwarden.agent.cli.node import node as node_at  # +93 ms (node.host: NVML, sysfs, the tools' runner)
    from gpuwarden.agent.core import config as config_mod  # +20 ms
    from gpuwarden.agent.core.model import Report  # +9 ms
    from gpuwarden.agent.core.render import Progress  # +11 ms
    from gpuwarden.agent.node.runner import run_checks  # +50 ms

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
    node = node_at(args.root)
    progress = Progress() if not args.json else None
    try:
        with tools_end_on_signals():
            results = run_checks(node, specs, cfg, progress, budget_s=cfg.agent["budget_s"] or None)
    finally:
        if progress:
            progress.close()
    report = Report(node.hostname, tuple(results), str(args.root) if args.root else "live")
    log.debug("preflight done", node=node.hostname, status=report.status.value, exit_code=report.exit_code)
    return emit(report, args.json)

"""`gpuwarden record`: what the checks read on this machine (or a recorded node), written to a folder: a support
bundle, and a recorded node that `preflight --root` and `run --root` replay."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpuwarden.agent.cli.flags import log_flags
from gpuwarden.agent.cli.interrupt import tools_end_on_signals
from gpuwarden.agent.cli.node import node as node_at
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.config_values import coerce
from gpuwarden.agent.node.record import record
from gpuwarden.checks import all_specs

log = logs.get_logger("gpuwarden")

DESCRIPTION = ("Write what the checks read on this machine (NVML, sysfs, the kernel log; with --with-tools the "
               "tools' outputs) to a folder: a support bundle, and a recorded node that preflight --root and "
               "run --root replay.")
EPILOG = ("examples:\n"
          "  gpuwarden record --out /tmp/node17\n"
          "  gpuwarden record --out /tmp/node17 --with-tools --budget 1200")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (required)")
    p.add_argument("--root", type=Path, metavar="DIR",
                   help="re-record an existing scenario instead of this machine")
    p.add_argument("--with-tools", action="store_true",
                   help="also run the full-level checks' tools (DCGM diag, NCCL, nvbandwidth, ib_write_bw, burn-in) "
                        "and record their outputs: minutes, loads the GPUs and the network")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML config: the tools' options and timeouts (default: /etc/gpuwarden/gpuwarden.toml if "
                        "present)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="with --with-tools: checks not started in time are not recorded (default: none)")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(all_specs(), args.config, explicit=args.config is not None)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    budget = None
    if args.budget is not None:  # checked as agent.budget_s is, but only this flag bounds a recording
        budget = coerce("agent.budget_s", args.budget, 0.0, "command line", name="--budget") or None
    with tools_end_on_signals():
        problems = record(node_at(args.root), args.out, cfg, with_tools=args.with_tools, budget_s=budget)
    for problem in problems:
        log.warning("could not record", problem=problem)
    log.info("recorded", out=str(args.out), problems=len(problems))
    print(f"recorded {args.out}" + (f" ({len(problems)} part(s) could not be read; see log)" if problems else ""))
    return 0

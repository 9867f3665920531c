"""`gpuwarden sweep`: its options, and the config it runs with; the sweep itself is agent/fleet/sweep/command.py."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpuwarden.agent.cli.flags import CONFIG_HELP, exit_codes_epilog, log_flags, options
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.fleet.sweep import command as sweep_command
from gpuwarden.checks import all_specs

DESCRIPTION = ("Test idle nodes with multi-node nccl-tests collectives, launched through the scheduler as "
               "low-priority preemptible jobs (srun) or with mpirun where there is none: groups within each "
               "NVLink domain, then across domains over the InfiniBand fabric. Small messages are judged on p95 "
               "latency, large ones on bus bandwidth; a failing group's culprit (a node, or the link between "
               "two) is found with a few more collectives. Each node's verdict is written for its daemon.")
EPILOG = ("examples:\n"
          "  gpuwarden sweep                        every idle node the scheduler knows\n"
          "  gpuwarden sweep --nodes n1,n2,n3,n4 --json\n"
          "  gpuwarden sweep --plan                 the groups it would run, and nothing else\n"
          "  gpuwarden sweep --hosts h1,h2,h3,h4    no scheduler: mpirun over these hosts\n\n"
          + exit_codes_epilog(sweep_command.EXIT_CODES))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", action="append", default=[], metavar="NAME[,NAME…]",
                   help="test only these of the idle nodes (repeatable or comma-separated)")
    p.add_argument("--hosts", action="append", default=[], metavar="NAME[,NAME…]",
                   help="no scheduler: the hosts to test with mpirun, taken as idle (repeatable or comma-separated)")
    p.add_argument("--plan", action="store_true", help="print the groups of the first rounds and run nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--results-dir", type=Path, metavar="DIR", help="verdicts and reports (default: [sweep] "
                                                                   "results_dir)")
    p.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the local adapter's folder (default: [agent] "
                                                                 "state_dir)")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(all_specs(), args.config, explicit=args.config is not None)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    return sweep_command.run(options(args, sweep_command.Options), cfg)

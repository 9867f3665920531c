"""`gpuwarden topology`: its options, the config and the scheduler adapter it runs with; what it does is
agent/node/topology_command.py (this node's NVLink domain, its publishing, and Slurm's block topology)."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpuwarden.agent.act.adapters import build
from gpuwarden.agent.cli.flags import options
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.node import topology_command
from gpuwarden.checks import all_specs

DESCRIPTION = ("Print this node's NVLink domain (from NVML's GPU fabric info, or [topology] domain), publish it to "
               "the scheduler (a Slurm node feature, Kubernetes labels), or write Slurm's block topology from the "
               "scheduler's view of the fleet.")
EPILOG = ("examples:\n"
          "  gpuwarden topology\n"
          "  gpuwarden topology --publish\n"
          "  gpuwarden topology --slurm-conf /etc/slurm/topology.conf\n\n"
          "exit codes:\n"
          "  0  done\n"
          "  1  no NVLink domain known for this node\n"
          "  2  usage, config, scheduler or file error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, help="read a recorded node (scenario folder) instead of this machine")
    parser.add_argument("--config", type=Path, help="TOML config (default /etc/gpuwarden/gpuwarden.toml if present)")
    parser.add_argument("--node-name", help="this node's name at the scheduler (default: [remediation] node_name, "
                                            "else the hostname)")
    parser.add_argument("--publish", action="store_true",
                        help="publish this node's NVLink domain to the scheduler (Slurm node feature, k8s labels)")
    parser.add_argument("--slurm-conf", type=Path, metavar="PATH",
                        help="write Slurm topology.conf (topology/block) from the scheduler's view of the fleet")
    parser.add_argument("--slurm-yaml", type=Path, metavar="PATH",
                        help="write Slurm topology.yaml (Slurm >= 25.05) from the scheduler's view of the fleet")
    parser.add_argument("--block-sizes", metavar="N[,N…]",
                        help="Slurm BlockSizes: the base size, then the base times powers of two (e.g. 16,32); "
                             "default: the smallest block's size, doubled until one size spans every block")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="the local adapter's folder (default: /var/lib/gpuwarden)")
    parser.add_argument("--log-format", choices=("auto", "json", "console"),
                        help="log format (default: [agent] log_format, auto)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        help="log level (default: [agent] log_level, info)")


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(all_specs(), args.config, explicit=args.config is not None)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    name = cfg.remediation["adapter"]
    state_dir = Path(args.state_dir or cfg.agent["state_dir"])
    opts = options(args, topology_command.Options)
    return topology_command.run(opts, cfg, build(name, cfg.remediation.get(name, {}), state_dir))

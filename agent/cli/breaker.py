"""`gpuwarden breaker reset`: close a latched circuit breaker, through the node's state store."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpuwarden.agent.act.remediation_breaker import RESET_AT_KEY
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core.model import EXIT_PASS
from gpuwarden.agent.state.store import record_meta

DESCRIPTION = ("The circuit breaker: when too large a share of the fleet or of one NVLink domain is drained "
               "within a window ([remediation.breaker]), the daemon holds new cordons and latches open.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    brk_sub = p.add_subparsers(dest="breaker_command", required=True, title="commands", metavar="COMMAND")
    reset = brk_sub.add_parser("reset", help="close a latched breaker: the running daemon judges the fleet again, "
                                             "counting only drains after now",
                               formatter_class=p.formatter_class,
                               description="Close a latched breaker: the running daemon judges the fleet again, "
                                           "counting only drains after now.")
    reset.add_argument("--state-dir", type=Path, metavar="DIR", help="the daemon's state folder (default: "
                                                                     "/var/lib/gpuwarden)")


def run(args: argparse.Namespace) -> int:
    """`gpuwarden breaker reset`: records the reset time in the node's state store; the running daemon reads it at
    its next turn, closes the breaker and judges the fleet again, counting only drains after this time."""
    state_dir = Path(args.state_dir or config_mod.AGENT_DEFAULTS["state_dir"])
    now = time.time()
    record_meta(state_dir / "state.db", RESET_AT_KEY, now)
    print(f"circuit breaker reset at {now:.0f}: drains before now no longer count; the daemon judges the fleet "
          "again at its next turn")
    return EXIT_PASS

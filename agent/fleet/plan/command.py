"""`gpuwarden plan`: fleet planning from numbers, nothing on this machine read and nothing acted on.

  plan capacity   usable nodes per slice size as node unavailability grows (agent/fleet/plan/capacity.py)
  plan risk       rack MTBI from node MTBI, P(at least one failure) for a job (agent/fleet/plan/risk.py)
  plan simulate   a fleet through simulated days, the real state machine and spare policy (agent/fleet/plan/simulate.py)
  plan defrag     the least disruptive preemptible jobs to move so one rack has a free slice
  (agent/fleet/plan/defrag.py)

Each part's module has `add_arguments(parser)` and `run(args) -> int`; this module only wires them under one
command, each imported when its subcommand is chosen (or every one, for the man page)."""
from __future__ import annotations

import argparse
import importlib
from typing import Any

PARTS = (
    ("capacity", "capacity", "usable nodes per slice size as node unavailability grows (table, --json, --plot)"),
    ("risk", "risk", "rack MTBI from node MTBI; the chance a job of N GPUs over T days meets a failure"),
    ("simulate", "simulate", "simulate a fleet through days: failures, repairs, spares, slices, the breaker"),
    ("defrag", "defrag", "the least disruptive preemptible jobs to move so one rack has a free slice"),
)


def add_parser(sub: Any, formatter: Any, log_flags: Any, chosen: str | None = "*") -> None:
    """`gpuwarden plan` with the options of the part `chosen` ("*": of every part; None: of none, as for
    `plan --help`): a part's module is imported only to build its own options."""
    p = sub.add_parser("plan", help="fleet planning: slice-size capacity, failure risk, simulation, defrag",
                       formatter_class=formatter,
                       description="Fleet planning from numbers: what slice size and how many spares per rack, "
                                   "what a policy does over simulated weeks, which jobs to move to free a rack. "
                                   "Reads nothing on this machine and acts on nothing.")
    plan = p.add_subparsers(dest="plan_command", required=True, title="parts", metavar="PART")
    for name, module_name, summary in PARTS:
        if chosen not in ("*", name):
            plan.add_parser(name, help=summary, formatter_class=formatter)
            continue
        module = importlib.import_module(f"gpuwarden.agent.fleet.plan.{module_name}")
        part = plan.add_parser(name, help=summary, formatter_class=formatter, description=_description(module, summary))
        module.add_arguments(part)
        if "--json" not in part._option_string_actions:
            part.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if "--log-format" not in part._option_string_actions:
            log_flags(part)
        part.set_defaults(plan_run=module.run)


def _description(module: Any, summary: str) -> str:
    """The first paragraph of the part's module docstring, as a sentence (less a leading "`gpuwarden plan X`: ")."""
    text = " ".join((module.__doc__ or summary).strip().split("\n\n")[0].split())
    if text.startswith("`") and "`: " in text:
        text = text.split("`: ", 1)[1]
    return text[:1].upper() + text[1:]


def run(args: argparse.Namespace) -> int:
    from gpuwarden.agent.core import logs

    logs.setup(getattr(args, "log_format", None) or "auto", getattr(args, "log_level", None) or "info")
    return args.plan_run(args)

"""`gpuwarden plan`: fleet planning from numbers, nothing on this machine read and nothing acted on.

  plan capacity   usable nodes per slice size as node unavailability grows (agent/fleet/plan/capacity.py)
  plan risk       rack MTBI from node MTBI, P(at least one failure) for a job (agent/fleet/plan/risk.py)
  plan simulate   a fleet through simulated days, the real state machine and spare policy (agent/fleet/plan/simulate.py)
  plan defrag     the least disruptive preemptible jobs to move so one rack has a free slice
  (agent/fleet/plan/defrag.py)

Each part's options are here; its module (`Options`, `run(options) -> int`) is imported when its part is chosen
(or every one, for the man page), and gives the part's description (the first paragraph of its docstring)."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from gpuwarden.agent.cli.flags import exit_codes_epilog, log_flags, options
from gpuwarden.agent.core import logs

EVERY = "*"  # add_arguments(part=EVERY): every part's options
DESCRIPTION = ("Fleet planning from numbers: what slice size and how many spares per rack, what a policy does over "
               "simulated weeks, which jobs to move to free a rack. Reads nothing on this machine and acts on nothing.")


def _capacity(p: argparse.ArgumentParser, module: Any) -> None:
    p.add_argument("--racks", default="128", metavar="R", help="racks (NVLink domains) in the fleet (default 128)")
    p.add_argument("--nodes-per-rack", default="18", metavar="N", help="nodes per rack (default 18: NVL72 trays)")
    p.add_argument("--slice", default="8,9,16,18", metavar="S[,S…]",
                   help="slice sizes in nodes, each placed within one rack (default 8,9,16,18)")
    p.add_argument("--unavailable", default="0..10", metavar="P[,A..B[:STEP]…]",
                   help="node unavailability in percent: values, and ranges A..B every STEP points (default step "
                        f"{module.DEFAULT_STEP:g}); default 0..10")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw usable nodes vs unavailability, one line per slice size (needs the 'plot' extra)")


def _risk(p: argparse.ArgumentParser, module: Any) -> None:
    p.add_argument("--node-mtbi-days", default="490", metavar="DAYS",
                   help="mean time between interruptions of one node, in days (default 490)")
    p.add_argument("--nodes-per-rack", default="18", metavar="N", help="nodes per rack (default 18: NVL72 trays)")
    p.add_argument("--racks", default="128", metavar="R", help="racks in the fleet (default 128)")
    p.add_argument("--gpus", default="256,1024", metavar="G[,G…]", help="job sizes in GPUs (default 256,1024)")
    p.add_argument("--days", default="30", metavar="T[,T…]", help="job lengths in days (default 30)")
    p.add_argument("--afr", default="1", metavar="PERCENT",
                   help="annual failure rate of one GPU, in percent (default 1)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")


def _simulate(p: argparse.ArgumentParser, module: Any) -> None:
    p.add_argument("--racks", default="128", metavar="R", help="racks, each one NVLink domain (default 128)")
    p.add_argument("--nodes-per-rack", default="18", metavar="N", help="nodes per rack (default 18)")
    p.add_argument("--days", default="30", metavar="D", help="simulated days (default 30)")
    p.add_argument("--policy", action="append", default=[], metavar="spares=K,slice=S",
                   help="a placement policy: K spares held in each rack's pool, slices of S nodes within one rack "
                        "(repeatable, compared side by side; default: spares=2,slice=16 and spares=0,slice=18)")
    p.add_argument("--mtbi-days", default="490", metavar="DAYS",
                   help="mean time between interruptions of one node (default 490)")
    p.add_argument("--repair-hours", default="48", metavar="H",
                   help="median time from a failure to the node's repair (lognormal; default 48)")
    p.add_argument("--repair-sigma", default="0.8", metavar="SIGMA",
                   help="the repair time's lognormal shape; 0: every repair takes the median (default 0.8: one in "
                        "ten repairs takes more than 2.8 times the median)")
    p.add_argument("--restart-minutes", default="10", metavar="M",
                   help="a slice placed again works after this long (its checkpoint reloaded; default 10)")
    p.add_argument("--breaker-reset-hours", default="2", metavar="H",
                   help="the operator resets a tripped circuit breaker this long after it trips; 0: never (default 2)")
    p.add_argument("--burst", action="append", default=[], metavar="RACK:NODES@HOURS",
                   help="NODES nodes of rack RACK (from 0) fail at once HOURS into the run, a rack-level event "
                        "(repeatable)")
    p.add_argument("--gpus-per-node", default="4", metavar="G",
                   help="GPUs per node; each slice runs one job on all its nodes' GPUs (default 4: a GB200 NVL72 "
                        "compute tray)")
    p.add_argument("--checkpoint-minutes", default="60", metavar="M",
                   help="a job checkpoints this often from the moment it works; a failure loses the work since "
                        "(default 60)")
    p.add_argument("--watchdog-minutes", default="10", metavar="M",
                   help="a doomed job left alone ends when PyTorch's NCCL watchdog fires, this long after the fault "
                        "(default 10: the process group's default timeout)")
    p.add_argument("--abort-seconds", default="2", metavar="S",
                   help="gpuwarden ends a doomed job this long after its requeue is carried out (the fault's "
                        "detection and the scheduler's calls; default 2)")
    p.add_argument("--job-response", default="fast-abort", metavar="fast-abort|watchdog",
                   help="the timeline simulated: gpuwarden ends doomed jobs, or every one waits for its watchdog; "
                        "the job rows charge each interruption both ways either way (default fast-abort)")
    p.add_argument("--seed", default="1", metavar="N", help="random seed: the same seed, the same report (default 1)")
    p.add_argument("--plot", type=Path, metavar="OUT.png",
                   help="draw usable capacity over time, one line per policy (needs the `plot` extra)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON instead of a table")


def _defrag(p: argparse.ArgumentParser, module: Any) -> None:
    p.add_argument("--slice", type=str, required=True, metavar="S",
                   help="nodes the pending slice needs, all in one rack (NVLink domain)")
    p.add_argument("--squeue", type=Path, metavar="FILE", help="`squeue --json` saved to a file (with --sinfo; "
                                                               "default: ask Slurm now)")
    p.add_argument("--sinfo", type=Path, metavar="FILE", help="`sinfo --json` saved to a file (with --squeue)")
    p.add_argument("--partitions", type=Path, metavar="FILE",
                   help="`scontrol show partition -o` saved to a file: the PreemptMode of each partition, for the "
                        "default of --preemptible-partitions")
    p.add_argument("--preemptible-partitions", action="append", default=[], metavar="P[,P…]",
                   help="jobs of these partitions may be moved (default: the partitions whose PreemptMode is "
                        "REQUEUE or CANCEL)")
    p.add_argument("--preemptible-qos", action="append", default=[], metavar="Q[,Q…]",
                   help="jobs of these QOS may be moved too")
    p.add_argument("--interactive-partitions", action="append", default=[], metavar="P[,P…]",
                   help="jobs of these partitions are never moved (salloc/srun jobs never are, wherever they run)")
    p.add_argument("--use-spares", action="store_true",
                   help="count the rack's spares (drained `gpuwarden: spare`) as free nodes")
    p.add_argument("--now", type=str, metavar="EPOCH",
                   help="the time the elapsed time of jobs is counted to (default: now; for saved files, when "
                        "they were saved)")
    p.add_argument("--slurm-conf", type=Path, metavar="FILE", help="the cluster to ask (default: SLURM_CONF, or "
                                                                   "Slurm's own default)")
    if not any(a.dest == "json" for a in p._actions):
        p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


# Each part: its name, its help line, its options, and its module (agent/fleet/plan/NAME.py).
PARTS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser, Any], None]], ...] = (
    ("capacity", "usable nodes per slice size as node unavailability grows (table, --json, --plot)", _capacity),
    ("risk", "rack MTBI from node MTBI; the chance a job of N GPUs over T days meets a failure", _risk),
    ("simulate", "simulate a fleet through days: failures, repairs, spares, slices, the breaker", _simulate),
    ("defrag", "the least disruptive preemptible jobs to move so one rack has a free slice", _defrag),
)


def add_arguments(p: argparse.ArgumentParser, part: str | None = EVERY) -> None:
    """`gpuwarden plan` with the options of the part `part` (EVERY: of every part; None: of none, as for
    `plan --help`): a part's module is imported only to build its own options."""
    formatter = p.formatter_class
    plan = p.add_subparsers(dest="plan_command", required=True, title="parts", metavar="PART")
    for name, summary, _ in PARTS:
        if part not in (EVERY, name):
            plan.add_parser(name, help=summary, formatter_class=formatter)
            continue
        sub = plan.add_parser(name, help=summary, formatter_class=formatter)
        module = part_arguments(sub, name)
        sub.description = _description(module, summary)
        codes = getattr(module, "EXIT_CODES", None)  # a part whose exit status says more than ok/bad input
        if codes:
            sub.epilog = exit_codes_epilog(codes)


def part_arguments(p: argparse.ArgumentParser, name: str) -> ModuleType:
    """The options of the plan part `name` on `p`, and its module, which runs it (run_part)."""
    # at use: one part's module; after capacity, risk +14 ms, simulate +46 ms, defrag (the Slurm adapter) +178 ms
    # (least of three, at load average 11 on 2 cores); tests/test_cli_startup.py holds it
    module = importlib.import_module(f"gpuwarden.agent.fleet.plan.{name}")
    dict((n, add) for n, _, add in PARTS)[name](p, module)
    if "--json" not in p._option_string_actions:
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    if "--log-format" not in p._option_string_actions:
        log_flags(p)
    p.set_defaults(plan_part=module)
    return module


def _description(module: Any, summary: str) -> str:
    """The first paragraph of the part's module docstring, as a sentence (less a leading "`gpuwarden plan X`: ")."""
    text = " ".join((module.__doc__ or summary).strip().split("\n\n")[0].split())
    if text.startswith("`") and "`: " in text:
        text = text.split("`: ", 1)[1]
    return text[:1].upper() + text[1:]


def run_part(args: argparse.Namespace) -> int:
    """The chosen part, with its flags as its module's Options."""
    module = args.plan_part
    return module.run(options(args, module.Options))


def run(args: argparse.Namespace) -> int:
    logs.setup(getattr(args, "log_format", None) or "auto", getattr(args, "log_level", None) or "info")
    return run_part(args)

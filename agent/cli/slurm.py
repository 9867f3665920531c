"""`gpuwarden slurm healthcheck|prolog|epilog`: the quick preflight as Slurm's HealthCheckProgram, Prolog or Epilog,
acting on this node's Slurm state itself (Slurm drains nothing on a failing health check; it drains on a failing
Prolog/Epilog, but with its own unreadable reason).

What it decides, from the verdict of the preflight within a budget that fits Slurm's limits:
- FAIL: drain this node with `gpuwarden: preflight: <the worst finding>` (its own mark), unless someone else holds
  the node out already (an administrator, NHC, the gpuwarden daemon's own cordon or quarantine): that drain is kept.
- pass (OK or WARN): resume the node only when it is drained with the preflight's own mark; any other drain stays.
- UNKNOWN (a check could not look): `--on-unknown leave` (default) changes nothing and says which check and why;
  `--on-unknown drain` drains with `gpuwarden: preflight: unknown: <checks>`, resumed like a FAIL once all can look.
Exit codes: 0 pass (a Prolog lets the job start); 1 FAIL (a Prolog or Epilog that exits 1 makes Slurm requeue the
job held and keep the node drained); 2 could not decide or could not reach slurmctld (health check only: a Prolog or
Epilog that leaves the node as it is exits 0, since any other code makes Slurm drain the node). docs/slurm.md."""
from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from gpuwarden import checks
from gpuwarden.agent.act.adapters.slurm import SlurmAdapter, reason_text
from gpuwarden.agent.act.remediation import finding_text
from gpuwarden.agent.cli.flags import CONFIG_HELP, log_flags
from gpuwarden.agent.cli.interrupt import tools_end_on_signals
from gpuwarden.agent.cli.node import node as node_at
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.config_values import coerce
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.model import EXIT_FAULT, EXIT_PASS, EXIT_UNDECIDED, CheckResult, Report, Status
from gpuwarden.agent.core.scheduler import AdapterError
from gpuwarden.agent.node.runner import run_checks

log = logs.get_logger("gpuwarden.slurm")

PREFLIGHT_MARK = "preflight:"  # after REASON_PREFIX: a drain this path wrote, and so the only one it resumes
PREFLIGHT_REASON = "gpuwarden: preflight:"
# Budgets (seconds) for the checks, per mode. slurmd kills a HealthCheckProgram after 60 s (slurm.conf(5)); the
# budget leaves room for the interpreter's start and up to three Slurm tool calls (SCONTROL_TIMEOUT_S each). A
# Prolog is "expected to complete quickly (in less time than MessageTimeout)", 10 s by default, and every job
# waits for it; the Epilog holds the node in COMPLETING.
BUDGET_S = {"healthcheck": 35.0, "prolog": 8.0, "epilog": 8.0}
SCONTROL_TIMEOUT_S = 5.0
MAX_NAME = 64
# slurmctld's reason on a DOWN node that stopped answering: it clears it itself, so a drain of ours may replace it.
SLURM_NOT_RESPONDING = "Not responding"


DESCRIPTION = ("Run the quick preflight within a budget that fits Slurm's limits and act on this node's Slurm "
               "state: a FAIL drains it with a 'gpuwarden: preflight: ...' reason, a pass resumes it only when "
               "that reason is gpuwarden's preflight's (never an administrator's, NHC's or the daemon's drain). "
               "Slurm ignores a health check's exit code, so this command drains the node itself.")
EPILOG = ("slurm.conf (the scripts set PATH, which slurmd does not;\n"
          "docs: /usr/share/doc/gpuwarden/docs/slurm.md):\n"
          "  HealthCheckProgram=/usr/lib/gpuwarden/slurm-healthcheck\n"
          "  Prolog=/usr/lib/gpuwarden/slurm-prolog\n"
          "  Epilog=/usr/lib/gpuwarden/slurm-epilog\n\n"
          "exit codes:\n"
          "  0  pass (or, for a Prolog/Epilog, could not decide: any other exit makes Slurm drain with "
          "'Prolog error')\n"
          "  1  FAIL: the node is drained (Prolog/Epilog: Slurm requeues the job and keeps our reason)\n"
          "  2  health check only: could not decide, or could not reach slurmctld")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=("healthcheck", "prolog", "epilog"),
                   help="healthcheck: HealthCheckProgram (budget 35 s of Slurm's 60 s); prolog / epilog: Prolog / "
                        "Epilog (budget 8 s)")
    p.add_argument("--node", metavar="NAME",
                   help="this node's Slurm name (default: SLURMD_NODENAME, which slurmd sets, else [remediation] "
                        "node_name, else the short hostname)")
    p.add_argument("--on-unknown", choices=("leave", "drain"), default="leave",
                   help="when a check could not look: leave the node as it is and say why (default), or drain it "
                        "with 'gpuwarden: preflight: unknown: <checks>'")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="time budget of the checks (default per mode)")
    p.add_argument("--checks", action="append", default=[], metavar="NAME[,NAME…]",
                   help="run only these checks (default: the quick level)")
    p.add_argument("--scontrol-timeout", type=float, default=SCONTROL_TIMEOUT_S, metavar="SECONDS",
                   help=f"each sinfo/scontrol call is ended after this (default {SCONTROL_TIMEOUT_S:g})")
    p.add_argument("--root", type=Path, metavar="DIR",
                   help="judge a recorded node (scenario folder) instead of this machine")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help=CONFIG_HELP + "; [remediation.slurm] names scontrol, sinfo, slurm_conf")
    log_flags(p)


def node_name(explicit: str | None, cfg: Any, environ: dict[str, str] | None = None) -> str:
    """This node's Slurm name: what the caller says, else SLURMD_NODENAME (slurmd sets it for the health check,
    Prolog and Epilog, and it is the `-N` name when one slurmd runs under another name), else [remediation]
    node_name, else the short hostname (Slurm's own default NodeName lookup)."""
    environ = os.environ if environ is None else environ
    for name in (explicit, environ.get("SLURMD_NODENAME"), cfg.remediation.get("node_name")):
        if name:
            break
    else:
        name = socket.gethostname().split(".", 1)[0]
    if not (0 < len(name) <= MAX_NAME and name[0] != "-"
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)):
        raise GpuwardenError(f"node name {name!r} is not a single Slurm node name; give --node")
    return name


def worst_finding(results: tuple[CheckResult, ...]) -> Any:
    """The FAIL finding with the biggest hammer (the report's order breaks a tie), or None."""
    best = None
    for r in results:
        for f in r.findings:
            if f.status is Status.FAIL and (best is None or f.action > best.action):
                best = f
    return best


def reason_for(report: Report) -> str:
    """`gpuwarden: preflight: xid 79 GPU2 0018:01:00.0`: the agent's compact finding form, behind the preflight's mark
    (cleaned and cut to the adapter's limit by the adapter)."""
    finding = worst_finding(report.results)
    if finding is not None:
        body = finding_text(finding.to_dict()) or finding.message
    else:  # a check that failed with no finding of its own
        body = " ".join(r.check for r in report.results if r.status is Status.FAIL) + " failed"
    return reason_text(f"{PREFLIGHT_MARK} {body}")


def unknown_reason(report: Report) -> str:
    names = [r.check for r in report.results if r.status is Status.UNKNOWN]
    return reason_text(f"{PREFLIGHT_MARK} unknown: {' '.join(names)}")


def _summary(report: Report) -> str:
    fails = [f for r in report.results for f in r.findings if f.status is Status.FAIL]
    unknown = [f"{r.check} ({(r.error or 'could not look')[:120]})" for r in report.results
               if r.status is Status.UNKNOWN]
    parts = [report.status.value.upper()]
    worst = worst_finding(report.results)
    if worst is not None:

        parts.append(finding_text(worst.to_dict()) + (f" and {len(fails) - 1} more finding(s)" if len(fails) > 1
                                                        else ""))
    if unknown:
        parts.append("could not look: " + "; ".join(unknown))
    return ", ".join(parts)


def _held(state: str) -> bool:
    """Out of service: drained, draining, down, failing (`drained*`: and not answering)."""
    return any(word in state for word in ("drain", "down", "fail"))


def act(adapter: Any, node: str, report: Report, on_unknown: str) -> tuple[int, str]:
    """(exit code, what was done) for `report` on `node`. Nothing is sent when nothing is to change; a drain or
    resume goes through the Slurm adapter, which checks the node again before it writes."""
    code = report.exit_code
    if code == EXIT_UNDECIDED and on_unknown == "leave":
        return EXIT_UNDECIDED, "node left as it is (could not decide; --on-unknown leave)"
    state, reason = adapter.state_and_reason(node)
    ours = reason.startswith(PREFLIGHT_REASON)
    if code == EXIT_PASS:
        if ours and _held(state):
            adapter.resume(node)
            return EXIT_PASS, f"resumed (was: {reason})"
        return EXIT_PASS, "nothing to do" + (f" (held by someone else: {reason}; left)" if reason else "")
    text = reason_for(report) if code == EXIT_FAULT else unknown_reason(report)
    if reason and not ours and reason != SLURM_NOT_RESPONDING:
        return code, f"already held out by someone else ({reason}); left as it is"
    if reason == text and "drain" in state:
        return code, f"drained already: {text}"
    adapter.drain(node, text)
    return code, f"drained: {text}"


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.load((), args.config, explicit=args.config is not None, names=checks.NAMES, forms=checks.forms)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    budget = args.budget if args.budget is not None else BUDGET_S[args.mode]
    budget = coerce("agent.budget_s", budget, 0.0, "command line", name="--budget")
    timeout = coerce("agent.budget_s", args.scontrol_timeout, 0.0, "command line", name="--scontrol-timeout")
    if not budget or not timeout:
        raise GpuwardenError("--budget and --scontrol-timeout must be more than 0")
    node = node_name(args.node, cfg)
    try:
        specs = checks.chosen([n for arg in args.checks for n in arg.split(",") if n], "quick")
    except ValueError as exc:
        raise GpuwardenError(str(exc)) from None
    config_mod.extend(cfg, checks.forms(s.name for s in specs))
    table = dict(cfg.remediation.get("slurm", {}))
    table["timeout_s"] = timeout  # Slurm's limit on this program is what bounds each call here
    try:
        adapter = SlurmAdapter(**table)
    except (TypeError, ValueError) as exc:
        raise GpuwardenError(f"[remediation.slurm]: {exc}") from None
    with tools_end_on_signals():
        results = run_checks(node_at(args.root), specs, cfg, None, budget_s=budget)
    report = Report(node, tuple(results), str(args.root) if args.root else "live")
    try:
        code, done = act(adapter, node, report, args.on_unknown)
    except AdapterError as exc:
        code, done = (report.exit_code if report.exit_code != EXIT_PASS else EXIT_UNDECIDED), f"slurmctld: {exc}"
    if args.mode != "healthcheck" and code == EXIT_UNDECIDED:
        # Any non-zero exit of a Prolog or Epilog makes Slurm drain the node ("Prolog error") and requeue the job:
        # right after a drain of ours (--on-unknown drain), not when the node is left as it is (could not decide,
        # or slurmctld could not be reached after a pass).
        code = EXIT_FAULT if done.startswith("drained") else EXIT_PASS
    line = f"gpuwarden slurm {args.mode} {node}: {_summary(report)}; {done}"
    # One line on stdout, the record: slurmd logs it when the program exits non-zero (`health_check failed: rc:1
    # output:...`); the same again in the log would only repeat it there.
    print(line, flush=True)
    log.debug("slurm " + args.mode, node=node, status=report.status.value, exit_code=code, done=done)
    return code


"""`gpuwarden status`: what the daemon recorded in its store (the node's state, each check's last result, the
remediation intents), read-only."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from gpuwarden.agent.act.remediation import STATUS_KEY
from gpuwarden.agent.act.remediation_breaker import RESET_AT_KEY
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.core.job import JobRef, jobs_in
from gpuwarden.agent.core.model import EXIT_PASS, EXIT_UNDECIDED
from gpuwarden.agent.core.render import iso_utc, seconds_text, when
from gpuwarden.agent.daemon.status_socket import store_writes
from gpuwarden.agent.jobs.respond import JOB_ACTION
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.store_errors import StoreError

DESCRIPTION = ("Print what the daemon recorded in its store: the node's state and its last transitions, each "
               "check's last result and findings, and the remediation intents (pending and recent). Read-only: "
               "it works while the daemon runs.")
EPILOG = ("examples:\n"
          "  gpuwarden status\n"
          "  gpuwarden status --json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="the daemon's state folder (default: "
                                                                 "/var/lib/gpuwarden)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def _remediation_view(record: Any, saved: Any, reset_at: Any, recent: list[dict[str, Any]]) -> dict[str, Any]:
    """What `status` says about remediation: the mode, the breaker, the recovery ladder's step (since when, and
    what its intent gave), the last spare swap."""
    saved = saved if isinstance(saved, dict) else {}
    step = getattr(record, "step", "") if record else ""
    outcome = None
    for p in reversed(recent):
        if step and p.get("action") == step:
            outcome = p.get("outcome") if p.get("done") is not None else "pending"
            break
    return {"mode": saved.get("mode", "dry-run"), "adapter": saved.get("adapter"), "domain": saved.get("domain"),
            "breaker": saved.get("breaker"), "breaker_reset_at": reset_at, "swap": saved.get("swap"),
            "scheduler_error": saved.get("scheduler_error"),
            "scheduler_error_since": saved.get("scheduler_error_since"),
            "scheduler_waiting": saved.get("scheduler_waiting"),
            "scheduler_waiting_since": saved.get("scheduler_waiting_since"),
            "ladder": {"step": step or None, "since": getattr(record, "step_since", None) if record else None,
                       "outcome": outcome}}


def _remediation_text(view: dict[str, Any], now: float) -> str:
    lines = [f"\nremediation: {view['mode']}" + (f" through {view['adapter']}" if view.get("adapter") else "")
             + (f", NVLink domain {view['domain']}" if view.get("domain") else "")
             + (" (intents are logged, not carried out)" if view["mode"] != "act" else "")]
    if view.get("scheduler_error"):
        lines.append(f"  scheduler unreachable since {when(view.get('scheduler_error_since'), now)}: "
                     f"{view['scheduler_error']} (retried; detection goes on)")
    if view.get("scheduler_waiting"):
        lines.append(f"  waiting since {when(view.get('scheduler_waiting_since'), now)}: "
                     f"{view['scheduler_waiting']} (the scheduler asks to come back later; retried)")
    breaker = view.get("breaker")
    if isinstance(breaker, dict):
        lines.append(f"  circuit breaker OPEN since {when(breaker.get('since'), now)}: {breaker.get('reason')} "
                     "(cordons wait; `gpuwarden breaker reset` once the cause is understood)")
    ladder = view["ladder"]
    if ladder.get("step"):
        lines.append(f"  recovery step: {ladder['step']} since {when(ladder.get('since'), now)}"
                     f" ({ladder.get('outcome') or 'pending'})"
                     + ("; waiting for repair" if ladder["step"] == "ticket" else ""))
    swap = view.get("swap")
    if isinstance(swap, dict) and swap.get("slice_must_move"):
        lines.append(f"  no spare left in {swap.get('domain')}: the slice must move (domains that could host it: "
                     f"{', '.join(swap.get('hosts') or []) or 'none'})")
    elif isinstance(swap, dict) and swap.get("spare"):
        lines.append(f"  spare {swap['spare']} of {swap.get('domain')} taken into service in this node's place")
    return "\n".join(lines) + "\n"


def _jobs_view(checks: list[Any], intents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs the `jobs` check last saw on the node, and the job actions of the journal: each job with what was
    done to it (a job the journal acted on that has left the node since is listed too)."""
    record = next((c for c in checks if c.name == "jobs"), None)
    seen = {j.job.key: j for j in jobs_in(record.state)} if record is not None else {}
    acted: dict[str, list[dict[str, Any]]] = {}
    for i in intents:
        job = i["detail"].get("job")
        # An intent whose job cannot be read (a journal edited by hand) is still listed, under "unknown:?".
        ref = JobRef.from_dict(job) if isinstance(job, dict) and "scheduler" in job and "id" in job \
            else JobRef("unknown", "?")
        acted.setdefault(ref.key, []).append({
            "key": i["key"], "rule": i["detail"].get("rule"), "reason": i["detail"].get("reason"),
            "policy": i["detail"].get("policy"), "fault_at": i["detail"].get("fault_at"), "created": i["created"],
            "done": i["done"], "outcome": i["outcome"] if i["done"] is not None else "pending"})
    out = []
    for key in [*seen, *(k for k in acted if k not in seen)]:
        job = seen.get(key)
        out.append({"job": key, "on_node": job is not None, "gpus": list(job.gpu_indices) if job else [],
                    "ranks": list(job.ranks) if job else [], "ports": list(job.ports) if job else [],
                    "effective_ib_timeout_s": job.effective_ib_timeout_s.to_dict()["value"] if job else None,
                    "watchdog_s": job.watchdog_s.value if job else None, "actions": acted.get(key, [])})
    return out


def _jobs_text(jobs: list[dict[str, Any]], now: float) -> str:
    if not jobs:
        return ""
    lines = ["\njobs on the node (the jobs check's last look) and what was done to them:"]
    for j in jobs:
        where = (f"GPUs {','.join(map(str, j['gpus'])) or '-'}, ranks {','.join(map(str, j['ranks'])) or '-'}, IB "
                 f"timeout {seconds_text(j['effective_ib_timeout_s'])}" if j["on_node"] else "no longer on the node")
        lines.append(f"  {j['job']}: {where}")
        for a in j["actions"]:
            lines.append(f"    {when(a['created'], now)} doomed by {a['reason']}: {a['policy']} -> {a['outcome']}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:


    cfg_dir = Path(args.state_dir or config_mod.AGENT_DEFAULTS["state_dir"])
    db = cfg_dir / "state.db"
    if not db.exists():
        raise GpuwardenError(f"{db}: no daemon state here (is `gpuwarden run` using another --state-dir?)")
    # Read-only: status never creates, locks, repairs or waits on the daemon's database. What cannot be read is
    # said (the daemon sets such a database aside at its next start), never a traceback.
    store = Store(db, readonly=True)
    problems: list[str] = []

    def read(what: str, fn: Any, default: Any) -> Any:
        try:
            return fn()
        except StoreError as exc:
            problems.append(f"{what}: {exc}")
            return default

    try:
        record = read("node record", store.node, None)
        checks = read("checks", store.checks, [])
        transitions = read("transitions", lambda: store.transitions(10), [])
        pending = read("intents", lambda: store.intents(pending_only=True), [])
        # One read of the journal's newest entries: the last ten shown, the job intents among them all.
        intents = read("intents", lambda: store.intents(limit=1000), [])
        recent = intents[-10:]
        job_intents = [i for i in intents if i["action"] == JOB_ACTION]
        remediation = read("meta", lambda: store.meta(STATUS_KEY), None)
        reset_at = read("meta", lambda: store.meta(RESET_AT_KEY), None)
        store_notes = [n for n in (read("meta", lambda: store.meta("store_fault"), None),
                                   read("meta", lambda: store.meta("store_set_aside"), None)) if n]
    finally:
        store.close()
    now = time.time()
    # What the file cannot say: whether the running daemon's writes into it succeed (agent/daemon/status_socket.py).
    writes, writes_text, writes_failing = store_writes(cfg_dir, now)
    jobs = _jobs_view(checks, job_intents)
    if args.json:
        # The epoch numbers stay (a contract); each time also comes as ISO 8601 UTC under the same name + "_utc".
        node = record.to_dict() if record else None
        if node is not None:
            node.update({f"{k}_utc": iso_utc(node[k]) for k in ("since", "fault_since", "clear_since")})
        print(json.dumps({
            "node": node,
            "now": now, "now_utc": iso_utc(now),
            "checks": [{"check": c.name, "status": c.status.value, "error": c.error, "updated": c.updated,
                        "updated_utc": iso_utc(c.updated),
                        "findings": [f.to_dict() for f in c.findings]} for c in checks],
            "transitions": [{"at": t.at, "at_utc": iso_utc(t.at), "from": t.frm.value, "to": t.to.value,
                             "reason": t.reason, "actions": list(t.actions)} for t in transitions],
            "pending_intents": [{**p, "created_utc": iso_utc(p.get("created"))} for p in pending],
            "intents": [{**p, "created_utc": iso_utc(p.get("created")), "done_utc": iso_utc(p.get("done"))}
                        for p in recent],
            "remediation": _remediation_view(record, remediation, reset_at, recent),
            "jobs": jobs, "store": store_notes, "store_writes": writes, "unreadable": problems}, indent=2))
        return EXIT_UNDECIDED if problems or writes_failing else EXIT_PASS
    out = sys.stdout
    out.write(writes_text)
    out.write(f"node state: {record.state.value if record else 'unknown'}"
              + (f" since {when(record.since, now)}: {record.reason}" if record else "") + "\n\n")
    for c in checks:
        out.write(f"{c.name:<14} {c.status.value:<8} updated {when(c.updated, now)}"
                  + (f"  {c.error}" if c.error else "") + "\n")
        for f in c.findings:
            out.write(f"  {f.status.value:<7} {f.action.name:<11} {f.code:<28} {f.entity.label()}\n")
    if transitions:
        out.write("\nrecent transitions (newest first):\n")
        for t in transitions:
            out.write(f"  {when(t.at, now)} {t.frm.value} -> {t.to.value}: {t.reason} {list(t.actions)}\n")
    out.write(_remediation_text(_remediation_view(record, remediation, reset_at, recent), now))
    out.write(_jobs_text(jobs, now))
    if pending:
        out.write("\npending actions:\n")
        for p in pending:
            out.write(f"  {p['action']} since {when(p.get('created'), now)}\n")
    done = [p for p in recent if p.get("done") is not None]
    if done:
        out.write("\nrecent actions (oldest first):\n")
        for p in done:
            out.write(f"  {when(p.get('done'), now)} {p['action']}: {p.get('outcome') or 'done'}\n")
    for note in store_notes:
        if isinstance(note, dict) and "detail" in note:
            out.write(f"\nstate store: {note['detail']}\n")
        elif isinstance(note, dict):
            out.write(f"\nstate store: writes failed from {when(note.get('since'), now)} to "
                      f"{when(note.get('until'), now)}: {note.get('error')} (detection went on; the pending state "
                      "was written once it could be)\n")
    for problem in problems:
        out.write(f"\nunreadable in {db}: {problem} (`gpuwarden run` sets this database aside at its next start)\n")
    return EXIT_UNDECIDED if problems or writes_failing else EXIT_PASS

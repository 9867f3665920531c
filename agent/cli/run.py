"""Wiring of `gpuwarden run` (daemon, HTTP endpoint, signals, systemd, remediation) and `gpuwarden status`."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import select
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, GpuwardenError
from gpuwarden.agent.core.model import EXIT_PASS, EXIT_UNDECIDED
from gpuwarden.agent.state.store import Store, StoreError, record_meta

if TYPE_CHECKING:  # the daemon's stack is imported by run_daemon: `status` and `breaker reset` read only the store
    from gpuwarden.agent.act.remediation import Settings
    from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
    from gpuwarden.agent.daemon.loop import Daemon

log = logs.get_logger("gpuwarden")
TEXTFILE_EVERY_S = 15.0
IDLE_WAKE_S = 60.0  # the main loop's wake-up without a watchdog or textfile to serve (signals wake it at once)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def run_daemon(args: argparse.Namespace) -> int:
    from gpuwarden.agent.cli.main import _node
    from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint, raise_fd_limit
    from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
    from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
    from gpuwarden.agent.jobs.evidence_window import serving
    from gpuwarden.agent.node.retest import run_retest
    from gpuwarden.agent.sources.systemd import name_this_thread, notify, watchdog_interval_s
    from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE

    specs = daemon_forms()
    cfg = load_config(specs, args)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    state_dir = Path(args.state_dir or cfg.agent["state_dir"])
    host, port = _listen(args.listen or cfg.agent["listen"])
    textfile = args.textfile or (Path(cfg.agent["textfile"]) if cfg.agent["textfile"] else None)
    node = _node(args.root)
    # The scheduler adapter is built before anything is locked: a bad [remediation] table refuses to start.
    remediation, adapter, domain = remediation_setup(cfg, node, state_dir)
    name_this_thread("gpuwarden")  # the main thread's name is the process's in ps/top (else "python3")
    collector = DaemonCollector()
    registry = registry_for(collector)
    # The port first: a daemon that cannot serve refuses before it has created or locked anything.
    raise_fd_limit()
    web_cfg = args.web_config_file or cfg.agent["web_config_file"] or None
    try:
        server = MetricsEndpoint(host, port, registry, web_config_file=Path(web_cfg) if web_cfg else None,
                                 findings=serving(state_dir / "state.db", remediation.node_name or node.hostname))
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        # Then the state folder's lock (a second daemon on it refuses, naming the first), then the database.
        store = Store(state_dir / "state.db", lock=True)
    except GpuwardenError:
        _close_server(server)
        raise

    def retest(since: Any) -> bool | None:
        passed, results = run_retest(node, daemon.config, since)
        log.info("retest", passed=passed, since_seq=getattr(since, "seq", None),
                 results={r.check: r.status.value for r in results})
        return passed

    daemon = Daemon(node, list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store, adapter, collector,
                    DaemonOptions(retest=retest, remediation=remediation, domain=domain, policy=policy_of(cfg)))
    reload_requested = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        (reload_requested if signum == signal.SIGHUP else daemon.stop_event).set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    # The kernel may deliver a signal to any thread, and Python runs its handler only when the main thread runs:
    # the main thread sleeps in select() on the wakeup pipe, which the interpreter writes on every signal.
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    server.start()
    daemon.start()
    # What start-up built (modules, config, catalogues) lives as long as the agent: freezing it keeps the
    # periodic garbage collections from walking it again and again (CPython's gc.freeze, meant for this).
    gc.freeze()
    log.info("running", node=node.hostname, listen=f"{host}:{port}", state_dir=str(state_dir),
             passive=[s.name for s in PASSIVE], kernel=[c.name for c in KERNEL_CONSUMERS],
             remediation=remediation.mode, adapter=remediation.adapter, scheduler_node=remediation.node_name,
             domain=domain)
    if not remediation.acting:
        log.warning("remediation in dry-run: intents are logged and written to actions.jsonl, never carried out "
                    "(set [remediation] mode = \"act\" to act)")
    notify("READY=1\nSTATUS=watching")
    # Woken by a signal at once; otherwise only as often as the watchdog or the textfile needs.
    tick = min(x for x in (watchdog_interval_s(), TEXTFILE_EVERY_S if textfile else None, IDLE_WAKE_S) if x)
    stalled: list[str] = []
    try:
        while not daemon.stop_event.is_set():
            if select.select([wake_r], [], [], tick)[0]:
                _drain(wake_r)  # the handlers have run by now (on_signal): act on what they set
            if daemon.stop_event.is_set():
                break
            if reload_requested.is_set():
                reload_requested.clear()
                _reload(daemon, specs, args)
            if textfile:
                _write_textfile(registry, textfile)
            stalled = _feed_watchdog(daemon, stalled)
    finally:
        notify("STOPPING=1")
        signal.set_wakeup_fd(-1)
        daemon.stop()
        server.stop()
        store.close()
        for fd in (wake_r, wake_w):
            os.close(fd)
        log.info("stopped")
    return EXIT_PASS


def daemon_forms() -> list[Any]:
    """Every form of the concerns the daemon runs: its passive checks and its kernel-log consumers. Other checks'
    modules (burn-in, NCCL, RDMA, DCGM) are not loaded: a config file's tables of those are checked against their
    forms only where the file sets them, and a retest adds the quick checks it runs (agent/node/retest.py)."""
    from gpuwarden import checks

    return checks.forms(dict.fromkeys(s.name for s in (*checks.PASSIVE, *checks.KERNEL_CONSUMERS)))


def load_config(specs: list[Any], args: argparse.Namespace) -> Any:
    from gpuwarden import checks

    cfg = config_mod.load(specs, args.config, explicit=args.config is not None, names=checks.NAMES,
                          forms=checks.forms)
    if getattr(args, "state_dir", None):  # what the checks that read the daemon's own history look at (jobs)
        config_mod.set_flag(cfg, "state_dir", str(args.state_dir), "--state-dir")
    return cfg


def remediation_setup(cfg: Any, node: Any, state_dir: Path) -> tuple[Settings, Any, str | None]:
    """The engine's settings, the scheduler adapter and this node's NVLink domain, from the config."""
    from gpuwarden.agent.act.adapters import build as build_adapter
    from gpuwarden.agent.act.remediation import Settings

    table = cfg.remediation
    settings = Settings.from_table(table, node.hostname, state_dir / "actions.jsonl")
    own = dict(table.get(settings.adapter, {}))
    if settings.adapter == "kubernetes":  # a job's pod is looked for among this node's pods only
        own.setdefault("node_name", settings.node_name)
    adapter = build_adapter(settings.adapter, own, state_dir)
    return settings, adapter, node_domain(node, cfg)


def node_domain(node: Any, cfg: Any) -> str | None:
    """agent/node/topology.py's answer: [topology] domain, else NVML's fabric clusterUuid.cliqueId."""
    from gpuwarden.agent.node.topology import node_domain as from_topology

    try:
        return from_topology(node, cfg)
    except Exception as exc:  # noqa: BLE001 - could not look: the domain is not known, never guessed
        log.warning("could not read this node's NVLink domain", error=f"{type(exc).__name__}: {exc}")
        return None


def policy_of(cfg: Any) -> dict[str, Any]:
    """The state machine's policy with the ladder's settings of [remediation.ladder]."""
    from gpuwarden.agent.state.transitions import DEFAULT_POLICY

    ladder = cfg.remediation.get("ladder", {})
    return {**DEFAULT_POLICY, **{k: ladder[k] for k in DEFAULT_POLICY if k in ladder}}


def breaker_reset(args: argparse.Namespace) -> int:
    """`gpuwarden breaker reset`: records the reset time in the node's state store; the running daemon reads it at
    its next turn, closes the breaker and judges the fleet again, counting only drains after this time."""
    import time

    from gpuwarden.agent.act.remediation import RESET_AT_KEY

    state_dir = Path(args.state_dir or config_mod.AGENT_DEFAULTS["state_dir"])
    now = time.time()
    record_meta(state_dir / "state.db", RESET_AT_KEY, now)
    print(f"circuit breaker reset at {now:.0f}: drains before now no longer count; the daemon judges the fleet "
          "again at its next turn")
    return EXIT_PASS


def _feed_watchdog(daemon: Daemon, was_stalled: list[str]) -> list[str]:
    """WATCHDOG=1 only while every loop has made progress within its deadline: a stuck loop starves systemd's
    watchdog, which restarts the agent (WatchdogSec)."""
    from gpuwarden.agent.sources.systemd import notify

    stalled = daemon.stalled()
    if stalled:
        if stalled != was_stalled:
            log.error("loops stalled; no longer feeding the watchdog", loops=stalled)
        notify(f"STATUS=stalled: {', '.join(stalled)}")
    else:
        if was_stalled:
            log.warning("loops making progress again", loops=was_stalled)
        notify(f"WATCHDOG=1\nSTATUS=node {daemon.record.state.value}")
    return stalled


def _write_textfile(registry: Any, textfile: Path) -> None:
    from gpuwarden.agent.daemon.metrics import write_textfile

    try:
        write_textfile(registry, textfile)
    except OSError as exc:
        log.error("textfile not written", path=str(textfile), error=str(exc))


def _close_server(server: MetricsEndpoint) -> None:
    server.stop()  # never started: closes the listening socket


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


# What a reload does not change: the agent reads these once, at start (the listening socket, the state folder's lock,
# the log's form, the scheduler adapter, the remediation engine and its ladder, this node's NVLink domain).
_AT_START_ONLY = {"agent": ("state_dir", "listen", "web_config_file", "textfile", "log_format", "log_level"),
                  "remediation": None, "topology": None}


def restart_needed(running: Any, fresh: Any) -> list[str]:
    """The keys (dotted, e.g. "remediation.mode") that differ between the running config and a fresh one and that
    only a restart applies. An operator who turns [remediation] mode back to "dry-run" and reloads must hear that
    the agent still acts."""
    out: list[str] = []

    def walk(prefix: str, old: Any, new: Any) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new), key=str):
                walk(f"{prefix}.{key}", old.get(key), new.get(key))
        elif old != new:
            out.append(prefix)

    for table, keys in _AT_START_ONLY.items():
        old, new = getattr(running, table), getattr(fresh, table)
        for key in keys if keys is not None else sorted(set(old) | set(new), key=str):
            walk(f"{table}.{key}", old.get(key), new.get(key))
    return out


def _reload(daemon: Daemon, specs: Any, args: argparse.Namespace) -> None:
    """SIGHUP: read the config again; a bad file is logged and the running config kept. What only a restart
    applies is named in a warning, and the running values of those keys stay in force."""
    try:
        fresh = load_config(specs, args)
    except ConfigError as exc:
        log.error("config reload failed; keeping the running config", error=str(exc))
        return
    running = daemon.config
    pending = restart_needed(running, fresh)
    # The at-start keys stay as they run, so that nothing read later (a retest, the sweep's node name) mixes a
    # reloaded value with the engine's running one.
    kept = {}
    for table, keys in _AT_START_ONLY.items():
        old = getattr(running, table)
        kept[table] = old if keys is None else {**getattr(fresh, table), **{k: old[k] for k in keys if k in old}}
    daemon.reload(dataclasses.replace(fresh, **kept))
    log.info("config reloaded")
    if pending:
        log.warning("config changed where only a restart applies; the running values stay until "
                    "`systemctl restart gpuwarden`", keys=pending)


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
    from gpuwarden.agent.core.render import when

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
    from gpuwarden.agent.core.job import JobRef, jobs_in

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
    from gpuwarden.agent.core.render import seconds_text, when

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


def print_status(args: argparse.Namespace) -> int:
    import time

    from gpuwarden.agent.act.remediation import RESET_AT_KEY, STATUS_KEY
    from gpuwarden.agent.core.render import iso_utc, when
    from gpuwarden.agent.daemon.status_socket import store_writes
    from gpuwarden.agent.jobs.respond import JOB_ACTION

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

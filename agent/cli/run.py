"""Wiring of `gpuwarden run` (daemon, HTTP endpoint, signals, systemd, remediation)."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import select
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden import checks
from gpuwarden.agent.act.adapters import build as build_adapter
from gpuwarden.agent.act.remediation import Settings
from gpuwarden.agent.cli.flags import CONFIG_HELP, log_flags
from gpuwarden.agent.cli.node import node as node_at
from gpuwarden.agent.core import config as config_mod
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ConfigError, GpuwardenError
from gpuwarden.agent.core.model import EXIT_PASS
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint, raise_fd_limit
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for, write_textfile
from gpuwarden.agent.jobs.evidence_window import serving
from gpuwarden.agent.node.retest import run_retest
from gpuwarden.agent.node.topology import node_domain as from_topology
from gpuwarden.agent.sources.systemd import name_this_thread, notify, watchdog_interval_s
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE

if TYPE_CHECKING:
    from gpuwarden.agent.act.remediation import Settings
    from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
    from gpuwarden.agent.daemon.loop import Daemon

log = logs.get_logger("gpuwarden")
TEXTFILE_EVERY_S = 15.0
IDLE_WAKE_S = 60.0  # the main loop's wake-up without a watchdog or textfile to serve (signals wake it at once)


DESCRIPTION = ("The daemon (systemd unit gpuwarden.service): runs the passive checks continuously, follows the "
               "kernel log, keeps the node's state (healthy, suspect, cordoned, quarantined, retired) in its "
               "store, asks the scheduler to act when [remediation] mode = \"act\" (dry-run by default), and "
               "serves Prometheus metrics on /metrics. SIGHUP reloads the config.")
EPILOG = ("examples:\n"
          "  gpuwarden run\n"
          "  gpuwarden run --listen 127.0.0.1:9456 --state-dir /tmp/gw-state\n"
          "  systemctl enable --now gpuwarden.service")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, metavar="DIR",
                   help="run on a recorded node (followed and re-read as if live)")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="SQLite state and action journal (default: [agent] state_dir, /var/lib/gpuwarden)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="serve /metrics here (default: [agent] listen, 0.0.0.0:9456)")
    p.add_argument("--config", type=Path, metavar="FILE", help=CONFIG_HELP)
    p.add_argument("--web.config.file", dest="web_config_file", type=Path, metavar="FILE",
                   help="TLS and basic auth for /metrics: exporter-toolkit's YAML web config "
                        "(default: [agent] web_config_file; none: plain HTTP)")
    p.add_argument("--textfile", type=Path, metavar="FILE",
                   help="also write metrics for node_exporter's textfile collector (default: [agent] textfile; "
                        "none)")
    log_flags(p)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def run(args: argparse.Namespace) -> int:
    specs = daemon_forms()
    cfg = load_config(specs, args)
    logs.setup(args.log_format or cfg.agent["log_format"], args.log_level or cfg.agent["log_level"])
    state_dir = Path(args.state_dir or cfg.agent["state_dir"])
    host, port = _listen(args.listen or cfg.agent["listen"])
    textfile = args.textfile or (Path(cfg.agent["textfile"]) if cfg.agent["textfile"] else None)
    node = node_at(args.root)
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
    return checks.forms(dict.fromkeys(s.name for s in (*checks.PASSIVE, *checks.KERNEL_CONSUMERS)))


def load_config(specs: list[Any], args: argparse.Namespace) -> Any:
    cfg = config_mod.load(specs, args.config, explicit=args.config is not None, names=checks.NAMES,
                          forms=checks.forms)
    if getattr(args, "state_dir", None):  # what the checks that read the daemon's own history look at (jobs)
        config_mod.set_flag(cfg, "state_dir", str(args.state_dir), "--state-dir")
    return cfg


def remediation_setup(cfg: Any, node: Any, state_dir: Path) -> tuple[Settings, Any, str | None]:
    """The engine's settings, the scheduler adapter and this node's NVLink domain, from the config."""
    table = cfg.remediation
    settings = Settings.from_table(table, node.hostname, state_dir / "actions.jsonl")
    own = dict(table.get(settings.adapter, {}))
    if settings.adapter == "kubernetes":  # a job's pod is looked for among this node's pods only
        own.setdefault("node_name", settings.node_name)
    adapter = build_adapter(settings.adapter, own, state_dir)
    return settings, adapter, node_domain(node, cfg)


def node_domain(node: Any, cfg: Any) -> str | None:
    """agent/node/topology.py's answer: [topology] domain, else NVML's fabric clusterUuid.cliqueId."""
    try:
        return from_topology(node, cfg)
    except Exception as exc:  # noqa: BLE001 - could not look: the domain is not known, never guessed
        log.warning("could not read this node's NVLink domain", error=f"{type(exc).__name__}: {exc}")
        return None


def policy_of(cfg: Any) -> dict[str, Any]:
    """The state machine's policy with the ladder's settings of [remediation.ladder]."""
    ladder = cfg.remediation.get("ladder", {})
    return {**DEFAULT_POLICY, **{k: ladder[k] for k in DEFAULT_POLICY if k in ladder}}


def _feed_watchdog(daemon: Daemon, was_stalled: list[str]) -> list[str]:
    """WATCHDOG=1 only while every loop has made progress within its deadline: a stuck loop starves systemd's
    watchdog, which restarts the agent (WatchdogSec)."""
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

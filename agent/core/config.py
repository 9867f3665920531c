"""Configuration: defaults < TOML file (/etc/gpuwarden/gpuwarden.toml or --config) < command-line flags.

An unknown key or a value of the wrong type is an error that names the key and the file: a typo in a
threshold must never silently fall back to the default. So is a value out of range, checked when the config is
loaded rather than when a check runs:
- a number (seconds, threshold) is finite and >= 0; a timeout or the budget is at most a day, any other duration at
  most a year; an integer (a count, a size, a level) is >= 0 and at most 2**53; `_RANGES` lists the keys that differ
  (-1 allowed, a fraction at most 1) (agent/core/config_values.py holds these bounds and checks each value);
- a setting with a fixed set of values (a spec's `choices`, the agent's log format) is one of them;
- strings and lists are bounded in length, and the file itself in size (a config is a few KB).
A file that is not UTF-8, is nested too deeply or holds a number too long to read is rejected the same way.
"""
from __future__ import annotations

import copy
import tomllib
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.config_values import _CHOICES, MAX_FILE_BYTES, coerce
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.sweep_policy import check_policy, parse_baselines  # 0.5 ms, imports nothing more

DEFAULT_PATH = Path("/etc/gpuwarden/gpuwarden.toml")

AGENT_DEFAULTS: dict[str, Any] = {
    "check_timeout_s": 0.0,  # seconds per check; 0 = each check's own default
    "checks": [],  # names to run; empty = every check of the chosen level
    "level": "quick",  # quick: non-disturbing checks (seconds) | full: also burn-in, NCCL, RDMA, DCGM (minutes)
    "budget_s": 0.0,  # overall time budget of one preflight; 0 = none (each check still has its timeout)
    "state_dir": "/var/lib/gpuwarden",  # gpuwarden run: SQLite state, action journal (flag: --state-dir)
    "listen": "0.0.0.0:9456",  # gpuwarden run: /metrics address, host:port (flag: --listen)
    "web_config_file": "",  # gpuwarden run: TLS / basic auth for /metrics, exporter-toolkit YAML ("" = off)
    "textfile": "",  # gpuwarden run: also write metrics here for node_exporter's textfile collector ("" = off)
    "log_format": "auto",  # auto (console on a TTY, JSON otherwise) | json | console
    "log_level": "info",
}
# [remediation]: what the agent does about a fault (docs/remediation.md). Dry-run until the operator says "act".
REMEDIATION_DEFAULTS: dict[str, Any] = {
    "mode": "dry-run",  # dry-run: intents logged (and written to actions.jsonl), never carried out | act
    "adapter": "local",  # the scheduler: local (embedded, SQLite) | slurm | kubernetes
    "node_name": "",  # the scheduler's name for this node ("" = the hostname)
    "retry_min_s": 1.0,  # a scheduler call that failed for now is retried after this, doubling ...
    "retry_max_s": 300.0,  # ... up to this
    "publish_every_s": 600.0,  # the node's NVLink domain is re-asserted this often (0 = only at start)
    "breaker": {  # the circuit breaker (agent/act/breaker.py): no more cordons past these shares within window_s
        "cluster_share": 0.10,  # of all the scheduler's nodes drained by the agents
        "domain_share": 0.25,  # of one NVLink domain's nodes
        "window_s": 600.0,
        "min_nodes": 1,  # a cordon is always allowed while fewer than this many are drained in the window
    },
    "spares": {
        "swap": True,  # take a spare of the domain into service when this node is quarantined
        "per_domain": 2,  # spares kept per NVLink domain (NVL72: 16 of 18 trays in use)
    },
    "ladder": {  # the recovery steps of a quarantined node (agent/state/transitions.py)
        "reset_gpu": True,  # GPU reset for a RESET_GPU-class fault once no process holds the GPU
        "reboot": True,
        "step_after_s": 60.0,  # the first step waits this long after quarantine (the drain goes first)
        "holders_wait_s": 300.0,  # the reset waits this long for the GPU's processes to go, else is skipped
        "reset_settle_s": 300.0,  # the fault has this long to clear after a reset before the next step
        "reboot_settle_s": 1800.0,  # ... and after a reboot
        "retest_after_s": 60.0,  # a quarantined node whose faults cleared is retested once all looked fine this long
        "reboot_command": ["systemctl", "reboot"],
        "ticket_command": [],  # the service-ticket hook: the finding as JSON on its stdin ([] = none)
        "step_timeout_s": 600.0,  # a reset, the reboot command or the ticket hook is ended after this
    },
    # Each adapter's own keyword arguments (timeout_s, and e.g. scontrol = "/usr/bin/scontrol", kubeconfig = ...),
    # checked by the adapter when it is built.
    "local": {},
    "slurm": {},
    "kubernetes": {},
}
# [jobs]: what is done to a job whose collectives a fault on this node has doomed (docs/jobs.md, agent/jobs/). Nothing
# is carried out while [remediation] mode = "dry-run": each action is logged and written to actions.jsonl.
JOBS_DEFAULTS: dict[str, Any] = {
    "on_doomed": "notify",  # notify (say why, where the owner sees it) | signal | requeue | cancel
    "signal": "USR1",  # what `signal` sends to every process of the job (and `requeue` first, see signal_before_s)
    "signal_before_s": 0.0,  # requeue: signal first and requeue this long after, so the job can checkpoint (0: at once)
}
TOPOLOGY_DEFAULTS: dict[str, Any] = {
    "domain": "",  # this node's NVLink domain; "" = read it from NVML (GPU fabric clusterUuid.cliqueId)
}
# [sweep]: `gpuwarden sweep`, the multi-node NCCL sweep of idle nodes (docs/sweep.md). The criteria's keys are
# merged in from agent/core/sweep_policy.py (CRITERIA_DEFAULTS), which owns their meaning.
SWEEP_DEFAULTS: dict[str, Any] = {
    "launcher": "auto",  # how collectives start: srun (Slurm) | mpirun (no scheduler: --hosts) | auto (by adapter)
    "command": ["all_reduce_perf", "-b", "8", "-e", "2G", "-f", "2", "-g", "1", "-c", "1", "-n", "20", "-w", "5",
                "-N", "10"],  # one rank per GPU; -N repeats the size table, the samples of the p95 latency
    "ranks_per_node": 4,  # processes (GPUs) per node (GB200 NVL72 compute tray: 4; HGX: 8)
    "group_nodes": 8,  # nodes per group in the first round (a domain with fewer idle nodes is one group)
    "cross_domain": True,  # also a round of groups across NVLink domains, over the InfiniBand fabric
    "max_nodes": 0,  # test at most this many idle nodes per sweep (0 = every idle node)
    "include_spares": False,  # also test healthy spares (local adapter only: a Slurm spare is drained)
    "sku": "",  # the nodes' SKU, for the SKU baselines (thresholds/nccl_sweep.toml); "" = none
    "timeout_s": 900.0,  # one collective past this is hung: its job is ended
    "start_timeout_s": 60.0,  # no nodes within this (busy with real work): the group is not run
    "max_tests": 256,  # collectives the localisation may run after the first rounds (a bad node in 8: ~8)
    "partition": "",  # srun: the low-priority preemptible partition the sweep runs in ("" = the default one)
    "qos": "",  # srun: its QOS ("" = none)
    "job_name": "gpuwarden-sweep",  # srun: job name (real work can preempt it, squeue shows it)
    "launcher_args": [],  # more arguments for srun or mpirun (e.g. "--mpi=pmix")
    "results_dir": "/var/lib/gpuwarden/sweep",  # verdicts per node (nodes/) and reports (reports/): a shared path
    "link_action": "drain",  # a bad link: drain both ends | monitor (a warning on both ends)
    # The criteria (agent/core/sweep_policy.py CRITERIA_DEFAULTS, which says why each default is what it is).
    "small_max_bytes": 65536,  # sizes up to this are latency-bound: judged on their p95 time over the cycles
    "large_min_bytes": 1073741824,  # sizes from this up are bandwidth-bound: judged on bus bandwidth
    "latency_factor": 1.5,  # SLOW above this many times the latency baseline
    "busbw_fraction": 0.8,  # SLOW under this fraction of the bus bandwidth baseline
    "min_cycles": 5,  # cycles (-N) needed for a p95; with fewer, the median over the cycles there are
    "history_min_samples": 5,  # a node's past figures at a group size needed before they make a baseline
    "history_keep": 50,  # past figures kept per node and group size
    # "<SKU>/<nodes>" = { latency_p95_us = .., busbw_gbps = .. }: baselines that win over the bundled table
    "baselines": {},
}
_SECTIONS = ("agent", "remediation", "jobs", "topology", "sweep")
_FREE_TABLES = {"remediation.local", "remediation.slurm", "remediation.kubernetes"}  # keys checked by their users


@dataclass
class Config:
    agent: dict[str, Any]
    checks: dict[str, dict[str, Any]]
    source: str = "defaults"
    files: list[str] = field(default_factory=list)
    list_types: dict[str, type] = field(default_factory=dict)  # "checks.xid.ignore_xids" -> int

    # Keys a check reads from another concern's table: {"rdma_loopback": {"ignore_ports": "ib_port"}}.
    shared: dict[str, dict[str, str]] = field(default_factory=dict)
    remediation: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(REMEDIATION_DEFAULTS))
    jobs: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(JOBS_DEFAULTS))
    topology: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(TOPOLOGY_DEFAULTS))
    sweep: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SWEEP_DEFAULTS))

    def for_check(self, name: str) -> dict[str, Any]:
        table = self.checks.get(name, {})
        if name == "nccl_sweep":  # the node's side of a sweep reads where [sweep] writes, as [remediation] names it
            table = {**table, "results_dir": table.get("results_dir") or self.sweep["results_dir"],
                     "node_name": table.get("node_name") or self.remediation["node_name"]}
        if name == "jobs":  # the NCCL settings check reads the port history where the daemon keeps its state
            table = {**table, "state_dir": self.agent["state_dir"]}
        borrowed = self.shared.get(name)
        if not borrowed:
            return table
        return {**table, **{key: self.checks[owner][key] for key, owner in borrowed.items()}}


def defaults(specs: Iterable[Any]) -> Config:
    """One table per concern: the preflight check, its daemon form and its kernel-log form share a name, and so
    a table (the union of their keys; a key both declare must have one default)."""
    specs = list(specs)
    tables: dict[str, dict[str, Any]] = {}
    list_types: dict[str, type] = {"agent.checks": str, "remediation.ladder.reboot_command": str,
                                   "remediation.ladder.ticket_command": str, "sweep.command": str,
                                   "sweep.launcher_args": str}
    shared: dict[str, dict[str, str]] = {}
    for spec in specs:
        table = tables.setdefault(spec.name, {})
        for key, value in spec.defaults.items():
            if key in table and table[key] != value:
                raise ValueError(f"checks.{spec.name}.{key}: two defaults ({table[key]!r}, {value!r})")
            table[key] = copy.deepcopy(value)
        list_types |= {f"checks.{spec.name}.{k}": t for k, t in spec.list_types.items()}
        if getattr(spec, "shared_keys", None):
            shared.setdefault(spec.name, {}).update(spec.shared_keys)
    for name, borrowed in shared.items():
        for key, owner in borrowed.items():
            if key not in tables.get(owner, {}):
                raise ValueError(f"checks.{name} reads '{key}' from [checks.{owner}], which has no such key")
    return Config(copy.deepcopy(AGENT_DEFAULTS), tables, list_types=list_types, shared=shared)


def load(specs: Iterable[CheckSpec], path: Path | None = None, explicit: bool = False,
         names: Iterable[str] | None = None, forms: "Callable[[Iterable[str]], Iterable[Any]] | None" = None) -> Config:
    """Defaults, overlaid with the file at `path` (or DEFAULT_PATH when it exists).

    `explicit` means the user named the file (--config): then a missing file is an error. `names`: every check's
    name (default: those of `specs`); with `forms` (names -> their specs), the file's [checks.<name>] tables of checks
    not among `specs` are checked against the forms it gives, so a command loads only the checks it runs and those
    the file sets (`extend` adds more)."""
    specs = list(specs)
    check_names = {s.name for s in specs} if names is None else set(names)
    cfg = defaults(specs)
    if path is None:
        path = DEFAULT_PATH
        if not path.exists():
            return cfg
    try:
        data = read_toml(Path(path))
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: config file not found") from None
        return cfg
    tables = data.get("checks")
    if forms is not None and isinstance(tables, Mapping):
        # A table that sets nothing (the packaged config lists every check's, its keys commented out) needs no check.
        more = [n for n, table in tables.items() if n in check_names and n not in cfg.checks and table != {}]
        if more:
            specs += [s for s in forms(more) if s.name not in cfg.checks]
            cfg = defaults(specs)
    apply(cfg, data, str(path), check_names, spec_choices(specs))
    cfg.files.append(str(path))
    cfg.source = str(path)
    return cfg


def extend(cfg: Config, specs: Iterable[Any]) -> None:
    """Add the default tables of the checks among `specs` that `cfg` has none of (a check chosen after the config
    was loaded; the file set nothing of it, or its table would be there). `specs` holds every form of those checks
    and of the checks whose keys they read."""
    new = [s for s in specs if s.name not in cfg.checks]
    if not new:
        return
    more = defaults([*new, *(s for s in specs if s.name in cfg.checks)])
    for name, table in more.checks.items():
        if name not in cfg.checks:
            cfg.checks[name] = table
            cfg.list_types |= {k: t for k, t in more.list_types.items() if k.startswith(f"checks.{name}.")}
            if name in more.shared:
                cfg.shared[name] = more.shared[name]


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file read as untrusted input: bounded in size, UTF-8, nesting and numbers the parser can hold. Every
    failure is a ConfigError naming the file, except FileNotFoundError (the caller decides what a missing file is)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 10} KiB; not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (line {line}, byte {exc.start}: {raw[exc.start]:#04x})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def spec_choices(specs: Iterable[Any]) -> dict[str, tuple[Any, ...]]:
    """The allowed values of every enum-like key: the agent's, and those the specs declare (`choices`)."""
    out = dict(_CHOICES)
    for spec in specs:
        out.update({f"checks.{spec.name}.{k}": tuple(v) for k, v in getattr(spec, "choices", {}).items()})
    return out


def apply(cfg: Config, data: Mapping[str, Any], origin: str, check_names: set[str],
          choices: Mapping[str, tuple[Any, ...]] | None = None) -> None:
    choices = _CHOICES if choices is None else choices
    for key, value in data.items():
        if key in _SECTIONS:
            _merge(cfg, getattr(cfg, key), _table(value, key, origin), key, origin, choices)
        elif key == "checks":
            for name, table in _table(value, "checks", origin).items():
                if name not in check_names:
                    known = ", ".join(sorted(check_names))
                    raise ConfigError(f"{origin}: unknown check 'checks.{name}' (known: {known})")
                values = _table(table, f"checks.{name}", origin)
                if values or name in cfg.checks:  # an empty table sets nothing, whether its check is loaded or not
                    _merge(cfg, cfg.checks[name], values, f"checks.{name}", origin, choices)
        else:
            raise ConfigError(f"{origin}: unknown key '{key}' (top-level tables are [agent], [remediation], [jobs], "
                              "[topology], [sweep] and [checks.<name>])")
    # The criteria's keys, against their own ranges (and small below large). A [sweep] that sets nothing but empty
    # tables (the packaged config's) leaves the defaults, which hold: they are not checked again.
    if any(v != {} for v in data.get("sweep", {}).values()):
        check_policy(cfg.sweep, f"{origin}: [sweep]")
    unknown_checks = [c for c in cfg.agent["checks"] if c not in check_names]
    if unknown_checks:
        raise ConfigError(f"{origin}: agent.checks names unknown check '{unknown_checks[0]}'")


def _table(value: Any, name: str, origin: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{origin}: '{name}' must be a table")
    return value


def _merge(cfg: Config, target: dict[str, Any], values: Mapping[str, Any], prefix: str, origin: str,
           choices: Mapping[str, tuple[Any, ...]]) -> None:
    for key, value in values.items():
        full = f"{prefix}.{key}"
        if full == "sweep.baselines":  # a table of tables: the sweep's criteria check every entry
            if value != {}:
                parse_baselines(_table(value, full, origin), f"{origin}: [{full}]")
            target[key] = {k: dict(v) for k, v in value.items()}
            continue
        if prefix in _FREE_TABLES:
            target[key] = _free_value(full, value, origin)
            continue
        if key not in target:
            raise ConfigError(f"{origin}: unknown key '{full}' (known: {', '.join(sorted(target)) or 'none'})")
        if isinstance(target[key], dict):
            _merge(cfg, target[key], _table(value, full, origin), full, origin, choices)
            continue
        target[key] = coerce(full, value, target[key], origin, cfg.list_types.get(full), choices.get(full))


def _free_value(key: str, value: Any, origin: str) -> Any:
    """A value of a table whose keys its user checks (an adapter's keywords): a string, number, boolean or a list
    of strings, bounded as every other value; a number finite and, for a *_s key, a duration."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return coerce(key, value, 0.0 if isinstance(value, float) or key.endswith("_s") else 0, origin)
    if isinstance(value, str):
        return coerce(key, value, "", origin)
    if isinstance(value, list):
        return coerce(key, value, [], origin, str)
    raise ConfigError(f"{origin}: '{key}' must be a string, a number, true or false, or a list of strings")


def set_flag(cfg: Config, key: str, value: Any, flag: str) -> None:
    """A command-line value for agent.`key`, checked as the file's would be; the error names the flag."""
    cfg.agent[key] = coerce(f"agent.{key}", value, AGENT_DEFAULTS[key], "command line", choices=_CHOICES.get(
        f"agent.{key}"), name=flag)

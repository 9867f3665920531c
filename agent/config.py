"""Configuration: defaults < TOML file (/etc/gpuwarden/gpuwarden.toml or --config) < command-line flags.

An unknown key or a value of the wrong type is an error that names the key and the file: a typo in a
threshold must never silently fall back to the default.
"""
from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .check import CheckSpec
from .errors import ConfigError

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
_CHOICES = {"log_format": ("auto", "json", "console"), "log_level": ("debug", "info", "warning", "error"),
            "level": ("quick", "full")}


@dataclass
class Config:
    agent: dict[str, Any]
    checks: dict[str, dict[str, Any]]
    source: str = "defaults"
    files: list[str] = field(default_factory=list)
    list_types: dict[str, type] = field(default_factory=dict)  # "checks.xid.ignore_xids" -> int

    # Keys a check reads from another concern's table: {"rdma_loopback": {"ignore_ports": "ib_port"}}.
    shared: dict[str, dict[str, str]] = field(default_factory=dict)

    def for_check(self, name: str) -> dict[str, Any]:
        table = self.checks.get(name, {})
        borrowed = self.shared.get(name)
        if not borrowed:
            return table
        return {**table, **{key: self.checks[owner][key] for key, owner in borrowed.items()}}


def defaults(specs: Iterable[Any]) -> Config:
    """One table per concern: the preflight check, its daemon form and its kernel-log form share a name, and so
    a table (the union of their keys; a key both declare must have one default)."""
    specs = list(specs)
    tables: dict[str, dict[str, Any]] = {}
    list_types: dict[str, type] = {"agent.checks": str}
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


def load(specs: Iterable[CheckSpec], path: Path | None = None, explicit: bool = False) -> Config:
    """Defaults, overlaid with the file at `path` (or DEFAULT_PATH when it exists).

    `explicit` means the user named the file (--config): then a missing file is an error."""
    specs = list(specs)
    cfg = defaults(specs)
    if path is None:
        path = DEFAULT_PATH
        if not path.exists():
            return cfg
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: config file not found") from None
        return cfg
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    apply(cfg, data, str(path), {s.name for s in specs})
    cfg.files.append(str(path))
    cfg.source = str(path)
    return cfg


def apply(cfg: Config, data: Mapping[str, Any], origin: str, check_names: set[str]) -> None:
    for key, value in data.items():
        if key == "agent":
            _merge(cfg, cfg.agent, _table(value, "agent", origin), "agent", origin)
        elif key == "checks":
            for name, table in _table(value, "checks", origin).items():
                if name not in check_names:
                    known = ", ".join(sorted(check_names))
                    raise ConfigError(f"{origin}: unknown check 'checks.{name}' (known: {known})")
                _merge(cfg, cfg.checks[name], _table(table, f"checks.{name}", origin), f"checks.{name}", origin)
        else:
            raise ConfigError(f"{origin}: unknown key '{key}' (top-level tables are [agent] and [checks.<name>])")
    unknown_checks = [c for c in cfg.agent["checks"] if c not in check_names]
    if unknown_checks:
        raise ConfigError(f"{origin}: agent.checks names unknown check '{unknown_checks[0]}'")


def _table(value: Any, name: str, origin: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{origin}: '{name}' must be a table")
    return value


def _merge(cfg: Config, target: dict[str, Any], values: Mapping[str, Any], prefix: str, origin: str) -> None:
    for key, value in values.items():
        full = f"{prefix}.{key}"
        if key not in target:
            raise ConfigError(f"{origin}: unknown key '{full}' (known: {', '.join(sorted(target)) or 'none'})")
        target[key] = coerce(full, value, target[key], origin, cfg.list_types.get(full))


def coerce(key: str, value: Any, default: Any, origin: str, item_type: type | None = None) -> Any:
    """Check `value` has the type of `default` (int is accepted where a float is expected)."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{origin}: '{key}' must be {expected}, got {value!r}")

    short = key.rsplit(".", 1)[-1]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
        if value < 0:
            raise bad("a number >= 0")
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise bad("a string")
        if short in _CHOICES and value not in _CHOICES[short]:
            raise bad("one of " + ", ".join(_CHOICES[short]))
    elif isinstance(default, list):
        if not isinstance(value, list):
            raise bad("a list")
        kind = item_type or (type(default[0]) if default else None)
        if kind is not None and any(not isinstance(v, kind) or isinstance(v, bool) != (kind is bool) for v in value):
            raise bad(f"a list of {kind.__name__}")
    return value

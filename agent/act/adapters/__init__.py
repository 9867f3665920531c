"""Scheduler adapters: how the node's state reaches the scheduler (local record, Slurm, Kubernetes).

`build(name, table, state_dir)` makes the adapter `[remediation] adapter` names, with its own table
([remediation.local], [remediation.slurm], [remediation.kubernetes]) as keyword arguments. Each adapter's module is
imported only when it is asked for: a node without the Kubernetes client can run the Slurm adapter."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping

from gpuwarden.agent.core.errors import ConfigError

# name -> (module, class). The local adapter keeps its scheduler in the state folder: its database beside the
# actions log (actions.jsonl), where it writes every change it makes.
ADAPTERS = {"local": ("gpuwarden.agent.act.adapters.local", "LocalAdapter"),
            "slurm": ("gpuwarden.agent.act.adapters.slurm", "SlurmAdapter"),
            "kubernetes": ("gpuwarden.agent.act.adapters.kubernetes", "KubernetesAdapter")}
ACTIONS_LOG = "actions.jsonl"


def build(name: str, table: Mapping[str, Any], state_dir: Path) -> Any:
    """The adapter `name`, built from its config table; a ConfigError that says what is wrong otherwise."""
    if name not in ADAPTERS:
        raise ConfigError(f"remediation.adapter: unknown adapter {name!r} (known: {', '.join(ADAPTERS)})")
    module_name, class_name = ADAPTERS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"remediation.adapter = {name!r}: cannot load {module_name} ({exc}); "
                          "is this gpuwarden installed with that adapter's extra?") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"remediation.adapter = {name!r}: {module_name} has no {class_name}")
    kwargs = dict(table)
    if name == "local":
        kwargs.setdefault("path", Path(state_dir) / ACTIONS_LOG)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # an unknown or missing keyword: a key of [remediation.<name>] the adapter refuses
        raise ConfigError(f"[remediation.{name}]: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"[remediation.{name}]: {exc}") from None

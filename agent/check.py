"""What a check is: a name, its config defaults, and a function from a node's sources to findings.

A check yields findings and nothing else. The runner (agent/runner.py) owns timing, timeouts,
exceptions (-> UNKNOWN), NotApplicable (-> SKIPPED) and folding findings into a status.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from .model import Finding

if TYPE_CHECKING:  # pragma: no cover
    from .node import Node


@dataclass(frozen=True)
class CheckSpec:
    name: str
    summary: str
    run: "Callable[[Node, Mapping[str, Any]], Iterable[Finding]]"
    # Config keys this check accepts, with their defaults; the type of each default is the type the
    # config loader enforces for the key.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Element type of list-valued keys whose default is empty (so the loader can still check them).
    list_types: Mapping[str, type] = field(default_factory=dict)
    timeout_s: float = 30.0
    level: str = "quick"  # quick: non-disturbing, seconds; full: loads the GPUs or the network


"""What a check is: a name, its config defaults, and a function from a node's sources to findings.

A check yields findings and nothing else. The runner (agent/node/runner.py) owns timing, timeouts,
exceptions (-> UNKNOWN), NotApplicable (-> SKIPPED) and folding findings into a status.
"""
from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.model import Finding
from gpuwarden.agent.core.records import dataclass

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.node.host import Node


@dataclass(frozen=True)
class Analyzer:
    """How `gpuwarden analyze` reads one kind of saved output (a tool's stdout, a log) into findings."""

    fmt: str  # e.g. "nccl-tests", "dcgmi-diag-json"
    detect: Callable[[str], bool]  # cheap: does this text look like my format?
    analyze: "Callable[[str, str], tuple[list[Finding], list[ParseError]]]"  # (text, source name)


@dataclass(frozen=True)
class CheckSpec:
    """A preflight check: its name (and config table), what it runs, and how the runner treats it."""

    name: str
    summary: str
    run: "Callable[[Node, Mapping[str, Any]], Iterable[Finding]]"
    # Config keys this check accepts, with their defaults; the type of each default is the type the
    # config loader enforces for the key.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # Element type of list-valued keys whose default is empty (so the loader can still check them).
    list_types: Mapping[str, type] = field(default_factory=dict)
    # The allowed values of enum-like keys (checked when the config is loaded: a typo is an error, not an UNKNOWN).
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    timeout_s: float = 30.0
    level: str = "quick"  # quick: non-disturbing, seconds; full: loads the GPUs or the network
    # Resources the check loads ("gpu", "network"): checks sharing one never run at the same time, so a
    # burn-in does not skew an NCCL bandwidth figure.
    resources: tuple[str, ...] = ()
    analyzers: tuple[Analyzer, ...] = ()  # saved-output formats this check's decision code can read
    # Keys read from another concern's table, so an operator sets them once: {"ignore_ports": "ib_port"}.
    shared_keys: Mapping[str, str] = field(default_factory=dict)



@dataclass(frozen=True)
class Concern:
    """One check as a whole: its name (its module checks/<name>.py and its one [checks.<name>] table), where it stands
    in the report, and where each of its parts lives.

    A concern module declares it as `CONCERN = Concern(key=literal, ...)`, a statement of its own that ends in a line
    `)`: gpuwarden.checks reads that statement from the file without importing the module (a quick preflight imports
    only the checks it runs). A part is named "ATTR" (in the concern's module) or "module.ATTR" (a submodule of
    gpuwarden.checks holding that part); "" means the concern has no such part.
    """

    name: str
    order: int  # place in the report, and in the order `gpuwarden analyze` asks the analyzers
    level: str | None = None  # its preflight level: quick or full; None: the daemon's only
    look: str = ""  # the preflight look: a CheckSpec, or a PassiveSpec judged in one look (agent/core/passive.py)
    poll: str = ""  # the daemon's poll: a PassiveSpec
    poll_order: int = 0  # the daemon's polls are listed (its start line, a job's evidence window) in this order
    kernel: str = ""  # the consumer of the daemon's followed kernel log: a KernelConsumer
    kernel_order: int = 0  # the kernel-log consumers get each batch in this order
    # What `gpuwarden analyze` reads with it: the formats of its look's analyzers, and "kernel-log" where analyze
    # reads a saved kernel log with its kernel-log consumer.
    analyze: tuple[str, ...] = ()
    doom: tuple[str, ...] = ()  # the rules of agent/jobs/doom_rules.toml that name this check (a job-doom rule)

    def parts(self) -> dict[str, str]:
        """{"look": "CHECK", "poll": "ecc_watch.SPEC", ...}: the parts it has, each where it lives."""
        return {part: where for part in ("look", "poll", "kernel") if (where := getattr(self, part))}

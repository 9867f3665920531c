"""Passive checks: what the daemon runs continuously, each at its own interval.

A passive check is two functions:
- `sample(node, cfg, state) -> sample`: the only I/O, through the node's sources (it may read `state` to know
  where it left off, e.g. a kernel-log cursor, but never writes it);
- `judge(state, sample, cfg, now) -> Judgement`: pure. Given the check's previous state (a JSON-serialisable
  dict the daemon persists in SQLite after every judgement, atomically with the findings) it returns the new
  state, the findings that hold now, and the metric samples to export.

Because the state is persisted with the findings, a restart (or kill -9) resumes exactly: rates, sliding
windows, downtime accumulators and log cursors are never lost or counted twice.
"""
from __future__ import annotations

import time
from dataclasses import field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, Sequence

from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.model import Finding
from gpuwarden.agent.core.records import dataclass

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.node.host import Node


class MetricSample(NamedTuple):
    """One Prometheus sample a check exports (the collector groups samples by name into families). Immutable, and a
    named tuple rather than a frozen dataclass: a judgement builds one per GPU, link or device and metric (hundreds
    per look on a large node), and a frozen dataclass costs three times as much to build."""

    name: str  # gpuwarden_* , e.g. "gpuwarden_ib_port_down_seconds"
    help: str
    labels: Mapping[str, str]
    value: float
    kind: str = "gauge"  # gauge | counter (counters are exported with the _total suffix by prometheus-client)


@dataclass(frozen=True)
class Judgement:
    """What a judge returns: the state to persist, the findings that hold now, and the samples to export."""

    state: dict[str, Any]  # persisted; must round-trip through json
    findings: tuple[Finding, ...] = ()
    metrics: tuple[MetricSample, ...] = ()
    # When (the judge's clock) a finding held for a time stops holding with no new input (an incident's hold
    # ending): the daemon judges again then, instead of at its next idle tick. None: no such time.
    wake_at: float | None = None


@dataclass(frozen=True)
class PassiveSpec:
    """A daemon check: its name (and config table), how it samples and judges, and how often."""

    name: str
    summary: str
    sample: "Callable[[Node, Mapping[str, Any], Mapping[str, Any]], Any]"
    judge: Callable[[Mapping[str, Any], Any, Mapping[str, Any], float], Judgement]
    interval_s: float  # production poll interval
    defaults: Mapping[str, Any] = field(default_factory=dict)
    list_types: Mapping[str, type] = field(default_factory=dict)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # allowed values of enum-like keys
    timeout_s: float = 10.0  # a sample that takes longer is UNKNOWN; it never blocks the other checks
    # "event": sampled by its own thread as fast as the source delivers (the kernel-log follower), not on
    # a timer; interval_s is then the longest wait between two samples.
    mode: str = "poll"
    # The part of the state that must reach the disk as soon as it changes (None: all of it). A change only
    # outside it (a "last looked at" time while all is quiet) is kept in memory and written with the next
    # durable change or at stop: an idle poll then costs no disk write, and a kill -9 loses only that part.
    durable: "Callable[[Mapping[str, Any]], Any] | None" = None
    # Whether a state is quiet: given a sample equal to the last one, judging it again would only move time
    # forward (no finding can appear or clear). The daemon then skips the judgement and its commit, and judges
    # at the latest every `quiet_rejudge_s` (time-decaying metrics, such as downtime in a sliding window, are at
    # most that stale). None: every sample is judged. For once-a-second polls, where judging is most of the cost.
    quiet: "Callable[[Mapping[str, Any]], bool] | None" = None
    quiet_rejudge_s: float = 30.0
    # While quiet, a cheaper look than a sample: `change_probe(node)` returns a ChangeProbe; when it sees no
    # change since it was last armed, the daemon skips the sample too (until quiet_rejudge_s).
    change_probe: "Callable[[Node], ChangeProbe] | None" = None
    # Where the probe watches events that say when to look (event_fds), the longest sleep between two looks while
    # quiet (None: every interval_s, events or not): a look at the probe's own pace besides, in case an event is
    # never delivered.
    event_look_s: float | None = None


class ChangeProbe(Protocol):
    def rearm(self) -> None:
        """Take the reference: called just before each full sample (so a change during the sample shows next)."""

    def changed(self) -> bool:
        """Whether anything the sample reads may differ from the reference (any error counts as a change)."""

    def event_fds(self) -> Sequence[int]:
        """Descriptors readable when what the sample reads may have changed (none: no such events here). The
        daemon samples when one is; rearm() reads them."""

    def close(self) -> None: ...


def step(spec: PassiveSpec, node: "Node", cfg: Mapping[str, Any], state: Mapping[str, Any], now: float) -> Judgement:
    """One sample and judgement (what the daemon does per tick; tests drive checks through time with it)."""
    return spec.judge(state, spec.sample(node, cfg, state), cfg, now)


@dataclass(frozen=True)
class KernelBatch:
    """What a kernel-log consumer is given per tick: the new records, the node's GPUs as last enumerated (for
    naming entities), and the boot they belong to (state from an earlier boot is stale).

    The daemon's NVML XID source hands over batches of its own (`source="nvml"`, no records): the XIDs NVML
    delivered (agent/sources/nvml/events.py NvmlXid) and why NVML could not be watched, if so (None: it is
    watched, or not available on this node). A kernel-log batch says nothing about NVML."""

    records: list[Any]
    gpus: list[Any]
    boot_id: str | None
    nvml_xids: list[Any] = field(default_factory=list)
    source: str = "kmsg"  # "kmsg" | "nvml"
    nvml_error: str | None = None
    # When each record was logged, on the wall clock (preflight judges a whole boot's log at once, each record at
    # its own time); None: at the time of the judgement (the daemon, which reads records as they come).
    event_time: "Callable[[Any], float] | None" = None


def event_clock(now: float, now_usec: int | None, records: Any) -> Callable[[Any], float]:
    """When each record was logged, on the wall clock: `now` minus its age on the kernel's clock (microseconds
    since boot), so preflight and the daemon judge a record's age alike. Without the node's uptime (a recorded node)
    the newest record stands for "now"; a record without a time counts as logged now (it stands longest)."""
    if now_usec is None:
        now_usec = max((r.usec for r in records if r.usec is not None), default=None)

    def at(record: Any) -> float:
        usec = getattr(record, "usec", None)
        if usec is None or now_usec is None:
            return now
        return now - max(0, now_usec - usec) / 1_000_000

    return at


def boot_batch(node: "Node", gpus: Any = ()) -> tuple[KernelBatch, float]:
    """The node's kernel log as one batch, with the time it is judged at: what preflight (and a retest, on a node
    whose log starts at the recovery) hands a kernel-log check's judge, each record at the time it was logged.
    Raises SourceError when the log cannot be read (the runner reports UNKNOWN)."""
    records = node.kmsg.records()
    now = time.time()
    return KernelBatch(records, list(gpus), node.kmsg.boot_id,
                       event_time=event_clock(now, node.uptime_usec(), records)), now


@dataclass(frozen=True)
class KernelConsumer:
    """A check fed by the kernel log: the daemon's one follower hands every consumer the new records (and an
    empty list on idle ticks, so time-based rules still advance). `judge(state, records, cfg, now)` is pure."""

    name: str
    summary: str
    judge: "Callable[[Mapping[str, Any], KernelBatch, Mapping[str, Any], float], Judgement]"
    defaults: Mapping[str, Any] = field(default_factory=dict)
    list_types: Mapping[str, type] = field(default_factory=dict)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # allowed values of enum-like keys
    # Substrings of the messages this consumer reads; the follower builds records only for those (a flood of
    # unrelated lines then costs a header check each). Empty: every record.
    interest: tuple[str, ...] = ()
    # Whether a state holds nothing that moves with time (no incident held, no event in a window, no unread line
    # shown): an empty batch would judge it the same, so the daemon's idle tick leaves it alone while its record is
    # OK without findings. None: every idle tick judges it.
    quiet: "Callable[[Mapping[str, Any]], bool] | None" = None


def one_look(spec: PassiveSpec) -> CheckSpec:
    """The preflight form of a daemon check that has no other: one sample judged from a fresh state, the same
    decision the daemon makes at its first poll. What a single look can tell (a link down, a fabric route
    unhealthy, an uncorrectable AER count) is judged at once; what needs time (a rate, a sustained reading) waits
    for the daemon."""
    def run(node: "Node", cfg: Mapping[str, Any]) -> tuple[Finding, ...]:
        return spec.judge({}, spec.sample(node, cfg, {}), cfg, time.time()).findings

    return CheckSpec(name=spec.name, summary=spec.summary, run=run, defaults=spec.defaults,
                     list_types=spec.list_types, timeout_s=max(spec.timeout_s, 10.0), level="quick")


"""Prometheus metrics: a custom collector over the daemon's latest results. A scrape never touches hardware:
it only reads what the last samples left in memory.

Names are gpuwarden_*; the per-check samples (IB downtime, throttle ratios, temperatures, ...) come from the
passive checks' judgements (agent/passive.py MetricSample).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .model import CheckResult, Status
from .passive import MetricSample
from .state import RECOVERY_STEPS, NodeRecord, NodeState


@dataclass
class Snapshot:
    """What the collector reads; the daemon replaces it under the lock after every judgement."""

    node: str = ""
    record: NodeRecord = field(default_factory=NodeRecord)
    results: dict[str, CheckResult] = field(default_factory=dict)
    samples: dict[str, tuple[MetricSample, ...]] = field(default_factory=dict)  # per check
    transitions: int = 0
    kmsg_records: int = 0
    kmsg_lost: int = 0


def _version() -> str:
    try:
        return metadata.version("gpuwarden")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


VERSION = _version()


class DaemonCollector(Collector):
    def __init__(self, started: float | None = None) -> None:
        self._lock = threading.Lock()
        self._snap = Snapshot()
        self._started = time.time() if started is None else started
        self._live: Callable[[], Iterable[MetricSample]] | None = None

    def update(self, snap: Snapshot) -> None:
        with self._lock:
            self._snap = snap

    def live(self, samples: Callable[[], Iterable[MetricSample]]) -> None:
        """Samples read at each scrape rather than from the snapshot: what must show even when the loops that
        publish snapshots are the ones stuck (the daemon's stalled loops). `samples` reads memory only, lock-free."""
        self._live = samples

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap, live = self._snap, self._live
        build = GaugeMetricFamily("gpuwarden_build_info", "1, with the agent's version as a label.",
                                  labels=["version"])
        build.add_metric([VERSION], 1.0)
        yield build
        # A restart shows as a change of this value (changes() over a range counts them; restart loops).
        started = GaugeMetricFamily("gpuwarden_start_time_seconds", "Unix time the agent process started.")
        started.add_metric([], self._started)
        yield started
        state = GaugeMetricFamily("gpuwarden_node_state", "1 for the node's current health state, 0 for the others.",
                                  labels=["state"])
        for s in NodeState:
            state.add_metric([s.value], 1.0 if snap.record.state is s else 0.0)
        yield state
        since = GaugeMetricFamily("gpuwarden_node_state_since_seconds",
                                  "Unix time the node entered its current state.")
        since.add_metric([], snap.record.since)
        yield since
        # The recovery ladder of a quarantined node: the step it is at ("none" before the first and out of
        # quarantine), and since when.
        ladder = GaugeMetricFamily("gpuwarden_ladder_step", "1 for the recovery step the quarantined node is at "
                                   "(none, reset_gpu, reboot, ticket), 0 for the others.", labels=["step"])
        current = snap.record.step if snap.record.state is NodeState.QUARANTINED and snap.record.step else "none"
        for step in ("none", *RECOVERY_STEPS):
            ladder.add_metric([step], 1.0 if step == current else 0.0)
        yield ladder
        step_since = GaugeMetricFamily("gpuwarden_ladder_step_since_seconds",
                                       "Unix time the current recovery step was taken (0: none).")
        step_since.add_metric([], snap.record.step_since or 0.0 if current != "none" else 0.0)
        yield step_since
        success = GaugeMetricFamily("gpuwarden_check_success",
                                    "1 if the check could look (ok, warn or fail), 0 if not (unknown) or skipped.",
                                    labels=["check"])
        status = GaugeMetricFamily("gpuwarden_check_status", "1 for the check's current status, 0 for the others.",
                                   labels=["check", "status"])
        duration = GaugeMetricFamily("gpuwarden_check_duration_seconds", "Duration of the check's last run.",
                                     labels=["check"])
        findings = GaugeMetricFamily("gpuwarden_finding",
                                     "1 for each finding that holds now, by check, code, entity and status.",
                                     labels=["check", "code", "entity_kind", "entity", "pci", "status", "action"])
        for name, r in sorted(snap.results.items()):
            success.add_metric([name], 1.0 if r.status in (Status.OK, Status.WARN, Status.FAIL) else 0.0)
            for s in Status:
                status.add_metric([name, s.value], 1.0 if r.status is s else 0.0)
            duration.add_metric([name], r.duration_s)
            for f in r.findings:
                findings.add_metric([name, f.code, f.entity.kind, f.entity.id, f.entity.pci or "", f.status.value,
                                     f.action.name], 1.0)
        yield from (success, status, duration, findings)
        transitions = CounterMetricFamily("gpuwarden_node_transitions", "Node state transitions since start.")
        transitions.add_metric([], snap.transitions)
        yield transitions
        kmsg = CounterMetricFamily("gpuwarden_kmsg_records", "Kernel-log records read since start.")
        kmsg.add_metric([], snap.kmsg_records)
        yield kmsg
        lost = CounterMetricFamily("gpuwarden_kmsg_overwritten",
                                   "Times the kernel ring buffer overwrote records before they were read.")
        lost.add_metric([], snap.kmsg_lost)
        yield lost
        extra = tuple(live()) if live is not None else ()
        yield from families([*(s for samples in snap.samples.values() for s in samples), *extra])


def families(samples: Iterable[MetricSample]) -> Iterator[Metric]:
    """Group check samples by name into metric families (label sets must agree within a name).

    A GPU's UUID is 47 characters, on each of a few hundred per-GPU series: a series that names its GPU by both
    index and UUID is exported with the index only, and `gpuwarden_gpu_info{gpu,uuid}` maps one to the other
    (join with `* on(gpu) group_left(uuid) gpuwarden_gpu_info`), which halves an 8-GPU node's page."""
    by_name: dict[str, list[MetricSample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    gpus: dict[tuple[str, str], None] = {}
    for name, group in sorted(by_name.items()):
        labels = sorted(group[0].labels)
        fold = "gpu" in labels and "uuid" in labels
        shown = [k for k in labels if not (fold and k == "uuid")]
        cls = CounterMetricFamily if group[0].kind == "counter" else GaugeMetricFamily
        family = cls(name, group[0].help, labels=shown)
        seen: set[tuple[str, ...]] = set()
        for s in group:
            if sorted(s.labels) != labels:
                continue  # a check emitting mixed label sets would break the exposition; drop the odd one
            values = tuple(str(s.labels[k]) for k in shown)
            if values in seen:
                continue  # one series twice (GPU indices shifted between two reads) would fail the whole scrape
            seen.add(values)
            if fold:
                gpus[(str(s.labels["gpu"]), str(s.labels["uuid"]))] = None
            family.add_metric(list(values), float(s.value))
        yield family
    if gpus:
        info = GaugeMetricFamily("gpuwarden_gpu_info", "1 for each GPU the checks read: its index (the gpu label of "
                                 "the per-GPU series) and its UUID.", labels=["gpu", "uuid"])
        for gpu, uuid in sorted(gpus, key=lambda k: (len(k[0]), k)):
            info.add_metric([gpu, uuid], 1.0)
        yield info


def registry_for(collector: DaemonCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def write_textfile(registry: CollectorRegistry, path: Path) -> None:
    """node_exporter textfile collector output (written atomically by prometheus-client)."""
    write_to_textfile(str(path), registry)

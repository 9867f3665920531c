"""Prometheus metrics: a custom collector over the daemon's latest results. A scrape never touches hardware:
it only reads what the last samples left in memory.

Names are gpuwarden_*; the per-check samples (IB downtime, throttle ratios, temperatures, ...) come from the
passive checks' judgements (agent/core/passive.py MetricSample). Each family is written as prometheus-client
writes it, without importing it (agent/daemon/exposition.py); the registry the endpoint and prometheus-client's
encoders read is DaemonRegistry.
"""
from __future__ import annotations

import threading
import time
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

from gpuwarden.agent.core.model import CheckResult, Status
from gpuwarden.agent.core.passive import MetricSample
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.version import VERSION
from gpuwarden.agent.daemon.exposition import render_family
from gpuwarden.agent.state.transitions import RECOVERY_STEPS, NodeRecord, NodeState

if TYPE_CHECKING:  # prometheus-client is imported where its own rendering or registry is needed, not by the daemon
    from prometheus_client.core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry


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


class Family(NamedTuple):
    """One metric family as exported: a row is (label values in `labels` order, value). Tuples all the way down,
    so that two families compare (and a cached rendering is found) in C."""

    name: str  # without a counter's _total suffix, as prometheus-client keeps it
    kind: str  # gauge | counter
    help: str
    labels: tuple[str, ...]
    rows: tuple[tuple[tuple[str, ...], float], ...]

    def metric(self) -> Metric:
        # at use: prometheus-client, ~100 ms of import (-X importtime); the page is written without it (render_family)
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        m = cls(self.name, self.help, labels=self.labels)
        for values, value in self.rows:
            m.add_metric(list(values), value)
        return m


def _family(name: str, kind: str, help: str, labels: Iterable[str], rows: Iterable) -> Family:
    if kind == "counter" and name.endswith("_total"):
        name = name[:-6]  # what CounterMetricFamily does with the name
    return Family(name, kind, help, tuple(labels), tuple(rows))


class DaemonCollector:
    def __init__(self, started: float | None = None) -> None:
        self._lock = threading.Lock()
        self._snap = Snapshot()
        self._started = time.time() if started is None else started
        self._live: Callable[[], Iterable[MetricSample]] | None = None
        # The page as last rendered: the snapshot and live samples it was built from, its families, each family's
        # text as last rendered (per format), and the whole page per format. A scrape renders only what changed.
        self._render_lock = threading.Lock()
        self._seen: tuple[Snapshot, tuple[MetricSample, ...]] | None = None
        self._families: list[Family] = []
        self._texts: dict[str, tuple[Family, dict[tuple[bool, str], bytes]]] = {}
        self._pages: dict[tuple[bool, str], bytes] = {}
        self._grouping = SampleFamilies()

    def update(self, snap: Snapshot) -> None:
        with self._lock:
            self._snap = snap

    def snapshot(self) -> Snapshot:
        """What the collector reads now (the daemon's last published snapshot)."""
        with self._lock:
            return self._snap

    def live(self, samples: Callable[[], Iterable[MetricSample]]) -> None:
        """Samples read at each scrape rather than from the snapshot: what must show even when the loops that
        publish snapshots are the ones stuck (the daemon's stalled loops). `samples` reads memory only, lock-free."""
        self._live = samples

    def collect(self) -> Iterator[Metric]:
        """The page's families as prometheus-client metrics (what any of its encoders reads)."""
        snap, live = self._read()
        for f in self.families_of(snap, live):
            yield f.metric()

    def _read(self) -> tuple[Snapshot, tuple[MetricSample, ...]]:
        with self._lock:
            snap, live = self._snap, self._live
        return snap, tuple(live()) if live is not None else ()

    def page(self, openmetrics: bool, escaping: str = "underscores",
             encoder: Callable[[Any], bytes] | None = None) -> bytes:
        """The whole /metrics page in the text format (0.0.4) or OpenMetrics 1.0.0, byte for byte what
        prometheus-client's generate_latest writes for collect(); `escaping` is the name escaping the scraper
        asked for (underscores or allow-utf-8: the same text for the names this agent exports). Only the families
        that changed since the last scrape are rendered again; an unchanged page is the same bytes object.
        `encoder` renders a family whose names are outside the legacy character set (prometheus-client's own)."""
        snap, live = self._read()
        key = (openmetrics, escaping)
        with self._render_lock:
            seen = self._seen
            if seen is None or seen[0] is not snap or seen[1] != live:
                self._seen = (snap, live)
                self._families = self.families_of(snap, live, self._grouping)
                self._pages = {}
            page = self._pages.get(key)
            if page is None:
                texts: dict[str, tuple[Family, dict[tuple[bool, str], bytes]]] = {}
                parts = []
                for f in self._families:
                    cached = self._texts.get(f.name)
                    if cached is None or cached[0] != f:
                        cached = (f, {})
                    text = cached[1].get(key)
                    if text is None:
                        text = cached[1][key] = render_family(f, openmetrics, encoder)
                    texts[f.name] = cached
                    parts.append(text)
                if openmetrics:
                    parts.append(b"# EOF\n")
                self._texts = texts  # families gone from the page are forgotten
                page = self._pages[key] = b"".join(parts)
            return page

    def families_of(self, snap: Snapshot, live: tuple[MetricSample, ...] = (),
                    grouping: SampleFamilies | None = None) -> list[Family]:
        """Every family of the page, in the page's order: the agent's own, the checks' status, the counters, then
        the checks' samples (agent/core/passive.py MetricSample) grouped by name (by `grouping`, which keeps what did
        not change since its last call, or from scratch)."""
        rec = snap.record
        out = [
            _family("gpuwarden_build_info", "gauge", "1, with the agent's version as a label.", ["version"],
                    [((VERSION,), 1.0)]),
            # A restart shows as a change of this value (changes() over a range counts them; restart loops).
            _family("gpuwarden_start_time_seconds", "gauge", "Unix time the agent process started.", (),
                    [((), self._started)]),
            _family("gpuwarden_node_state", "gauge", "1 for the node's current health state, 0 for the others.",
                    ["state"], [((s.value,), 1.0 if rec.state is s else 0.0) for s in NodeState]),
            _family("gpuwarden_node_state_since_seconds", "gauge", "Unix time the node entered its current state.",
                    (), [((), rec.since)]),
        ]
        # The recovery ladder of a quarantined node: the step it is at ("none" before the first and out of
        # quarantine), and since when.
        current = rec.step if rec.state is NodeState.QUARANTINED and rec.step else "none"
        out.append(_family("gpuwarden_ladder_step", "gauge", "1 for the recovery step the quarantined node is at "
                           "(none, reset_gpu, reboot, ticket), 0 for the others.", ["step"],
                           [((step,), 1.0 if step == current else 0.0) for step in ("none", *RECOVERY_STEPS)]))
        out.append(_family("gpuwarden_ladder_step_since_seconds", "gauge",
                           "Unix time the current recovery step was taken (0: none).", (),
                           [((), rec.step_since or 0.0 if current != "none" else 0.0)]))
        results = sorted(snap.results.items())
        out.append(_family("gpuwarden_check_success", "gauge",
                           "1 if the check could look (ok, warn or fail), 0 if not (unknown) or skipped.", ["check"],
                           [((name,), 1.0 if r.status in _LOOKED else 0.0) for name, r in results]))
        out.append(_family("gpuwarden_check_status", "gauge", "1 for the check's current status, 0 for the others.",
                           ["check", "status"],
                           [((name, s.value), 1.0 if r.status is s else 0.0) for name, r in results for s in Status]))
        out.append(_family("gpuwarden_check_duration_seconds", "gauge", "Duration of the check's last run.",
                           ["check"], [((name,), r.duration_s) for name, r in results]))
        out.append(_family("gpuwarden_finding", "gauge",
                           "1 for each finding that holds now, by check, code, entity and status.",
                           ["check", "code", "entity_kind", "entity", "pci", "status", "action"],
                           [((name, f.code, f.entity.kind, f.entity.id, f.entity.pci or "", f.status.value,
                              f.action.name), 1.0) for name, r in results for f in r.findings]))
        out.append(_family("gpuwarden_node_transitions", "counter", "Node state transitions since start.", (),
                           [((), snap.transitions)]))
        out.append(_family("gpuwarden_kmsg_records", "counter", "Kernel-log records read since start.", (),
                           [((), snap.kmsg_records)]))
        out.append(_family("gpuwarden_kmsg_overwritten", "counter",
                           "Times the kernel ring buffer overwrote records before they were read.", (),
                           [((), snap.kmsg_lost)]))
        out.extend((grouping or SampleFamilies())([*snap.samples.items(), (None, live)]))
        return out


_LOOKED = (Status.OK, Status.WARN, Status.FAIL)


def families(samples: Iterable[MetricSample]) -> Iterator[Metric]:
    """The check samples' families as prometheus-client metrics (see sample_families)."""
    for f in sample_families(samples):
        yield f.metric()


def sample_families(samples: Iterable[MetricSample]) -> list[Family]:
    """Group check samples by name into metric families (label sets must agree within a name).

    A GPU's UUID is 47 characters, on each of a few hundred per-GPU series: a series that names its GPU by both
    index and UUID is exported with the index only, and `gpuwarden_gpu_info{gpu,uuid}` maps one to the other
    (join with `* on(gpu) group_left(uuid) gpuwarden_gpu_info`), which halves an 8-GPU node's page."""
    return SampleFamilies()([(None, tuple(samples))])


class SampleFamilies:
    """sample_families() over each check's samples, kept from one snapshot to the next: a check's samples are
    grouped again only when they changed, and a family is built again only when a check that feeds it changed.
    A family's samples are in the checks' order, then each check's own, whichever way it is computed."""

    def __init__(self) -> None:
        self._grouped: dict[Any, tuple[tuple[MetricSample, ...], dict[str, list[MetricSample]]]] = {}
        self._built: dict[str, tuple[list[list[MetricSample]], Family, dict[tuple[str, str], None]]] = {}

    def __call__(self, per_check: Iterable[tuple[Any, tuple[MetricSample, ...]]]) -> list[Family]:
        grouped: dict[Any, tuple[tuple[MetricSample, ...], dict[str, list[MetricSample]]]] = {}
        feeds: dict[str, list[list[MetricSample]]] = {}
        for check, samples in per_check:
            old = self._grouped.get(check)
            if old is None or not (old[0] is samples or old[0] == samples):
                by_name: dict[str, list[MetricSample]] = {}
                for sample in samples:
                    by_name.setdefault(sample.name, []).append(sample)
                old = (samples, by_name)
            grouped[check] = old
            for name, group in old[1].items():
                feeds.setdefault(name, []).append(group)
        built: dict[str, tuple[list[list[MetricSample]], Family, dict[tuple[str, str], None]]] = {}
        gpus: dict[tuple[str, str], None] = {}
        out = []
        for name in sorted(feeds):
            groups = feeds[name]
            done = self._built.get(name)
            if done is None or len(done[0]) != len(groups) or \
                    any(a is not b for a, b in zip(done[0], groups, strict=True)):
                folded: dict[tuple[str, str], None] = {}
                done = (groups, _one_family(name, [s for g in groups for s in g], folded), folded)
            built[name] = done
            out.append(done[1])
            gpus.update(done[2])
        self._grouped, self._built = grouped, built
        if gpus:
            out.append(_family("gpuwarden_gpu_info", "gauge", "1 for each GPU the checks read: its index (the gpu "
                               "label of the per-GPU series) and its UUID.", ["gpu", "uuid"],
                               [((gpu, uuid), 1.0) for gpu, uuid in sorted(gpus, key=lambda k: (len(k[0]), k))]))
        return out


def _one_family(name: str, group: list[MetricSample], gpus: dict[tuple[str, str], None]) -> Family:
    """The family of one name's samples; the (gpu, uuid) pairs of a family that folds the UUID go into `gpus`."""
    labels = sorted(group[0].labels)
    keys = set(labels)
    fold = "gpu" in keys and "uuid" in keys
    shown = [k for k in labels if not (fold and k == "uuid")]
    rows = []
    seen: set[tuple[str, ...]] = set()
    for s in group:
        lab = s.labels
        if lab.keys() != keys:
            continue  # a check emitting mixed label sets would break the exposition; drop the odd one
        values = tuple([str(lab[k]) for k in shown])
        if values in seen:
            continue  # one series twice (GPU indices shifted between two reads) would fail the whole scrape
        seen.add(values)
        if fold:
            gpus[(str(lab["gpu"]), str(lab["uuid"]))] = None
        rows.append((values, float(s.value)))
    return _family(name, "counter" if group[0].kind == "counter" else "gauge", group[0].help, shown, rows)


class DaemonRegistry:
    """A registry for the daemon's collector: what any prometheus-client encoder reads (collect()), and, while it
    holds that collector alone, the collector's own cached page (DaemonCollector.page) for the endpoint.
    prometheus-client's CollectorRegistry is built only when a collector is registered from outside or one of its
    other methods is asked for: the daemon's page needs none of it."""

    def __init__(self, collector: DaemonCollector):
        self._own = collector
        self._collector: DaemonCollector | None = collector
        self._registry: CollectorRegistry | None = None

    def _real(self) -> CollectorRegistry:
        if self._registry is None:
            # at use: prometheus-client, ~100 ms of import (-X importtime), which the daemon's own page never needs
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry(auto_describe=False)
            registry.register(self._own)
            self._registry = registry
        return self._registry

    def register(self, collector: Collector) -> None:
        self._real().register(collector)
        self._collector = None  # another collector's families are not on the cached page

    def unregister(self, collector: Collector) -> None:
        self._real().unregister(collector)
        self._collector = None

    def collect(self) -> Iterator[Metric]:
        if self._registry is None:
            return self._own.collect()
        return self._registry.collect()

    def __getattr__(self, name: str) -> Any:
        # The rest of CollectorRegistry (restricted_registry, get_sample_value, target info) is its own.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    @property
    def has_page(self) -> bool:
        """Whether page() renders this registry: it holds the daemon's collector alone."""
        return self._collector is not None

    def page(self, openmetrics: bool, escaping: str = "underscores",
             encoder: Callable[[Any], bytes] | None = None) -> bytes | None:
        """The cached page, or None when this registry holds more than the daemon's collector."""
        collector = self._collector
        return collector.page(openmetrics, escaping, encoder) if collector is not None else None


def registry_for(collector: DaemonCollector) -> DaemonRegistry:
    return DaemonRegistry(collector)


def write_textfile(registry: Any, path: Path) -> None:
    """node_exporter textfile collector output (written atomically by prometheus-client)."""
    # at use: prometheus-client, ~100 ms of import (-X importtime), only for --textfile (not the endpoint's page)
    from prometheus_client import write_to_textfile

    write_to_textfile(str(path), registry)

"""What the agent really exports, and which metric names and labels a PromQL expression reads: the checks that
the shipped Prometheus rules (packaging/prometheus/) and Grafana dashboard (packaging/grafana/) ask only for
series that exist.

`exported()` runs the real daemon in-process on copies of recorded nodes (a faulty GB200 tray with findings, an
XID, an IB port down; a healthy one whose NVLink domain is known), reads its /metrics exposition, and returns
every metric name with the label sets Prometheus would store (a label with an empty value is no label there).
`references(expr)` reads the metric names, label matchers and grouping labels out of an expression with a
linear tokenizer: enough of PromQL for rules and dashboards, no evaluation.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from conftest import NODES, wait_for

NODES_READ = ("gb200-nvl72-faulty", "gb200-nvl72-healthy")
TARGET_LABELS = frozenset({"instance", "job"})  # what the scrape adds to every series
PROMETHEUS_OWN = {"up": [frozenset()]}  # series Prometheus makes itself per target (their labels: target labels)

_cache: dict[str, dict[str, list[frozenset]]] = {}
_texts: dict[str, str] = {}


def exported() -> dict[str, list[frozenset]]:
    """{sample name: [frozenset of (label, value)]} over the recorded nodes (computed once per test session)."""
    if not _cache:
        from prometheus_client.parser import text_string_to_metric_families

        for node in NODES_READ:
            _texts[node] = scrape(node)
            for family in text_string_to_metric_families(_texts[node]):
                for s in family.samples:
                    labels = frozenset((k, v) for k, v in s.labels.items() if v != "")
                    _cache.setdefault(s.name, [])
                    if labels not in _cache[s.name]:
                        _cache[s.name].append(labels)
    return _cache


def exposition(node: str) -> str:
    exported()
    return _texts[node]


def scrape(node: str) -> str:
    """The daemon's exposition on a copy of a recorded node, once every check has looked (and the XIDs of the
    node's kernel log are counted)."""
    from gpuwarden.agent.act.adapters.local import LocalAdapter
    from gpuwarden.agent.cli.run import node_domain
    from gpuwarden.agent.core import config
    from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
    from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
    from gpuwarden.agent.node.host import Node
    from gpuwarden.agent.state.store import Store
    from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs
    from prometheus_client import generate_latest

    work = Path(tempfile.mkdtemp(prefix="gpuwarden-series-"))
    try:
        root = work / node
        shutil.copytree(NODES / node, root, symlinks=True)  # its recorded tools too (fabric reads systemctl's)
        cfg = config.defaults(all_specs())
        recorded = Node.recorded_at(root)
        store = Store(work / "state" / "state.db")
        collector = DaemonCollector()
        d = Daemon(recorded, list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store, LocalAdapter(work / "actions.jsonl"),
                   collector, DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, domain=node_domain(recorded, cfg),
                                            intervals={s.name: 0.1 for s in PASSIVE}))
        d.start()
        try:
            wait_for(lambda: len(d.results()) == len(PASSIVE) + len(KERNEL_CONSUMERS), timeout_s=60,
                     what=f"every check's first look on {node}")
            if "faulty" in node:  # its XID counted, its IB port down past down_fail_s (2 s)
                wait_for(lambda: all(k in generate_latest(registry_for(collector))
                                     for k in (b"gpuwarden_xid_events{", b'code="ib-port-down"')),
                         timeout_s=60, what="the faulty node's XID and IB port findings")
            return generate_latest(registry_for(collector)).decode()
        finally:
            d.stop()
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- reading PromQL --------------------------------------------------------------------------------------------
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "inf", "nan", "atan2",
            # aggregations, which may be followed by their by/without clause before the "("
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_IDENT_START = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_IDENT = _IDENT_START | set("0123456789")


@dataclass
class References:
    metrics: list[str] = field(default_factory=list)
    matchers: list[tuple[str, str, str, str]] = field(default_factory=list)  # (metric or "", label, op, value)
    grouping: list[str] = field(default_factory=list)  # labels named in by/on/ignoring/group_* clauses


def references(expr: str) -> References:
    """Metric names, label matchers and grouping labels of a PromQL expression. One pass, no backtracking:
    strings are skipped with their escapes, [..] (ranges, subqueries) skipped, an identifier followed by "("
    is a function or aggregation, a keyword is not a metric."""
    out = References()
    i, n = 0, len(expr)
    last_metric = ""
    while i < n:
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "[":
            j = expr.find("]", i)
            assert j > 0, f"unclosed [ in {expr!r}"
            i = j + 1
        elif c == "{":
            i = _matchers(expr, i + 1, last_metric, out)
            last_metric = ""
        elif c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            while i < n and (expr[i].isalnum() or expr[i] in "._"):
                i += 1  # a number or a duration (10m, 1h30m, 1e3)
        elif c in _IDENT_START:
            j = i
            while j < n and expr[j] in _IDENT:
                j += 1
            word = expr[i:j]
            k = j
            while k < n and expr[k].isspace():
                k += 1
            nxt = expr[k] if k < n else ""
            if word in GROUPING and nxt == "(":
                close = expr.index(")", k)
                out.grouping += [w.strip() for w in expr[k + 1:close].split(",") if w.strip()]
                i = close + 1
                continue
            if word.lower() in KEYWORDS or nxt == "(":
                last_metric = ""
            else:
                out.metrics.append(word)
                last_metric = word
            i = j
        else:
            if not c.isspace():
                last_metric = ""
            i += 1
    return out


def _skip_string(expr: str, i: int) -> int:
    quote, i = expr[i], i + 1
    while i < len(expr):
        if expr[i] == "\\" and quote != "`":
            i += 2
            continue
        if expr[i] == quote:
            return i + 1
        i += 1
    raise AssertionError(f"unclosed string in {expr!r}")


def _matchers(expr: str, i: int, metric: str, out: References) -> int:
    """label op "value", ... up to the closing brace."""
    n = len(expr)
    while i < n:
        while i < n and (expr[i].isspace() or expr[i] == ","):
            i += 1
        if i < n and expr[i] == "}":
            return i + 1
        j = i
        while j < n and expr[j] in _IDENT:
            j += 1
        label = expr[i:j]
        assert label, f"no label name at {i} in {expr!r}"
        while j < n and expr[j].isspace():
            j += 1
        op = next(o for o in ("=~", "!~", "!=", "=") if expr.startswith(o, j))
        j += len(op)
        while j < n and expr[j].isspace():
            j += 1
        end = _skip_string(expr, j)
        value = expr[j + 1:end - 1]
        out.matchers.append((metric, label, op, value))
        i = end
    raise AssertionError(f"unclosed {{ in {expr!r}")


def labels_of(metric: str, recorded: dict[str, set[str]] | None = None) -> set[str]:
    """Every label a metric's series carry in Prometheus: the agent's own plus the target's."""
    if recorded and metric in recorded:
        return set(recorded[metric])
    sets = exported().get(metric) or PROMETHEUS_OWN.get(metric)
    assert sets is not None, f"{metric} is not exported by the agent"
    return {k for s in sets for k, _ in s} | TARGET_LABELS


def values_of(metric: str, label: str) -> set[str]:
    return {v for s in exported().get(metric, []) for k, v in s if k == label}

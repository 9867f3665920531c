"""The /metrics page the daemon's collector renders itself (agent/daemon/metrics.py DaemonCollector.page) and the
endpoint serves: byte for byte what prometheus-client writes for the same families, in each format and name escaping a
scraper negotiates, with and without gzip; a change shows on the next scrape; an unchanged page is the same bytes.

The families come from the real daemon run on a copy of a recorded node (a faulty GB200 tray: findings, an XID,
per-GPU series folded by UUID); the changes are made to its snapshot."""
from __future__ import annotations

import dataclasses
import gzip
import http.client
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import NODES, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import CheckResult, Status
from gpuwarden.agent.core.passive import MetricSample
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, Snapshot, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import choose_encoder

PROMETHEUS = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
ACCEPTS = ["", "text/plain;version=0.0.4", PROMETHEUS, PROMETHEUS_3, "application/openmetrics-text",
           "text/plain;version=1.0.0;escaping=allow-utf-8", "text/plain;version=1.0.0;escaping=underscores",
           "application/openmetrics-text;version=1.0.0;escaping=dots", "text/plain;version=1.0.0;escaping=values"]


@pytest.fixture(scope="module")
def real_snapshot() -> Snapshot:
    """The snapshot the daemon published on a faulty GB200 tray once its XID and findings showed."""
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-page-"))
    try:
        root = work / "node"
        shutil.copytree(NODES / "gb200-nvl72-faulty", root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
        store = Store(work / "state" / "state.db")
        collector = DaemonCollector()
        d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(all_specs()),
                   store, LocalAdapter(work / "actions.jsonl"), collector,
                   DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE}))
        d.start()
        try:
            wait_for(lambda: len(d.results()) == len(PASSIVE) + len(KERNEL_CONSUMERS), timeout_s=60,
                     what="every check's first look")
            wait_for(lambda: all(k in collector.page(False) for k in (b"gpuwarden_xid_events{", b"gpuwarden_finding{",
                                                                      b"gpuwarden_gpu_info{")),
                     timeout_s=60, what="the XID, a finding and the GPUs on the page")
            return collector.snapshot()
        finally:
            d.stop()
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def served(real_snapshot):
    """A collector holding the real snapshot, behind the endpoint; yields (collector, endpoint)."""
    collector = DaemonCollector(started=1796000000.25)
    collector.update(real_snapshot)
    ep = MetricsEndpoint("127.0.0.1", 0, registry_for(collector))
    ep.start()
    yield collector, ep
    ep.stop(timeout_s=5)


def scrape(ep: MetricsEndpoint, accept: str = PROMETHEUS, gz: bool = False) -> tuple[str, bytes]:
    """(Content-Type, body as sent) of one GET /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", ep.port, timeout=10)
    try:
        headers = {"Accept": accept} if accept else {}
        if gz:
            headers["Accept-Encoding"] = "gzip"
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200
        assert (resp.getheader("Content-Encoding") == "gzip") is gz
        return resp.getheader("Content-Type"), body
    finally:
        conn.close()


def expected(collector: DaemonCollector, accept: str) -> tuple[str, bytes]:
    """What prometheus-client writes for the collector's families with that Accept header."""
    encoder, content_type = choose_encoder(accept)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # a registry of prometheus-client's own: its encoder renders every family
    return content_type, encoder(registry)


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_page_is_what_prometheus_client_writes(served, accept):
    collector, ep = served
    want_type, want = expected(collector, accept)
    assert b"xid" in want and b"finding" in want  # the real families are there (names escaped as asked)
    for gz in (False, True):
        content_type, body = scrape(ep, accept, gz)
        assert content_type == want_type
        assert (gzip.decompress(body) if gz else body) == want


def test_a_change_shows_on_the_next_scrape(served, real_snapshot):
    collector, ep = served
    before = scrape(ep)[1]
    # One sample's value changes, one check's status goes UNKNOWN, a counter moves: each on the next scrape.
    check, samples = next((c, s) for c, s in real_snapshot.samples.items() if s)
    changed = (samples[0]._replace(value=samples[0].value + 12345.5), *samples[1:])
    name = sorted(real_snapshot.results)[0]
    results = {**real_snapshot.results, name: CheckResult(name, Status.UNKNOWN, (), "could not look", 0.5)}
    collector.update(dataclasses.replace(real_snapshot, samples={**real_snapshot.samples, check: changed},
                                         results=results, kmsg_records=real_snapshot.kmsg_records + 7))
    for accept in (PROMETHEUS, ""):
        _, want = expected(collector, accept)
        _, got = scrape(ep, accept)
        assert got == want
    text = got.decode()
    assert f"{samples[0].value + 12345.5}" in text
    assert f'gpuwarden_check_status{{check="{name}",status="unknown"}} 1.0' in text
    assert f"gpuwarden_kmsg_records_total {float(real_snapshot.kmsg_records + 7)}" in text
    assert got != before
    # And back: the page is again what it was.
    collector.update(real_snapshot)
    assert scrape(ep)[1] == before


def test_a_family_that_comes_and_goes(served, real_snapshot):
    collector, ep = served
    new = MetricSample("gpuwarden_test_new_gauge", "A gauge only some snapshots carry.", {"gpu": "0", "uuid": "GPU-x"},
                       1.5)
    collector.update(dataclasses.replace(real_snapshot, samples={**real_snapshot.samples, "extra": (new,)}))
    got = scrape(ep)[1]
    assert got == expected(collector, PROMETHEUS)[1]
    assert b'gpuwarden_test_new_gauge{gpu="0"} 1.5' in got and b'gpuwarden_gpu_info{gpu="0",uuid="GPU-x"}' in got
    collector.update(real_snapshot)
    got = scrape(ep)[1]
    assert got == expected(collector, PROMETHEUS)[1] and b"gpuwarden_test_new_gauge" not in got


def test_an_unchanged_page_is_the_same_bytes(served, real_snapshot):
    collector, ep = served
    first_plain, first_gz = scrape(ep)[1], scrape(ep, gz=True)[1]
    # A new snapshot with the same content (the daemon publishes one after every judgement) changes nothing.
    collector.update(dataclasses.replace(real_snapshot, samples=dict(real_snapshot.samples)))
    assert scrape(ep)[1] == first_plain
    assert scrape(ep, gz=True)[1] == first_gz  # the compressed page too, byte for byte
    assert collector.page(True) is collector.page(True)  # rendered once


def test_samples_read_at_each_scrape_show_at_once(served):
    collector, ep = served
    stalled = [0.0]
    collector.live(lambda: (MetricSample("gpuwarden_loops_stalled", "Stalled loops.", {}, stalled[0]),))
    assert b"gpuwarden_loops_stalled 0.0\n" in scrape(ep)[1]
    stalled[0] = 2.0
    got = scrape(ep)[1]
    assert b"gpuwarden_loops_stalled 2.0\n" in got and got == expected(collector, PROMETHEUS)[1]


def test_text_that_needs_escaping_and_names_outside_the_legacy_set(served, real_snapshot):
    collector, ep = served
    odd = (MetricSample("gpuwarden_test_escaped", 'Help with "quotes", a \\ and a\nnewline.',
                        {"path": 'a "b"\\c\nd', "gpu": "1"}, 1.0),
           MetricSample("gpuwarden_test_unicode", "A label name outside the legacy set.", {"unicodé": "x"}, 1.0),
           MetricSample("gpuwarden_test:colon", "A colon in the name.", {"port": "mlx5_0/1"}, 2.0, "counter"),
           MetricSample("gpuwarden_test_plain_total", "A counter named with its suffix.", {}, 3.0, "counter"),
           MetricSample("gpuwarden_test_values", "Values as Go prints them.", {"v": "big"}, 1.5e22),
           MetricSample("gpuwarden_test_values", "Values as Go prints them.", {"v": "inf"}, float("inf")),
           MetricSample("gpuwarden_test_values", "Values as Go prints them.", {"v": "nan"}, float("nan")),
           MetricSample("gpuwarden_test_values", "Values as Go prints them.", {"v": "small"}, -1e-7))
    collector.update(dataclasses.replace(real_snapshot, samples={**real_snapshot.samples, "odd": odd}))
    for accept in ACCEPTS:
        want_type, want = expected(collector, accept)
        assert scrape(ep, accept) == (want_type, want)
    assert b"gpuwarden_test_plain_total 3.0" in scrape(ep, "")[1]


def test_a_registry_with_another_collector_is_rendered_by_prometheus_client(real_snapshot):
    collector = DaemonCollector(started=1796000000.25)
    collector.update(real_snapshot)
    registry = registry_for(collector)
    Gauge("gpuwarden_test_other", "Another collector's gauge.", registry=registry).set(4)
    ep = MetricsEndpoint("127.0.0.1", 0, registry)
    ep.start()
    try:
        got = scrape(ep)[1]
    finally:
        ep.stop(timeout_s=5)
    assert b"gpuwarden_test_other 4.0" in got and b"gpuwarden_xid_events{" in got


def test_a_family_fed_by_two_checks_follows_either(served, real_snapshot):
    collector, ep = served

    def port(check: str, value: float) -> MetricSample:
        return MetricSample("gpuwarden_test_shared", "Fed by two checks.", {"check": check}, value)

    base = dict(real_snapshot.samples)
    steps = [{"a": (port("a", 1.0),), "b": (port("b", 2.0),)},
             {"a": (port("a", 1.0),), "b": (port("b", 3.0),)},  # only b changed
             {"b": (port("b", 3.0),), "a": (port("a", 1.0),)},  # the checks' order changed: the series' order too
             {"b": (port("b", 3.0), port("a", 9.0)), "a": (port("a", 1.0),)},  # one series twice: the first is kept
             {"a": (port("a", 1.0),)}]
    for step in steps:
        collector.update(dataclasses.replace(real_snapshot, samples={**base, **step}))
        assert scrape(ep)[1] == expected(collector, PROMETHEUS)[1], step


def test_behind_basic_auth_the_page_is_the_same(real_snapshot, tmp_path):
    """A password check is made on a worker thread; the page it answers with is the collector's own."""
    import base64

    import bcrypt

    collector = DaemonCollector(started=1796000000.25)
    collector.update(real_snapshot)
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"basic_auth_users:\n  prometheus: {bcrypt.hashpw(b'pw', bcrypt.gensalt(4)).decode()}\n")
    ep = MetricsEndpoint("127.0.0.1", 0, registry_for(collector), web_config_file=cfg)
    ep.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", ep.port, timeout=10)
        token = base64.b64encode(b"prometheus:pw").decode()
        conn.request("GET", "/metrics", headers={"Accept": PROMETHEUS, "Authorization": f"Basic {token}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    finally:
        ep.stop(timeout_s=5)
    assert resp.status == 200 and body == expected(collector, PROMETHEUS)[1]

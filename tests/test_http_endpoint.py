"""The /metrics endpoint: serves the registry read-only on loopback, and stops although it sleeps in select()."""
from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Gauge

from gpuwarden.agent.http_endpoint import MetricsEndpoint


def registry_with_one_gauge() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("gpuwarden_test_value", "A value for the endpoint test.", registry=reg).set(42)
    return reg


def test_serves_metrics_and_stops():
    ep = MetricsEndpoint("127.0.0.1", 0, registry_with_one_gauge())
    ep.start()
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=5).read().decode()
        assert "gpuwarden_test_value 42.0" in body
    finally:
        ep.stop(timeout_s=5)
    assert not ep._thread.is_alive()  # the serve loop ended (it would otherwise sleep for an hour)


def test_stops_when_never_scraped():
    ep = MetricsEndpoint("127.0.0.1", 0, registry_with_one_gauge())
    ep.start()
    ep.stop(timeout_s=5)
    assert not ep._thread.is_alive()

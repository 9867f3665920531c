"""The endpoint serves the daemon's page without importing prometheus-client: its content negotiation, gzip test and
float formatting are copied (agent/daemon/exposition.py negotiate, _go_float). Each copy
must answer exactly as the installed prometheus-client does, or not at all (None: prometheus-client answers)."""
from __future__ import annotations

import math

import pytest
from gpuwarden.agent.daemon import exposition
from gpuwarden.agent.daemon.exposition import gzip_accepted as _gzip_accepted
from gpuwarden.agent.daemon.exposition import negotiate as _negotiate
from gpuwarden.agent.daemon.exposition import page_format as _page_format
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.utils import floatToGoString

PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
                "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;"
                "q=0.3,*/*;q=0.2")
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
ACCEPTS = [
    "", "*/*", "text/html", "text/plain", "text/plain; version=0.0.4", "text/plain;version=1.0.0",
    "text/plain; version=1.0.0; escaping=underscores", "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots", "text/plain;version=1.0.0;escaping=values",
    "text/plain;version=1.0.0;escaping=bogus", "text/plain;version=2.0.0", "text/plain;version=0.0.1",
    "text/plain;version=x", "text/plain; version =1.0.0", "application/openmetrics-text",
    "application/openmetrics-text; version=1.0.0", "application/openmetrics-text;version=0.0.1",
    "application/openmetrics-text;version=0.0.1,text/plain;version=0.0.4",
    "application/openmetrics-text;version=2.0.0", "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;escaping=allow-utf-8", "application/openmetrics-text;version=1.0.0;escaping=values",
    " application/openmetrics-text ; version=1.0.0 ; escaping=allow-utf-8", "APPLICATION/OPENMETRICS-TEXT",
    "text/plain;version=0.0.4,application/openmetrics-text;version=1.0.0", ",,;;==,", "text/plain;=;version=1.0.0",
    PROMETHEUS_3, PROMETHEUS_2,
]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_negotiation_answers_as_prometheus_client_or_defers(accept):
    ours = _negotiate(accept)
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):  # a version it cannot compare: ours must defer to it
        assert ours is None
        return
    if ours is not None:
        assert ours == (_page_format(encoder), content_type)


def test_negotiation_answers_what_prometheus_asks_without_prometheus_client():
    if not exposition.client_mirrored():
        pytest.skip("the installed prometheus-client is not the version the copies follow: it answers itself")
    for accept in ("", PROMETHEUS_3, PROMETHEUS_2, "application/openmetrics-text; version=1.0.0"):
        assert _negotiate(accept) is not None, accept


@pytest.mark.parametrize("header", ["", "gzip", "GZIP", "deflate, gzip;q=0.5", "gzip-ish", " gzip ", "identity",
                                    "br;q=1.0, gzip;q=0.8, *;q=0.1", ",,"])
def test_gzip_accepted_as_prometheus_client(header):
    assert _gzip_accepted(header) == gzip_accepted(header)


def test_go_float_as_prometheus_client():
    if not exposition.client_mirrored():
        pytest.skip("the installed prometheus-client is not the version the copies follow: its own is used")
    values = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-7, 123456.0, 1234567.0, 12345678.9, 1796000000.5, 1e10, 1.5e15, 1e22,
              2.0 ** 63, -1e22, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308, 3, 10 ** 12]
    values += [x * 10.0 ** e for x in (1.0, 1.25, 9.999) for e in range(-12, 25)]
    for v in values:
        assert exposition._go_float(v) == floatToGoString(v), v

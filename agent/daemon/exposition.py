"""prometheus-client's exposition, mirrored: a family rendered as its generate_latest writes it, its content
negotiation (which format an Accept header gets), its gzip test and its float formatting, as its version 0.26 has
them (byte for byte: tests/test_metrics_mirror.py compares them with the installed one's), so that serving the
daemon's page needs no import of it. Where another version is installed, or a format the page does not have is
asked for, prometheus-client's own code answers (imported then), as it does for a `name[]=` selection.
"""
from __future__ import annotations

import math
import os
import re
import sys
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:  # prometheus-client is imported where its own rendering is needed, not by the daemon
    from gpuwarden.agent.daemon.metrics import Family
    from prometheus_client.core import Metric


# The names the text below is written for; any other name is rendered by prometheus-client (its escaping rules).
_LEGACY_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def render_family(f: Family, openmetrics: bool, encoder: Callable[[Any], bytes] | None = None) -> bytes:
    """One family in the text format or OpenMetrics, as prometheus-client's generate_latest writes it (HELP and
    TYPE lines, label names sorted, values as Go prints floats; OpenMetrics also escapes '"' in HELP)."""
    if not (_LEGACY_NAME.fullmatch(f.name) and all(_LEGACY_NAME.fullmatch(k) for k in f.labels)):
        if encoder is None:
            # at use: prometheus-client, ~100 ms of import (-X importtime), which the daemon's own page never needs
            from prometheus_client.exposition import generate_latest as text_latest
            from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

            encoder = openmetrics_latest if openmetrics else text_latest
        text = encoder(_One(f.metric()))
        return text[:-len(b"# EOF\n")] if openmetrics and text.endswith(b"# EOF\n") else text
    sample = f"{f.name}_total" if f.kind == "counter" else f.name
    head = f.name if openmetrics else sample
    doc = f.help.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        doc = doc.replace('"', r'\"')
    out = [f"# HELP {head} {doc}\n# TYPE {head} {f.kind}\n"]
    order = sorted(range(len(f.labels)), key=f.labels.__getitem__)
    names = [f.labels[i] for i in order]
    go_float = _go_float if client_mirrored() else _client_go_float()
    for values, value in f.rows:
        if names:
            labels = ",".join(f'{n}="{_escape(values[i])}"' for n, i in zip(names, order, strict=True))
            out.append(f"{sample}{{{labels}}} {go_float(value)}\n")
        else:
            out.append(f"{sample} {go_float(value)}\n")
    return "".join(out).encode("utf-8")


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


class _One:
    def __init__(self, metric: Metric):
        self._metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self._metric


class Restricted:
    """The registry with only the samples named (`name[]=`), by prometheus-client's rule (a sample's own name:
    `x_total` for a counter `x`). Its own restricted_registry() finds nothing in a registry whose collector
    does not describe its names in advance, and this one cannot: the checks' series come and go."""

    def __init__(self, registry: Any, names: Iterable[str]):
        self._registry, self._names = registry, frozenset(names)

    def collect(self) -> Iterator[Metric]:
        # at use: prometheus-client, ~100 ms of import (-X importtime); a selection is its rendering, not the page
        from prometheus_client.metrics_core import Metric

        for metric in self._registry.collect():
            samples = [s for s in metric.samples if s.name in self._names]
            if samples:
                m = Metric(metric.name, metric.documentation, metric.type, getattr(metric, "unit", ""))
                m.samples = samples
                yield m


def negotiate(accept: str) -> tuple[tuple[bool, str], str] | None:
    """(the page's format (OpenMetrics?, escaping), the Content-Type) that prometheus-client's choose_encoder
    answers for this Accept header, where it is one the registry's own page renders and this copy of the
    negotiation (of the version client_mirrored() names) is sure of it; None for anything else, which
    prometheus-client then negotiates and renders itself (a version this copy does not know, a format or
    escaping the page does not have, a version number it does not parse)."""
    if not client_mirrored():
        return None
    for accepted in (accept or "").split(","):
        toks = accepted.split(";")
        kind = toks[0].strip()
        if kind not in ("application/openmetrics-text", "text/plain"):
            continue
        version, escaping = _token(toks, "version"), _token(toks, "escaping")
        if escaping not in ("", "underscores", "allow-utf-8"):
            return None  # dots, values, or a name prometheus-client reads as underscores: its answer
        escaping = escaping or "underscores"
        if kind == "application/openmetrics-text":
            if not version:
                return (True, "underscores"), "application/openmetrics-text; version=1.0.0; charset=utf-8"
            if version == "1.0.0":
                return (True, escaping), \
                    f"application/openmetrics-text; version=1.0.0; charset=utf-8; escaping={escaping}"
            if version in ("0.0.1", "0.0.4"):
                continue  # older than 1.0.0: not this entry
            return None
        if version == "1.0.0":
            return (False, escaping), f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}"
        if version not in ("", "0.0.1", "0.0.4"):
            return None
    return (False, "underscores"), "text/plain; version=0.0.4; charset=utf-8"


def _token(toks: list[str], key: str) -> str:
    """The first `key=value` parameter's value, as prometheus-client reads it (its _get_version/_get_escaping)."""
    for tok in toks:
        if "=" not in tok:
            continue
        k, value = tok.strip().split("=", 1)
        if k == key:
            return value
    return ""


def gzip_accepted(header: str) -> bool:
    """prometheus-client's gzip_accepted."""
    return any(accepted.split(";")[0].strip().lower() == "gzip" for accepted in (header or "").split(","))


def encode(accept: str, registry: Any) -> bytes:
    """A registry rendered by the encoder prometheus-client chooses for this Accept header: the page's families
    whose names are outside the legacy character set (render_family)."""
    # at use: prometheus-client, ~100 ms of import (-X importtime), for a family the page cannot write itself
    from prometheus_client.exposition import choose_encoder

    return choose_encoder(accept)[0](registry)


def page_format(encoder: Callable[[Any], bytes]) -> tuple[bool, str] | None:
    """(OpenMetrics?, escaping) of the encoder prometheus-client chose, where a registry's own page renders the
    same bytes: the text format 0.0.4, or OpenMetrics 1.0.0, with names escaped by underscores or allowed as
    UTF-8 (the same text for legacy names). None for anything else (the encoder renders it)."""
    # at use: prometheus-client, ~100 ms of import (-X importtime); its encoder was chosen, so it is loaded already
    from prometheus_client.exposition import generate_latest as text_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    if encoder is text_latest:
        return False, "underscores"
    if encoder is openmetrics_latest:  # prometheus-client before escaping was negotiated
        return True, "underscores"
    if not isinstance(encoder, partial) or encoder.args:
        return None
    kw = encoder.keywords
    escaping = kw.get("escaping", "underscores")
    if escaping not in ("underscores", "allow-utf-8"):
        return None
    if encoder.func is text_latest and set(kw) <= {"escaping"}:
        return False, escaping
    if encoder.func is openmetrics_latest and set(kw) <= {"escaping", "version"} and \
            kw.get("version", "1.0.0") == "1.0.0":
        return True, escaping
    return None


# prometheus-client's content negotiation and float formatting as its version 0.26 has them (byte for byte: a test
# compares them with the installed one's), so that serving the daemon's page needs no import of it (~5 MB of
# http.server, email, urllib, importlib.metadata). Where another version is installed, its own are used.
_MIRRORED_FROM = (0, 26)


def _go_float(d: float) -> str:
    """A float as Go prints it (prometheus-client's utils.floatToGoString)."""
    d = float(d)
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if math.isnan(d):
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    # Past 6 integer digits Go writes an exponent where Python's repr does not; bucket bounds (le) and quantiles,
    # the only floats written as label values, are positive.
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _client_go_float() -> Callable[[float], str]:
    # at use: prometheus-client, ~100 ms of import (-X importtime), only where its version is not the one mirrored
    from prometheus_client.utils import floatToGoString

    return floatToGoString


_mirrored: list[bool] = []


def client_mirrored() -> bool:
    """Whether the installed prometheus-client negotiates and formats as the copies here do: its version, read from
    the name of its metadata folder beside the package (importing it, or importlib.metadata, is what this avoids).
    Unknown (not found, several, not a version) is False: prometheus-client's own code then answers."""
    if not _mirrored:
        _mirrored.append(_client_version() >= _MIRRORED_FROM)
    return _mirrored[0]


def _client_version() -> tuple[int, ...]:
    for entry in sys.path:
        base = entry or "."
        if not os.path.isfile(os.path.join(base, "prometheus_client", "__init__.py")):
            continue
        try:
            names = [n for n in os.listdir(base) if n.startswith("prometheus_client-") and n.endswith(".dist-info")]
        except OSError:
            return ()
        if len(names) != 1:
            return ()
        parts = names[0][len("prometheus_client-"):-len(".dist-info")].split(".")
        numbers = []
        for part in parts[:3]:
            if not part.isdigit():
                break
            numbers.append(int(part))
        return tuple(numbers) if len(numbers) >= 2 else ()
    return ()

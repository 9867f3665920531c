"""Prometheus' HTTP API as `gpuwarden explain --prometheus` asks it (agent/jobs/prometheus_evidence.py): POSTed
queries that share one deadline from the first connect to the last byte, each answer bounded and checked to be the
JSON API's, every failure a PrometheusError that says which and why."""
from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import time
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlencode, urlsplit

from gpuwarden.agent.jobs.http_cutoff import Cutoff


class PrometheusError(Exception):
    """Prometheus could not be asked, or its answer was not its JSON API's: the message says which and why."""


class _Api:
    """Prometheus' HTTP API (/api/v1/query, /api/v1/query_range), POSTed (a thousand nodes' selector is long). All
    the queries of one call share `timeout_s`, from the first connect to the last byte."""

    def __init__(self, url: str, auth: tuple[str, str] | None, ca_file: Path | None, timeout_s: float,
                 max_bytes: int):
        parts = urlsplit(url)
        self.url, self.https = url.rstrip("/"), parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")  # a Prometheus behind a path (--web.route-prefix, a proxy)
        self.auth, self.ca_file, self.timeout_s, self.max_bytes = auth, ca_file, timeout_s, max_bytes
        self.deadline = time.monotonic() + timeout_s

    def instant(self, expr: str, at: float) -> list[Mapping[str, Any]]:
        return self._result(self._post("/api/v1/query", {"query": expr, "time": _stamp(at)}), "vector")

    def range(self, expr: str, start: float, end: float, step: float) -> list[Mapping[str, Any]]:
        return self._result(self._post("/api/v1/query_range", {"query": expr, "start": _stamp(start),
                                                               "end": _stamp(end), "step": _duration(step)}),
                            "matrix")

    def series(self, match: str, start: float, end: float) -> list[Mapping[str, str]]:
        doc = self._post("/api/v1/series", {"match[]": match, "start": _stamp(start), "end": _stamp(end)})
        data = doc.get("data")
        if not isinstance(data, list) or not all(_labels(m) for m in data):
            raise PrometheusError("the answer is not a list of series of Prometheus' series API")
        return data

    def _result(self, doc: Any, kind: str) -> list[Mapping[str, Any]]:
        data = doc.get("data") if isinstance(doc, dict) else None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("resultType") != kind or not isinstance(result, list):
            raise PrometheusError(f"the answer is not a {kind} of Prometheus' query API")
        field = "values" if kind == "matrix" else "value"
        for r in result:
            if not (isinstance(r, dict) and _labels(r.get("metric")) and isinstance(r.get(field), list)):
                raise PrometheusError(f"a result of the {kind} is not a series with its {field}")
            samples = [r["value"]] if kind == "vector" else r["values"]
            if not all(isinstance(p, list) and len(p) == 2 for p in samples):
                raise PrometheusError(f"a sample of the {kind} is not [time, value]")
        return result

    def _post(self, path: str, form: Mapping[str, str]) -> Any:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(f"no complete answer within {self.timeout_s:g} s")
        form = {**form, "timeout": _duration(left)}  # Prometheus stops evaluating when the caller stops waiting
        body = urlencode(form).encode()
        if self.https:
            try:
                ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise PrometheusError(f"cannot read the CA file {self.ca_file}: {exc}") from None
            conn: Any = http.client.HTTPSConnection(self.host, self.port, timeout=left, context=ctx)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=left)
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
                   "User-Agent": "gpuwarden-explain"}
        if self.auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
        cut = Cutoff(conn, left)
        where = f"{self.prefix}{path}"
        try:
            conn.request("POST", where, body=body, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length and length.isdigit() and int(length) > self.max_bytes:
                raise PrometheusError(f"an answer of {int(length)} bytes, over the {self.max_bytes} bytes allowed "
                                      "(a shorter window, or fewer nodes)")
            data = resp.read(self.max_bytes + 1)
        except ssl.SSLError as exc:
            raise PrometheusError(f"TLS failed: {exc.reason or exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            if cut.fired:
                raise PrometheusError(f"no complete answer within {self.timeout_s:g} s") from None
            raise PrometheusError(_why(exc, self.timeout_s)) from None
        finally:
            cut.cancel()
            conn.close()
        if cut.fired:
            raise PrometheusError(f"no complete answer within {self.timeout_s:g} s")
        if len(data) > self.max_bytes:
            raise PrometheusError(f"an answer over the {self.max_bytes} bytes allowed (a shorter window, or fewer "
                                  "nodes)")
        return _answer(resp.status, resp.reason, data, where, self.auth)


def _labels(m: Any) -> bool:
    """Whether `m` is a label set as Prometheus writes one: names and values strings."""
    return isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())


def _answer(code: int, reason: str, data: bytes, path: str, auth: tuple[str, str] | None) -> Any:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and doc.get("status") == "error":
        # Prometheus' own refusal (bad_data, timeout, execution): its words, which name the problem.
        raise PrometheusError(f"HTTP {code}: the query was refused ({doc.get('errorType', '?')}): "
                              f"{str(doc.get('error', ''))[:300]}")
    if code == 401:
        raise PrometheusError("HTTP 401: the user and password were refused" if auth else
                              "HTTP 401: it asks for a user and password (basic auth)")
    if code == 404:
        raise PrometheusError(f"HTTP 404: no {path} there (is this Prometheus' address, with its route prefix?)")
    if code != 200:
        text = data[:200].decode("utf-8", "replace").strip().splitlines()
        raise PrometheusError(f"HTTP {code} {reason}" + (f": {text[0]}" if text else ""))
    if not isinstance(doc, dict) or doc.get("status") != "success":
        text = data[:80].decode("utf-8", "replace").strip().splitlines()
        raise PrometheusError(f"the answer to {path} is not Prometheus' JSON API"
                              + (f" (it begins {text[0]!r})" if text else " (it is empty)"))
    return doc


def _stamp(t: float) -> str:
    return f"{t:.3f}"


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there: Prometheus' address and port?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the name: {exc.strerror or exc}"
    if isinstance(exc, ConnectionResetError):
        return "connection reset before a complete answer (an https server asked in plain http?)"
    if isinstance(exc, OSError):
        return exc.strerror or f"{type(exc).__name__}: {exc}"
    return f"not an HTTP answer: {type(exc).__name__}: {exc}"

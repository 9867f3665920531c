"""What the metrics endpoint (agent/daemon/http_endpoint.py) serves: `/metrics` (Prometheus text or OpenMetrics as
the scraper asks, gzip when it accepts it, `name[]=` to select series as prometheus-client does), `/api/v1/findings`
(the node's findings, transitions and job intents over a window, as JSON: agent/jobs/evidence_window.py) and `/` (a
page that links to them). Any other path is 404. Basic auth, where the web config (agent/core/web_config.py) sets
it, guards every path alike. Which requests the I/O thread answers itself and which go to a worker is said here.
"""
from __future__ import annotations

import base64
import binascii
import gzip
import json
import time
from functools import partial
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs

from gpuwarden.agent.core import logs, web_config
from gpuwarden.agent.daemon.exposition import Restricted, encode, gzip_accepted, negotiate, page_format
from gpuwarden.agent.daemon.http_protocol import Request, response, simple
from gpuwarden.agent.jobs.evidence_window import parse_time, window_problem
from gpuwarden.agent.state.store_errors import StoreError

log = logs.get_logger("gpuwarden.http")

LANDING_PAGE = (b"<!DOCTYPE html>\n<html><head><title>gpuwarden</title></head><body><h1>gpuwarden</h1>\n"
                b"<p>GPU node health agent.</p>\n<p><a href=\"metrics\">Metrics</a></p>\n</body></html>\n")
FINDINGS_PATH = "/api/v1/findings"
_FINDINGS_LINK = (b"<p>Findings, transitions and job intents over a window: <code>api/v1/findings?since=T&amp;"
                  b"until=T</code> (JSON; T a Unix time or an RFC 3339 time)</p>\n")
_GZIP_KEPT = 4
_MAX_QUERY_FIELDS = 256


class Routes:
    """The responses of one endpoint: `registry` the page's (agent/daemon/metrics.py DaemonRegistry, or any
    prometheus-client registry), `web` its web config (None: no auth), `findings(since, until)` the window document
    (None: that path is 404)."""

    def __init__(self, registry: Any, web: web_config.Watched | None,
                 findings: Callable[[float, float], Mapping[str, Any]] | None = None):
        self._registry = registry
        self._findings = findings
        self._landing = LANDING_PAGE if findings is None else LANDING_PAGE.replace(
            b"</p>\n</body>", b"</p>\n" + _FINDINGS_LINK + b"</body>")
        self._web = web
        self._gzipped: list[tuple[bytes, bytes]] = []  # (page, its gzip), the latest first

    def quick(self, req: Request) -> bool:
        """Whether the request is answered on the I/O thread: anything but a password check (bcrypt, ~0.1 s) and a
        page prometheus-client renders (a `name[]=` selection, a format the registry's own page does not have).
        The registry's page is cached and its changed families re-rendered in a few ms; two hand-offs between
        threads would cost more than that while the checks keep the interpreter busy."""
        if self._web is not None and self._web.current().auth:
            return False
        path, _, query = req.target.partition("?")
        if path == FINDINGS_PATH:
            return self._findings is None  # a read of the store: a worker's
        if path != "/metrics":
            return True
        return ("name" not in query and getattr(self._registry, "has_page", False)
                and negotiate(req.headers.get("accept", "")) is not None)

    def answer(self, request: Request) -> tuple[bytes, bool]:
        """The response, and whether the connection closes after it."""
        try:
            payload = self._respond(request)
        except Exception as exc:  # a defect must cost one response, not the connection's worker
            log.error("metrics endpoint: could not answer", error=repr(exc), target=request.target[:200])
            payload = simple(500, "Internal Server Error", "internal error\n", keep=False)
            request.keep_alive = False
        return payload, not request.keep_alive

    def _respond(self, req: Request) -> bytes:
        keep, head_only = req.keep_alive, req.method == "HEAD"
        if self._web is not None:
            cfg = self._web.current()
            if cfg.auth and not self._authorized(cfg, req.headers.get("authorization", "")):
                return simple(401, "Unauthorized", "Unauthorized\n", keep,
                               ("WWW-Authenticate: Basic realm=\"gpuwarden\"",), head_only)
        path, _, query = req.target.partition("?")
        if path not in ("/", "/metrics") and (path != FINDINGS_PATH or self._findings is None):
            return simple(404, "Not Found", "404 page not found\n", keep, head_only=head_only)
        if req.method not in ("GET", "HEAD"):
            return simple(405, "Method Not Allowed", "method not allowed\n", keep, ("Allow: GET, HEAD",), head_only)
        if path == "/":
            return response(200, "OK", self._landing, "text/html; charset=utf-8", keep, (), head_only)
        if path == FINDINGS_PATH:
            return self._window(query, keep, head_only)
        try:
            params = parse_qs(query, max_num_fields=_MAX_QUERY_FIELDS)
        except ValueError:
            return simple(400, "Bad Request", "too many query parameters\n", keep, head_only=head_only)
        accept = req.headers.get("accept", "")
        known = negotiate(accept) if "name[]" not in params and getattr(self._registry, "has_page", False) \
            else None
        if known is not None:
            fmt, content_type = known
            body = self._registry.page(*fmt, partial(encode, accept))
        if known is None or body is None:
            # at use: prometheus-client, ~100 ms of import (-X importtime), which the daemon's own page never needs
            from prometheus_client.exposition import choose_encoder

            encoder, content_type = choose_encoder(accept)
            if "name[]" in params:
                body = encoder(Restricted(self._registry, params["name[]"]))
            else:
                body = self._page(encoder)
        extra: tuple[str, ...] = ("Vary: Accept-Encoding",)
        if gzip_accepted(req.headers.get("accept-encoding", "")):
            body = self._gzip(body)
            extra += ("Content-Encoding: gzip",)
        return response(200, "OK", body, content_type, keep, extra, head_only)

    def _window(self, query: str, keep: bool, head_only: bool) -> bytes:
        """GET /api/v1/findings?since=T[&until=T]: the window document as JSON; 400 with a one-line reason for a
        bad window, 503 when the store cannot be read now (the daemon goes on; the reason names the file)."""
        def bad(reason: str) -> bytes:
            return simple(400, "Bad Request", reason + "\n", keep, head_only=head_only)

        try:
            params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query),
                              max_num_fields=_MAX_QUERY_FIELDS)
        except ValueError:
            return bad("malformed query")
        unknown = sorted(set(params) - {"since", "until"})
        if unknown:
            return bad(f"unknown parameter {unknown[0][:40]!r} (since and until only)")
        if any(len(v) > 1 for v in params.values()):
            return bad("since and until may each be given once")
        if "since" not in params:
            return bad("since is required (a Unix time or an RFC 3339 time, e.g. 2026-12-06T11:00:00Z)")
        try:
            since = parse_time(params["since"][0])
            until = parse_time(params["until"][0]) if "until" in params else time.time()
        except ValueError as exc:
            return bad(str(exc)[:200])
        problem = window_problem(since, until)
        if problem:
            return bad(problem)
        assert self._findings is not None
        try:
            doc = self._findings(since, until)
        except StoreError as exc:
            log.warning("findings: the store could not be read", error=str(exc))
            return simple(503, "Service Unavailable", f"the store could not be read: {str(exc)[:300]}\n", keep,
                           head_only=head_only)
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        return response(200, "OK", body, "application/json", keep, ("Cache-Control: no-store",), head_only)

    def _page(self, encoder: Callable[[Any], bytes]) -> bytes:
        """The registry's own cached page where it has one and the format is one it renders (the text format and
        OpenMetrics 1.0.0 as Prometheus asks for them); otherwise the encoder's rendering of the registry."""
        fmt = page_format(encoder)
        if fmt is not None and getattr(self._registry, "has_page", False):
            body = self._registry.page(*fmt, encoder)
            if body is not None:
                return body
        return encoder(self._registry)

    def _gzip(self, body: bytes) -> bytes:
        """Compressed once per page: an unchanged page (the same bytes object) reuses its compression."""
        cache = self._gzipped
        for plain, packed in cache:
            if plain is body:
                return packed
        # The fastest level: ~8x smaller on this text already. mtime 0: the same page, the same bytes.
        packed = gzip.compress(body, compresslevel=1, mtime=0)
        self._gzipped = [(body, packed), *cache[:_GZIP_KEPT - 1]]  # one per format a scraper asks for
        return packed

    def _authorized(self, cfg: web_config.WebConfig, header: str) -> bool:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, ValueError):
            return False
        assert self._web is not None
        return bool(sep) and self._web.authorized(cfg, user, password)

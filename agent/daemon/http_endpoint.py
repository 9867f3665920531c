"""The read-only HTTP endpoint of `gpuwarden run`: `/metrics` (Prometheus text or OpenMetrics as the scraper
asks, gzip when it accepts it, `name[]=` to select series as prometheus-client does), `/api/v1/findings` (the
node's findings, transitions and job intents over a window, as JSON: agent/jobs/evidence_window.py) and `/` (a
page that links to them). Any other path is 404. Optional TLS and basic auth come from a web config file
(agent/core/web_config.py); they guard every path alike.

Whatever a client does, the endpoint must not take from the checks what they need (file descriptors, threads):
- one thread does all socket I/O on non-blocking sockets through a selector, and answers what is quick itself:
  the daemon's page (cached by its collector, only what changed rendered again, its gzip kept while it is
  unchanged), the landing page, errors. A fixed pool of two threads builds the rest (a bcrypt check takes ~0.1 s;
  a `name[]=` selection or a format the page does not have is prometheus-client's rendering; a findings window is
  a read of the store on a connection of its own; the I/O thread serves the others meanwhile). No thread per
  connection.
- at most `max_connections` are open (64, far under the descriptor limit), at most `max_per_address` from one
  client address. A new connection past either cap takes the place of one that has waited longest for its request
  (agent/daemon/http_guard.py says which), so that a scrape is answered however many slow clients there are.
- every connection has a deadline: a connection's first request head within `head_timeout_s` of its accept (the
  TLS handshake included), a later one within `head_timeout_s` of its first byte (trickling bytes buys a slow
  client nothing), an idle keep-alive connection `idle_timeout_s`, the response written within
  `write_timeout_s`. A request head is at most `max_head_bytes`.
- accept() is paced (`accept_per_s`): clients that reconnect the moment they are closed cannot keep this thread
  busy, and wait in the listen backlog meanwhile. accept() failing for want of descriptors pauses accepting
  briefly instead of spinning on the listener.
A scrape reads only the collector's memory, never hardware. An idle endpoint sleeps in the selector with no
timeout: nothing wakes it while nobody connects.
"""
from __future__ import annotations

import base64
import binascii
import errno
import gzip
import json
import os
import queue
import resource
import selectors
import socket
import threading
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping
from urllib.parse import parse_qs

from gpuwarden.agent.core import logs, web_config
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.daemon.http_guard import AcceptPace, Admission, client_key
from gpuwarden.agent.daemon.metrics import client_mirrored
from gpuwarden.agent.sources.systemd import name_this_thread

if TYPE_CHECKING:  # prometheus-client renders only what the registry's own page does not (see _negotiate)
    from prometheus_client.metrics_core import Metric

log = logs.get_logger("gpuwarden.http")

LANDING_PAGE = (b"<!DOCTYPE html>\n<html><head><title>gpuwarden</title></head><body><h1>gpuwarden</h1>\n"
                b"<p>GPU node health agent.</p>\n<p><a href=\"metrics\">Metrics</a></p>\n</body></html>\n")
FINDINGS_PATH = "/api/v1/findings"
_FINDINGS_LINK = (b"<p>Findings, transitions and job intents over a window: <code>api/v1/findings?since=T&amp;"
                  b"until=T</code> (JSON; T a Unix time or an RFC 3339 time)</p>\n")
_CHUNK = 65536
_GZIP_KEPT = 4
_MAX_QUERY_FIELDS = 256
# Connections waiting to be accepted: more than a flood of clients reconnecting at once, so that a scraper's SYN is
# queued behind them rather than dropped (and retried a second later). The kernel caps it at net.core.somaxconn.
_BACKLOG = 1024


@dataclass(frozen=True)
class Limits:
    max_connections: int = 64
    max_per_address: int = 16  # a Prometheus pair holds one each; a host past this gives way to itself first
    head_timeout_s: float = 5.0  # from the first byte of a request (or the TLS handshake's start) to its last
    idle_timeout_s: float = 5.0  # a connection with no request in flight; Prometheus reconnects at its next scrape
    write_timeout_s: float = 10.0  # to send one response
    max_head_bytes: int = 16384
    workers: int = 2
    accept_pause_s: float = 0.5  # after accept() failed with EMFILE / ENFILE
    # accept()s a second, a burst of accept_burst at once: ~50 us of this thread each, so a reconnecting flood costs
    # it at most ~5 % of a core, and a scraper queued behind 150 such clients waits ~0.15 s.
    accept_per_s: float = 1000.0
    accept_burst: int = 64


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (what the Go runtime does for node_exporter): the
    endpoint caps its own connections, and the checks' files then have room. Returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit", soft=soft, hard=hard, error=str(exc))
    return soft, hard


class _Restricted:
    """The registry with only the samples named (`name[]=`), by prometheus-client's rule (a sample's own name:
    `x_total` for a counter `x`). Its own restricted_registry() finds nothing in a registry whose collector
    does not describe its names in advance, and this one cannot: the checks' series come and go."""

    def __init__(self, registry: Any, names: Iterable[str]):
        self._registry, self._names = registry, frozenset(names)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric

        for metric in self._registry.collect():
            samples = [s for s in metric.samples if s.name in self._names]
            if samples:
                m = Metric(metric.name, metric.documentation, metric.type, getattr(metric, "unit", ""))
                m.samples = samples
                yield m


class _Workers:
    """A fixed pool of threads running what the I/O thread hands over, each started at its first job (what
    concurrent.futures' executor does here, without its futures or the logging module it loads)."""

    def __init__(self, count: int, name: str):
        self._count, self._name = count, name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopped = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the endpoint's workers are stopped")
            self._jobs.put((fn, args))
            if self._idle == 0 and len(self._threads) < self._count:
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._idle = max(0, self._idle - 1)

    def _run(self) -> None:
        name_this_thread(self._name)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a defect costs its one job, never the worker
                log.error("metrics endpoint: a worker's job failed", error=repr(exc))
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Jobs not yet started are dropped; each worker ends after its current one (not waited for)."""
        with self._lock:
            self._stopped = True
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._jobs.put(None)


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    keep_alive: bool


_HANDSHAKE, _READ, _WORK, _WRITE = "handshake", "read", "work", "write"


class _Conn:
    __slots__ = ("sock", "address", "state", "inbuf", "scanned", "out", "off", "close_after", "deadline", "since",
                 "heading", "events", "closed")

    def __init__(self, sock: socket.socket, address: bytes | str, now: float, tls: bool, limits: Limits):
        self.sock = sock
        self.address = address
        self.state = _HANDSHAKE if tls else _READ
        self.inbuf = bytearray()
        self.scanned = 0
        self.out = memoryview(b"")
        self.off = 0
        self.close_after = False
        self.since = now  # when its current wait for a request, or its current response, began
        self.heading = True  # the deadline is the head's: the first request's runs from the accept
        self.deadline = now + limits.head_timeout_s
        self.events = selectors.EVENT_READ
        self.closed = False

    @property
    def idle(self) -> bool:
        return self.state == _READ and not self.inbuf

    @property
    def rank(self) -> int | None:
        """For agent/daemon/http_guard.py: 0 waiting for a request, 1 writing a response, None with a worker."""
        return None if self.state == _WORK else 1 if self.state == _WRITE else 0


class MetricsEndpoint:
    def __init__(self, host: str, port: int, registry: Any, web_config_file: Path | None = None,
                 limits: Limits | None = None,
                 findings: Callable[[float, float], Mapping[str, Any]] | None = None):
        """`findings(since, until)`: the node's window document (agent/jobs/evidence_window.py), served on
        /api/v1/findings; run on a worker, never on the I/O thread. None: that path is 404."""
        self._registry = registry
        self._findings = findings
        self._landing = LANDING_PAGE if findings is None else LANDING_PAGE.replace(
            b"</p>\n</body>", b"</p>\n" + _FINDINGS_LINK + b"</body>")
        self.limits = limits or Limits()
        self._web = web_config.Watched(Path(web_config_file), log) if web_config_file else None
        # What a non-blocking TLS socket raises for want of bytes: ssl (and OpenSSL) is loaded only with a web
        # config, the only way TLS is on; without one nothing raises them and `except ()` catches nothing.
        self._want_read: tuple[type[BaseException], ...] = ()
        self._want_write: tuple[type[BaseException], ...] = ()
        if self._web is not None:
            import ssl

            self._want_read, self._want_write = (ssl.SSLWantReadError,), (ssl.SSLWantWriteError,)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # Never more than a quarter of what the process may open, whatever the configured cap.
        self._max_conns = max(1, min(self.limits.max_connections,
                                     soft // 4 if soft != resource.RLIM_INFINITY else self.limits.max_connections))
        self._admission = Admission(self._max_conns, self.limits.max_per_address)
        self._pace = AcceptPace(self.limits.accept_per_s, self.limits.accept_burst)
        family, _, _, _, addr = socket.getaddrinfo(_host(host), port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(addr)
            self._listener.listen(_BACKLOG)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._done: deque[tuple[_Conn, bytes, bool]] = deque()  # responses the workers built, for the I/O thread
        self._pipe_lock = threading.Lock()  # the workers' wake-up write vs the pipe's close at stop
        self._pipe_open = True
        self._stopping = False
        self._accept_paused_until: float | None = None
        self._shed = self._refused = 0
        self._capped_logged_at = 0.0
        self._pool = _Workers(self.limits.workers, "gw-metrics-work")
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
        self._gzipped: list[tuple[bytes, bytes]] = []  # (page, its gzip), the latest first
        client_mirrored()  # looked up once here, not on the first scrape

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def tls(self) -> bool:
        return self._web is not None and self._web.config.tls is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._close_all()
        self._pool.shutdown()
        with self._pipe_lock:
            if self._pipe_open:
                self._pipe_open = False
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)

    # -- the I/O thread ------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        name_this_thread("gw-metrics-http")
        try:
            while not self._stopping:
                try:
                    for key, _ in self._sel.select(self._timeout()):
                        if key.data == "accept":
                            self._accept()
                        elif key.data == "wake":
                            self._on_wake()
                        else:
                            self._advance(key.data)
                    self._expire()
                except Exception as exc:  # a defect here must not end the endpoint for good
                    log.error("metrics endpoint loop error", error=repr(exc))
                    time.sleep(0.1)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for c in list(self._conns):
            self._close(c)
        try:
            self._sel.close()
        except (OSError, ValueError, KeyError):
            pass
        self._listener.close()

    def _timeout(self) -> float | None:
        deadlines = [c.deadline for c in self._conns if c.state != _WORK]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for c in [c for c in self._conns if c.state != _WORK and c.deadline <= now]:
            self._close(c)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")

    def _accept(self) -> None:
        for _ in range(16):  # then let the selector look at the others
            now = time.monotonic()
            wait = self._pace.take(now)
            if wait:
                self._pause_accepting(now + wait)
                return
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("metrics endpoint: cannot accept, pausing", error=exc.strerror,
                                pause_s=self.limits.accept_pause_s)
                    self._pause_accepting(time.monotonic() + self.limits.accept_pause_s)
                    return
                continue  # ECONNABORTED and the like: that client is gone
            address = client_key(peer)
            taken, victim = self._admission.admit(address)
            if victim is not None:
                self._close(victim)  # type: ignore[arg-type]
                self._shed += 1
            if not taken:
                sock.close()
                self._refused += 1
            if victim is not None or not taken:
                self._note_capped(now)
            if taken:
                self._open(sock, address, now)

    def _pause_accepting(self, until: float) -> None:
        if self._accept_paused_until is None:
            self._sel.unregister(self._listener)
        self._accept_paused_until = until

    def _note_capped(self, now: float) -> None:
        if now - self._capped_logged_at >= 60.0:
            log.warning("metrics endpoint at a connection cap: connections waiting longest closed for new ones, "
                        "or new ones closed while all were being answered", cap=self._max_conns,
                        per_address=self._admission.per_address, shed_since_last_log=self._shed,
                        refused_since_last_log=self._refused)
            self._shed = self._refused = 0
            self._capped_logged_at = now

    def _open(self, sock: socket.socket, address: bytes | str, now: float) -> None:
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cfg = self._web.current() if self._web else None
            if cfg is not None and cfg.tls is not None:
                sock = cfg.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = _Conn(sock, address, now, cfg is not None and cfg.tls is not None, self.limits)
            self._sel.register(sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError) as exc:
            log.debug("metrics endpoint: could not set up a connection", error=str(exc))
            sock.close()
            return
        self._conns.add(conn)
        self._admission.add(conn)
        # The request usually arrived with the handshake: take it now, so that a flood of connections accepted in
        # the same pass cannot evict this one as idle before its request is read.
        self._advance(conn)

    def _close(self, c: _Conn) -> None:
        if c.closed:
            return
        c.closed = True
        self._conns.discard(c)
        self._admission.remove(c)
        if c.state != _WORK:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
        try:
            c.sock.close()
        except OSError:
            pass

    def _want(self, c: _Conn, events: int) -> None:
        if events != c.events:
            self._sel.modify(c.sock, events, c)
            c.events = events

    def _advance(self, c: _Conn) -> None:
        """Move the connection on as far as its socket allows: handshake, read a request, hand it to a worker;
        or write the response, then wait for the next request (keep-alive) or close."""
        if c.closed:
            return
        try:
            while True:
                if c.state == _HANDSHAKE:
                    c.sock.do_handshake()  # type: ignore[attr-defined]
                    c.state = _READ  # the head's deadline, from the accept, goes on
                elif c.state == _READ:
                    request = self._take_request(c)
                    if request is None:
                        data = c.sock.recv(_CHUNK)
                        if not data:
                            self._close(c)
                            return
                        if not c.heading:  # a keep-alive connection's next request begins
                            c.deadline, c.heading = time.monotonic() + self.limits.head_timeout_s, True
                        c.inbuf += data
                    elif isinstance(request, bytes):  # malformed: answered here, and the connection closed
                        self._start_write(c, request, close=True)
                    elif self._quick(request):
                        self._start_write(c, *self._answer(request))
                    else:
                        c.state = _WORK
                        self._sel.unregister(c.sock)
                        self._pool.submit(self._work, c, request)
                        return
                elif c.state == _WRITE:
                    c.off += c.sock.send(c.out[c.off:c.off + _CHUNK])
                    if c.off >= len(c.out):
                        if c.close_after:
                            self._close(c)
                            return
                        c.state, c.out, c.off = _READ, memoryview(b""), 0
                        c.since, c.heading = time.monotonic(), bool(c.inbuf)
                        c.deadline = c.since + (self.limits.head_timeout_s if c.inbuf
                                                else self.limits.idle_timeout_s)
                        self._want(c, selectors.EVENT_READ)
                else:
                    return
        except self._want_read:
            self._want(c, selectors.EVENT_READ)
        except self._want_write:
            self._want(c, selectors.EVENT_WRITE)
        except (BlockingIOError, InterruptedError):
            self._want(c, selectors.EVENT_WRITE if c.state == _WRITE else selectors.EVENT_READ)
        except (OSError, ValueError):  # reset by the peer, a TLS failure, a socket closed under us
            self._close(c)

    def _start_write(self, c: _Conn, payload: bytes, close: bool) -> None:
        c.state, c.out, c.off, c.close_after = _WRITE, memoryview(payload), 0, close
        c.since = time.monotonic()
        c.deadline = c.since + self.limits.write_timeout_s

    def _take_request(self, c: _Conn) -> _Request | bytes | None:
        """The next request in the buffer: a _Request, an error response (bytes), or None (need more bytes)."""
        buf, limit = c.inbuf, self.limits.max_head_bytes
        if buf[:1] in (b"\r", b"\n"):  # CRLFs between requests are allowed before a request line
            stripped = buf.lstrip(b"\r\n")
            del buf[:len(buf) - len(stripped)]
            c.scanned = 0
        start = max(0, c.scanned - 3)
        found = ((buf.find(b"\r\n\r\n", start, limit + 4), 4), (buf.find(b"\n\n", start, limit + 2), 2))
        ends = [(i, n) for i, n in found if i >= 0]
        if not ends:
            c.scanned = len(buf)
            if len(buf) > limit:
                return _simple(431, "Request Header Fields Too Large", "request head too large\n", keep=False)
            return None
        end, sep = min(ends)
        head = bytes(buf[:end])
        del buf[:end + sep]
        c.scanned = 0
        return _parse_head(head)

    def _on_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            c, payload, close = self._done.popleft()
            if c.closed or self._stopping:
                continue
            self._start_write(c, payload, close)
            try:
                self._sel.register(c.sock, selectors.EVENT_WRITE, c)
                c.events = selectors.EVENT_WRITE
            except (OSError, ValueError, KeyError):
                self._close(c)
                continue
            self._advance(c)

    def _wake(self) -> None:
        with self._pipe_lock:
            if self._pipe_open:
                try:
                    os.write(self._wake_w, b"x")
                except (BlockingIOError, InterruptedError):
                    pass  # the pipe already holds a wake-up

    # -- the workers ---------------------------------------------------------------------------------------------
    def _quick(self, req: _Request) -> bool:
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
                and _negotiate(req.headers.get("accept", "")) is not None)

    def _answer(self, request: _Request) -> tuple[bytes, bool]:
        """The response, and whether the connection closes after it."""
        try:
            payload = self._respond(request)
        except Exception as exc:  # a defect must cost one response, not the connection's worker
            log.error("metrics endpoint: could not answer", error=repr(exc), target=request.target[:200])
            payload = _simple(500, "Internal Server Error", "internal error\n", keep=False)
            request.keep_alive = False
        return payload, not request.keep_alive

    def _work(self, c: _Conn, request: _Request) -> None:
        self._done.append((c, *self._answer(request)))
        self._wake()

    def _respond(self, req: _Request) -> bytes:
        keep, head_only = req.keep_alive, req.method == "HEAD"
        if self._web is not None:
            cfg = self._web.current()
            if cfg.auth and not self._authorized(cfg, req.headers.get("authorization", "")):
                return _simple(401, "Unauthorized", "Unauthorized\n", keep,
                               ("WWW-Authenticate: Basic realm=\"gpuwarden\"",), head_only)
        path, _, query = req.target.partition("?")
        if path not in ("/", "/metrics") and (path != FINDINGS_PATH or self._findings is None):
            return _simple(404, "Not Found", "404 page not found\n", keep, head_only=head_only)
        if req.method not in ("GET", "HEAD"):
            return _simple(405, "Method Not Allowed", "method not allowed\n", keep, ("Allow: GET, HEAD",), head_only)
        if path == "/":
            return _response(200, "OK", self._landing, "text/html; charset=utf-8", keep, (), head_only)
        if path == FINDINGS_PATH:
            return self._window(query, keep, head_only)
        try:
            params = parse_qs(query, max_num_fields=_MAX_QUERY_FIELDS)
        except ValueError:
            return _simple(400, "Bad Request", "too many query parameters\n", keep, head_only=head_only)
        accept = req.headers.get("accept", "")
        known = _negotiate(accept) if "name[]" not in params and getattr(self._registry, "has_page", False) \
            else None
        if known is not None:
            fmt, content_type = known
            body = self._registry.page(*fmt, partial(_encode, accept))
        if known is None or body is None:
            from prometheus_client.exposition import choose_encoder

            encoder, content_type = choose_encoder(accept)
            if "name[]" in params:
                body = encoder(_Restricted(self._registry, params["name[]"]))
            else:
                body = self._page(encoder)
        extra: tuple[str, ...] = ("Vary: Accept-Encoding",)
        if _gzip_accepted(req.headers.get("accept-encoding", "")):
            body = self._gzip(body)
            extra += ("Content-Encoding: gzip",)
        return _response(200, "OK", body, content_type, keep, extra, head_only)

    def _window(self, query: str, keep: bool, head_only: bool) -> bytes:
        """GET /api/v1/findings?since=T[&until=T]: the window document as JSON; 400 with a one-line reason for a
        bad window, 503 when the store cannot be read now (the daemon goes on; the reason names the file)."""
        from gpuwarden.agent.jobs.evidence_window import parse_time, window_problem
        from gpuwarden.agent.state.store import StoreError

        def bad(reason: str) -> bytes:
            return _simple(400, "Bad Request", reason + "\n", keep, head_only=head_only)

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
            return _simple(503, "Service Unavailable", f"the store could not be read: {str(exc)[:300]}\n", keep,
                           head_only=head_only)
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        return _response(200, "OK", body, "application/json", keep, ("Cache-Control: no-store",), head_only)

    def _page(self, encoder: Callable[[Any], bytes]) -> bytes:
        """The registry's own cached page where it has one and the format is one it renders (the text format and
        OpenMetrics 1.0.0 as Prometheus asks for them); otherwise the encoder's rendering of the registry."""
        fmt = _page_format(encoder)
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


def _host(host: str) -> str | bytes | None:
    """The host as getaddrinfo takes it: an ASCII name or address as bytes, which it does not IDNA-encode (the
    codec loads unicodedata's tables, ~0.5 MB, for an address like 127.0.0.1); anything else as given."""
    if not host:
        return None
    return host.encode("ascii") if host.isascii() else host


def _negotiate(accept: str) -> tuple[tuple[bool, str], str] | None:
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


def _gzip_accepted(header: str) -> bool:
    """prometheus-client's gzip_accepted."""
    return any(accepted.split(";")[0].strip().lower() == "gzip" for accepted in (header or "").split(","))


def _encode(accept: str, registry: Any) -> bytes:
    """A registry rendered by the encoder prometheus-client chooses for this Accept header: the page's families
    whose names are outside the legacy character set (agent/daemon/metrics.py render_family)."""
    from prometheus_client.exposition import choose_encoder

    return choose_encoder(accept)[0](registry)


def _page_format(encoder: Callable[[Any], bytes]) -> tuple[bool, str] | None:
    """(OpenMetrics?, escaping) of the encoder prometheus-client chose, where a registry's own page renders the
    same bytes: the text format 0.0.4, or OpenMetrics 1.0.0, with names escaped by underscores or allowed as
    UTF-8 (the same text for legacy names). None for anything else (the encoder renders it)."""
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


def _parse_head(head: bytes) -> _Request | bytes:
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        return _simple(400, "Bad Request", "malformed request line\n", keep=False)
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        if version.startswith("HTTP/"):
            return _simple(505, "HTTP Version Not Supported", "HTTP/1.0 and HTTP/1.1 only\n", keep=False)
        return _simple(400, "Bad Request", "malformed request line\n", keep=False)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.rstrip("\r").partition(":")
        if not sep or not name or name != name.strip() or " " in name or "\t" in name:
            return _simple(400, "Bad Request", "malformed header line\n", keep=False)
        key, value = name.lower(), value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
    length = headers.get("content-length", "0").strip()
    if not length.isascii() or not length.isdigit():
        return _simple(400, "Bad Request", "malformed Content-Length\n", keep=False)
    if "transfer-encoding" in headers or int(length.lstrip("0") or "0") > 0:
        keep = False  # a body is never read: the next request's start in the stream is unknown
    return _Request(method, target, version, headers, keep)


def _response(code: int, reason: str, body: bytes, content_type: str, keep: bool, extra: tuple[str, ...] = (),
              head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {code} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}", *extra,
             "Connection: keep-alive" if keep else "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


def _simple(code: int, reason: str, text: str, keep: bool, extra: tuple[str, ...] = (),
            head_only: bool = False) -> bytes:
    return _response(code, reason, text.encode(), "text/plain; charset=utf-8", keep, extra, head_only)

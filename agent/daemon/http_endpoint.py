"""The read-only HTTP endpoint of `gpuwarden run`: its server, what it serves being agent/daemon/http_routes.py's
(`/metrics`, `/api/v1/findings`, `/`). Optional TLS and basic auth come from a web config file
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

import errno
import os
import resource
import selectors
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuwarden.agent.core import logs, web_config
from gpuwarden.agent.daemon.exposition import client_mirrored
from gpuwarden.agent.daemon.http_conn import HANDSHAKE, READ, WORK, WRITE, Conn, Limits, take_request
from gpuwarden.agent.daemon.http_guard import AcceptPace, Admission, client_key
from gpuwarden.agent.daemon.http_protocol import Request
from gpuwarden.agent.daemon.http_routes import Routes
from gpuwarden.agent.daemon.http_workers import Workers
from gpuwarden.agent.sources.systemd import name_this_thread

log = logs.get_logger("gpuwarden.http")

_CHUNK = 65536
# Connections waiting to be accepted: more than a flood of clients reconnecting at once, so that a scraper's SYN is
# queued behind them rather than dropped (and retried a second later). The kernel caps it at net.core.somaxconn.
_BACKLOG = 1024


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


class MetricsEndpoint:
    def __init__(self, host: str, port: int, registry: Any, web_config_file: Path | None = None,
                 limits: Limits | None = None,
                 findings: Callable[[float, float], Mapping[str, Any]] | None = None):
        """`findings(since, until)`: the node's window document (agent/jobs/evidence_window.py), served on
        /api/v1/findings; run on a worker, never on the I/O thread. None: that path is 404."""
        self.limits = limits or Limits()
        self._web = web_config.Watched(Path(web_config_file), log) if web_config_file else None
        self._routes = Routes(registry, self._web, findings)
        # What a non-blocking TLS socket raises for want of bytes: ssl (and OpenSSL) is loaded only with a web
        # config, the only way TLS is on; without one nothing raises them and `except ()` catches nothing.
        self._want_read: tuple[type[BaseException], ...] = ()
        self._want_write: tuple[type[BaseException], ...] = ()
        if self._web is not None:
            # at use: ssl and OpenSSL, ~15 ms of import (-X importtime), needed only with a web config
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
        self._conns: set[Conn] = set()
        self._done: deque[tuple[Conn, bytes, bool]] = deque()  # responses the workers built, for the I/O thread
        self._pipe_lock = threading.Lock()  # the workers' wake-up write vs the pipe's close at stop
        self._pipe_open = True
        self._stopping = False
        self._accept_paused_until: float | None = None
        self._shed = self._refused = 0
        self._capped_logged_at = 0.0
        self._pool = Workers(self.limits.workers, "gw-metrics-work")
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
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
        deadlines = [c.deadline for c in self._conns if c.state != WORK]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for c in [c for c in self._conns if c.state != WORK and c.deadline <= now]:
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
            conn = Conn(sock, address, now, cfg is not None and cfg.tls is not None, self.limits)
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

    def _close(self, c: Conn) -> None:
        if c.closed:
            return
        c.closed = True
        self._conns.discard(c)
        self._admission.remove(c)
        if c.state != WORK:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
        try:
            c.sock.close()
        except OSError:
            pass

    def _want(self, c: Conn, events: int) -> None:
        if events != c.events:
            self._sel.modify(c.sock, events, c)
            c.events = events

    def _advance(self, c: Conn) -> None:
        """Move the connection on as far as its socket allows: handshake, read a request, hand it to a worker;
        or write the response, then wait for the next request (keep-alive) or close."""
        if c.closed:
            return
        try:
            while True:
                if c.state == HANDSHAKE:
                    c.sock.do_handshake()  # type: ignore[attr-defined]
                    c.state = READ  # the head's deadline, from the accept, goes on
                elif c.state == READ:
                    request = take_request(c, self.limits.max_head_bytes)
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
                    elif self._routes.quick(request):
                        self._start_write(c, *self._routes.answer(request))
                    else:
                        c.state = WORK
                        self._sel.unregister(c.sock)
                        self._pool.submit(self._work, c, request)
                        return
                elif c.state == WRITE:
                    c.off += c.sock.send(c.out[c.off:c.off + _CHUNK])
                    if c.off >= len(c.out):
                        if c.close_after:
                            self._close(c)
                            return
                        c.state, c.out, c.off = READ, memoryview(b""), 0
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
            self._want(c, selectors.EVENT_WRITE if c.state == WRITE else selectors.EVENT_READ)
        except (OSError, ValueError):  # reset by the peer, a TLS failure, a socket closed under us
            self._close(c)

    def _start_write(self, c: Conn, payload: bytes, close: bool) -> None:
        c.state, c.out, c.off, c.close_after = WRITE, memoryview(payload), 0, close
        c.since = time.monotonic()
        c.deadline = c.since + self.limits.write_timeout_s

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
    def _work(self, c: Conn, request: Request) -> None:
        self._done.append((c, *self._routes.answer(request)))
        self._wake()


def _host(host: str) -> str | bytes | None:
    """The host as getaddrinfo takes it: an ASCII name or address as bytes, which it does not IDNA-encode (the
    codec loads unicodedata's tables, ~0.5 MB, for an address like 127.0.0.1); anything else as given."""
    if not host:
        return None
    return host.encode("ascii") if host.isascii() else host

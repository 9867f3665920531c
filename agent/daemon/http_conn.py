"""One connection of the metrics endpoint (agent/daemon/http_endpoint.py): where it is (the TLS handshake, reading
a request, with a worker, writing the response), its deadline, and the next request in what it has read; and the
limits every connection is held to (Limits: how many, how long, how large).
"""
from __future__ import annotations

import selectors
import socket

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.daemon.http_protocol import Request, parse_head, simple


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


HANDSHAKE, READ, WORK, WRITE = "handshake", "read", "work", "write"


class Conn:
    __slots__ = ("sock", "address", "state", "inbuf", "scanned", "out", "off", "close_after", "deadline", "since",
                 "heading", "events", "closed")

    def __init__(self, sock: socket.socket, address: bytes | str, now: float, tls: bool, limits: Limits):
        self.sock = sock
        self.address = address
        self.state = HANDSHAKE if tls else READ
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
        return self.state == READ and not self.inbuf

    @property
    def rank(self) -> int | None:
        """For agent/daemon/http_guard.py: 0 waiting for a request, 1 writing a response, None with a worker."""
        return None if self.state == WORK else 1 if self.state == WRITE else 0


def take_request(c: Conn, limit: int) -> Request | bytes | None:
    """The next request in the buffer: a Request, an error response (bytes), or None (need more bytes)."""
    buf = c.inbuf
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
            return simple(431, "Request Header Fields Too Large", "request head too large\n", keep=False)
        return None
    end, sep = min(ends)
    head = bytes(buf[:end])
    del buf[:end + sep]
    c.scanned = 0
    return parse_head(head)

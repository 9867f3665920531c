"""Which connections the metrics endpoint keeps when more arrive than it takes: a cap on connections in all and one
per client address, the order in which connections give way to a new one, and the pace of accept().

A new connection is always taken while anything can give way for it, so that a scrape is answered whatever other
clients do. What gives way is the connection that has waited longest for a request (idle, or still sending its
head: a complete request is answered at once, so a head still incomplete is a slow client's), then the one whose
response has been written longest (a client that does not read); of the new connection's own address when that
address is at its cap, otherwise of the address holding the most. A connection a worker is answering never goes;
when every connection is one, the new one is closed at once.
"""
from __future__ import annotations

import socket
from typing import Protocol


class Guarded(Protocol):
    address: bytes | str  # client_key() of its peer
    since: float  # monotonic time its current phase began (waiting for a request, or writing a response)

    @property
    def rank(self) -> int | None:
        """0 waiting for a request, 1 writing a response, None being answered by a worker (never shed)."""


def client_key(peer: object) -> bytes | str:
    """What the per-address cap counts: the IPv4 address (also where it arrives IPv4-mapped on an IPv6 listener),
    or the IPv6 /64, which one host commonly holds whole (counting single IPv6 addresses would let it open a cap's
    worth per address)."""
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
    if not isinstance(host, str) or ":" not in host:
        return str(host)
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    except OSError:
        return host
    if packed[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, packed[12:])
    return packed[:8]


class Admission:
    """The connections open now, by client address, and which one gives way when a new one arrives."""

    def __init__(self, total: int, per_address: int):
        self.total, self.per_address = total, max(1, min(per_address, total))
        self._by_address: dict[bytes | str, set[Guarded]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def admit(self, address: bytes | str) -> tuple[bool, Guarded | None]:
        """Whether a new connection from `address` is taken, and the connection that must be closed first to make
        room for it (None: there is room)."""
        mine = self._by_address.get(address, ())
        if len(mine) >= self.per_address:
            victim = min((c for c in mine if c.rank is not None), key=_order, default=None)
            return victim is not None, victim
        if self._count < self.total:
            return True, None
        candidates = [c for conns in self._by_address.values() for c in conns if c.rank is not None]
        if not candidates:
            return False, None
        # Waiting before writing; among those, the address holding the most pays first, its oldest first.
        return True, min(candidates, key=lambda c: (c.rank, -len(self._by_address[c.address]), c.since))

    def add(self, conn: Guarded) -> None:
        self._by_address.setdefault(conn.address, set()).add(conn)
        self._count += 1

    def remove(self, conn: Guarded) -> None:
        conns = self._by_address.get(conn.address)
        if conns is None or conn not in conns:
            return
        conns.discard(conn)
        self._count -= 1
        if not conns:
            del self._by_address[conn.address]


def _order(c: Guarded) -> tuple[int, float]:
    return c.rank or 0, c.since


class AcceptPace:
    """A token bucket on accept(): clients that reconnect the moment they are closed would otherwise have the
    endpoint's thread accept and close as fast as they connect, taking the interpreter from the checks' threads.
    Beyond the pace, connections wait in the listen backlog, in the order they came. Once empty, the bucket is let
    fill up to `batch` before accepting again: a pass of the endpoint's loop per `batch` accepts, not per accept."""

    def __init__(self, per_s: float, burst: int, batch: int = 16):
        self.per_s, self.burst, self.batch = per_s, float(burst), float(max(1, min(batch, burst)))
        self._tokens, self._at = float(burst), 0.0

    def take(self, now: float) -> float:
        """0.0 when an accept may go ahead now (and it is counted); else the seconds to wait before the next."""
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (self.batch - self._tokens) / self.per_s

"""A whole-answer deadline for one HTTP connection: what both the node-evidence and the Prometheus readers need,
since a socket timeout bounds each wait, not the whole answer."""
from __future__ import annotations

import socket
import threading
from typing import Any


class Cutoff:
    """Cuts a connection off `timeout_s` after it was made, whatever it waits in (the connect, a trickled head, the
    body)."""

    def __init__(self, conn: Any, timeout_s: float):
        self.conn, self.fired = conn, False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: a TLS one's state is its own
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()

"""The read-only /metrics endpoint of `gpuwarden run`.

prometheus-client's own `start_http_server` runs `serve_forever()` with its default 0.5 s poll, so an idle
agent woke twice a second for nothing. This server sleeps in select() until a request arrives; `stop()` wakes
it with one loopback connection. A scrape reads only the collector's memory (never hardware).
"""
from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import make_wsgi_app

from .systemd import name_this_thread

log = structlog.get_logger("gpuwarden.http")
_IDLE_POLL_S = 3600.0  # serve_forever's select timeout: a wake-up an hour when nobody scrapes


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client must not hold the agent's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every 15 s is not news; errors still reach the client


class MetricsEndpoint:
    def __init__(self, host: str, port: int, registry: Any):
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("Server", (_Server,), {"address_family": family})
        self._server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _serve(self) -> None:
        name_this_thread("gw-metrics-http")
        self._server.serve_forever(poll_interval=_IDLE_POLL_S)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        stopper = threading.Thread(target=self._server.shutdown, name="metrics-http-stop", daemon=True)
        stopper.start()  # shutdown() waits for the loop, which sleeps in select(): wake it with a connection
        deadline = time.monotonic() + timeout_s
        # A poke that lands before shutdown() has raised its flag is served as an empty request and the loop
        # sleeps again: poke until the loop has ended.
        while stopper.is_alive() and time.monotonic() < deadline:
            self._poke()
            stopper.join(0.1)
        self._server.server_close()

    def _poke(self) -> None:
        host, port = self._server.server_address[:2]
        target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        try:
            with socket.create_connection((target, port), timeout=1.0):
                pass
        except OSError as exc:  # the loop then ends at its next hourly wake; the process exits regardless
            log.warning("could not wake the metrics server for shutdown", error=str(exc))

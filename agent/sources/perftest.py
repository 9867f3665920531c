"""perftest loopback on one HCA port: an `ib_write_bw` server in the background and a client to localhost on the
same host, as perftest's own run_perftest_loopback script does (server &, sleep, client localhost, wait).

Live, the server is spawned here (no shell, looked up on PATH like ToolRunner) in a process group of its own,
registered in the running check's scope like any tool (agent/sources/tools.py), and always ended before returning;
the client goes through the ToolRunner. Both are bounded by the check's time and the budget, and both are ended when
the check is cancelled. On a recorded node the client's output is replayed from
tools/ib_write_bw-<hca>-<port>.out (+ .rc / .hang), and the server's from ...-server.out when present.
"""
from __future__ import annotations

import re
import shutil
import socket
import tempfile
import time
from typing import Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import ToolMissing
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.tools import (
    Scope,
    ToolOutput,
    ToolProcess,
    ToolRunner,
    ToolTimeout,
    current_scope,
    read_output,
)

log = logs.get_logger("gpuwarden.perftest")

TOOL = "ib_write_bw"
# The client tried before the server listened: perftest's messages for a refused TCP connection
# (src/perftest_communication.c ethernet_client_connect / main's " Unable to init the socket connection").
_NOT_LISTENING = re.compile(r"Couldn't connect to|Unable to open file descriptor for socket connection")


@dataclass(frozen=True)
class LoopbackOutput:
    client: ToolOutput
    server: ToolOutput | None  # None on a recorded node without ...-server.out
    attempts: int = 1  # client runs (a client that came before the server listened is run again)


def tool_name(hca: str, port: int | str) -> str:
    """The recorded-output name of one port's loopback: tools/ib_write_bw-mlx5_0-1.out."""
    return f"{TOOL}-{hca}-{port}"


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))  # only to learn a free port number; nothing listens beyond loopback
        return int(s.getsockname()[1])


def _stop(server: ToolProcess, grace_s: float) -> None:
    """Let the server finish on its own (it exits after the client's report), then end its group."""
    scope = current_scope()
    if scope is not None:
        left = scope.left()
        grace_s = 0.0 if scope.cancelled else grace_s if left is None else min(grace_s, left)
    server.wait(grace_s)
    problem = server.end()
    if problem:
        log.warning("ib_write_bw server left running", problem=problem)


def _pause(seconds: float, scope: Scope | None) -> None:
    if scope is None:
        time.sleep(seconds)
    elif scope.sleep(seconds):
        raise ToolTimeout(f"{TOOL}: ended: {scope.reason}")


def loopback_pair(tools_runner: ToolRunner, hca: str, port: int | str, args: Sequence[str], timeout_s: float, *,
                  attempts: int = 5, startup_s: float = 1.0, retry_delay_s: float = 0.5,
                  server_grace_s: float = 5.0) -> LoopbackOutput:
    """Run `ib_write_bw <args>` as server and `ib_write_bw <args> localhost` as client on one port.

    `args` are the test's options (-d, -i, -s, -D, ...) without -p and host. Raises ToolMissing when
    ib_write_bw is not installed, ToolError when the client does not finish within `timeout_s`."""
    name = tool_name(hca, port)
    if tools_runner.recorded_dir is not None:
        client = tools_runner.run(name, [TOOL, *args, "localhost"], timeout_s)
        server = None
        if (tools_runner.recorded_dir / f"{name}-server.out").exists():
            server = tools_runner.run(f"{name}-server", [TOOL, *args], timeout_s)
        return LoopbackOutput(client, server)

    exe = shutil.which(TOOL)
    if exe is None:
        raise ToolMissing(f"{TOOL}: not installed (not on PATH; perftest package)")
    tcp = ["-p", str(_free_tcp_port())]
    scope = current_scope()
    limit, _ = scope.bound(timeout_s) if scope is not None else (timeout_s, False)
    deadline = time.monotonic() + limit
    with tempfile.TemporaryFile() as server_out:
        start = time.monotonic()
        server = ToolProcess([exe, *args, *tcp], server_out, scope)
        client_ok = False
        try:
            _pause(startup_s, scope)  # run_perftest_loopback: "give server time to start"
            runs = 0
            while True:
                runs += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    if scope is not None and limit < timeout_s:
                        scope.expired = True  # the check's time, not the pair's own, ran out
                    raise ToolTimeout(f"{TOOL} client on {hca}/{port}: no result within {limit:.3g}s (killed)")
                client = tools_runner.run(name, [TOOL, *args, *tcp, "localhost"], left)
                retry = (client.returncode != 0 and _NOT_LISTENING.search(client.output) is not None
                         and server.poll() is None and runs < attempts)
                if not retry:
                    break
                _pause(retry_delay_s, scope)
            client_ok = client.returncode == 0
        finally:
            # After a good run the server exits by itself once it has sent its report; otherwise it would wait
            # for a client forever.
            _stop(server, server_grace_s if client_ok else 0.1)
        text = read_output(server_out, f"{TOOL} server")
    rc = server.returncode if server.returncode is not None else -9
    return LoopbackOutput(client, ToolOutput(f"{name}-server", (TOOL, *args, *tcp), text, rc,
                                             time.monotonic() - start), runs)

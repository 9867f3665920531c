"""perftest loopback on one HCA port: an `ib_write_bw` server in the background and a client to localhost on the
same host, as perftest's own run_perftest_loopback script does (server &, sleep, client localhost, wait).

Live, the server is spawned here (no shell, looked up on PATH like ToolRunner) and is always killed before
returning; the client goes through the ToolRunner. On a recorded node the client's output is replayed from
tools/ib_write_bw-<hca>-<port>.out (+ .rc / .hang), and the server's from ...-server.out when present.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from ..errors import ToolError, ToolMissing
from .tools import ToolOutput, ToolRunner

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


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """Let the server finish on its own (it exits after the client's report), then TERM, then KILL its group."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


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
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryFile() as server_out:
        start = time.monotonic()
        try:
            server = subprocess.Popen([exe, *args, *tcp], stdout=server_out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise ToolError(f"{TOOL} server: cannot run: {exc.strerror or exc}") from None
        client_ok = False
        try:
            time.sleep(startup_s)  # run_perftest_loopback: "give server time to start"
            runs = 0
            while True:
                runs += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ToolError(f"{TOOL} client on {hca}/{port}: no result within {timeout_s:g}s (killed)")
                client = tools_runner.run(name, [TOOL, *args, *tcp, "localhost"], left)
                retry = (client.returncode != 0 and _NOT_LISTENING.search(client.output) is not None
                         and server.poll() is None and runs < attempts)
                if not retry:
                    break
                time.sleep(retry_delay_s)
            client_ok = client.returncode == 0
        finally:
            # After a good run the server exits by itself once it has sent its report; otherwise it would wait
            # for a client forever.
            _stop(server, server_grace_s if client_ok else 0.1)
        server_out.seek(0)
        text = server_out.read().decode(errors="replace")
    rc = server.returncode if server.returncode is not None else -9
    return LoopbackOutput(client, ToolOutput(f"{name}-server", (TOOL, *args, *tcp), text, rc,
                                             time.monotonic() - start), runs)

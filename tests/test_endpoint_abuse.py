"""The endpoint under abuse, on the real daemon: `gpuwarden run` on a recorded GB200 tray in its own process,
allowed 256 open files, while a thousand idle connections are kept open against it (each one the server closes is
opened again), slow clients trickle request heads, and odd requests arrive (path traversal, `name[]`, a 100 KB
header). Meanwhile an IB port goes down and an XID 79 is logged.

What must hold: the checks keep looking (both faults are found, no check is UNKNOWN, none says "Too many open
files"), a normal scrape succeeds, and the descriptors the daemon holds stay bounded. Loopback only; every loop
is bounded and every socket and process is cleaned up."""
from __future__ import annotations

import errno
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, wait_for

FD_LIMIT = 256  # the daemon's: 1,000 idle connections are four times what it may open
IDLE = 1000
SLOW = 20
ABUSE_MAX_S = 180.0  # no abuser outlives this, whatever happens to the test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def status(state: Path) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(state), "--json"],
                          capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def checks(state: Path) -> dict[str, dict]:
    return {c["check"]: c for c in status(state).get("checks", [])}


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int, path: str = "/metrics", headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Abuser(threading.Thread):
    """Keeps `count` connections open; with `trickle`, each sends a request head a byte at a time and never ends
    it. A connection the server closes is opened again."""

    def __init__(self, port: int, count: int, stop: threading.Event, trickle: bool = False):
        super().__init__(daemon=True)
        self.port, self.count, self.stop, self.trickle = port, count, stop, trickle
        self.opened = self.closed_by_server = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        socks: set[socket.socket] = set()
        begun: set[socket.socket] = set()  # trickling: the request line is out, a header byte follows each round
        end = time.monotonic() + ABUSE_MAX_S
        try:
            while not self.stop.is_set() and time.monotonic() < end:
                for _ in range(min(100, self.count - len(socks))):  # at most 100 new connections per round
                    s = socket.socket()
                    s.setblocking(False)
                    if s.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
                        s.close()
                        break
                    sel.register(s, selectors.EVENT_READ)
                    socks.add(s)
                    self.opened += 1
                for key, _ in sel.select(0.1):
                    s = key.fileobj
                    try:
                        if s.recv(4096):
                            continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    sel.unregister(s)
                    s.close()
                    socks.discard(s)
                    begun.discard(s)
                    self.closed_by_server += 1
                if self.trickle:
                    for s in list(socks):
                        try:
                            s.send(b"z" if s in begun else b"GET /metrics HTTP/1.1\r\nX-Slow: ")
                            begun.add(s)
                        except OSError:
                            pass  # not connected yet, or closed: the next round sees
                    time.sleep(0.2)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
        finally:
            for s in socks:
                s.close()
            sel.close()


@pytest.fixture
def client_fds():
    """The test process itself needs descriptors for its thousand connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE + SLOW + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the test needs {need} open files; the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_abuse_of_the_endpoint_takes_nothing_from_the_checks(scenario_copy, tmp_path, client_fds):
    root, state, port = scenario_copy("gb200-nvl72-healthy"), tmp_path / "state", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root), "--state-dir",
                             str(state), "--listen", f"127.0.0.1:{port}", "--log-format", "json"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit_fds)
    stop = threading.Event()
    abusers = [Abuser(port, IDLE, stop), Abuser(port, SLOW, stop, trickle=True)]
    try:
        wait_for(lambda: len(checks(state)) >= 10, timeout_s=60, what="every check's first look")
        before = checks(state)
        assert all(c["status"] == "ok" for c in before.values()), before
        baseline = fds(proc.pid)
        for a in abusers:
            a.start()
        wait_for(lambda: abusers[0].opened >= IDLE, timeout_s=60, what="a thousand idle connections")
        time.sleep(1.0)  # for the server to have taken them in
        peak = [fds(proc.pid)]

        def sampled(predicate):
            def look():
                peak.append(fds(proc.pid))
                return predicate()
            return look

        # Odd requests, each answered as it should be.
        assert scrape(port, "/../../etc/passwd")[0] == 404
        code, body = scrape(port, "/metrics?name[]=gpuwarden_node_state")
        assert code == 200 and body.count(b"gpuwarden_node_state{") == 5
        assert scrape(port, "/metrics?name[]=x") == (200, b"")
        try:
            assert scrape(port, "/metrics", {"X-Big": "a" * 100_000})[0] == 431
        except (ConnectionResetError, BrokenPipeError, urllib.error.URLError):
            pass  # refused while still writing the head: as good
        # The checks keep looking: faults injected now are found.
        port_dir = root / "sys/class/infiniband/mlx5_1/ports/1"
        (port_dir / "state").write_text("1: DOWN\n")
        (port_dir / "phys_state").write_text("2: Polling\n")
        wait_for(sampled(lambda: any(f["code"] == "ib-port-down"
                                     for f in checks(state).get("ib_port", {}).get("findings", []))),
                 timeout_s=90, what="ib-port-down found under abuse")
        last = max(int(line.split(",")[1]) for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit())
        with open(root / "kmsg", "a") as f:
            f.write(f"3,{last + 1},{(last + 1) * 1000},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', "
                    "name=<unknown>, GPU has fallen off the bus.\n")
        wait_for(sampled(lambda: any(f["code"] == "79"
                                     for f in checks(state).get("xid", {}).get("findings", []))),
                 timeout_s=90, what="XID 79 found under abuse")
        # A normal scrape still succeeds, and shows the node as it is.
        code, body = scrape(port)
        assert code == 200 and b'gpuwarden_node_state{state="quarantined"} 1.0' in body
        after = checks(state)
        assert not [c for c in after.values() if c["status"] == "unknown"], after
        assert not [c for c in after.values() if "open files" in (c["error"] or "")], after
        peak.append(fds(proc.pid))
        # The endpoint's cap (64 connections) plus its two workers' and the selector's few.
        assert max(peak) <= baseline + 64 + 8, (baseline, max(peak))
        assert all(a.is_alive() and a.error is None for a in abusers)
    finally:
        stop.set()
        for a in abusers:
            a.join(30)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "Too many open files" not in err

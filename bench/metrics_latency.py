
"""XID line -> /metrics: the time from an XID line appended to the kernel log that `gpuwarden run` follows to the
first scrape of /metrics that shows it, with /metrics polled every 5 ms (the scrape's own time included).

The real command runs on a copy of a recorded node (default h100-hgx-healthy, 8 GPUs, every passive check at its
production interval). What is watched is the XID's count, `gpuwarden_xid_events{pci=...,xid=...}`, reaching the
number of lines written. Polls are scraped as Prometheus asks (OpenMetrics, gzip) on one keep-alive connection,
on a fixed grid of 5 ms ticks that does not move with the writes (a tick that falls inside a scrape still in
flight is skipped), so a line lands at a random point between two polls.

  fresh   a new daemon per run; the XID is written within a poll interval of /metrics first showing the xid
          check (the daemon's first samples may still be running then): the first XID of a daemon just started
  warm    one daemon at steady state (every check has looked twice), N XIDs one after the other, each after
          the previous one showed, at a random gap of 20-120 ms so that the polls' phase varies

Run: .venv/bin/python bench/metrics_latency.py [--fresh N] [--warm N] [--scenario NAME] [--poll-ms 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rows import write_rows

ROOT = Path(__file__).resolve().parent.parent
ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"  # Prometheus'
HEADERS = {"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "bench-metrics-latency"}
XID = 79
TARGET_MS = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Scraper:
    """One keep-alive connection, reopened after any failure."""

    def __init__(self, port: int):
        self.port, self.conn = port, None

    def get(self) -> bytes | None:
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            self.conn.request("GET", "/metrics", headers=HEADERS)
            resp = self.conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                return None
            return gzip.decompress(body) if resp.getheader("Content-Encoding") == "gzip" else body
        except (OSError, http.client.HTTPException):
            self.close()
            return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Agent:
    """`gpuwarden run` on a copy of a recorded node, and the kernel-log lines appended to it."""

    def __init__(self, work: Path, scenario: str):
        self.root = work / "node"
        shutil.copytree(ROOT / "fixtures" / "nodes" / scenario, self.root, symlinks=True,
                        ignore=shutil.ignore_patterns("tools"))
        nvml = json.loads((self.root / "nvml.json").read_text())
        bus = nvml["gpus"][0]["pci_bus_id"]  # "00000000:19:00.0": the driver prints "0000:19:00"
        self.pci = f"{bus.split(':', 1)[0][-4:]}:{bus.split(':', 1)[1].rsplit('.', 1)[0]}"
        kmsg = (self.root / "kmsg").read_text()
        self.seq = max(int(line.split(",")[1]) for line in kmsg.splitlines() if line[:1].isdigit())
        self.usec = max(int(line.split(",")[2]) for line in kmsg.splitlines() if line[:1].isdigit())
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(self.root),
                                      "--state-dir", str(work / "state"), "--listen", f"127.0.0.1:{self.port}",
                                      "--log-format", "json", "--log-level", "warning"],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.scraper = Scraper(self.port)
        self.written = 0
        self.grid = time.perf_counter()  # the polls' ticks: grid + k * poll interval
        # The line that shows the count; the value is matched on its own (1.0, 2.0, ...).
        self.series = re.compile(rb'^gpuwarden_xid_events\{pci="(?:0000:)?' + re.escape(self.pci[5:]).encode()
                                 + rb'[^"]*",xid="' + str(XID).encode() + rb'"\} (\S+)$', re.M)

    def count(self, page: bytes) -> int:
        m = self.series.search(page)
        return int(float(m.group(1))) if m else 0

    def wait_for(self, needle: bytes, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"gpuwarden run exited with {self.proc.returncode}")
            page = self.scraper.get()
            if page is not None and needle in page:
                return
            time.sleep(0.005)
        raise SystemExit(f"/metrics did not show {needle!r} within {timeout_s} s")

    def inject(self, poll_s: float, timeout_s: float = 30.0) -> float:
        """Appends one XID line; seconds until a poll's page shows it."""
        self.seq += 1
        self.usec += 1000
        line = (f"3,{self.seq},{self.usec},-;NVRM: Xid (PCI:{self.pci}): {XID}, pid='<unknown>', "
                f"name=<unknown>, GPU has fallen off the bus.\n")
        want = self.written + 1
        t0 = time.perf_counter()
        with open(self.root / "kmsg", "a") as f:
            f.write(line)
        self.written = want
        while True:
            # The polls keep their own grid, whenever the line was written (as a scraper's interval does).
            now = time.perf_counter()
            time.sleep(poll_s - (now - self.grid) % poll_s)
            page = self.scraper.get()
            now = time.perf_counter()
            if page is not None and self.count(page) >= want:
                return now - t0
            if now - t0 > timeout_s:
                raise SystemExit(f"XID {want} not on /metrics within {timeout_s} s")

    def stop(self) -> None:
        self.scraper.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fresh(runs: int, scenario: str, poll_s: float) -> list[float]:
    out = []
    rng = random.Random(1)
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="gw-latency-") as tmp:
            agent = Agent(Path(tmp), scenario)
            try:
                agent.wait_for(b'gpuwarden_check_success{check="xid"} 1.0')
                # Written at a random point between two polls, as an XID comes whenever it comes.
                time.sleep(rng.uniform(0, poll_s))
                out.append(agent.inject(poll_s))
            finally:
                agent.stop()
    return out


def warm(runs: int, scenario: str, poll_s: float) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory(prefix="gw-latency-") as tmp:
        agent = Agent(Path(tmp), scenario)
        try:
            # Steady state: every check has looked twice (the clock-event ratios need two readings).
            agent.wait_for(b"gpuwarden_gpu_clock_event_ratio{")
            rng = random.Random(1)
            for _ in range(runs):
                time.sleep(rng.uniform(0.02, 0.12))
                out.append(agent.inject(poll_s))
        finally:
            agent.stop()
    return out


def row(name: str, values: list[float], args: argparse.Namespace, mode: str) -> dict:
    ms = [v * 1000 for v in values]
    p99 = pct(ms, 0.99)
    other = "warm" if mode == "fresh" else "fresh"
    return {"measure": f"XID line -> /metrics, {name}, polled every {args.poll_ms:g} ms", "ours": round(p99, 2),
            "unit": "ms (p99)", "peer": None, "peer_name": None, "ratio": None, "target": f"p99 < {TARGET_MS:g} ms",
            "met": p99 < TARGET_MS,
            "command": f".venv/bin/python bench/metrics_latency.py --{mode} {len(values)} --{other} 0 "
                       f"--scenario {args.scenario}",
            "detail": {"runs": len(ms), "p50_ms": round(pct(ms, 0.5), 2), "p99_ms": round(p99, 2),
                       "max_ms": round(max(ms), 2), "scenario": args.scenario, "poll_ms": args.poll_ms}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", type=int, default=10, help="runs, each on a new daemon")
    ap.add_argument("--warm", type=int, default=100, help="XIDs written to one daemon at steady state")
    ap.add_argument("--scenario", default="h100-hgx-healthy")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--json", type=Path, help="write the rows here (bench/run reads them)")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    load_before = list(os.getloadavg())
    rows = []
    for name, mode, fn, runs in (("fresh daemon (first XID)", "fresh", fresh, args.fresh),
                                 ("warm daemon", "warm", warm, args.warm)):
        if runs <= 0:
            continue
        values = fn(runs, args.scenario, args.poll_ms / 1000)
        r = row(name, values, args, mode)
        rows.append(r)
        d = r["detail"]
        print(f"{r['measure']}: {d['runs']} runs, p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms, "
              f"max {d['max_ms']:.1f} ms (target {r['target']}: {'met' if r['met'] else 'NOT met'})")
    if args.json:
        write_rows(args.json, rows, load_before)


if __name__ == "__main__":
    main()

"""Scrape benchmark: `gpuwarden run` on a recorded node beside node_exporter (Debian's prometheus-node-exporter,
default collectors, on this machine), both on 127.0.0.1.

Each target is scraped as Prometheus asks (OpenMetrics preferred, gzip accepted), N times, the two targets in
turn so that a change of load on the machine hits both alike, after a warm-up. Two ways: a new connection per
scrape (what Prometheus does against gpuwarden, whose idle keep-alive is shorter than a scrape interval) and one
kept-alive connection. Per target: page size (raw and as sent), series, wall time per scrape (median, p90, p99,
client included) and the server's CPU per scrape (its user+sys time over the run / N, from psutil).

Run: .venv/bin/python bench/scrape.py [--scrapes N] [--scenario NAME] [--node-exporter PATH]
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"  # Prometheus'
HEADERS = {"Accept": ACCEPT, "Accept-Encoding": "gzip", "User-Agent": "bench-scrape"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
    conn.request("GET", "/metrics", headers=HEADERS)
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, resp.status
    return len(body), gzip.decompress(body) if resp.getheader("Content-Encoding") == "gzip" else body


def wait_ready(port: int, needle: bytes, timeout_s: float = 60.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            _, text = get(conn)
            conn.close()
            if needle in text:
                return text
        except (OSError, AssertionError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise SystemExit(f"port {port}: not ready with {needle!r} after {timeout_s}s")


def series(text: bytes) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))


def measure(targets: dict[str, tuple[int, psutil.Process]], n: int, fresh: bool) -> dict[str, dict]:
    walls: dict[str, list[float]] = {name: [] for name in targets}
    sent: dict[str, int] = {}
    cpu0 = {name: sum(proc.cpu_times()[:2]) for name, (_, proc) in targets.items()}
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name, (port, _) in targets.items()}
    for _ in range(n):
        for name, (port, _) in targets.items():
            if fresh:
                conns[name].close()
                conns[name] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            t0 = time.perf_counter()
            sent[name], _ = get(conns[name])
            walls[name].append(time.perf_counter() - t0)
    for c in conns.values():
        c.close()
    out = {}
    for name, (_, proc) in targets.items():
        w = sorted(walls[name])
        out[name] = {"sent": sent[name], "median_ms": 1000 * statistics.median(w),
                     "p90_ms": 1000 * w[int(0.9 * (len(w) - 1))], "p99_ms": 1000 * w[int(0.99 * (len(w) - 1))],
                     "cpu_ms": 1000 * (sum(proc.cpu_times()[:2]) - cpu0[name]) / n}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--scenario", default="h100-hgx-healthy")
    ap.add_argument("--node-exporter", default=shutil.which("prometheus-node-exporter") or "node_exporter")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-scrape-"))
    procs: list[subprocess.Popen] = []
    try:
        root = work / "node"
        shutil.copytree(ROOT / "fixtures" / "nodes" / args.scenario, root, symlinks=True,
                        ignore=shutil.ignore_patterns("tools"))
        gw_port, ne_port = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(root),
                                       "--state-dir", str(work / "state"), "--listen", f"127.0.0.1:{gw_port}",
                                       "--log-format", "json", "--log-level", "warning"],
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([args.node_exporter, f"--web.listen-address=127.0.0.1:{ne_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # gpuwarden at steady state: every check has looked twice (the clock-event ratios need two readings).
        gw_text = wait_ready(gw_port, b"gpuwarden_gpu_clock_event_ratio{")
        ne_text = wait_ready(ne_port, b"node_cpu_seconds_total")
        targets = {"gpuwarden": (gw_port, psutil.Process(procs[0].pid)),
                   "node_exporter": (ne_port, psutil.Process(procs[1].pid))}
        measure(targets, 20, fresh=True)  # warm-up
        version = subprocess.run([args.node_exporter, "--version"], capture_output=True, text=True)
        print(f"scenario {args.scenario}; {args.scrapes} scrapes per target and mode; "
              f"{(version.stdout or version.stderr).splitlines()[0]} (default collectors)")
        for name, text in (("gpuwarden", gw_text), ("node_exporter", ne_text)):
            print(f"  {name:<14} page {len(text):>7} bytes, {series(text):>5} series")
        for fresh in (True, False):
            print("new connection per scrape" if fresh else "one keep-alive connection")
            for name, r in measure(targets, args.scrapes, fresh).items():
                print(f"  {name:<14} sent {r['sent']:>6} B  wall median {r['median_ms']:6.2f} ms  p90 "
                      f"{r['p90_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  server CPU {r['cpu_ms']:5.2f} ms/scrape")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

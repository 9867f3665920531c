"""Scrape benchmark: `gpuwarden run` on a recorded node beside node_exporter (Debian's prometheus-node-exporter,
default collectors, on this machine), both on 127.0.0.1.

Each target is scraped as Prometheus asks (OpenMetrics preferred, gzip accepted), N times, the two targets in
turn so that a change of load on the machine hits both alike, after a warm-up. Two ways: a new connection per
scrape (what Prometheus does against gpuwarden, whose idle keep-alive is shorter than a scrape interval) and one
kept-alive connection; then a few scrapes seconds apart, between which the checks look again (an unchanged page
is served from gpuwarden's cache; these show a page that changed). Per target: page size (raw and as sent),
series, wall time per scrape (median, p90, p99, client included) and the server's CPU per scrape (its user+sys
time over the back-to-back run / N, from psutil).

With `--json PATH` the rows of the comparison go there too (bench/run reads them): wall median per scrape in
each way, and the server's CPU per scrape, each with node_exporter's and the ratio (target: at most half of it).

Run: .venv/bin/python bench/scrape.py [--scrapes N] [--spaced N --gap-s S] [--scenario NAME] [--node-exporter PATH]
     [--json PATH]
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rows import write_rows

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


def measure(targets: dict[str, tuple[int, psutil.Process]], n: int, fresh: bool, gap_s: float = 0.0) \
        -> dict[str, dict]:
    walls: dict[str, list[float]] = {name: [] for name in targets}
    sent: dict[str, int] = {}
    cpu0 = {name: sum(proc.cpu_times()[:2]) for name, (_, proc) in targets.items()}
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name, (port, _) in targets.items()}
    for i in range(n):
        if gap_s and i:
            time.sleep(gap_s)
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


TARGET_RATIO = 0.5


def rows(results: dict[bool, dict[str, dict]], pages: dict[str, bytes], args: argparse.Namespace,
         ne_version: str) -> list[dict]:
    """The JSON rows: ours beside node_exporter's, wall time per scrape in each way and the server's CPU."""
    command = (f".venv/bin/python bench/scrape.py --scrapes {args.scrapes} --spaced {args.spaced} "
               f"--gap-s {args.gap_s:g} --scenario {args.scenario}")
    out = []
    for label, key, mode in (("wall median, a new connection per scrape", "median_ms", True),
                             ("wall median, one keep-alive connection", "median_ms", False),
                             ("server CPU per scrape", "cpu_ms", True),
                             (f"wall median, scrapes {args.gap_s:g} s apart (the page changed between them)",
                              "median_ms", "spaced")):
        ours, peer = results[mode]["gpuwarden"], results[mode]["node_exporter"]
        if mode == "spaced":  # CPU over seconds of idle work is not a scrape's
            ours, peer = ({k: v for k, v in r.items() if k != "cpu_ms"} for r in (ours, peer))
        ratio = ours[key] / peer[key] if peer[key] > 0 else None
        out.append({
            "measure": f"/metrics scrape, idle {args.scenario}: {label}", "ours": round(ours[key], 3), "unit": "ms",
            "peer": round(peer[key], 3), "peer_name": f"prometheus-node-exporter {ne_version} (default collectors)",
            "ratio": round(ratio, 3) if ratio is not None else None,
            "target": f"<= {TARGET_RATIO:g}x node_exporter", "met": ratio is not None and ratio <= TARGET_RATIO,
            "command": command,
            "detail": {"scrapes": args.spaced if mode == "spaced" else args.scrapes,
                       "new_connection_per_scrape": mode is not False,
                       "gap_s": args.gap_s if mode == "spaced" else 0.0,
                       "gpuwarden": {k: round(v, 3) for k, v in ours.items()},
                       "node_exporter": {k: round(v, 3) for k, v in peer.items()},
                       "page_bytes": {n: len(t) for n, t in pages.items()},
                       "series": {n: series(t) for n, t in pages.items()}}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--spaced", type=int, default=15, help="scrapes --gap-s apart, after the back-to-back ones")
    ap.add_argument("--gap-s", type=float, default=2.0)
    ap.add_argument("--scenario", default="h100-hgx-healthy")
    ap.add_argument("--node-exporter", default=shutil.which("prometheus-node-exporter") or "node_exporter")
    ap.add_argument("--json", type=Path, help="write the rows here (bench/run reads them)")
    args = ap.parse_args()
    if shutil.which(args.node_exporter) is None:
        raise SystemExit(f"{args.node_exporter}: not found (apt-get install prometheus-node-exporter)")
    load_before = list(os.getloadavg())
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
        version_line = (version.stdout or version.stderr).splitlines()[0]
        print(f"scenario {args.scenario}; {args.scrapes} scrapes per target and mode; {version_line} "
              "(default collectors)")
        pages = {"gpuwarden": gw_text, "node_exporter": ne_text}
        for name, text in pages.items():
            print(f"  {name:<14} page {len(text):>7} bytes, {series(text):>5} series")
        results = {}
        for mode in (True, False, "spaced"):
            print({True: "new connection per scrape", False: "one keep-alive connection",
                   "spaced": f"{args.spaced} scrapes {args.gap_s:g} s apart, a new connection each (the checks look "
                             "again between scrapes: the page has changed)"}[mode])
            results[mode] = (measure(targets, args.spaced, True, args.gap_s) if mode == "spaced"
                             else measure(targets, args.scrapes, mode))
            for name, r in results[mode].items():
                cpu = f"server CPU {r['cpu_ms']:5.2f} ms/scrape" if mode != "spaced" else ""
                print(f"  {name:<14} sent {r['sent']:>6} B  wall median {r['median_ms']:6.2f} ms  p90 "
                      f"{r['p90_ms']:6.2f}  p99 {r['p99_ms']:6.2f}  {cpu}")
        ne_version = version_line.split("version", 1)[-1].split()[0] if "version" in version_line else "?"
        out = rows(results, pages, args, ne_version)
        for r in out:
            print(f"  {r['measure']}: ours/node_exporter {r['ratio']} (target {r['target']}: "
                  f"{'met' if r['met'] else 'NOT met'})")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        write_rows(args.json, out, load_before)


if __name__ == "__main__":
    main()

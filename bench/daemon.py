"""Daemon benchmarks on recorded nodes (production intervals unless noted):

  latency   time from an XID line appended to the followed kernel log to the node's state change (p50/p99),
            and from an IB port's state file going DOWN to the action (cordon) reaching the adapter
  idle      CPU (% of one core) and RSS of `gpuwarden run` on the 8-GPU, 9-port H100 scenario
  flood     kernel-log throughput: N records appended at once, time until the daemon has consumed them all

Run: .venv/bin/python bench/daemon.py latency|idle|flood [--runs N] [--seconds S] [--lines N] [--live]
"""
from __future__ import annotations

import argparse
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

from gpuwarden.agent import config
from gpuwarden.agent.adapters.local import LocalAdapter
from gpuwarden.agent.daemon import Daemon, DaemonOptions
from gpuwarden.agent.metrics import DaemonCollector
from gpuwarden.agent.node import Node
from gpuwarden.agent.state import NodeState
from gpuwarden.agent.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
XID79 = ("3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.\n")
NOISE = "6,{seq},{usec},-;mlx5_core 0000:03:00.0: poll_health: device's health compromised - reached miss count\n"


def last_seq(path: Path) -> int:
    return max(int(line.split(",")[1]) for line in path.read_text().splitlines() if line[:1].isdigit())


def new_daemon(work: Path, scenario: str) -> tuple[Daemon, Path, Store]:
    root = work / "node"
    shutil.copytree(NODES / scenario, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    store = Store(work / "state" / "state.db")
    specs = all_specs()
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(specs), store,
               LocalAdapter(work / "state" / "actions.jsonl"), DaemonCollector(), DaemonOptions())
    d.start()
    return d, root, store


def wait(pred, timeout_s: float = 30.0) -> float:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if pred():
            return time.perf_counter()
        time.sleep(0.0005)
    raise TimeoutError


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def latency(runs: int) -> None:
    xid, ib = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            d, root, store = new_daemon(Path(tmp), "gb200-nvl72-healthy")
            try:
                wait(lambda d=d: "xid" in d.results())
                seq = last_seq(root / "kmsg") + 1
                t0 = time.perf_counter()
                with open(root / "kmsg", "a") as f:
                    f.write(XID79.format(seq=seq, usec=seq * 1000))
                xid.append(wait(lambda d=d: d.record.state is not NodeState.HEALTHY) - t0)
            finally:
                d.stop()
                store.close()
        if any(s.name == "ib_port" for s in PASSIVE):
            with tempfile.TemporaryDirectory() as tmp:
                d, root, store = new_daemon(Path(tmp), "gb200-nvl72-healthy")
                try:
                    wait(lambda d=d: "ib_port" in d.results())
                    port = root / "sys/class/infiniband/mlx5_1/ports/1"
                    t0 = time.perf_counter()
                    (port / "state").write_text("1: DOWN\n")
                    (port / "phys_state").write_text("2: Polling\n")
                    ib.append(wait(lambda d=d: any(a["action"] == "cordon" for a in d.adapter.actions()), 60) - t0)
                finally:
                    d.stop()
                    store.close()
    print(f"XID line -> state change, {len(xid)} runs: p50 {pct(xid, .5) * 1000:.1f} ms, "
          f"p99 {pct(xid, .99) * 1000:.1f} ms, max {max(xid) * 1000:.1f} ms")
    if ib:
        print(f"IB port down -> cordon action, {len(ib)} runs: p50 {pct(ib, .5):.2f} s, p99 {pct(ib, .99):.2f} s, "
              f"max {max(ib):.2f} s")


def idle(seconds: float, live: bool) -> None:
    """`live`: the machine's own /dev/kmsg, sysfs and NVML instead of the recorded H100 node."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "node"
        shutil.copytree(NODES / "h100-hgx-healthy", root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        where = [] if live else ["--root", str(root)]
        proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "run", *where,
                                 "--state-dir", str(Path(tmp) / "state"), "--listen", f"127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            p = psutil.Process(proc.pid)
            time.sleep(5)  # start-up (imports, first samples) is not idle
            if proc.poll() is not None:
                raise SystemExit(f"gpuwarden run exited with {proc.returncode}")
            c0, t0, s0 = p.cpu_times(), time.perf_counter(), thread_runtimes(proc.pid)
            rss = []
            while time.perf_counter() - t0 < seconds:
                rss.append(p.memory_info().rss)
                time.sleep(1)
            c1, t1, s1 = p.cpu_times(), time.perf_counter(), thread_runtimes(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
    cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
    print(f"idle over {t1 - t0:.0f} s ({'live, this machine' if live else 'h100-hgx-healthy'}, {len(PASSIVE)} passive "
          "checks at production intervals): "
          f"CPU {cpu:.3f} % of one core; RSS median {statistics.median(rss) / 2**20:.1f} MB, "
          f"max {max(rss) / 2**20:.1f} MB")
    per_thread = {name: ns - s0.get(name, 0) for name, ns in s1.items()}
    print("  per thread (schedstat run time, % of one core): " + ", ".join(
        f"{name} {ns / 1e9 / (t1 - t0) * 100:.3f}" for name, ns in sorted(per_thread.items(), key=lambda kv: -kv[1])
        if ns > 0))


def thread_runtimes(pid: int) -> dict[str, int]:
    """Nanoseconds each of the process's threads has run, by thread name (the daemon names its threads gw-*;
    /proc/<pid>/task/<tid>/schedstat is exact where cpu_times() counts 10 ms ticks)."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[name] = out.get(name, 0) + int(f.read().split()[0])
        except OSError:
            pass  # a thread that ended meanwhile
    return out


def flood(lines: int) -> None:
    """The flood is written before the daemon starts, so the figure is the follower + parser + consumers + store,
    not the time it takes this script to write 100 MB."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = work / "node"
        shutil.copytree(NODES / "gb200-nvl72-healthy", root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
        seq = last_seq(root / "kmsg") + 1
        boot = seq - 1 - sum(1 for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit()) + 1
        with open(root / "kmsg", "a") as f:
            f.write("".join((XID79 if i % 1000 == 999 else NOISE).format(seq=seq + i, usec=(seq + i) * 10)
                            for i in range(lines)))
        store = Store(work / "state" / "state.db")
        specs = all_specs()
        d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), config.defaults(specs), store,
                   LocalAdapter(work / "state" / "actions.jsonl"), DaemonCollector(), DaemonOptions())
        total = lines + (seq - boot)
        t0 = time.perf_counter()
        d.start()
        try:
            t1 = wait(lambda: d.collector._snap.kmsg_records >= total, 600)
            got = d.collector._snap.kmsg_records
            (inc,) = [f for f in d.results()["xid"].findings if f.code == "79"]
        finally:
            d.stop()
            store.close()
    print(f"flood: {total} records (boot log + {lines}) consumed in {t1 - t0:.2f} s = "
          f"{total / (t1 - t0) / 1e6:.2f} M lines/s; records counted {got}, XID 79 events {inc.evidence['count']} "
          f"(expected {lines // 1000})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("latency", "idle", "flood"))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--live", action="store_true", help="idle: this machine's own kernel log, sysfs and NVML")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    {"latency": lambda: latency(args.runs), "idle": lambda: idle(args.seconds, args.live),
     "flood": lambda: flood(args.lines)}[args.what]()


if __name__ == "__main__":
    main()

"""Daemon benchmarks on recorded nodes (production intervals unless noted):

  latency   time from an XID line appended to the followed kernel log to the node's state change (p50/p99),
            and from an IB port's state file going DOWN to the action (cordon) reaching the adapter
  idle      CPU (% of one core), RSS and /metrics page size of `gpuwarden run` at idle on a recorded node: the
            8-GPU, 9-port H100 scenario, another (--scenario), or N GPUs' worth (--gpus 72: the H100 node's GPUs,
            PCI devices and IB ports copied N/8 times into a temporary folder, one PCI domain per copy)
  flood     kernel-log throughput: N records appended at once, time until the daemon has consumed them all

Run: .venv/bin/python bench/daemon.py latency|idle|flood [--runs N] [--seconds S] [--lines N] [--live]
     .venv/bin/python bench/daemon.py idle [--scenario NAME | --gpus N] [--seconds S] [--json PATH]
     .venv/bin/python bench/daemon.py growth [--seconds S] [--json PATH]   (idle at 1, 8 and 72 GPUs, in turn)
With --json the rows are written as bench/run reads them (measure, ours, unit, target, met, command, detail).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs
from rows import write_rows

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


IDLE_SCENARIO = "h100-hgx-healthy"
IDLE_TARGETS = {"cpu": 0.05, "rss": 32.0}  # % of one core, MB: on the 8-GPU, 9-port node at production intervals


def idle(seconds: float, live: bool, scenario: str = IDLE_SCENARIO, gpus: int | None = None) -> dict:
    """`live`: the machine's own /dev/kmsg, sysfs and NVML instead of a recorded node. Returns the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "node"
        if gpus is not None:
            scale_node(NODES / IDLE_SCENARIO, root, gpus)
        else:
            shutil.copytree(NODES / scenario, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
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
            # The page as a scrape sees it, once before the measured span (a scrape is not idle): plain text, and
            # OpenMetrics as Prometheus asks for it (gzip).
            page = scrape(port, None)
            om_gzip = scrape(port, "application/openmetrics-text; version=1.0.0", gzip=True)
            c0, t0, s0 = process_cpu_s(p), time.perf_counter(), thread_runtimes(proc.pid)
            rss = []
            while time.perf_counter() - t0 < seconds:
                rss.append(p.memory_info().rss)
                time.sleep(1)
            c1, t1, s1 = process_cpu_s(p), time.perf_counter(), thread_runtimes(proc.pid)
            memory = smaps_rollup(proc.pid)
            threads = p.num_threads()
        finally:
            proc.terminate()
            proc.wait(10)
        shape = node_shape(root) if not live else {}
    span = t1 - t0
    cpu = (c1 - c0) / span * 100
    per_thread = {name: ns - s0.get(name, 0) for name, ns in s1.items()}
    thread_cpu = {name: round(ns / 1e9 / span * 100, 4)
                  for name, ns in sorted(per_thread.items(), key=lambda kv: -kv[1]) if ns > 0}
    what = "live, this machine" if live else (f"{gpus} GPUs' worth of {IDLE_SCENARIO}" if gpus else scenario)
    print(f"idle over {span:.0f} s ({what}, {len(PASSIVE)} passive checks at production intervals): "
          f"CPU {cpu:.3f} % of one core; RSS median {statistics.median(rss) / 2**20:.1f} MB, "
          f"max {max(rss) / 2**20:.1f} MB; /metrics {len(page)} bytes (OpenMetrics gzip {len(om_gzip)})")
    print("  per thread (schedstat run time, % of one core): " + ", ".join(
        f"{name} {v:.3f}" for name, v in thread_cpu.items()))
    return {"what": what, "scenario": None if live or gpus else scenario, "gpus": shape.get("gpus"),
            "ports": shape.get("ports"), "seconds": round(span, 1), "cpu_pct": round(cpu, 4),
            "rss_median_mb": round(statistics.median(rss) / 2**20, 2), "rss_max_mb": round(max(rss) / 2**20, 2),
            "page_bytes": len(page), "openmetrics_gzip_bytes": len(om_gzip), "per_thread_cpu_pct": thread_cpu,
            "threads": threads, "smaps_rollup_kb": memory}


def process_cpu_s(p: "psutil.Process") -> float:
    """CPU seconds the process has run, all its threads (those that ended too): the kernel's scheduler clock of the
    process (clock_gettime of its CPU clock, exact to the ns), where psutil's user and system times count 10 ms ticks
    (180 s of an idle daemon in steps of 0.0056 % of a core, the size of the margin measured)."""
    try:
        return time.clock_gettime(((~p.pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        times = p.cpu_times()
        return times.user + times.system


def scrape(port: int, accept: str | None, gzip: bool = False) -> bytes:
    headers = {"Accept": accept} if accept else {}
    if gzip:
        headers["Accept-Encoding"] = "gzip"
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                timeout=30) as r:
        return r.read()


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's memory by kind (kB): anonymous (Python objects, malloc) against file-backed (libraries)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Anonymous", "Pss_Anon", "Pss_File", "Private_Dirty", "Shared_Clean"):
                out[key] = int(rest.split()[0])
    return out


def node_shape(root: Path) -> dict[str, int]:
    gpus = len(json.loads((root / "nvml.json").read_text())["gpus"])
    ib = root / "sys/class/infiniband"
    ports = sum(1 for dev in ib.iterdir() for _ in (dev / "ports").iterdir()) if ib.is_dir() else 0
    return {"gpus": gpus, "ports": ports}


def scale_node(src: Path, dst: Path, gpus: int) -> None:
    """`gpus` GPUs' worth of the recorded node `src` (a multiple of its GPU count) in `dst`: its GPUs, PCI devices and
    IB ports copied once per block, block k in PCI domain k (0000:19:00.0 -> 000k:19:00.0) with its own UUIDs and
    HCA names (mlx5_3 -> mlx5_k_3 for k > 0). The kernel log and node.toml are the node's own."""
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("tools", "sys", "proc", "nvml.json"))
    snap = json.loads((src / "nvml.json").read_text())
    per = len(snap["gpus"])
    if gpus % per:
        raise SystemExit(f"--gpus must be a multiple of {per} (the GPUs of {src.name})")
    out = []
    for k in range(gpus // per):
        for g in snap["gpus"]:
            g = json.loads(json.dumps(g))
            g.pop("p2p", None)  # pairs are read by the full checks only; 72 x 71 of them would be most of the file
            g["index"] = len(out)
            g["uuid"] = g["uuid"][:-4] + f"{k:04x}" if k else g["uuid"]
            domain, rest = g["pci_bus_id"].split(":", 1)
            g["pci_bus_id"] = f"{int(domain, 16) + k:08x}:{rest}"
            out.append(g)
    snap["gpus"] = out
    (dst / "nvml.json").write_text(json.dumps(snap))
    pci, gpu_proc, ib = "sys/bus/pci/devices", "proc/driver/nvidia/gpus", "sys/class/infiniband"
    for k in range(gpus // per):
        for rel in (pci, gpu_proc):
            if (src / rel).is_dir():
                for dev in (src / rel).iterdir():
                    d, rest = dev.name.split(":", 1)
                    shutil.copytree(dev, dst / rel / f"{int(d, 16) + k:04x}:{rest}", symlinks=True)
        if (src / ib).is_dir():
            for hca in (src / ib).iterdir():
                name = hca.name if k == 0 else hca.name.replace("mlx5_", f"mlx5_{k}_", 1)
                shutil.copytree(hca, dst / ib / name, symlinks=True)
    for rel in ("sys", "proc"):  # anything else the node records there (boot id, kernel settings)
        for path in (src / rel).rglob("*"):
            target = dst / path.relative_to(src)
            if path.is_file() and not path.is_symlink() and not target.exists() and not any(
                    str(path.relative_to(src)).startswith(r) for r in (pci, gpu_proc, ib)):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


def idle_rows(fig: dict, command: str) -> list[dict]:
    """The figures of one idle run as bench/run's rows; the targets apply to the 8-GPU, 9-port node."""
    label = fig["what"] if fig["gpus"] is None else (
        f"{fig['gpus']} GPU{'s' if fig['gpus'] != 1 else ''}, {fig['ports']} ports ({fig['what']})")
    targeted = fig["scenario"] == IDLE_SCENARIO
    detail = {k: fig[k] for k in ("seconds", "rss_max_mb", "openmetrics_gzip_bytes", "per_thread_cpu_pct", "threads",
                                  "smaps_rollup_kb")}

    def row(what: str, ours: float, unit: str, target: str | None, met: bool | None) -> dict:
        return {"measure": f"daemon idle at production intervals, {label}: {what}", "ours": ours, "unit": unit,
                "peer": None, "peer_name": None, "ratio": None, "target": target if targeted else None,
                "met": met if targeted else None, "command": command, "detail": detail}

    return [row("CPU", fig["cpu_pct"], "% of one core", f"<= {IDLE_TARGETS['cpu']} %",
                fig["cpu_pct"] <= IDLE_TARGETS["cpu"]),
            row("RSS (median)", fig["rss_median_mb"], "MB", f"< {IDLE_TARGETS['rss']:g} MB",
                fig["rss_median_mb"] < IDLE_TARGETS["rss"]),
            row("/metrics page", fig["page_bytes"], "bytes", None, None)]


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
    ap.add_argument("what", choices=("latency", "idle", "flood", "growth"))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--live", action="store_true", help="idle: this machine's own kernel log, sysfs and NVML")
    ap.add_argument("--scenario", default=IDLE_SCENARIO, help="idle: the recorded node (fixtures/nodes/NAME)")
    ap.add_argument("--gpus", type=int, help=f"idle: N GPUs' worth of {IDLE_SCENARIO}, generated in a temporary folder")
    ap.add_argument("--json", help="idle, growth: write the rows here as bench/run reads them")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    load = os.getloadavg()
    me = ".venv/bin/python bench/daemon.py"
    if args.what in ("idle", "growth"):
        if args.what == "idle":
            runs = [(args.scenario, args.gpus)]
        else:
            runs = [("h200-vm-1gpu", None), (IDLE_SCENARIO, None), (IDLE_SCENARIO, 72)]
        rows = []
        for scenario, gpus in runs:
            fig = idle(args.seconds, args.live, scenario, gpus)
            where = "--live" if args.live else f"--gpus {gpus}" if gpus else f"--scenario {scenario}"
            rows += idle_rows(fig, f"{me} idle {where} --seconds {args.seconds:g}")
        if args.json:
            write_rows(args.json, rows, load)
        return
    {"latency": lambda: latency(args.runs), "flood": lambda: flood(args.lines)}[args.what]()


if __name__ == "__main__":
    main()

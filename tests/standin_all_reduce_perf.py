#!/usr/bin/env python3
"""A stand-in for nccl-tests' all_reduce_perf, run by a real launcher (srun, mpirun) on several nodes: it prints what
the real tool prints (nccl-tests 2.17 layout: version banner, settings line, one device line per rank, the table
with one row per size and cycle, the out-of-bounds and average-bandwidth summary), with figures a scenario bends.

Where it runs, from the launcher's environment:
- its node: SLURMD_NODENAME (srun), else GW_STANDIN_NODE (set it per host under mpirun, e.g. from the rsh agent),
  else the host name;
- its rank and the group's size: SLURM_PROCID / SLURM_NTASKS, else OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE;
- the group's nodes: every rank writes its node and pid into a rendezvous folder of its job (key SLURM_JOB_ID +
  SLURM_STEPID, or Open MPI's PMIX_NAMESPACE / OMPI_MCA_ess_base_jobid), under GW_STANDIN_DIR, else next to the
  scenario file, else the temporary folder; rank 0 reads them. So the node list is where the ranks really ran.
Only rank 0 prints the table (as nccl-tests under MPI does); the other ranks wait for rank 0 and exit as it did.

The scenario: a JSON file named by GW_SWEEP_SCENARIO (none: every group is healthy):
  slow_nodes   [node]           a group holding one runs slow: busbw x slow_factor at large sizes, latency /
  bad_links    [[a, b]]         slow_factor at small ones; a link makes the group slow when both ends are in it
  wrong_nodes  [node]           wrong values: #wrong > 0, "Out of bounds values : N FAILED", exit 1
  hang_nodes   [node]           every rank of the group hangs after a few sizes (a real NCCL hang): never exits
  crash_nodes  [node]           NCCL's remote error on every rank after a few sizes, exit 1
  slow_factor  0.4
  duration_s   0.0              rank 0 takes this long in all (a long run, to be preempted)
  seed         0                per-cycle noise, so a p95 over cycles is meaningful
  barrier_groups 0              rank 0 first waits (up to 60 s) until this many groups have started (the log): proof
                                that groups ran at the same time, without timing anything
GW_SWEEP_STANDIN_LOG, when set, gets one JSON line per group when it starts and one when it ends, naming its nodes.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import zlib
from pathlib import Path

VERSION_BANNER = "# nccl-tests version 2.17.6 nccl-headers=22803 nccl-library=22803"
GPU = "NVIDIA H100 80GB HBM3"
RENDEZVOUS_WAIT_S = 60.0
BARRIER_WAIT_S = 60.0
# A healthy 2-node H100 group (fixtures/tools/nccl/aws__all_reduce_perf__2x-p5-H100__...): ~70 us at small sizes,
# ~480 GB/s busbw at GB sizes.
BASE_LATENCY_US = 60.0
PEAK_BUSBW_GBPS = 480.0
WRONG_FROM_BYTES = 1 << 20  # corrupted values show in the rows from this size up
FAULT_AFTER_ROWS = 6  # a hang or crash comes after this many rows of the first cycle


def parse_size(text: str) -> int:
    """nccl-tests' sizes: a number with an optional K, M or G suffix (powers of 1024)."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_args(argv: list[str]) -> dict:
    """The flags this stand-in acts on; every other flag of nccl-tests (all take a value) is read and ignored."""
    opts = {"b": 32 << 20, "e": 32 << 20, "f": 2, "g": 1, "n": 20, "w": 1, "c": 1, "N": 1}
    long_names = {"minbytes": "b", "maxbytes": "e", "stepfactor": "f", "ngpus": "g", "iters": "n",
                  "warmup_iters": "w", "check": "c", "run_cycles": "N"}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            i += 1
            continue
        name, _, value = token.lstrip("-").partition("=")
        name = long_names.get(name, name)
        if not value and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if name in ("b", "e"):
            opts[name] = parse_size(value)
        elif name in opts:
            opts[name] = int(value)
        i += 1
    opts["f"] = max(2, opts["f"])
    opts["N"] = max(1, opts["N"])
    return opts


def where() -> tuple[str, int, int, int]:
    """(node, rank, ranks, local rank) from the launcher's environment."""
    env = os.environ
    node = env.get("SLURMD_NODENAME") or env.get("GW_STANDIN_NODE") or socket.gethostname()
    rank = int(env.get("SLURM_PROCID") or env.get("OMPI_COMM_WORLD_RANK") or 0)
    ranks = int(env.get("SLURM_NTASKS") or env.get("OMPI_COMM_WORLD_SIZE") or 1)
    local = int(env.get("SLURM_LOCALID") or env.get("OMPI_COMM_WORLD_LOCAL_RANK") or 0)
    return node, rank, ranks, local


def rendezvous_dir(scenario_path: str | None) -> Path:
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        key = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEPID', '0')}"
    else:
        key = "ompi-" + (env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or str(os.getppid()))
    base = env.get("GW_STANDIN_DIR") or (str(Path(scenario_path).parent) if scenario_path else tempfile.gettempdir())
    return Path(base) / f"gw-standin-{key.replace('/', '_')}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # not matched by the "rank-*" count
    tmp.write_text(text)
    os.replace(tmp, path)


def log_event(event: str, nodes: list[str], **more) -> None:
    path = os.environ.get("GW_SWEEP_STANDIN_LOG")
    if not path:
        return
    line = json.dumps({"event": event, "nodes": nodes, "job": os.environ.get("SLURM_JOB_ID"), **more}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of one short line: appends from several groups do not interleave
    finally:
        os.close(fd)


def started_groups() -> int:
    path = os.environ.get("GW_SWEEP_STANDIN_LOG")
    try:
        lines = Path(path).read_text().splitlines() if path else []
    except OSError:
        return 0
    return sum(1 for line in lines if json.loads(line).get("event") == "start")


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def fmt_time(us: float) -> str:
    """nccl-tests' time column: two decimals under 100 us, one under 10 ms, none above."""
    if us >= 10000:
        return f"{us:7.0f}"
    return f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def fmt_bw(gbps: float) -> str:
    return f"{gbps:6.2f}" if gbps < 1000 else f"{gbps:6.1f}"


def row(size: int, ranks: int, slow: float, rng: random.Random, wrong: int | None, iters: int) -> str:
    """One row: the time of `size` from a latency + bandwidth model; a slow group has its latency divided and its
    bandwidth multiplied by `slow` (< 1). `wrong` None: values not checked (-c 0), printed "N/A"."""
    factor = 2 * (ranks - 1) / ranks  # nccl-tests' all-reduce bus factor: 0 for one rank (busbw 0.00, as it prints)
    peak_algbw = PEAK_BUSBW_GBPS / factor if factor else PEAK_BUSBW_GBPS
    cells = []
    for _ in range(2):  # out-of-place, in-place
        noise = math.exp(rng.gauss(0.0, 0.03))
        latency = BASE_LATENCY_US / slow
        time_us = (latency + size / (peak_algbw * slow * 1e3)) * noise
        algbw = size / (time_us * 1e3)
        checked = "N/A" if wrong is None else str(wrong)
        cells.append(f"  {fmt_time(time_us)}  {fmt_bw(algbw)}  {fmt_bw(algbw * factor)}  {checked:>6}")
    return f"{size:12d}  {size // 4:12d}  {'float':>8s}  {'sum':>6s}  {-1:6d}" + "".join(cells) + f"  {iters:6d}"


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    node, rank, ranks, local = where()
    scenario_path = os.environ.get("GW_SWEEP_SCENARIO")
    scenario = json.loads(Path(scenario_path).read_text()) if scenario_path else {}
    rdv = rendezvous_dir(scenario_path)
    rdv.mkdir(parents=True, exist_ok=True)
    write_atomic(rdv / f"rank-{rank}", json.dumps({"node": node, "pid": os.getpid(), "local": local}))
    done = rdv / "done"
    if rank != 0:
        while not done.exists():  # a hung rank 0 never writes it: this rank hangs with it
            time.sleep(0.1)
        code = int(done.read_text() or 1)
        (rdv / f"rank-{rank}").unlink(missing_ok=True)
        # Exit after rank 0 (it removes the folder on its way out): a rank that exits 1 first has srun's
        # --kill-on-bad-exit end the step, and srun can then stop forwarding rank 0's last lines (the summary).
        deadline = time.monotonic() + 10.0
        while rdv.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    deadline = time.monotonic() + RENDEZVOUS_WAIT_S
    while len(list(rdv.glob("rank-*"))) < ranks:
        if time.monotonic() > deadline:
            print(f"{node}: Test NCCL failure common.cu:1144 'unhandled system error (run with NCCL_DEBUG=INFO for "
                  f"details) / bootstrap: timed out waiting for {ranks} ranks'", flush=True)
            write_atomic(done, "1")
            return 1
        time.sleep(0.05)
    members = [json.loads((rdv / f"rank-{r}").read_text()) for r in range(ranks)]
    nodes = list(dict.fromkeys(m["node"] for m in members))
    log_event("start", nodes, ranks=ranks)
    code = run(opts, scenario, nodes, members, node)
    log_event("end", nodes, code=code)
    write_atomic(done, str(code))
    deadline = time.monotonic() + 10.0
    while len(list(rdv.glob("rank-*"))) > 1 and time.monotonic() < deadline:  # the others have read it
        time.sleep(0.05)
    shutil.rmtree(rdv, ignore_errors=True)
    return code


def run(opts: dict, scenario: dict, nodes: list[str], members: list[dict], node: str) -> int:
    group = set(nodes)
    ranks = len(members)
    slow_factor = float(scenario.get("slow_factor", 0.4))
    slow = any(n in group for n in scenario.get("slow_nodes", ())) or any(
        a in group and b in group for a, b in scenario.get("bad_links", ()))
    wrong = any(n in group for n in scenario.get("wrong_nodes", ()))
    hang = any(n in group for n in scenario.get("hang_nodes", ()))
    crash = any(n in group for n in scenario.get("crash_nodes", ()))
    duration_s = float(scenario.get("duration_s", 0.0))
    barrier = int(scenario.get("barrier_groups", 0))
    deadline = time.monotonic() + BARRIER_WAIT_S
    while barrier and started_groups() < barrier and time.monotonic() < deadline:
        time.sleep(0.1)
    if barrier and started_groups() < barrier:
        log_event("barrier-timeout", nodes)
    seed = zlib.crc32(f"{scenario.get('seed', 0)}:{','.join(sorted(nodes))}".encode())
    rng = random.Random(seed)
    sizes = []
    size = max(opts["b"], 1)
    while size <= opts["e"]:
        sizes.append(size)
        size *= opts["f"]
    out = sys.stdout
    print(VERSION_BANNER, file=out)
    print("# Collective test starting: all_reduce_perf", file=out)
    print(f"# nThread 1 nGpus {opts['g']} minBytes {opts['b']} maxBytes {opts['e']} step: {opts['f']}(factor) "
          f"warmup iters: {opts['w']} iters: {opts['n']} agg iters: 1 validation: {opts['c']} graph: 0", file=out)
    print("#\n# Using devices", file=out)
    for r, m in enumerate(members):
        print(f"#  Rank {r:2d} Group  0 Pid {m['pid']:6d} on {m['node']:>10s} device {m['local']:2d} "
              f"[0x{0x18 + 0x11 * m['local']:02x}] {GPU}", file=out)
    print("#", file=out)
    print("#                                                              out-of-place                       "
          "in-place", file=out)
    print("#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   "
          "busbw  #wrong  #iters", file=out)
    print("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  "
          "(GB/s)", file=out)
    out.flush()
    wrong_total, busbw = 0, []
    for cycle in range(opts["N"]):
        for i, size in enumerate(sizes):
            if cycle == 0 and i == FAULT_AFTER_ROWS and (hang or crash):
                out.flush()
                if hang:
                    sleep_forever()
                warn = (f"{node}:{os.getpid()}:{os.getpid() + 17} [0] NCCL WARN NET/IB : Got completion from peer "
                        f"10.0.0.2<59427> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 "
                        f"remoteGids::ffff:10.0.0.2")
                print(warn, file=sys.stderr, flush=True)
                print(f"{node}: Test NCCL failure common.cu:1279 'remote process exited or there was a network error "
                      f"/ NET/IB : Got completion from peer 10.0.0.2<59427> with status=12'", file=out)
                print(f" .. {node} pid {os.getpid()}: Test failure common.cu:401", file=out, flush=True)
                return 1
            bad = 1 + (size >> 22) if wrong and size >= WRONG_FROM_BYTES else 0
            if not opts["c"]:
                bad = None  # nothing checked: a wrong node's values go unseen, as with the real tool
            wrong_total += 2 * (bad or 0)
            text = row(size, ranks, slow_factor if slow else 1.0, rng, bad, opts["n"])
            busbw.append(float(text.split()[7]))
            print(text, file=out)
        out.flush()
        if duration_s > 0:
            time.sleep(duration_s / opts["N"])
    print(f"# Out of bounds values : {wrong_total} {'FAILED' if wrong_total else 'OK'}", file=out)
    print(f"# Avg bus bandwidth    : {sum(busbw) / max(len(busbw), 1):g} ", file=out)
    print("#\n# Collective test concluded: all_reduce_perf\n#", file=out)
    if wrong_total:
        print(f" .. {node} pid {os.getpid()}: Test failure common.cu:1127", file=out)
    out.flush()
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

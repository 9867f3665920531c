"""Where the time of one `gpuwarden analyze` goes: the CPU of this process (start, reading the file's head, the
checks' judging in file order, the report) against the CPU of the reader processes it forks for a large file, and
the wall time of the whole. With two CPUs the wall cannot drop below the larger of this process's CPU and half of
all the CPU: the figures say which bound a change has to move.

Run: .venv/bin/python bench/analyze_split.py FILE [--runs N]
     (a log from bench/gen_kernel_log.py --lines 1000000 --out FILE)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

ONE_RUN = r"""
import contextlib, io, json, os, sys, time
wall0, cpu0 = time.perf_counter(), time.process_time()
from gpuwarden.agent import cli
wall1, cpu1 = time.perf_counter(), time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    try:
        cli.main(["analyze", sys.argv[1]])
    except SystemExit:
        pass
wall2, cpu2 = time.perf_counter(), time.process_time()
t = os.times()
print(json.dumps({"start_ms": 1e3 * (wall1 - wall0), "main_wall_ms": 1e3 * (wall2 - wall1),
                  "parent_cpu_ms": 1e3 * (cpu2 - cpu0),
                  "readers_cpu_ms": 1e3 * (t.children_user + t.children_system)}))
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    rows = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", ONE_RUN, args.file], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    total = med["parent_cpu_ms"] + med["readers_cpu_ms"]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"{args.file}: median of {args.runs} runs on {cpus} CPUs")
    print(f"  CLI import {med['start_ms']:.0f} ms (the interpreter's own start not counted)")
    print(f"  analyze wall {med['main_wall_ms']:.0f} ms; this process's CPU {med['parent_cpu_ms']:.0f} ms, "
          f"the readers' {med['readers_cpu_ms']:.0f} ms")
    print(f"  bounds on the wall: this process's CPU {med['parent_cpu_ms']:.0f} ms, all CPU over {cpus} CPUs "
          f"{total / cpus:.0f} ms")
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What one wake-up of an idle Python thread costs on this machine, in CPU: the floor under any poll the daemon keeps.
A thread sleeps `--period` seconds `--wakes` times, by each way the daemon sleeps (select() on a pipe, as its poll
loops do; time.sleep; threading.Event.wait, as its writer and action worker do), and its run time is read from
/proc/self/task/<tid>/schedstat (exact nanoseconds, kernel and user) before and after.

A poll every second costs at least this much per second; bench/daemon.py idle gives what each daemon thread costs.

Run: .venv/bin/python bench/wake_cost.py [--wakes N] [--period S]
"""
from __future__ import annotations

import argparse
import os
import select
import sys
import threading
import time


def _run_ns() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        return int(f.read().split()[0])


def _select(period: float, wakes: int) -> None:
    r, w = os.pipe()
    try:
        for _ in range(wakes):
            select.select([r], [], [], period)
    finally:
        os.close(r)
        os.close(w)


def _sleep(period: float, wakes: int) -> None:
    for _ in range(wakes):
        time.sleep(period)


def _event(period: float, wakes: int) -> None:
    event = threading.Event()
    for _ in range(wakes):
        event.wait(period)


WAYS = {"select() on a pipe": _select, "time.sleep": _sleep, "threading.Event.wait": _event}


def per_wake_us(way, period: float, wakes: int) -> float:
    out: dict[str, float] = {}

    def body() -> None:
        before = _run_ns()
        way(period, wakes)
        out["us"] = (_run_ns() - before) / wakes / 1e3

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["us"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wakes", type=int, default=20)
    ap.add_argument("--period", type=float, default=0.5, help="seconds between wake-ups (idle in between)")
    args = ap.parse_args(argv)
    for name, way in WAYS.items():
        us = per_wake_us(way, args.period, args.wakes)
        print(f"{name:22s} {us:7.1f} us of CPU per wake-up; once a second that is {us / 1e4:.4f} % of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

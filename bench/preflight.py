"""Wall time and peak RSS of one `gpuwarden preflight --root` per bundled scenario (a fresh process each run).

Run: .venv/bin/python bench/preflight.py [--repeat 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    for scenario in sorted((ROOT / "fixtures/nodes").glob("*/node.toml")):
        times, rss = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "gpuwarden.agent.cli", "preflight", "--root",
                                                  str(scenario.parent), "--json"],
                                 os.environ, file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
            _, status, usage = os.wait4(pid, 0)
            times.append(time.perf_counter() - t0)
            rss.append(usage.ru_maxrss / 1024)
        print(f"{scenario.parent.name:<22} wall median {statistics.median(times) * 1000:.0f} ms "
              f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}); "
              f"peak RSS median {statistics.median(rss):.1f} MB; exit {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    main()

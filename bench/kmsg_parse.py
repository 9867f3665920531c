"""Kernel-log parse throughput: lines/s through parse_kmsg_text and through the xid check's event pass.

Input: the bundled H100 boot log (real records) repeated to N lines, with one XID line in every 1000.
Run: .venv/bin/python bench/kmsg_parse.py [--lines 1000000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from gpuwarden.agent.kernel_log import parse_kmsg_text
from gpuwarden.checks.xid import collect

ROOT = Path(__file__).resolve().parent.parent
XID = "3,{seq},{usec},-;NVRM: Xid (PCI:0000:19:00): 13, pid=1234, name=python3, Graphics Exception: ESR 0x1"


def corpus(n: int) -> str:
    base = [ln.split(";", 1)[1] for ln in (ROOT / "fixtures/nodes/h100-hgx-healthy/kmsg").read_text().splitlines()
            if ln and not ln.startswith(" ")]
    lines = []
    for seq in range(n):
        if seq % 1000 == 999:
            lines.append(XID.format(seq=seq, usec=seq * 10))
        else:
            lines.append(f"6,{seq},{seq * 10},-;{base[seq % len(base)]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    text = corpus(args.lines)
    parse_rates, full_rates = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        records, errors = parse_kmsg_text(text, "bench")
        t1 = time.perf_counter()
        events, _ = collect(records)
        t2 = time.perf_counter()
        assert len(records) == args.lines and not errors and len(events) == args.lines // 1000
        parse_rates.append(args.lines / (t1 - t0))
        full_rates.append(args.lines / (t2 - t0))
    print(f"lines={args.lines} repeat={args.repeat}")
    print(f"parse_kmsg_text: median {statistics.median(parse_rates) / 1e6:.2f} M lines/s "
          f"(min {min(parse_rates) / 1e6:.2f}, max {max(parse_rates) / 1e6:.2f})")
    print(f"parse + xid event pass: median {statistics.median(full_rates) / 1e6:.2f} M lines/s "
          f"(min {min(full_rates) / 1e6:.2f}, max {max(full_rates) / 1e6:.2f})")


if __name__ == "__main__":
    main()

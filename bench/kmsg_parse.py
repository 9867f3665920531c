"""Kernel-log parse throughput: lines/s through the raw /dev/kmsg parser, alone and with the xid check's event
pass, unfiltered (parse_kmsg_text: a record per line) and filtered (parse_kmsg_filtered: records only for
messages the checks look at; every header still validated).

Input: the bundled H100 boot log (real records) repeated to N lines, with one XID line in every 1000.
Nothing lost: every run asserts no parse error, N records (unfiltered), one XID event per injected XID
line, and (filtered) that the last seq reported is the last line's.
Run: .venv/bin/python bench/kmsg_parse.py [--lines 1000000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from gpuwarden.agent.core.kernel_log import parse_kmsg_filtered, parse_kmsg_text
from gpuwarden.checks.xid import collect

ROOT = Path(__file__).resolve().parent.parent
XID = "3,{seq},{usec},-;NVRM: Xid (PCI:0000:19:00): 13, pid=1234, name=python3, Graphics Exception: ESR 0x1"


def keep(message: str) -> bool:
    # What the kernel-log checks look at: xid ("NVRM: "), fabric ("SXid", "NVSwitch"), pcie_aer. A substring
    # test: a compiled alternation's .search per message measured ~3x slower than this.
    return ("NVRM: " in message or "SXid" in message or "NVSwitch" in message or "AER" in message
            or "PCIe Bus Error" in message or "[Hardware Error]:" in message)


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


def rate(lines: int, rates: list[float]) -> str:
    return (f"median {statistics.median(rates) / 1e6:.2f} M lines/s "
            f"(min {min(rates) / 1e6:.2f}, max {max(rates) / 1e6:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.lines
    text = corpus(n)
    injected = n // 1000
    results: dict[str, list[float]] = {k: [] for k in ("parse", "parse+xid", "filtered", "filtered+xid")}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        records, errors = parse_kmsg_text(text, "bench")
        t1 = time.perf_counter()
        events, _ = collect(records)
        t2 = time.perf_counter()
        assert not errors and len(records) == n and records[-1].seq == n - 1, "unfiltered parse lost records"
        assert len(events) == injected, f"unfiltered: {len(events)} XID events, {injected} injected"
        results["parse"].append(n / (t1 - t0))
        results["parse+xid"].append(n / (t2 - t0))
        del records, events

        t0 = time.perf_counter()
        kept, errors, last_seq = parse_kmsg_filtered(text, "bench", keep)
        t1 = time.perf_counter()
        events, _ = collect(kept)
        t2 = time.perf_counter()
        assert not errors and last_seq == n - 1, f"filtered: last seq {last_seq}, last line's is {n - 1}"
        assert len(events) == injected, f"filtered: {len(events)} XID events, {injected} injected"
        results["filtered"].append(n / (t1 - t0))
        results["filtered+xid"].append(n / (t2 - t0))
        del kept, events
    print(f"lines={n} repeat={args.repeat} (nothing lost: {injected} XID events found of {injected} injected, "
          f"last seq {n - 1} in every run)")
    print(f"parse_kmsg_text:                        {rate(n, results['parse'])}")
    print(f"parse_kmsg_text + xid event pass:       {rate(n, results['parse+xid'])}")
    print(f"parse_kmsg_filtered:                    {rate(n, results['filtered'])}")
    print(f"parse_kmsg_filtered + xid event pass:   {rate(n, results['filtered+xid'])}")


if __name__ == "__main__":
    main()

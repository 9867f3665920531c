"""The real `gpuwarden run` under a kernel-log flood: 1M lines appended to the followed log, every one an XID (the
worst case: each is a record the consumers read), while its RSS is sampled. It stays bounded during the flood and,
once the flood is read, comes back to within 2 MB of its idle figure (the outside report: 26.6 -> 34.1 MB, and
kept). Every XID is counted."""
from __future__ import annotations

import random
import time
from pathlib import Path

from conftest import wait_for
from test_store_damage import Agent, agent  # noqa: F401,F811 - the fixture

LINES = 1_000_000
XID = "3,{seq},{usec},-;NVRM: Xid (PCI:{pci}): {xid}, pid=1234, name=python3, Ch 00000008"
PCIS = ("0008:01:00", "0009:01:00", "0018:01:00", "0019:01:00")
XIDS = (13, 31, 43, 45, 48)
BACK_MB = 2.0  # the contract: back within this of idle once the flood is read
PEAK_MB = 24.0  # during the flood at most this over idle (unbounded batches reached ~120)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def settled_rss(pid: int, within_mb: float = 0.25, timeout_s: float = 60.0) -> float:
    """The RSS once three readings a second apart agree within `within_mb` (start-up's trim, the first writes)."""
    readings: list[float] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readings = (readings + [rss_mb(pid)])[-3:]
        if len(readings) == 3 and max(readings) - min(readings) <= within_mb:
            return readings[-1]
        time.sleep(1.0)
    raise AssertionError(f"RSS did not settle: {readings}")


def records_read(a: Agent) -> float:
    return a.sample("gpuwarden_kmsg_records_total") or 0.0


def test_the_daemon_s_memory_is_bounded_under_a_flood_and_comes_back(agent):  # noqa: F811 - the fixture
    a = agent().start()
    wait_for(lambda: a.sample("gpuwarden_check_success", 'check="xid"') is not None, timeout_s=60,
             what="the xid check's first look")
    time.sleep(5.0)
    idle = settled_rss(a.proc.pid)
    kmsg = a.root / "kmsg"
    seq = max(int(line.split(",")[1]) for line in kmsg.read_text().splitlines() if line[:1].isdigit())
    base, rng, peak = records_read(a), random.Random(7), idle
    expected: dict[tuple[str, int], int] = {}
    with open(kmsg, "a") as f:
        for start in range(0, LINES, 20_000):
            chunk = []
            for i in range(start, start + 20_000):
                pci, xid = rng.choice(PCIS), rng.choice(XIDS)
                expected[(pci, xid)] = expected.get((pci, xid), 0) + 1
                chunk.append(XID.format(seq=seq + 1 + i, usec=10**9 + 100 * i, pci=pci, xid=xid))
            f.write("\n".join(chunk) + "\n")
            f.flush()
            peak = max(peak, rss_mb(a.proc.pid))

    def read_all() -> bool:
        nonlocal peak
        peak = max(peak, rss_mb(a.proc.pid))
        return records_read(a) >= base + LINES

    wait_for(read_all, timeout_s=300, what="the flood read")
    after = settled_rss(a.proc.pid)
    counted = {(pci, xid): a.sample("gpuwarden_xid_events", f'pci="{pci}.0",xid="{xid}"') for pci, xid in expected}
    a.stop()
    print(f"RSS idle {idle:.1f} MB, peak {peak:.1f}, after {after:.1f}")
    assert counted == {k: float(n) for k, n in expected.items()}
    assert peak - idle <= PEAK_MB, (idle, peak)
    assert after - idle <= BACK_MB, (idle, peak, after)

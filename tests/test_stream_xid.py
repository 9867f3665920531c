"""The xid check judged batch after batch as the daemon does: the state judged from is never changed, an incident no
XID touched stays the same object (what lets the store write only what moved), and what is reused from the last
judgement gives exactly what a judgement from scratch gives."""
from __future__ import annotations

import copy
import json

from gpuwarden.agent.kernel_log import parse_kmsg_text
from gpuwarden.agent.passive import KernelBatch
from gpuwarden.checks import xid

LINE = "3,{seq},{usec},-;NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, name=proc{pid}, detail {seq}\n"
PAIRS = [(f"000{g}:01:00", x) for x in (13, 31, 43, 45, 48, 79, 94, 154) for g in range(4)]


def batch(lines: list[tuple[str, int]], first_seq: int) -> KernelBatch:
    text = "".join(LINE.format(seq=first_seq + i, usec=(first_seq + i) * 10, pci=p, xid=x, pid=1000 + i % 13)
                   for i, (p, x) in enumerate(lines))
    records, errors = parse_kmsg_text(text, "kmsg")
    assert not errors
    return KernelBatch(records, [], "boot")


def test_batch_after_batch_the_state_is_kept_pure_and_the_findings_are_those_of_a_fresh_judgement():
    cfg = dict(xid.DEFAULTS)
    state: dict = {}
    seq = 1
    for round_ in range(12):
        lines = PAIRS if round_ == 0 else [PAIRS[(round_ * 7 + k) % len(PAIRS)] for k in range(3)]
        b = batch(lines, seq)
        seq += len(lines)
        frozen = json.dumps(state, sort_keys=True)
        got = xid.judge(state, b, cfg, 1000.0 + round_)
        assert json.dumps(state, sort_keys=True) == frozen  # the state judged from is as it was
        fresh = xid.judge(copy.deepcopy(state), b, cfg, 1000.0 + round_)  # new objects: nothing to reuse
        assert got.findings == fresh.findings and got.metrics == fresh.metrics and got.state == fresh.state
        if state:
            touched = {f"{p}.0|{x}" for p, x in lines}
            before, after = state["incidents"], got.state["incidents"]
            for key, inc in after.items():
                if key in before and key not in touched:
                    assert inc is before[key], key  # untouched: the same object, so not written again
                elif key in touched:
                    assert inc is not before.get(key)
        state = got.state
    counts = {k: v["count"] for k, v in state["incidents"].items()}
    assert sum(counts.values()) > len(PAIRS)  # the rounds counted onto the incidents of the first

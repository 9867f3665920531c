"""The xid check judged batch after batch as the daemon does: the state judged from is never changed, an incident no
XID touched stays the same object (what lets the store write only what moved), and what is reused from the last
judgement gives exactly what a judgement from scratch gives."""
from __future__ import annotations

import copy
import json

from gpuwarden.agent.core.kernel_log import parse_kmsg_text
from gpuwarden.agent.core.passive import KernelBatch
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


RECOVERED = "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
RESET_REQUIRED = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"


def _gpu(i: int):
    from gpuwarden.agent.sources.nvml.gpu import Gpu
    return Gpu(index=i, uuid=f"GPU-{i:04d}", pci=f"000{i}:01:00.0", bus_id=f"0000000{i}:01:00.0")


def _random_batch(rng, seq: int, gpus: list, pairs: list[tuple[str, int]]) -> KernelBatch:
    """A batch of what the daemon is fed: XIDs on incidents held or new, recoveries and resets (XID 154), lines that
    mention an XID in a form not read, or NVML's events (some on GPUs NVML did not list, an error now and then)."""
    from gpuwarden.agent.sources.nvml.events import NvmlXid
    kind = rng.choice(["held"] * 12 + ["new", "recovered", "reset", "unreadable", "nvml", "nvml", "empty"])
    if kind == "nvml":
        xids = []
        for _ in range(rng.randint(0, 3)):
            pci, x = rng.choice(pairs)
            g = int(pci[3])
            xids.append(NvmlXid(g, f"GPU-{g:04d}", pci + ".0", x, 0.0) if rng.random() < 0.9 else
                        NvmlXid(None, None, None, x, 0.0))
        return KernelBatch([], list(gpus), "boot", nvml_xids=xids, source="nvml",
                           nvml_error=rng.choice([None] * 5 + ["NVML_ERROR_UNKNOWN"]))
    lines = []
    for _ in range(rng.randint(1, 4) if kind != "empty" else 0):
        pci, x = rng.choice(pairs)
        if kind == "new":
            pci, x = f"000{rng.randint(0, 6)}:01:00", rng.choice((13, 31, 43, 45, 48, 63, 79, 94, 95, 119))
        detail = f"pid={1000 + seq % 13}, name=proc{seq % 13}, detail {seq}"
        if kind in ("recovered", "reset"):
            x, detail = 154, RECOVERED if kind == "recovered" else RESET_REQUIRED
        if kind == "unreadable" and not lines:
            lines.append(f"3,{seq},{seq * 10},-;NVRM: Xid (PCI:{pci}): not a number here\n")
        else:
            lines.append(f"3,{seq},{seq * 10},-;NVRM: Xid (PCI:{pci}): {x}, {detail}\n")
        if (pci, x) not in pairs and x != 154:
            pairs.append((pci, x))
        seq += 1
    records, _ = parse_kmsg_text("".join(lines), "kmsg")
    return KernelBatch(records, list(gpus), "boot")


def test_random_batches_judged_one_after_another_equal_a_judgement_from_scratch_each_time(monkeypatch):
    """Whatever reuse a judgement makes of the last one (only the incidents a batch touched are judged again when
    nothing else moved), it equals a judgement of the same state with nothing to reuse: findings, samples, state
    and wake-up time, over random runs of XIDs, recoveries, unreadable lines, NVML events, new GPUs, a policy that
    ignores or forces XIDs and changes, and time that runs past incidents' holds."""
    import random
    reused = []
    real = xid._judge_touched
    monkeypatch.setattr(xid, "_judge_touched", lambda *a: reused.append(real(*a)) or reused[-1])
    for run in range(6):
        rng = random.Random(run)
        gpus = [_gpu(i) for i in range(rng.randint(0, 4))]
        pairs = [(f"000{g}:01:00", x) for g in range(4) for x in (13, 31, 43, 45, 79)][:rng.randint(1, 20)]
        cfg = {**xid.DEFAULTS, "hold_s": 50.0, "ignore_xids": [43], "fail_xids": [31]}
        state: dict = {}
        now, seq = 1000.0, 1
        for step in range(150):
            if rng.random() < 0.05:
                gpus = [*gpus, _gpu(len(gpus))]  # a GPU appears (NVML lists one more)
            if rng.random() < 0.03:
                cfg = {**cfg, "fail_xids": rng.choice([[31], [31, 13], []])}
            now += rng.choice([0.0, 0.5, 1.0, 5.0] * 5 + [30.0, 60.0])  # sometimes past a hold's end
            b = _random_batch(rng, seq, gpus, pairs)
            seq += 10
            frozen = json.dumps(state, sort_keys=True)
            fresh = xid.judge(copy.deepcopy(state), b, cfg, now)  # new objects: nothing to reuse
            got = xid.judge(state, b, cfg, now)
            assert json.dumps(state, sort_keys=True) == frozen, (run, step)
            assert got.findings == fresh.findings, (run, step)
            assert got.metrics == fresh.metrics, (run, step)
            assert got.state == fresh.state and got.wake_at == fresh.wake_at, (run, step)
            state = got.state
    assert sum(1 for r in reused if r is not None) > 100  # many batches took the reuse, and it gave the same
    assert any(r is None for r in reused)  # and a hold that ran out sent one back to a whole judgement

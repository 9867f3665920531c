"""The NCCL settings check: a job whose effective IB timeout is shorter than the port outages this node has had gives
up on a rail that would have come back. Pure: the jobs and the ports' outage history (the ib_port check's state, as
the daemon keeps it) in, WARN findings out, each saying how long the outages were, what the job's settings give up
after, and the NCCL_IB_TIMEOUT that would ride them out."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from gpuwarden.agent.core import nccl_env as nccl
from gpuwarden.agent.core.job import JobOnNode
from gpuwarden.agent.core.model import Action, Entity, Finding, Status

CHECK_NAME = "jobs"
CODE = "nccl-ib-timeout-short"
MAX_SHOWN = 5  # outages named in a message


def outages(ib_state: Mapping[str, Any], now: float) -> dict[str, list[tuple[float, float]]]:
    """{port: [(start, seconds)]} of the outages the ib_port check holds in its window (its state's `intervals`, and
    the outage going on now). A stretch of several flaps the check merged counts as that many outages of its mean
    length: never longer than any of them could have been."""
    out: dict[str, list[tuple[float, float]]] = {}
    ports = ib_state.get("ports") if isinstance(ib_state, Mapping) else None
    if not isinstance(ports, Mapping):
        return out
    for name, port in ports.items():
        if not isinstance(port, Mapping):
            continue
        found: list[tuple[float, float]] = []
        for entry in port.get("intervals", ())[:1024]:
            try:
                start, _end, seconds, flaps = (float(x) for x in entry[:4])
            except (TypeError, ValueError):
                continue
            n = max(1, int(flaps))
            found.extend([(start, seconds / n)] * min(n, 64))
        since = port.get("down_since")
        if isinstance(since, (int, float)):
            found.append((float(since), max(0.0, now - float(since))))
        if found:
            out[str(name)] = found
    return out


def decide(jobs: Sequence[JobOnNode], history: Mapping[str, list[tuple[float, float]]]) -> list[Finding]:
    """One WARN per job whose effective IB timeout is shorter than an outage of a port it uses, in the history (the
    ib_port check's window, [checks.ib_port] window_s)."""
    findings = []
    for job in jobs:
        timeout = job.effective_ib_timeout_s.value
        if job.ib_disabled or job.multi_node is False or not isinstance(timeout, (int, float)) or math.isinf(timeout):
            continue
        longer = sorted(((seconds, port, start) for port in job.ports for start, seconds in history.get(port, ())
                         if seconds > timeout), reverse=True)
        if not longer:
            continue
        retries = job.ib_retry_cnt.value if isinstance(job.ib_retry_cnt.value, int) else nccl.DEFAULT_RETRY_CNT
        worst = longer[0][0]
        ride = nccl.riding_out(worst, retries)
        shown = ", ".join(f"{port} {seconds:.1f} s" for seconds, port, _ in longer[:MAX_SHOWN])
        more = f" and {len(longer) - MAX_SHOWN} more" if len(longer) > MAX_SHOWN else ""
        advice = (f"NCCL_IB_TIMEOUT={ride} ({nccl.effective_timeout_s(ride, retries):.3g} s with {max(1, retries)} "
                  "retries) would ride them out" if ride is not None else
                  "no finite NCCL_IB_TIMEOUT rides them out: the ports themselves need looking at")
        message = (f"{job.job.label()} gives up on a silent rail after {timeout:.3g} s "
                   f"(NCCL_IB_TIMEOUT {job.ib_timeout.value}: {job.ib_timeout.source}; NCCL_IB_RETRY_CNT "
                   f"{job.ib_retry_cnt.value}), but ports of this node it uses were down longer than that "
                   f"recently ([checks.ib_port] window_s): {shown}{more}; {advice}")
        findings.append(Finding(CHECK_NAME, CODE, Entity("job", job.job.key), Status.WARN, message, Action.MONITOR, {
            "job": job.job.to_dict(), "effective_ib_timeout_s": timeout, "ib_timeout": job.ib_timeout.value,
            "ib_retry_cnt": job.ib_retry_cnt.value, "outages": [{"port": p, "seconds": round(s, 3), "start": t}
                                                                for s, p, t in longer[:MAX_SHOWN]],
            "riding_out": ride}))
    return findings

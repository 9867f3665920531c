"""What a job-log line says of where and when it was written, before what it says: the launcher's prefix (torchrun's
`[rank3]:` and `[default3]:`, mpirun's `[1,3]<stdout>:`, a `[N] ` or srun --label `N: ` tag), NCCL's own
`host:pid:tid [dev]` prefix, and its time stamp (glog's `[E1206 10:15:02.123]`, or an ISO time). Pure; the patterns
are data (data/joblog_patterns.toml, with the rest of the job-log forms)."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from gpuwarden.agent.jobs.joblog_patterns import shipped

_DATA = shipped()
_RANK_PREFIX = _DATA.get("rank_prefix")
_LOCAL_PREFIX = _DATA.get("local_prefix")
_MPI_TAG = _DATA.get("mpi_tag")
_BRACKET_TAG = _DATA.get("bracket_tag")
_SRUN_LABEL = _DATA.get("srun_label")
_NCCL = _DATA.get("nccl_prefix")
_GLOG = _DATA.get("glog_stamp")
_ISO = _DATA.get("iso_stamp")


def context(text: str) -> dict[str, Any]:
    """The line's rank / local_rank (a launcher's prefix), host / pid / dev (NCCL's prefix) and stamp: (clock,
    seconds), "glog" (no year: comparable only with glog stamps) or "wall"."""
    # Each pattern is tried only where a fixed text it needs is there (an `in` costs a tenth of a search).
    ctx: dict[str, Any] = {}
    head = text[:200]
    if "[rank" in head:
        m = _RANK_PREFIX.search(head)
        if m:
            ctx["rank"] = int(m.group(1))
    if "[default" in head:
        m = _LOCAL_PREFIX.search(head)
        if m:
            ctx["local_rank"] = int(m.group(1))
    if "rank" not in ctx and "<std" in head:
        m = _MPI_TAG.search(head)
        if m:
            ctx["rank"] = int(m.group(1))
    if "NCCL INFO" in text or "NCCL WARN" in text:
        m = _NCCL.search(text, 0, 400)
        if m:
            ctx["host"], ctx["pid"], ctx["dev"] = m.group(1), int(m.group(2)), int(m.group(4))
    stamp = _stamp(head)
    if stamp:
        ctx["stamp"] = stamp
    return ctx


def _stamp(head: str) -> tuple[str, float] | None:
    m = _GLOG.search(head) if ("[E" in head or "[W" in head or "[I" in head or "[F" in head) else None
    if m:
        mo, d, h, mi, s, frac = m.groups()
        return "glog", ((int(mo) * 31 + int(d)) * 86400 + int(h) * 3600 + int(mi) * 60 + int(s)
                        + (float("0." + frac) if frac else 0.0))
    m = _ISO.search(head) if "-" in head else None
    if m:
        return "wall", _iso(m)
    return None


def wall_time(text: str) -> float | None:
    """The Unix time of the first ISO time in `text` (torchrun's `2023-06-13_12:14:01`, slurmstepd's `AT ...`), taken
    as UTC; 0.0 for one that is no date (month 13); None where there is none."""
    m = _ISO.search(text)
    return _iso(m) if m else None


def _iso(m: re.Match) -> float:
    y, mo, d, h, mi, s = m.groups()
    try:
        return datetime(int(y), int(mo), int(d), int(h), int(mi), int(s or 0), tzinfo=timezone.utc).timestamp()
    except ValueError:
        return 0.0


def tag_context(text: str) -> dict[str, Any]:
    """A `[N] ` or srun `N: ` tag at the line's start: a rank, unless the file shows it counts lines."""
    m = _BRACKET_TAG.match(text) or _SRUN_LABEL.match(text)
    return {"_tag": int(m.group(1))} if m else {}

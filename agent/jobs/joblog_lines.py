"""What the lines of a distributed job's log mean: the forms PyTorch's ProcessGroupNCCL, NCCL, torchrun and
srun/slurmstepd print (the forms, as patterns, with the example file of fixtures/job_logs/ each was read from, are data:
agent/jobs/data/joblog_patterns.toml; the versions that print them where known: fixtures/job_logs/FACTS.md). Pure: a
line in, its events out.

`NEEDLES` are fixed texts of which every line of interest holds one: the reader decodes only those lines."""
from __future__ import annotations

import re
from typing import Any

from gpuwarden.agent.jobs.joblog_patterns import shipped
from gpuwarden.agent.jobs.joblog_prefix import context, wall_time

# The patterns, their forms and the sources they were learned from are data (data/joblog_patterns.toml), read
# once (joblog_patterns.shipped): module globals, so that a line costs what it cost with the patterns in the code.
_DATA = shipped()
NEEDLES: tuple[bytes, ...] = _DATA.needles
HARDWARE_CUDA = _DATA.hardware_cuda  # (text in CUDA's message, part, what it means): the GPU itself failed

# ---- PyTorch ProcessGroupNCCL ----------------------------------------------------------------------------------------
_WATCHDOG = _DATA.get("watchdog")
_BLOCKING = _DATA.get("blocking_wait")
_PROGRESS = _DATA.get("pg_progress")
_STUCK = _DATA.get("watchdog_stuck")
_HEARTBEAT = _DATA.get("heartbeat")
_DUMP = _DATA.get("dump_signal")
_DESYNC_HEAD = _DATA.get("desync_head")
_DESYNC_RANK = _DATA.get("desync_rank")
_FAILED = _DATA.get("nccl_failed")

# ---- NCCL ------------------------------------------------------------------------------------------------------------
_COMM = _DATA.get("comm")
_TESTS_RANK = _DATA.get("tests_rank")
_BOOTSTRAP = _DATA.get("bootstrap")
_IFACE_IP = _DATA.get("iface_ip")
_IB_USING = _DATA.get("ib_using")
_IB_PORT = _DATA.get("ib_port")
_IB_COMPLETION = _DATA.get("ib_completion")
_IB_ASYNC = _DATA.get("ib_async")
_REFUSED = _DATA.get("connect_refused")
_PEER_GONE = _DATA.get("peer_gone")
_CUDA_FAILURE = _DATA.get("cuda_failure")
_NCCL_VERSION = _DATA.get("nccl_version")
_NCCL_ENV = _DATA.get("nccl_env")

# ---- CUDA errors raised into the program -----------------------------------------------------------------------------
_CUDA_ERROR = _DATA.get("cuda_error")
_XID = _DATA.get("xid")

# ---- torchrun / elastic ----------------------------------------------------------------------------------------------
_TR_FIELD = _DATA.get("torchrun_field")
_TR_RANK = _DATA.get("torchrun_rank")
_TR_EXIT = _DATA.get("torchrun_exit")
_SIGNAL = _DATA.get("signal")

# ---- srun / slurmstepd -----------------------------------------------------------------------------------------------
_STEPD_CANCEL = _DATA.get("stepd_cancel")
_STEPD_OOM = _DATA.get("stepd_oom")
_SRUN_TASK = _DATA.get("srun_task")
_SRUN_NODE_FAIL = _DATA.get("srun_node_failure")
_SRUN_EXIT_CODE = _DATA.get("srun_exit_code")


Events = list[tuple[str, dict[str, Any], dict[str, Any]]]  # (kind, fields, context) of each event of a line


class BlockState:
    """What a multi-line block has said so far (torchrun's summary; a desync report's list of ranks)."""

    def __init__(self) -> None:
        self.torchrun_section: str | None = None  # "failure" | "root" inside a torchrun summary
        self.torchrun_entry: dict[str, Any] | None = None
        self.desync_until = -1  # lines of a desync report still to come (its ranks follow its head)
        self.lines = 0
        self.lineno = 0  # the file's line being read (the reader sets it)


def parse(text: str, state: BlockState) -> Events:
    """The events of one line: (kind, fields, context) where context is the prefix's host/pid/dev/rank/
    local_rank and the line's time stamp. Each part below appends to one list (a generator a part cost more than
    the part itself on a log dense in such lines)."""
    state.lines += 1
    ctx = context(text)  # the launcher's and NCCL's prefix, the stamp: joblog_prefix
    out: Events = []
    if "NCCL" in text:
        _nccl(text, ctx, out)
    if ("ProcessGroupNCCL" in text or "Rank " in text or "collective #" in text or "dump signal" in text
            or "caused the desync" in text):
        _pytorch(text, ctx, state, out)
    if "CUDA error" in text or "cudaError" in text or "ECC error" in text:
        m = _CUDA_ERROR.search(text)
        msg = m.group("msg").strip() if m else text.strip()
        hw = next(((what, kind) for key, kind, what in HARDWARE_CUDA if key in msg), None)
        out.append(("cuda_error", {"message": msg, "hardware": hw[0] if hw else None,
                                   "part": hw[1] if hw else None}, ctx))
    if "Rank  " in text:
        m = _TESTS_RANK.search(text)
        if m:
            out.append(("tests_rank", {"rank": int(m.group("rank")), "host": m.group("host"),
                                       "dev": int(m.group("dev")), "bus": int(m.group("bus"), 16) << 12}, ctx))
    if "Xid" in text:
        m = _XID.search(text)
        if m:
            out.append(("xid", {"xid": int(m.group("xid")), "pci": m.group("pci")}, ctx))
    if "Traceback (most recent call last)" in text:
        out.append(("traceback", {}, ctx))
    _torchrun(text, ctx, state, out)
    if "slurmstepd" in text or "srun: error" in text or "ode failure" in text:
        _slurm(text, ctx, out)
    return out


def reads_block(text: str) -> bool:
    """Whether what `parse` makes of this line depends on the lines before it or changes what the next ones mean (a
    desync report's rank lines and its head, a torchrun summary's heads and fields). Every other line means the same
    wherever it stands: the reader may take a repeat of it from what it made of it the first time."""
    return ("collective #" in text or "caused the desync" in text or "Root Cause" in text or "Failures:" in text
            or _TR_FIELD.match(text) is not None)


def _nccl(text: str, ctx: dict[str, Any], out: Events) -> None:
    if " busId " in text:
        m = _COMM.search(text)
        if m:
            out.append(("comm", {"comm_rank": int(m.group("rank")), "nranks": int(m.group("nranks")),
                                 "cuda_dev": int(m.group("dev")), "bus": bus_id(m.group("bus")),
                                 "state": m.group("state")}, ctx))
    if "Bootstrap : Using" in text:
        m = _BOOTSTRAP.search(text)
        if m:
            ips = [ip for _, ip in _IFACE_IP.findall(m.group("list"))]
            if ips:
                out.append(("bootstrap", {"ips": ips}, ctx))
    if "NET/IB : Using" in text:
        m = _IB_USING.search(text)
        if m:
            ports = [{"index": int(i), "device": dev, "port": int(p), "link": link}
                     for i, dev, p, link in _IB_PORT.findall(m.group("list"))]
            oob = _IFACE_IP.findall(m.group("oob") or "")
            out.append(("ib_devices", {"ports": ports, "oob_ip": oob[0][1] if oob else None}, ctx))
    if "NCCL version" in text:
        m = _NCCL_VERSION.search(text)
        if m:
            out.append(("nccl_version", {"version": m.group("version")}, ctx))
    if "set by environment to" in text:
        m = _NCCL_ENV.search(text)
        if m:
            out.append(("nccl_env", {"var": m.group("var"), "value": m.group("value")}, ctx))
    if "NCCL WARN" not in text:
        return
    warn = text[text.index("NCCL WARN") + 10:].strip()
    m = _IB_COMPLETION.search(text)
    if m:
        out.append(("ib_completion", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                                      "status": int(m.group("status")), "vendor": int(m.group("vendor")),
                                      "message": warn}, ctx))
        return
    m = _IB_ASYNC.search(text)
    if m:
        out.append(("ib_async", {"event": m.group("event").strip(), "message": warn}, ctx))
        return
    m = _REFUSED.search(text)
    if m:
        out.append(("connect_failed", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                                       "why": m.group("why").strip(), "message": warn}, ctx))
        return
    m = _PEER_GONE.search(text)
    if m and m.group("peer"):
        out.append(("peer_gone", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                                  "why": (m.group("why") or "connection closed by the remote peer").strip(),
                                  "message": warn}, ctx))
        return
    m = _CUDA_FAILURE.search(text)
    if m:
        out.append(("nccl_cuda", {"message": m.group("msg")}, ctx))
        return
    out.append(("nccl_warn", {"message": warn}, ctx))


def _pytorch(text: str, ctx: dict[str, Any], state: BlockState, out: Events) -> None:
    if "collective #" in text and state.desync_until >= state.lines:
        m = _DESYNC_RANK.search(text)
        if m:
            out.append(("desync_rank", {"lagging": int(m.group("rank")), "what": m.group("what").strip(),
                                        "collective": int(m.group("n"))}, ctx))
            state.desync_until = state.lines + 64
            return
    if "caused the desync" in text and _DESYNC_HEAD.search(text):
        state.desync_until = state.lines + 64
        out.append(("desync_report", {}, ctx))
        return
    if "Watchdog caught" in text or "blocking wait" in text:
        m = _WATCHDOG.search(text) or _BLOCKING.search(text)
        if m:
            g = m.groupdict()
            out.append(("watchdog_timeout", {**_pg(m), "seq": int(g["seq"]), "op": g["op"],
                                             "timeout_ms": int(g["timeout"]) if g.get("timeout") else None,
                                             "ran_ms": int(g["ran"]) if g.get("ran") else None,
                                             "numel_in": int(g["nin"]) if g.get("nin") else None,
                                             "numel_out": int(g["nout"]) if g.get("nout") else None,
                                             "blocking": "blocking wait" in text}, ctx))
        return
    if "last completed" in text:
        m = _PROGRESS.search(text)
        if m and "dump signal" not in text:
            out.append(("pg_progress", {**_pg(m), "at": int(m.group("at")), "enqueued": int(m.group("enq")),
                                        "completed": int(m.group("done"))}, ctx))
            return
    if "watchdog got stuck" in text:
        m = _STUCK.search(text)
        out.append(("heartbeat", {**(_pg(m) if m else {}), "stuck_s": int(m.group("secs")) if m else None}, ctx))
        return
    if "Heartbeat monitor timed out" in text:
        m = _HEARTBEAT.search(text)
        out.append(("heartbeat", {**(_pg(m) if m else {}), "stuck_s": None}, ctx))
        return
    if "dump signal" in text:
        m = _DUMP.search(text)
        if m:
            out.append(("dump_signal", {"from_rank": int(m.group("rank")),
                                        "completed": int(m.group("done")) if m.group("done") else None}, ctx))
        return
    if "Some NCCL operations have failed" in text:
        m = _FAILED.search(text)
        out.append(("nccl_failed", {"pg_rank": int(m.group("pgrank")) if m else None}, ctx))


def _pg(m: re.Match) -> dict[str, Any]:
    g = m.groupdict()
    return {"pg": int(g["pg"]) if g.get("pg") else None, "pg_name": g.get("pgname") or None,
            "pg_rank": int(g["pgrank"]) if g.get("pgrank") else None}


def _torchrun(text: str, ctx: dict[str, Any], state: BlockState, out: Events) -> None:
    if "Root Cause (first observed failure)" in text:
        _close_entry(state, out)
        state.torchrun_section = "root"
        return
    if "Failures:" in text and text.strip().endswith("Failures:"):
        _close_entry(state, out)
        state.torchrun_section = "failure"
        return
    if state.torchrun_section is None:
        return
    m = _TR_FIELD.match(text)
    if not m:
        return
    key, value = m.group("key"), m.group("value").strip()
    if key == "time":
        _close_entry(state, out)
        state.torchrun_entry = {"section": state.torchrun_section, "time": value, "ctx": ctx,
                                "line": state.lineno}
        return
    entry = state.torchrun_entry
    if entry is None:
        return
    if key == "host":
        entry["host"] = value
    elif key == "rank":
        r = _TR_RANK.match(value)
        if r:
            entry["rank"] = int(r.group("rank"))
            entry["local_rank"] = int(r.group("local")) if r.group("local") else None
    elif key == "exitcode":
        r = _TR_EXIT.match(value)
        if r:
            entry["exitcode"] = int(r.group("code"))
    elif key == "traceback":
        s = _SIGNAL.search(value)
        entry["signal"] = s.group("name") if s else None
        entry["traceback"] = value
        _close_entry(state, out)


def _close_entry(state: BlockState, out: Events) -> None:
    entry, state.torchrun_entry = state.torchrun_entry, None
    if not entry or "rank" not in entry and "host" not in entry:
        return
    ctx = dict(entry.pop("ctx"))
    at = wall_time(entry.get("time", ""))
    if at is not None:
        ctx["stamp"] = ("wall", at)
    ctx["rank"] = entry.get("rank")
    ctx["host"] = entry.get("host")
    ctx["local_rank"] = entry.get("local_rank")
    text = (f"torchrun {'root cause' if entry['section'] == 'root' else 'failure'}: rank {entry.get('rank')} on "
            f"{entry.get('host')}, exitcode {entry.get('exitcode')}"
            f"{' (' + entry['signal'] + ')' if entry.get('signal') else ''} at {entry.get('time')}")
    out.append(("torchrun_failure", {"root_cause": entry["section"] == "root", "time": entry.get("time"),
                                     "exitcode": entry.get("exitcode"), "signal": entry.get("signal"),
                                     "_line": entry["line"], "_text": text}, ctx))


def flush(state: BlockState) -> Events:
    """What a block left open at the end of the file says (a torchrun entry cut before its traceback field)."""
    out: Events = []
    _close_entry(state, out)
    return out


def _slurm(text: str, ctx: dict[str, Any], out: Events) -> None:
    m = _STEPD_CANCEL.search(text)
    if m:
        at = wall_time(m.group("at"))
        ctx = {**ctx, "stamp": ("wall", at)} if at is not None else ctx
        out.append(("slurm_cancel", {"what": m.group("what").lower(), "id": m.group("id"),
                                     "batch_host": m.group("host"), "at": m.group("at"),
                                     "why": (m.group("why") or "").strip() or None}, ctx))
        return
    m = _SRUN_TASK.search(text)
    if m:
        how = m.group("how").strip()
        code = _SRUN_EXIT_CODE.search(how)
        out.append(("srun_task", {"host": m.group("host"), "tasks": m.group("tasks"), "how": how,
                                  "exit_code": int(code.group(1)) if code else None,
                                  "killed": how.startswith(("Killed", "Terminated"))}, ctx))
        return
    m = _SRUN_NODE_FAIL.search(text)
    if m:
        out.append(("node_failure", {"host": m.group("host").rstrip(".")}, ctx))
        return
    if "oom" in text.lower():
        m = _STEPD_OOM.search(text)
        if m:
            out.append(("oom_kill", {"count": int(m.group("n"))}, ctx))


def bus_id(text: str) -> int | None:
    """A PCI bus id as one number, the way NCCL prints it (`busId b000` is 0000:0b:00.0; `e1000` 0000:e1:00.0):
    the hex digits of domain:bus:device.function run together."""
    digits = "".join(ch for ch in text.lower().removeprefix("0x") if ch in "0123456789abcdef")
    if not digits:
        return None
    if ":" in text:  # 0000:e1:00.0 / e1:00.0: each part to its width (device 2 digits, function 1)
        parts = text.lower().replace(".", ":").split(":")
        try:
            *dom_bus, dev, fn = parts
            bus = int(dom_bus[-1], 16)
            dom = int(dom_bus[-2], 16) if len(dom_bus) > 1 else 0
            return (dom << 20) | (bus << 12) | (int(dev, 16) << 4) | int(fn, 16)
        except (ValueError, IndexError):
            return None
    return int(digits, 16)

"""What the lines of a distributed job's log mean: the forms PyTorch's ProcessGroupNCCL, NCCL, torchrun and
srun/slurmstepd print (each form with an example file of ../fixtures/job_logs/ it was read from, and the versions
that print it where known: see fixtures/job_logs/FACTS.md). Pure: a line in, its events out.

`NEEDLES` are fixed texts of which every line of interest holds one: the reader decodes only those lines."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Iterator

NEEDLES: tuple[bytes, ...] = (
    # Each is searched for in a pass of its own over a buffer (a pass costs about as much as the next), so they are
    # as few as cover the forms below; not "NCCL" alone, which NCCL_DEBUG=INFO puts on every line of a log
    # (Channel/Ring/Trees lines, error chains): only the NCCL lines that say something. "rror" is in CUDA's,
    # srun's, slurmstepd's and Python's errors.
    b"NCCL WARN", b"ProcessGroupNCCL", b"NCCL work", b" busId ", b"Bootstrap : ", b"NET/IB : Using",
    b"NCCL version", b"set by environment", b"NCCL operations", b"atchdog", b"Heartbeat monitor", b"dump signal",
    b"rror", b"collective #", b"Rank  ", b"Root Cause", b"Failures:", b"      :", b"exitcode", b"traceback :",
    b"Traceback", b"Xid", b"desync",
)

# ---- the launcher's prefix and NCCL's own ---------------------------------------------------------------------
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")  # torchrun --tee / logs_specs: [rank3]:
_LOCAL_PREFIX = re.compile(r"\[default(\d+)\]:")  # torchrun per-local-rank: [default3]:
_MPI_TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")  # mpirun --tag-output: [jobid,rank]<stdout>:
_BRACKET_TAG = re.compile(r"^\[(\d+)\] ")  # mpirun rank tag ("[56] ") or a paste's line number ("[80746] ")
_SRUN_LABEL = re.compile(r"^\s{0,4}(\d{1,6}): ")  # srun --label: "3: "
# host:pid:tid [cudaDev] (file.cc:line )?NCCL INFO|WARN (NCCL_DEBUG's prefix; the host may be anonymised: <name>)
_NCCL = re.compile(r"(?:^|(?<=[\s:>\]]))([^\s:\[\]]+):(\d+):(\d+) \[(\d+)\] (?:\S+:\d+ )?NCCL (INFO|WARN) ")
_GLOG = re.compile(r"\[[EWIF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?")  # [E1002 18:16:40.662329700
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d)(?::(\d\d))?")

# ---- PyTorch ProcessGroupNCCL ---------------------------------------------------------------------------------
_PG = r"\[(?:PG (?:ID )?(?P<pg>\d+)(?: PG GUID (?P<guid>\d+))?(?:\s*\((?P<pgname>[^)]*)\))? )?Rank (?P<pgrank>\d+)\]"
# [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=..,
# NumelOut=.., Timeout(ms)=600000) ran for 600020 milliseconds before timing out.  (basicsr__737, ofa__271: no Numel)
_WATCHDOG = re.compile(_PG + r" (?:Watchdog caught collective operation timeout|Work): WorkNCCL\(SeqNum=(?P<seq>\d+), "
                       r"OpType=(?P<op>\w+)(?:, NumelIn=(?P<nin>-?\d+), NumelOut=(?P<nout>-?\d+))?"
                       r".*?Timeout\(ms\)=(?P<timeout>\d+)\)(?: ran for (?P<ran>\d+) milliseconds)?")
_BLOCKING = re.compile(_PG + r" Work WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+).*timed out in blocking wait")
# [PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580, last enqueued NCCL work:
# 1582, last completed NCCL work: 1579.  /  [PG 0 Rank 1] Timeout at NCCL work: 5, last enqueued ..: 7, ..: 4.
# [PG ID 1 PG GUID 1 Rank 1]  failure detected by watchdog at work sequence id: 1116 PG status: last enqueued work:
# 1118, last completed work: 1115
_PROGRESS = re.compile(_PG + r"\s+(?:Exception \(either an error or timeout\) detected by watchdog at work: |"
                       r"Timeout at NCCL work: |failure detected by watchdog at work sequence id: )(?P<at>\d+)"
                       r".*?last enqueued (?:NCCL )?work: (?P<enq>-?\d+), "
                       r"last completed (?:NCCL )?work: (?P<done>-?\d+)")
_STUCK = re.compile(_PG + r" ProcessGroupNCCL's watchdog got stuck for (?P<secs>\d+) seconds")
_HEARTBEAT = re.compile(_PG + r" Heartbeat monitor timed out")
_DUMP = re.compile(r"Received a dump signal due to a collective timeout from\s+rank (?P<rank>\d+)"
                   r"(?:.*?last enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL work: (?P<done>-?\d+))?")
_DESYNC_HEAD = re.compile(r"lagging/dead/mismatched ranks that caused the desync are")
_DESYNC_RANK = re.compile(r"\[(?P<rank>\d+)\] (?P<what>(?:finished|joined|is running|completed)[^#]*collective "
                          r"#(?P<n>\d+)[^\n]*)")
_FAILED = re.compile(r"\[Rank (?P<pgrank>\d+)\] Some NCCL operations have failed or timed out")

# ---- NCCL -----------------------------------------------------------------------------------------------------
# comm 0x12464df00 rank 6 nranks 8 cudaDev 2 busId b000 - Abort COMPLETE (uniworld__46); ncclCommInitRank comm 0x..
# rank 3 nranks 4 cudaDev 3 nvmlDev 3 busId e1000 commId 0x.. - Init COMPLETE (FACTS.md)
_COMM = re.compile(r"comm 0x[0-9a-fA-F]+ rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<dev>\d+)"
                   r"(?: nvmlDev (?P<nvml>\d+))? busId (?P<bus>[0-9a-fA-F]+)(?:.*?- (?P<state>Init|Abort|Destroy))?")
# nccl-tests: #  Rank  1 Group  0 Pid   4940 on ai-worker03 device  0 [0x61] NVIDIA L40 (nccl-tests__227)
_TESTS_RANK = re.compile(r"#\s+Rank\s+(?P<rank>\d+) Group\s+\d+ Pid\s+(?P<pid>\d+) on (?P<host>\S+) device\s+"
                         r"(?P<dev>\d+) \[(?P<bus>0x[0-9a-fA-F]+)\]")
_BOOTSTRAP = re.compile(r"Bootstrap : Using (?P<list>.*)")
_IFACE_IP = re.compile(r"(?:\[\d+\])?([\w.\-]+):([0-9a-fA-F.:]+?)<\d+>")
_IB_USING = re.compile(r"NET/IB : Using (?P<list>.*?)(?:; OOB (?P<oob>\S+))?\s*$")
_IB_PORT = re.compile(r"\[(\d+)\]([\w.\-]+):(\d+)/(\w+)")
# NET/IB : Got completion from peer 172.17.127.143<49577> with error 12, opcode 1, len 0, vendor err 129 (nccl__733)
# ... with status=12 opcode=129 len=65536 vendor err 129 (Recv) localGid .. remoteGids.. (nccl__1814)
_IB_COMPLETION = re.compile(r"NET/IB\s*: Got completion from peer (?P<peer>[^\s<]+)<(?P<port>\d+)> with "
                            r"(?:error |status=)(?P<status>\d+)[, ].*?vendor err (?P<vendor>\d+)")
_IB_ASYNC = re.compile(r"NET/IB\s*: (?:IB )?Got async event\s*: (?P<event>[^\n]+)")
_REFUSED = re.compile(r"Connect to (?P<peer>[^\s<]+)<(?P<port>\d+)> failed : (?P<why>[^\n]+)")
_PEER_GONE = re.compile(r"(?:Call to (?:recv|send) from|Call to (?:recv|send) to|Connection closed by remote peer|"
                        r"Connection reset by peer) ?(?P<peer>[^\s<]+)?<(?P<port>\d+)>(?: failed : (?P<why>[^\n]+))?")
_CUDA_FAILURE = re.compile(r"Cuda failure '(?P<msg>[^']*)'")
_NCCL_VERSION = re.compile(r"NCCL version (?P<version>\d+\.\d+\.\d+)")
_NCCL_ENV = re.compile(r"(?P<var>NCCL_\w+) set by environment to (?P<value>[^\s.]+(?:\.\d+)?)")

# ---- CUDA errors raised into the program ----------------------------------------------------------------------
_CUDA_ERROR = re.compile(r"(?:CUDA error: |cudaError\w*: )(?P<msg>[^\n]+)")
# What CUDA says when the GPU itself failed (a fatal XID, an ECC error, a GPU off the bus), as opposed to what a
# program does wrong (an illegal address, out of memory, a device-side assert).
HARDWARE_CUDA = (
    ("uncorrectable ECC error", "gpu", "an uncorrectable ECC error: the GPU's memory failed"),
    ("uncorrectable NVLink error", "nvlink", "an uncorrectable NVLink error"),
    ("GPU is lost", "gpu", "the GPU is lost (fallen off the bus)"),
    ("fallen off the bus", "gpu", "the GPU has fallen off the bus"),
    ("unknown error", "gpu", "CUDA's 'unknown error': what a GPU that hit a fatal XID or fell off the bus answers"),
    ("ECC error", "gpu", "an ECC error"),
)
_XID = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)")

# ---- torchrun / elastic ---------------------------------------------------------------------------------------
_TR_FIELD = re.compile(r"^\s+(?P<key>time|host|rank|exitcode|traceback)\s*:\s*(?P<value>.*)$")
_TR_RANK = re.compile(r"(?P<rank>-?\d+)(?: \(local_rank: (?P<local>\d+)\))?")
_TR_EXIT = re.compile(r"(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?")
_SIGNAL = re.compile(r"Signal (?P<num>\d+) \((?P<name>SIG\w+)\)")

# ---- srun / slurmstepd ----------------------------------------------------------------------------------------
# slurmstepd: error: *** STEP 1999616.0 ON r6i4n5 CANCELLED AT 2021-05-27T21:42:11 DUE TO TIME LIMIT ***
_STEPD_CANCEL = re.compile(r"\*\*\* (?P<what>STEP|JOB) (?P<id>\S+) ON (?P<host>\S+) CANCELLED AT (?P<at>\S+)"
                           r"(?: DUE TO (?P<why>[A-Z ]+?))?(?:,[^*]*)? \*\*\*")
_STEPD_OOM = re.compile(r"Detected (?P<n>\d+) oom[_-]kill event")
# srun: error: node12: task 3: Exited with exit code 1 / srun: error: node12: tasks 0-3: Killed
_SRUN_TASK = re.compile(r"srun: error: (?P<host>[^\s:]+): tasks? (?P<tasks>[\d,\-]+): (?P<how>[^\n]+)")
_SRUN_NODE_FAIL = re.compile(r"[Nn]ode failure on (?P<host>[^\s,]+)")


class BlockState:
    """What a multi-line block has said so far (torchrun's summary; a desync report's list of ranks)."""

    def __init__(self) -> None:
        self.torchrun_section: str | None = None  # "failure" | "root" inside a torchrun summary
        self.torchrun_entry: dict[str, Any] | None = None
        self.desync_until = -1  # lines of a desync report still to come (its ranks follow its head)
        self.lines = 0
        self.lineno = 0  # the file's line being read (the reader sets it)


def parse(text: str, state: BlockState) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The events of one line: (kind, fields, context) where context is the prefix's host/pid/dev/rank/
    local_rank and the line's time stamp."""
    state.lines += 1
    ctx = _context(text)
    if "NCCL" in text:
        yield from _nccl(text, ctx)
    if ("ProcessGroupNCCL" in text or "Rank " in text or "collective #" in text or "dump signal" in text
            or "caused the desync" in text):
        yield from _pytorch(text, ctx, state)
    if "CUDA error" in text or "cudaError" in text or "ECC error" in text:
        m = _CUDA_ERROR.search(text)
        msg = m.group("msg").strip() if m else text.strip()
        hw = next(((what, kind) for key, kind, what in HARDWARE_CUDA if key in msg), None)
        yield "cuda_error", {"message": msg, "hardware": hw[0] if hw else None, "part": hw[1] if hw else None}, ctx
    if "Rank  " in text:
        m = _TESTS_RANK.search(text)
        if m:
            yield "tests_rank", {"rank": int(m.group("rank")), "host": m.group("host"), "dev": int(m.group("dev")),
                                 "bus": int(m.group("bus"), 16) << 12}, ctx
    if "Xid" in text:
        m = _XID.search(text)
        if m:
            yield "xid", {"xid": int(m.group("xid")), "pci": m.group("pci")}, ctx
    if "Traceback (most recent call last)" in text:
        yield "traceback", {}, ctx
    yield from _torchrun(text, ctx, state)
    if "slurmstepd" in text or "srun: error" in text or "ode failure" in text:
        yield from _slurm(text, ctx)


def _context(text: str) -> dict[str, Any]:
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


def _nccl(text: str, ctx: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    if " busId " in text:
        m = _COMM.search(text)
        if m:
            yield "comm", {"comm_rank": int(m.group("rank")), "nranks": int(m.group("nranks")),
                           "cuda_dev": int(m.group("dev")), "bus": bus_id(m.group("bus")),
                           "state": m.group("state")}, ctx
    if "Bootstrap : Using" in text:
        m = _BOOTSTRAP.search(text)
        if m:
            ips = [ip for _, ip in _IFACE_IP.findall(m.group("list"))]
            if ips:
                yield "bootstrap", {"ips": ips}, ctx
    if "NET/IB : Using" in text:
        m = _IB_USING.search(text)
        if m:
            ports = [{"index": int(i), "device": dev, "port": int(p), "link": link}
                     for i, dev, p, link in _IB_PORT.findall(m.group("list"))]
            oob = _IFACE_IP.findall(m.group("oob") or "")
            yield "ib_devices", {"ports": ports, "oob_ip": oob[0][1] if oob else None}, ctx
    if "NCCL version" in text:
        m = _NCCL_VERSION.search(text)
        if m:
            yield "nccl_version", {"version": m.group("version")}, ctx
    if "set by environment to" in text:
        m = _NCCL_ENV.search(text)
        if m:
            yield "nccl_env", {"var": m.group("var"), "value": m.group("value")}, ctx
    if "NCCL WARN" not in text:
        return
    warn = text[text.index("NCCL WARN") + 10:].strip()
    m = _IB_COMPLETION.search(text)
    if m:
        yield "ib_completion", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                                "status": int(m.group("status")), "vendor": int(m.group("vendor")),
                                "message": warn}, ctx
        return
    m = _IB_ASYNC.search(text)
    if m:
        yield "ib_async", {"event": m.group("event").strip(), "message": warn}, ctx
        return
    m = _REFUSED.search(text)
    if m:
        yield "connect_failed", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                                 "why": m.group("why").strip(), "message": warn}, ctx
        return
    m = _PEER_GONE.search(text)
    if m and m.group("peer"):
        yield "peer_gone", {"peer": m.group("peer"), "peer_port": int(m.group("port")),
                            "why": (m.group("why") or "connection closed by the remote peer").strip(),
                            "message": warn}, ctx
        return
    m = _CUDA_FAILURE.search(text)
    if m:
        yield "nccl_cuda", {"message": m.group("msg")}, ctx
        return
    yield "nccl_warn", {"message": warn}, ctx


def _pytorch(text: str, ctx: dict[str, Any], state: BlockState) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    if "collective #" in text and state.desync_until >= state.lines:
        m = _DESYNC_RANK.search(text)
        if m:
            yield "desync_rank", {"lagging": int(m.group("rank")), "what": m.group("what").strip(),
                                  "collective": int(m.group("n"))}, ctx
            state.desync_until = state.lines + 64
            return
    if "caused the desync" in text and _DESYNC_HEAD.search(text):
        state.desync_until = state.lines + 64
        yield "desync_report", {}, ctx
        return
    if "Watchdog caught" in text or "blocking wait" in text:
        m = _WATCHDOG.search(text) or _BLOCKING.search(text)
        if m:
            g = m.groupdict()
            yield "watchdog_timeout", {**_pg(m), "seq": int(g["seq"]), "op": g["op"],
                                       "timeout_ms": int(g["timeout"]) if g.get("timeout") else None,
                                       "ran_ms": int(g["ran"]) if g.get("ran") else None,
                                       "numel_in": int(g["nin"]) if g.get("nin") else None,
                                       "numel_out": int(g["nout"]) if g.get("nout") else None,
                                       "blocking": "blocking wait" in text}, ctx
        return
    if "last completed" in text:
        m = _PROGRESS.search(text)
        if m and "dump signal" not in text:
            yield "pg_progress", {**_pg(m), "at": int(m.group("at")), "enqueued": int(m.group("enq")),
                                  "completed": int(m.group("done"))}, ctx
            return
    if "watchdog got stuck" in text:
        m = _STUCK.search(text)
        yield "heartbeat", {**(_pg(m) if m else {}), "stuck_s": int(m.group("secs")) if m else None}, ctx
        return
    if "Heartbeat monitor timed out" in text:
        m = _HEARTBEAT.search(text)
        yield "heartbeat", {**(_pg(m) if m else {}), "stuck_s": None}, ctx
        return
    if "dump signal" in text:
        m = _DUMP.search(text)
        if m:
            yield "dump_signal", {"from_rank": int(m.group("rank")),
                                  "completed": int(m.group("done")) if m.group("done") else None}, ctx
        return
    if "Some NCCL operations have failed" in text:
        m = _FAILED.search(text)
        yield "nccl_failed", {"pg_rank": int(m.group("pgrank")) if m else None}, ctx


def _pg(m: re.Match) -> dict[str, Any]:
    g = m.groupdict()
    return {"pg": int(g["pg"]) if g.get("pg") else None, "pg_name": g.get("pgname") or None,
            "pg_rank": int(g["pgrank"]) if g.get("pgrank") else None}


Events = Iterator[tuple[str, dict[str, Any], dict[str, Any]]]


def _torchrun(text: str, ctx: dict[str, Any], state: BlockState) -> Events:
    if "Root Cause (first observed failure)" in text:
        yield from _close_entry(state)
        state.torchrun_section = "root"
        return
    if "Failures:" in text and text.strip().endswith("Failures:"):
        yield from _close_entry(state)
        state.torchrun_section = "failure"
        return
    if state.torchrun_section is None:
        return
    m = _TR_FIELD.match(text)
    if not m:
        return
    key, value = m.group("key"), m.group("value").strip()
    if key == "time":
        yield from _close_entry(state)
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
        yield from _close_entry(state)


def _close_entry(state: BlockState) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    entry, state.torchrun_entry = state.torchrun_entry, None
    if not entry or "rank" not in entry and "host" not in entry:
        return
    ctx = dict(entry.pop("ctx"))
    t = _ISO.search(entry.get("time", ""))
    if t:
        ctx["stamp"] = ("wall", _iso(t))
    ctx["rank"] = entry.get("rank")
    ctx["host"] = entry.get("host")
    ctx["local_rank"] = entry.get("local_rank")
    text = (f"torchrun {'root cause' if entry['section'] == 'root' else 'failure'}: rank {entry.get('rank')} on "
            f"{entry.get('host')}, exitcode {entry.get('exitcode')}"
            f"{' (' + entry['signal'] + ')' if entry.get('signal') else ''} at {entry.get('time')}")
    yield "torchrun_failure", {"root_cause": entry["section"] == "root", "time": entry.get("time"),
                               "exitcode": entry.get("exitcode"), "signal": entry.get("signal"),
                               "_line": entry["line"], "_text": text}, ctx


def flush(state: BlockState) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """What a block left open at the end of the file says (a torchrun entry cut before its traceback field)."""
    yield from _close_entry(state)


def _slurm(text: str, ctx: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    m = _STEPD_CANCEL.search(text)
    if m:
        t = _ISO.search(m.group("at"))
        ctx = {**ctx, "stamp": ("wall", _iso(t))} if t else ctx
        yield "slurm_cancel", {"what": m.group("what").lower(), "id": m.group("id"), "batch_host": m.group("host"),
                               "at": m.group("at"), "why": (m.group("why") or "").strip() or None}, ctx
        return
    m = _SRUN_TASK.search(text)
    if m:
        how = m.group("how").strip()
        code = re.search(r"[Ee]xit(?:ed with exit)? code (\d+)", how)
        yield "srun_task", {"host": m.group("host"), "tasks": m.group("tasks"), "how": how,
                            "exit_code": int(code.group(1)) if code else None,
                            "killed": how.startswith(("Killed", "Terminated"))}, ctx
        return
    m = _SRUN_NODE_FAIL.search(text)
    if m:
        yield "node_failure", {"host": m.group("host").rstrip(".")}, ctx
        return
    if "oom" in text.lower():
        m = _STEPD_OOM.search(text)
        if m:
            yield "oom_kill", {"count": int(m.group("n"))}, ctx


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

"""A Slurm job's window as its tools write it: `sacct -j ID --json` (22.05's plain values and newer Slurm's {set,
infinite, number} numbers and state lists) and `scontrol show job ID` (keys and values on lines, some values the rest
of their line), read into a JobWindow and its StepWindows; and the output files a path names on each node, filled in
as slurmstepd fills them. agent/act/adapters/slurm_job.py asks the tools and merges what they say."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpuwarden.agent.act.adapters.slurm_hostlist import MAX_HOSTLIST, expand_hostlist
from gpuwarden.agent.act.adapters.slurm_json import _json_document, job_state_words, slurm_number
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import Transient

MAX_JOBS = 100_000  # entries of one sacct document looked at (an array job's tasks)
MAX_STEPS = 10_000  # steps of one job read
MAX_LINES = 200_000  # lines of `scontrol show job` read
MAX_FILES = 4096  # output files a window names (one per node)
_EXIT_TEXT = re.compile(r"[0-9]{1,10}:[0-9]{1,5}")
# Slurm's job states after which its end time and exit code are final (squeue(1) "JOB STATE CODES").
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                   "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED", "COMPLETING"})
FAILED = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                    "OUT_OF_MEMORY"})
# `scontrol show job` keys whose value is the rest of their line (a path or a comment may hold spaces and `=`).
_WHOLE_LINE = frozenset({"Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment", "AdminComment",
                         "SystemComment"})
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_/:]*)=")
_NONE = ("", "(null)", "None", "Unknown", "N/A")


@dataclass(frozen=True)
class StepWindow:
    """One step of the job (`4242.batch`, `4242.0`), as accounting recorded it."""

    id: str
    name: str | None
    state: str | None
    exit_code: str | None  # "3:0": return code and signal, as Slurm prints them; None: not ended or not known
    nodes: tuple[str, ...]
    start: float | None
    end: float | None

    @property
    def failed(self) -> bool:
        return self.state in FAILED or (self.exit_code is not None and self.exit_code != "0:0")


@dataclass(frozen=True)
class JobWindow:
    """A Slurm job: where and when it ran, how it ended, and where its output went.

    `stdout` / `stderr` are the paths as slurmctld has them (it fills in %j, %x, %u, %A, %a itself; %N, %n, %t, %s
    are left to the node); `stdout_files` / `stderr_files` are those paths as each node of the job names them
    (`locate_outputs` finds the ones that exist). `sources`: the tool calls that answered; `errors`: what the
    others said (a tool that could not be asked is named, never taken for an empty answer)."""

    job_id: str
    name: str | None
    user: str | None
    state: str | None
    exit_code: str | None  # "3:0"; None while the job runs, or where no tool said
    nodes: tuple[str, ...]
    start: float | None
    end: float | None
    stdout: str | None
    stderr: str | None
    batch_host: str | None
    steps: tuple[StepWindow, ...]
    sources: tuple[str, ...]
    stdout_files: tuple[str, ...] = ()
    stderr_files: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def failed_steps(self) -> tuple[StepWindow, ...]:
        return tuple(s for s in self.steps if s.failed)

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "name": self.name, "user": self.user, "state": self.state,
                "exit_code": self.exit_code, "nodes": list(self.nodes), "start": self.start, "end": self.end,
                "stdout": self.stdout, "stderr": self.stderr, "batch_host": self.batch_host,
                "stdout_files": list(self.stdout_files), "stderr_files": list(self.stderr_files),
                "steps": [{"id": s.id, "name": s.name, "state": s.state, "exit_code": s.exit_code,
                           "nodes": list(s.nodes), "start": s.start, "end": s.end} for s in self.steps],
                "sources": list(self.sources), "errors": list(self.errors)}


def _after_tool(message: str, tool: str) -> str:
    """The adapter's message less its own `<tool> <what>: ` head (the call is named here in full)."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith(tool) else message


# -- sacct --json ----------------------------------------------------------------------------------------------------
def parse_sacct_json(text: str, job_id: str) -> JobWindow | None:
    """The job of `sacct -j ID --json`: 22.05's document (plain numbers, `state.current` a word, `exit_code`
    {status, return_code, signal {signal_id}}, steps `{job_id, id: "batch" | 0}`) or a newer one (numbers as {set,
    infinite, number}, states as lists, `signal {id}`, step ids "4242.batch"). None when accounting has no such job
    (22.05 says so as an "errors" entry, `Nothing found with query`; newer Slurm with an empty list). Raises
    ParseError for a document that is not sacct's, or one whose errors say accounting could not be asked."""
    source = f"sacct -j {job_id} --json"
    try:
        doc = _json_document(text, "sacct")
    except Transient as exc:
        if "nothing found" in str(exc).lower():
            return None
        raise ParseError(_after_tool(str(exc), "sacct").replace("slurmctld not reached", "accounting not read"),
                         source) from None
    jobs = doc.get("jobs")
    if not isinstance(jobs, list):
        raise ParseError("no job list", source)
    entry = next((e for e in jobs[:MAX_JOBS] if isinstance(e, dict) and _is_job(e, job_id)), None)
    if entry is None:
        return None
    state = _state(entry.get("state"))
    ended = state in ENDED
    times = entry.get("time") if isinstance(entry.get("time"), dict) else {}
    assoc = entry.get("association") if isinstance(entry.get("association"), dict) else {}
    steps = []
    for raw in (entry.get("steps") if isinstance(entry.get("steps"), list) else [])[:MAX_STEPS]:
        if isinstance(raw, dict):
            step = _sacct_step(raw, _number_id(entry))
            if step is not None:
                steps.append(step)
    return JobWindow(
        job_id=job_id, name=_text(entry.get("name")), user=_text(entry.get("user")) or _text(assoc.get("user")),
        state=state, exit_code=_exit_code(entry.get("exit_code")) if ended else None,
        nodes=_hostlist(entry.get("nodes")), start=slurm_number(times.get("start")),
        end=slurm_number(times.get("end")) if ended else None, stdout=None, stderr=None, batch_host=None,
        steps=tuple(steps), sources=(source,))


def _is_job(entry: Mapping[str, Any], job_id: str) -> bool:
    """Whether the entry is job `job_id`: its own job id, or for `A_T` task T of array A."""
    parent, sep, task = job_id.partition("_")
    if not sep:
        return _number_id(entry) == job_id
    array = entry.get("array") if isinstance(entry.get("array"), dict) else {}
    return str(_int(array.get("job_id"))) == parent and str(_int(array.get("task_id"))) == task


def _number_id(entry: Mapping[str, Any]) -> str | None:
    n = _int(entry.get("job_id"))
    return str(n) if n is not None else None


def _sacct_step(raw: Mapping[str, Any], job: str | None) -> StepWindow | None:
    step = raw.get("step") if isinstance(raw.get("step"), dict) else {}
    ident = step.get("id")
    if isinstance(ident, dict):  # {"job_id", "step_id"} shapes of some versions
        ident = ident.get("step_id", ident.get("id"))
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        return None
    ident = str(ident)[:64]
    if "." not in ident:  # 22.05: "batch", "extern", 0 beside step.job_id; newer: "4242.batch"
        owner = _int(step.get("job_id"))
        ident = f"{owner if owner is not None else job}.{ident}"
    nodes_raw = raw.get("nodes")
    nodes: tuple[str, ...] = ()
    if isinstance(nodes_raw, dict):
        nodes = _hostlist(nodes_raw.get("range"))
        if not nodes and isinstance(nodes_raw.get("list"), list):
            nodes = _hostlist(",".join(n for n in nodes_raw["list"][:MAX_FILES] if isinstance(n, str)))
    elif isinstance(nodes_raw, str):
        nodes = _hostlist(nodes_raw)
    state = _state(raw.get("state"))
    times = raw.get("time") if isinstance(raw.get("time"), dict) else {}
    end = slurm_number(times.get("end"))
    done = state in ENDED or (end is not None and state is None)
    return StepWindow(ident, _text(step.get("name")), state, _exit_code(raw.get("exit_code")) if done else None,
                      nodes, slurm_number(times.get("start")), end if done else None)


def parse_sacct_exit_codes(text: str) -> dict[str, str]:
    """`sacct -j ID --noheader --parsable2 --format=JobID,ExitCode`: job or step id -> "3:0"."""
    out = {}
    for line in text.splitlines()[:MAX_STEPS + 1]:
        ident, sep, code = line.strip().partition("|")
        if sep and _EXIT_TEXT.fullmatch(code) and 0 < len(ident) <= 64:
            out[ident] = code
    return out


def _state(value: Any) -> str | None:
    """A job or step state: "FAILED", {"current": "FAILED"} (22.05), {"current": ["FAILED"]} or ["FAILED"]."""
    if isinstance(value, dict):
        value = value.get("current")
    words = job_state_words(value)
    return words[0] if words else None


def _exit_code(value: Any) -> str | None:
    """An exit code as Slurm prints it ("3:0", "0:15") from sacct's object: {status, return_code, signal
    {signal_id | id, name}}, numbers plain (22.05) or {set, infinite, number}."""
    if isinstance(value, str):
        return value if _EXIT_TEXT.fullmatch(value) else None
    if not isinstance(value, dict):
        return None
    code = _int(value.get("return_code"))
    signal = value.get("signal") if isinstance(value.get("signal"), dict) else {}
    sig = _int(signal.get("id", signal.get("signal_id")))
    if code is None and not sig:
        return None
    return f"{code or 0}:{sig or 0}"


def _int(value: Any) -> int | None:
    """A count or id of sacct's JSON, 0 included: plain, or {"set": true, "number": n}."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32 else None


def _text(value: Any, limit: int = 1024) -> str | None:
    return value[:limit] if isinstance(value, str) and value and value not in _NONE else None


def _hostlist(value: Any) -> tuple[str, ...]:
    """A node list ("n[1-2,7]"); () for none ("None assigned", "(null)") or one that does not read."""
    if not isinstance(value, str) or value.strip() in _NONE or len(value) > MAX_HOSTLIST:
        return ()
    try:
        return tuple(expand_hostlist(value))
    except ValueError:
        return ()


# -- scontrol show job -----------------------------------------------------------------------------------------------
def parse_scontrol_job(text: str, job_id: str) -> JobWindow | None:
    """The job of `scontrol show job ID` (its several-line form): None when no record is that job's. Times are
    local time as scontrol prints them (`2026-12-06T11:40:02`); a pending job's StartTime (an estimate) and a
    running one's EndTime (its time limit) are not taken."""
    for record in _records(text):
        if _scontrol_id(record) != job_id:
            continue
        state = _first_word(record.get("JobState"))
        ended = state in ENDED
        nodes = _hostlist(record.get("NodeList"))
        batch_host = _text(record.get("BatchHost"), 64)
        work = _text(record.get("WorkDir"), 4096)
        stdout, stderr = (_path(record.get(k), work) for k in ("StdOut", "StdErr"))
        exit_code = record.get("ExitCode")
        return JobWindow(
            job_id=job_id, name=_text(record.get("JobName")), user=_user(record.get("UserId")), state=state,
            exit_code=exit_code if ended and exit_code and _EXIT_TEXT.fullmatch(exit_code) else None, nodes=nodes,
            start=_local_time(record.get("StartTime")) if state not in (None, "PENDING") else None,
            end=_local_time(record.get("EndTime")) if ended else None, stdout=stdout, stderr=stderr,
            batch_host=batch_host, steps=(), sources=(f"scontrol show job {job_id}",),
            stdout_files=output_files(stdout, _batch_first(nodes, batch_host), job_id),
            stderr_files=output_files(stderr, _batch_first(nodes, batch_host), job_id))
    return None


def _records(text: str) -> Iterable[dict[str, str]]:
    """Each job record (a blank line between records) as key -> value."""
    record: dict[str, str] = {}
    for line in text[: 64 << 20].splitlines()[:MAX_LINES]:
        line = line.strip()
        if not line:
            if record:
                yield record
            record = {}
            continue
        key, sep, rest = line.partition("=")
        if sep and key in _WHOLE_LINE:
            record.setdefault(key, rest)
            continue
        keys = list(_KEY.finditer(line))
        for i, m in enumerate(keys):
            end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
            record.setdefault(m.group(1), line[m.end():end].strip())
    if record:
        yield record


def _scontrol_id(record: Mapping[str, str]) -> str | None:
    array, task = record.get("ArrayJobId"), record.get("ArrayTaskId")
    if array and task and array.isdigit() and task.isdigit():
        return f"{array}_{task}"
    return record.get("JobId")


def _first_word(value: str | None) -> str | None:
    words = job_state_words(value) if value else []
    return words[0] if words else None


def _user(value: str | None) -> str | None:
    """`root(0)` -> root."""
    name = (value or "").partition("(")[0].strip()
    return name[:256] or None


def _path(value: str | None, work: str | None) -> str | None:
    value = _text(value, 4096)
    if value is None:
        return None
    return value if value.startswith("/") or not work else str(Path(work) / value)


def _local_time(value: str | None) -> float | None:
    """`2026-12-06T11:40:02` in this host's local time (scontrol prints slurmctld's times in the reader's zone)."""
    if not value or value in _NONE:
        return None
    try:
        return time.mktime(time.strptime(value[:19], "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def _batch_first(nodes: tuple[str, ...], batch_host: str | None) -> tuple[str, ...]:
    if batch_host and batch_host in nodes:
        return (batch_host,) + tuple(n for n in nodes if n != batch_host)
    return nodes


# -- output files ----------------------------------------------------------------------------------------------------
_FIELD = re.compile(r"%(\d*)([%JNnts])")


def output_files(pattern: str | None, nodes: Iterable[str], job_id: str = "") -> tuple[str, ...]:
    """The files an output path names on each node, filled in as slurmstepd fills in what slurmctld left (22.05
    leaves these): %N the node, %n its index among the job's nodes (the batch host's is 0), %t the task (0, the
    batch script's), %s the step (`batch`), %J the job id (the batch step's has no step suffix), %% a percent
    sign. A path without %N or %n names one file. A path with a backslash is taken as it is, less its backslashes
    (Slurm then fills in nothing)."""
    if not pattern:
        return ()
    if "\\" in pattern:
        return (pattern.replace("\\", ""),)
    names = list(nodes)[:MAX_FILES]
    if not re.search(r"%\d*[Nn]", pattern):
        return (_fill(pattern, names[0] if names else "", 0, job_id),)
    return tuple(dict.fromkeys(_fill(pattern, node, i, job_id) for i, node in enumerate(names)))


def _fill(pattern: str, node: str, index: int, job_id: str = "") -> str:
    def one(m: re.Match) -> str:
        width, field = int(m.group(1) or 0), m.group(2)
        if field == "%":
            return "%"
        if field == "N":
            return node or m.group(0)
        if field == "s":
            return "batch"
        if field == "J":
            return job_id or m.group(0)
        return str(index if field == "n" else 0).zfill(min(width, 10))

    return _FIELD.sub(one, pattern)

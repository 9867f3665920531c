"""Parser of nccl-tests / rccl-tests output (all_reduce_perf and its siblings): the result rows, the header, the
summary lines and the NCCL warnings and errors around them, as printed bare, under srun's "0: " labels or under
mpirun's "[1,0]<stdout>:" tags."""
from __future__ import annotations

import math
import re
from dataclasses import field

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_limits import MAX_MESSAGE, bounded_int, check_size, text_lines

# Every pattern is linear in the length of a line: quantifiers are possessive (*+, ++) or bounded wherever what
# follows could fail, so a long damaged line is read in one pass instead of being retried from every split point.
# Numbers are ASCII digits ([0-9], not \d, which takes "١٢٣") of bounded length, converted by parse_limits.
# Launcher labels in front of every line: srun -l ("0: ", "12: ") and Open MPI --tag-output ("[1,0]<stdout>:").
_PREFIX = re.compile(r"^\s*+(?:\[[0-9]{1,9},[0-9]{1,9}\]<(?:stdout|stderr)>:|[0-9]{1,6}: ?)")
_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][-+]?[0-9]{1,3})?")
_HEADER = re.compile(r"^#\s*+size\s++count\s++type\b")
_TOOL_VERSION = re.compile(r"^#?+\s*+([a-z]++)-tests:?+\s++[Vv]ersion\s++(\S++)")
_NCCL_VERSION = re.compile(r"^#?+\s*+NCCL version\s++(\S++)")
_COLLECTIVE = re.compile(r"^#\s*+Collective test (starting|concluded):\s*+(\S++)")
_COMMAND = re.compile(r"(?:^|[\s/])(\w+_perf)(?:_mpi)?(?:\s|$)")  # \w+ backtracks only within one word
_SETTINGS = re.compile(r"^#\s*+(?:nThread\s++[0-9]++\s++)?+nGpus\b")
_SETTING = {  # field -> (the tool's name for it, its pattern, most digits)
    "n_threads": ("nThread", re.compile(r"\bnThread\s++([0-9]++)"), 9),
    "n_gpus": ("nGpus", re.compile(r"\bnGpus(?:\(perProc\))?+\s++([0-9]++)"), 9),
    "min_bytes": ("minBytes", re.compile(r"\bminBytes\s++([0-9]++)"), 18),
    "max_bytes": ("maxBytes", re.compile(r"\bmaxBytes\s++([0-9]++)"), 18),
    "validation": ("validation", re.compile(r"\bvalidation:\s*+([0-9]++)"), 9),
}
_DEVICE = re.compile(r"^#\s*+Rank\s++([0-9]++)(?:\s++Group\s++([0-9]++))?+(?:\s++Pid\s++([0-9]++))?+"
                     r"(?:\s++on\s++(\S++))?+\s++device\s++([0-9]++)\s++\[([^\]]*+)\]\s*+(.*+)")
_OUT_OF_BOUNDS = re.compile(r"^#\s*+Out of bounds values\s*+:\s*+([0-9]++)\s*+(OK|FAILED)?+")
_AVG_BUSBW = re.compile(r"^#\s*+Avg bus bandwidth\s*+:\s*+(\S++)\s*+(?:GB/s)?+\s*+(FAILED)?+")
_ELISION = re.compile(r"^\s*+(?:\.\s*+){3,}+$")
_WARN = re.compile(r"\bNCCL WARN\b")
# Lines that say a run failed: nccl-tests' own NCCLCHECK / CUDACHECK / testResult reports, its -T timeout, and
# what launchers and the C runtime print when a rank dies.
_ERROR = re.compile(
    r"Test (?:NCCL |CUDA )?failure\b|: Test timeout\b|\bNCCL error\b|Segmentation fault|\(core dumped\)"
    r"|exited on signal|^srun: error:|MPI_ABORT|mpirun detected that one or more processes exited"
    r"|error while loading shared libraries|^terminate called|^Aborted\b")


@dataclass(frozen=True)
class Result:
    """One half of a row: the out-of-place or the in-place run of that size."""

    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # wrong elements; None where the tool printed "N/A" (not checked), never taken as 0


@dataclass(frozen=True)
class Row:
    line: int
    size_bytes: int
    count: int
    type: str
    redop: str | None  # None in formats without the column
    root: int | None
    out_of_place: Result
    in_place: Result
    iters: int | None = None  # the "#iters" column of nccl-tests 2.17+

    @property
    def busbw_gbps(self) -> float:
        return max(self.out_of_place.busbw_gbps, self.in_place.busbw_gbps)

    @property
    def wrong(self) -> int:
        """Wrong elements over the halves that were checked; an "N/A" half adds nothing (and stays None)."""
        return sum(r.wrong for r in (self.out_of_place, self.in_place) if r.wrong is not None)


@dataclass(frozen=True)
class Device:
    rank: int
    group: int | None
    pid: int | None
    host: str | None
    device: int
    bus: str  # as printed: "0x18" or "0000:1b:00"
    name: str


@dataclass(frozen=True)
class Line:
    line: int  # 1-based line number in the text
    text: str  # without the launcher label


@dataclass
class NcclTestsRun:
    source: str
    rows: list[Row] = field(default_factory=list)
    tool: str | None = None  # "nccl" or "rccl", from the version banner
    version: str | None = None  # nccl-tests version, when printed
    nccl_version: str | None = None
    collective: str | None = None  # "all_reduce_perf", from the banner or the command line
    n_threads: int | None = None
    n_gpus: int | None = None  # GPUs per thread (-g)
    min_bytes: int | None = None
    max_bytes: int | None = None
    validation: int | None = None
    devices: list[Device] = field(default_factory=list)
    out_of_bounds: int | None = None
    avg_busbw_gbps: float | None = None
    avg_busbw_failed: bool = False  # the tool's own average-bandwidth check said FAILED
    complete: bool = False  # saw the closing "# Avg bus bandwidth" line
    warnings: list[Line] = field(default_factory=list)  # NCCL WARN lines
    errors: list[Line] = field(default_factory=list)  # failure reports of nccl-tests, MPI, srun, the runtime
    elided: list[int] = field(default_factory=list)  # lines of "..." where someone cut the output
    problems: list[ParseError] = field(default_factory=list)  # lines that looked like rows but were not

    @property
    def ranks(self) -> int | None:
        return len(self.devices) or None

    @property
    def hosts(self) -> list[str]:
        return sorted({d.host for d in self.devices if d.host})


def _int(token: str) -> int | None:
    return int(token) if _INT.fullmatch(token) else None


def _float(token: str) -> float | None:
    """A finite number, else None: "1e999" is no bandwidth."""
    if not _FLOAT.fullmatch(token):
        return None
    value = float(token)
    return value if math.isfinite(value) else None


def _result(tokens: list[str]) -> Result | None:
    time_us, algbw, busbw = (_float(t) for t in tokens[:3])
    wrong = None if tokens[3] == "N/A" else _int(tokens[3])
    if time_us is None or algbw is None or busbw is None or (wrong is None and tokens[3] != "N/A"):
        return None
    return Result(time_us, algbw, busbw, wrong)


def _row(tokens: list[str], lineno: int, columns: list[str]) -> Row | None:
    """A result row: size count type [redop] [root] then time algbw busbw #wrong twice, then [#iters]."""
    size, count = _int(tokens[0]), _int(tokens[1]) if len(tokens) > 1 else None
    if size is None or count is None or size < 0 or count < 0 or len(tokens) < 11:
        return None
    kind, rest = tokens[2], tokens[3:]
    if _float(kind) is not None:
        return None
    redop = None
    if _float(rest[0]) is None:
        redop, rest = rest[0], rest[1:]
    has_iters = "#iters" in columns if columns else len(rest) == 10
    has_root = ("root" in columns if columns else len(rest) >= 9) and redop is not None
    root = None
    if has_root:
        root, rest = _int(rest[0]), rest[1:]
        if root is None:
            return None
    iters = None
    if has_iters and len(rest) == 9:
        iters, rest = _int(rest[8]), rest[:8]
        if iters is None:
            return None
    if len(rest) != 8:
        return None
    oop, inp = _result(rest[:4]), _result(rest[4:])
    if oop is None or inp is None:
        return None
    return Row(lineno, size, count, kind, redop, root, oop, inp, iters)


def _strip_label(raw: str) -> str:
    text = raw.rstrip()
    for _ in range(2):  # srun under mpirun or the reverse
        m = _PREFIX.match(text)
        if not m:
            break
        text = text[m.end():]
    return text


def parse_nccl_tests(text: str, source: str) -> NcclTestsRun:
    """Parse one nccl-tests run. Unrecognised lines (NCCL INFO, the command line, launcher chatter) are skipped;
    a line that starts like a result row but is not one goes to `problems`. Raises ParseError only when nothing
    in the text is nccl-tests output."""
    check_size(text, source, "nccl-tests output")
    run = NcclTestsRun(source)
    columns: list[str] = []
    recognised = False
    for lineno, raw in enumerate(text_lines(text), start=1):
        line = _strip_label(raw)
        body = line.strip()
        if not body:
            continue
        if body.startswith("#"):
            recognised |= _header_line(run, body, columns, lineno)
            continue
        tokens = body.split()
        if _int(tokens[0]) is not None or (_float(tokens[0]) is not None and len(tokens) > 3):
            row = _row(tokens, lineno, columns)
            if row is None:
                run.problems.append(ParseError(f"not a result row: {body[:120]!r}", source, lineno))
            else:
                run.rows.append(row)
            recognised = True
            continue
        if _ELISION.match(body):
            run.elided.append(lineno)
        elif _WARN.search(head := body[:MAX_MESSAGE]):
            run.warnings.append(Line(lineno, body))
        elif _ERROR.search(head):
            run.errors.append(Line(lineno, body))
        elif (m := _TOOL_VERSION.match(body)) or (m := _NCCL_VERSION.match(body)):
            if m.re is _TOOL_VERSION:
                run.tool, run.version = m.group(1), m.group(2)
            else:
                run.nccl_version = m.group(1)
        elif run.collective is None and (m := _COMMAND.search(head)):
            run.collective = m.group(1)
    if not text.strip():
        raise ParseError("empty output", source)
    if not (recognised or run.warnings or run.errors or run.version):
        raise ParseError("not nccl-tests output: no result table, header, device or summary line", source)
    return run


def _header_line(run: NcclTestsRun, body: str, columns: list[str], lineno: int) -> bool:
    """Read one '#' line into `run`; True when it is one nccl-tests prints. A number past its bound on such a line
    goes to `problems` and is not taken (neither cut to fit nor read as another value)."""
    try:
        return _read_header_line(run, body, columns, lineno)
    except ParseError as err:
        run.problems.append(err)
        return True


def _read_header_line(run: NcclTestsRun, body: str, columns: list[str], lineno: int) -> bool:
    def number(token: str, what: str, digits: int) -> int:
        return bounded_int(token, what, run.source, lineno, digits)

    if _HEADER.match(body):
        columns[:] = body.lstrip("#").split()
        return True
    if (m := _TOOL_VERSION.match(body)) is not None:
        run.tool, run.version = m.group(1), m.group(2)
        return True
    if (m := _NCCL_VERSION.match(body)) is not None:
        run.nccl_version = m.group(1)
        return True
    if (m := _COLLECTIVE.match(body)) is not None:
        run.collective = m.group(2)
        return True
    if _SETTINGS.match(body):
        found = {}
        for name, (label, pattern, digits) in _SETTING.items():
            if (m := pattern.search(body)) is not None:
                found[name] = number(m.group(1), f"settings line: {label}", digits)
        for name, value in found.items():
            setattr(run, name, value)
        return True
    if (m := _DEVICE.match(body)) is not None:
        rank, group, pid, host, dev, bus, name = m.groups()
        run.devices.append(Device(number(rank, "device line: rank", 9),
                                  number(group, "device line: group", 9) if group else None,
                                  number(pid, "device line: pid", 12) if pid else None, host,
                                  number(dev, "device line: device", 9), bus, name.strip()))
        return True
    if (m := _OUT_OF_BOUNDS.match(body)) is not None:
        run.out_of_bounds = number(m.group(1), "out-of-bounds values", 18)
        return True
    if (m := _AVG_BUSBW.match(body)) is not None:
        run.avg_busbw_gbps = _float(m.group(1))
        run.avg_busbw_failed = m.group(2) is not None
        run.complete = True
        return True
    return False

"""Parser of perftest output (ib_write_bw, ib_read_bw, ib_send_lat, ib_read_lat, ...): the test banner, the
parameter block, the result table (bandwidth or latency), warnings and error lines, server or client side.

perftest prints bandwidth in Gb/sec with --report_gbits (1 Gb = 125,000,000 bytes) and in MB/sec otherwise
(1 MB = 0x100000 bytes): linux-rdma/perftest src/perftest_results / perftest_parameters.c, `format_factor`.
"""
from __future__ import annotations

import re
from dataclasses import field

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_limits import MAX_MESSAGE, bounded_int, check_size, text_lines

_MB_PER_SEC_IN_GBPS = 0x100000 * 8 / 1e9  # one perftest "MB/sec" in Gb/s

# Every pattern is linear in the length of a line: quantifiers are possessive (*+, ++) wherever what follows could
# fail, and a pattern searched at every position starts only where a run begins (a lookbehind), so a long damaged
# line is read in one pass instead of being retried from every split point. Numbers are ASCII digits ([0-9], not \d,
# which takes "١٢٣") of bounded length.
_SEPARATOR = re.compile(r"^\s*+-{20,}+\s*+$")
# The lazy test name tries a fixed-length tail at each step: linear.
_TITLE = re.compile(r"^\s*+(?P<test>[A-Za-z_][A-Za-z_ ]*?(?P<bidir> Bidirectional)? (?P<kind>BW|Latency)) Test\s*+$")
_BANNER = re.compile(r"Waiting for client to connect")
_PROMPT = re.compile(r"^\s*+\[[^\]\s@]++@[^\]]++\][$#]\s?")  # "[user@host ~]$ "
_JOB = re.compile(r"^\s*+\[[0-9]++\][+-]?+\s")  # "[1] 650300", "[1]+  Done  ..."
_META = re.compile(r"^\s*+(Connected|Completed):\s|^\s*+Total run time:")
_ADDRESS = re.compile(r"^\s*+(local|remote) address:", re.IGNORECASE)
_GID = re.compile(r"^\s*+GID:\s")
_VALUE = re.compile(r"\s*+(\S*+)")  # a parameter's value after its colon
_PARAM_LINE = re.compile(r"\S\s*+:\s")  # "Mtu             : 4096[B]", "PCIe relax order: ON"
_WARNING = re.compile(r"warning|Conflicting CPU frequency|CPU Frequency is not max|Using sampled CPU speed",
                      re.IGNORECASE)
# perftest's own failure messages (fprintf(stderr, ...) in src/*.c) and getopt's complaint.
_ERROR = re.compile(r"Couldn't|Unable to|Failed|failed|\bError\b|\bERROR\b|Did not detect devices|not found|"
                    r"unrecognized option|Invalid Command|Problems with|Completion with error|aborting")
# Messages only perftest prints (they make a bare failure output recognisable as perftest's).
_OWN_ERROR = re.compile(r"Couldn't|Unable to|Failed status|Failed to|Did not detect devices|Invalid Command or flag|"
                        r"unrecognized option|Problems with warm up|Completion with error|IB device \S++ not found|"
                        r"Parser function exited")
_CUDA = re.compile(r"\bCUDA\b|use_cuda|cuMemAlloc|GPU buffer|Picking device No\.")
_CUDA_DEVICE = re.compile(r"Picking device No\.\s*+([0-9]++)|use_cuda=([0-9]++)")
_COLUMN = re.compile(r"#bytes|#iterations|(?<![0-9.])[0-9.]++% percentile\[[^\]]*+\]"
                     r"|(?<![A-Za-z_])[A-Za-z_]++(?: [a-z]++)?+\[[^\]]*+\]")
_NUMBER = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?")  # at most 20 digits each side: finite, and no 1e400
_BW_UNITS = {"Gb/sec": 1.0, "MB/sec": _MB_PER_SEC_IN_GBPS}
_LAT_KEYS = {"t_min[usec]": "t_min", "t_max[usec]": "t_max", "t_typical[usec]": "t_typical",
             "t_avg[usec]": "t_avg", "t_stdev[usec]": "t_stdev", "99% percentile[usec]": "p99",
             "99.9% percentile[usec]": "p99_9"}


@dataclass(frozen=True)
class BwRow:
    bytes: int
    iterations: int
    bw_peak: float | None  # in the run's unit (PerftestRun.bw_unit)
    bw_average: float
    msg_rate_mpps: float | None
    bw_average_gbps: float  # normalised to Gb/s (1e9 bit/s)


@dataclass(frozen=True)
class LatRow:
    bytes: int
    iterations: int
    usec: dict[str, float]  # t_min, t_max, t_typical, t_avg, t_stdev, p99, p99_9 (those printed)


@dataclass(frozen=True)
class PerftestRun:
    source: str
    test: str | None = None  # "RDMA_Write BW", "RDMA_Write Bidirectional BW", "RDMA_Read Latency"
    kind: str | None = None  # "bw" | "lat"
    bidirectional: bool = False
    role: str | None = None  # "server" (printed the waiting banner) | "client" | None (no table, no banner)
    params: dict[str, str] = field(default_factory=dict)  # the parameter block, "Device" -> "mlx5_0"
    bw_unit: str | None = None  # "Gb/sec" | "MB/sec"
    bw_rows: tuple[BwRow, ...] = ()
    lat_rows: tuple[LatRow, ...] = ()
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    cuda: bool = False  # the output mentions CUDA / GPUDirect buffers
    cuda_device: int | None = None
    qps: int = 0  # local address lines

    @property
    def device(self) -> str | None:
        return self.params.get("Device")

    @property
    def link_type(self) -> str | None:
        return self.params.get("Link type")

    @property
    def best_bw_gbps(self) -> float | None:
        """The highest BW average of the run in Gb/s (the plateau of a size sweep)."""
        return max((r.bw_average_gbps for r in self.bw_rows), default=None)


def _number(token: str, what: str, source: str, line: int) -> float:
    if not _NUMBER.fullmatch(token):
        raise ParseError(f"{what}: {token[:20]!r}{'...' if len(token) > 20 else ''} is not a number "
                         "(ASCII digits, at most 20 before and after the point)", source, line)
    return float(token)


def _params(line: str) -> dict[str, str]:
    """The "Key : value" pairs of a parameter line, one or two a line ("Dual-port : OFF   Device : mlx5_0"). A key
    runs from the previous value (or a tab) to its colon; a value is the word after the colon, colons included
    ("a:b"). One pass over the line, whatever it holds."""
    out: dict[str, str] = {}
    pos = 0
    while (colon := line.find(":", pos)) >= 0:
        key = line[pos:colon].rstrip().rpartition("\t")[2].strip()  # a tab may stand before the colon
        value = _VALUE.match(line, colon + 1)
        assert value is not None  # \s*+(\S*+) matches anywhere
        if key and value[1]:
            out[key] = value[1]
            pos = value.end()
        else:
            pos = colon + 1
    return out


def _columns(header: str, source: str, line: int) -> tuple[list[str], str | None]:
    if len(header) > MAX_MESSAGE:
        raise ParseError(f"result table header of {len(header):,} characters", source, line)
    cols = _COLUMN.findall(header)
    if cols[:2] != ["#bytes", "#iterations"] or len(cols) < 3:
        raise ParseError(f"unknown result table header {header.strip()[:80]!r}", source, line)
    unit = None
    for col in cols[2:]:
        if col.startswith("BW "):
            u = col[col.index("[") + 1:-1]
            if u not in _BW_UNITS:
                raise ParseError(f"unknown bandwidth unit [{u}]", source, line)
            unit = u
        elif col not in _LAT_KEYS and not col.startswith("MsgRate") and not col.startswith("CPU"):
            raise ParseError(f"unknown result column {col!r}", source, line)
    if unit is not None and not any(c.startswith("BW average") for c in cols):
        raise ParseError("bandwidth table without a BW average column", source, line)
    if unit is None and not any(c in _LAT_KEYS for c in cols):
        raise ParseError("result table has neither bandwidth nor latency columns", source, line)
    return cols, unit


def _row(tokens: list[str], cols: list[str], unit: str | None, source: str, line: int) -> BwRow | LatRow:
    if len(tokens) != len(cols):
        raise ParseError(f"result row has {len(tokens)} fields, the header {len(cols)}", source, line)
    values = {c: _number(t, c, source, line) for c, t in zip(cols, tokens, strict=True)}
    size, iters = int(values.pop("#bytes")), int(values.pop("#iterations"))  # finite: 20 digits at most
    if unit is not None:
        peak = next((v for c, v in values.items() if c.startswith("BW peak")), None)
        avg = next(v for c, v in values.items() if c.startswith("BW average"))  # _columns checked it is there
        rate = next((v for c, v in values.items() if c.startswith("MsgRate")), None)
        return BwRow(size, iters, peak, avg, rate, avg * _BW_UNITS[unit])
    return LatRow(size, iters, {_LAT_KEYS[c]: v for c, v in values.items() if c in _LAT_KEYS})


def parse_perftest(text: str, source: str) -> PerftestRun:
    """One perftest run (server or client side) from its captured stdout+stderr."""
    check_size(text, source, "perftest output")
    if not text.strip():
        raise ParseError("empty perftest output", source)
    fields: dict = {"params": {}}
    warnings: list[str] = []
    errors: list[str] = []
    bw_rows: list[BwRow] = []
    lat_rows: list[LatRow] = []
    cols: list[str] | None = None
    unit: str | None = None
    section = "start"  # start -> params (after the title) -> addresses -> table
    recognised = banner = cuda = False
    cuda_device = None
    qps = 0
    for num, raw in enumerate(text_lines(text), 1):
        line = _PROMPT.sub("", raw.replace("\x00", "")).rstrip()
        stripped = line.strip()
        if not stripped or _JOB.match(line) or _META.match(line):
            continue
        head = line[:MAX_MESSAGE]  # what tells a message apart (the whole line is read as a row or parameters)
        if _CUDA.search(head):
            cuda = True
            m = _CUDA_DEVICE.search(head)
            if m:
                cuda_device = bounded_int(m[1] or m[2], "CUDA device", source, num, 9)
        if _PROMPT.match(raw) and "ib_" in line and " " in stripped:
            continue  # the shell command line someone pasted with the output
        if _BANNER.search(line):
            banner = recognised = True
            continue
        if stripped.strip("*").strip() == "":
            continue  # the banner's frame
        if _SEPARATOR.match(line):
            recognised = True
            if section == "table":
                cols = None
                section = "done"
            continue
        m = _TITLE.match(line) if len(line) <= MAX_MESSAGE else None
        if m:
            recognised = True
            fields.update(test=m["test"], kind="bw" if m["kind"] == "BW" else "lat",
                          bidirectional=bool(m["bidir"]))
            section = "params"
            continue
        if _WARNING.search(head):
            warnings.append(stripped)
            continue
        if "#bytes" in line:
            recognised = True
            cols, unit = _columns(line, source, num)
            fields["bw_unit"] = unit
            section = "table"
            continue
        if cols is not None and (stripped[0].isdigit() or stripped[0].isdecimal()):  # "²", "١": not a number
            row = _row(stripped.split(), cols, unit, source, num)
            (bw_rows if isinstance(row, BwRow) else lat_rows).append(row)  # type: ignore[arg-type]
            continue
        if _ADDRESS.match(line):
            qps += line.strip().lower().startswith("local")
            section = "addresses"
            continue
        if _GID.match(line):
            continue
        if section == "params" and _PARAM_LINE.search(line) and not _ERROR.search(head):
            fields["params"].update(_params(stripped))
            continue
        if _ERROR.search(head):
            recognised = recognised or _OWN_ERROR.search(head) is not None
            errors.append(stripped)
    if not recognised:
        raise ParseError("not perftest output: no test banner, result table or perftest message", source)
    role = "server" if banner else ("client" if fields.get("test") or bw_rows or lat_rows else None)
    return PerftestRun(source=source, role=role, bw_rows=tuple(bw_rows), lat_rows=tuple(lat_rows),
                       warnings=tuple(warnings), errors=tuple(errors), cuda=cuda, cuda_device=cuda_device, qps=qps,
                       **fields)


def last_error_line(text: str) -> str | None:
    """The last line of a perftest output that reads like one of its error messages, else the last non-empty
    line (what an operator should see first)."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not _SEPARATOR.match(ln) and ln.strip().strip("*").strip()]
    errors = [ln for ln in lines if _ERROR.search(ln[:MAX_MESSAGE]) and not _WARNING.search(ln[:MAX_MESSAGE])]
    return errors[-1] if errors else (lines[-1] if lines else None)

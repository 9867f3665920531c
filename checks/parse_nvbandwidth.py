"""Parser of nvbandwidth's plain-text output (github.com/NVIDIA/nvbandwidth): one matrix per testcase.

The shape, from nvbandwidth's own printer (PeerValueMatrix operator<< in inline_common.h / common.h):

    Running device_to_device_memcpy_read_ce.
    memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)
               0         1
     0       N/A    395.08
     1    395.08       N/A

    SUM device_to_device_memcpy_read_ce 790.16

A cell is a number or "N/A" (a pair nvbandwidth could not measure: the diagonal, or peers without access to
each other); releases before v0.5 print 0.00 on the diagonal instead. "SUM <testcase> <value>" (or
"&&&& PERF <testcase> <value><unit>" with the perf formatter) closes a matrix; "Waived:" marks a testcase the
system cannot run. Several runs may be concatenated; a later matrix for the same testcase replaces the earlier.
"""
from __future__ import annotations

import re
from dataclasses import field, replace

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_limits import bounded_int, check_size, finite_float, text_lines

# Linear in the length of a line: possessive quantifiers (*+, ++) where what follows could fail; the lazy testcase
# name tries a one-character tail at each step. Numbers are ASCII digits, then bounded and finite (parse_limits).
_RUNNING = re.compile(r"^Running (\S+?)\.?$")
_TITLE_UNIT = re.compile(r"\(([^()]*+)\)\s*+$")  # starts only at a "(", and stops at the next parenthesis
_NUMBER_TEXT = r"-?+[0-9]++(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"
_SUM = re.compile(r"^(?:SUM|&&&& PERF) (\S++) (" + _NUMBER_TEXT + ")")
_DEVICE = re.compile(r"^Device ([0-9]++): (.*+)")
_BUS = re.compile(r" \(([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\)")  # at the end of a device line
_NUMBER = re.compile(_NUMBER_TEXT)


@dataclass(frozen=True)
class NvbMatrix:
    testcase: str  # "device_to_device_memcpy_read_ce"
    title: str  # "memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)"
    unit: str  # "GB/s", "ns", ... (the last parenthesised group of the title)
    columns: tuple[str, ...]  # column labels as printed ("0", "1", ...)
    values: dict[tuple[str, str], float | None]  # (row, column) -> value; None for N/A
    total: float | None = None  # the SUM line, when printed
    line: int = 0  # where the matrix starts (for messages)

    @property
    def rows(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for r, _ in self.values))


@dataclass(frozen=True)
class NvbandwidthRun:
    version: str | None = None
    driver: str | None = None
    devices: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # ordinal -> (name, "0000:19:00")
    matrices: dict[str, NvbMatrix] = field(default_factory=dict)
    waived: tuple[str, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)  # testcase -> first line after "Running" that is no table


def _label(token: str) -> bool:
    return token.isascii() and token.isdigit()


def _cell(token: str, source: str, lineno: int) -> float | None:
    if token == "N/A":
        return None
    if not _NUMBER.fullmatch(token):
        raise ParseError(f"matrix cell {token[:20]!r} is neither a number nor N/A", source, lineno)
    return finite_float(token, "matrix cell", source, lineno)


def parse_nvbandwidth(text: str, source: str) -> NvbandwidthRun:
    """Every matrix in `text`. ParseError on a matrix that is cut short or holds a cell that is not a
    number; text without any matrix parses to a run with no matrices (the caller decides what it needed)."""
    check_size(text, source, "nvbandwidth output")
    version = driver = None
    devices: dict[int, tuple[str, str | None]] = {}
    matrices: dict[str, NvbMatrix] = {}
    waived: list[str] = []
    errors: dict[str, str] = {}
    lines = text_lines(text)
    current: str | None = None  # testcase named by the last "Running" line, not yet given a matrix
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        lineno = i + 1
        i += 1
        if not line:
            continue
        if line.startswith("nvbandwidth Version:"):
            version = line.split(":", 1)[1].strip() or None
            continue
        if line.startswith("Driver Version:"):
            driver = line.split(":", 1)[1].strip() or None
            continue
        if m := _DEVICE.match(line):
            name, bus = m.group(2).rstrip(), None
            cut = name.rfind(" (")
            if cut >= 0 and (b := _BUS.fullmatch(name, cut)):
                name, bus = name[:cut].rstrip(), f"{int(b[1], 16):04x}:{b[2].lower()}:{b[3].lower()}"
            devices[bounded_int(m.group(1), "device number", source, lineno, 9)] = (name, bus)
            continue
        if m := _RUNNING.match(line):
            current = m.group(1)
            continue
        if line.startswith("Waived"):
            if current is not None:
                waived.append(current)
                current = None
            continue
        if m := _SUM.match(line):
            name = m.group(1)
            if name in matrices and matrices[name].total is None:
                matrices[name] = replace(matrices[name], total=finite_float(m.group(2), "SUM", source, lineno))
            continue
        unit = _TITLE_UNIT.search(line)
        header = lines[i].split() if i < len(lines) else []
        if unit and header and all(_label(h) for h in header):
            matrix, i = _matrix(current or "", line, unit.group(1), header, lines, i + 1, source, lineno)
            # The SUM line after the table names the testcase too (and is all there is when the "Running"
            # line was not captured).
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and (m := _SUM.match(lines[j].strip())):
                total = finite_float(m.group(2), "SUM", source, j + 1)
                matrix = replace(matrix, testcase=matrix.testcase or m.group(1), total=total)
                i = j + 1
            matrices[matrix.testcase] = matrix
            current = None
            continue
        if current is not None:
            errors.setdefault(current, line)  # "ASSERT ...", "[CUDA_ERROR_...] ...", an unexpected message
    return NvbandwidthRun(version, driver, devices, matrices, tuple(waived), errors)


def _matrix(testcase: str, title: str, unit: str, columns: list[str], lines: list[str], i: int, source: str,
            title_line: int) -> tuple[NvbMatrix, int]:
    values: dict[tuple[str, str], float | None] = {}
    while i < len(lines):
        tokens = lines[i].split()
        if not tokens or _SUM.match(lines[i].strip()) or tokens[0].startswith(("SUM", "COEFFICIENT", "&&&&")):
            break
        if len(tokens) != len(columns) + 1:
            raise ParseError(f"{testcase}: row has {len(tokens) - 1} value(s), the header {len(columns)}",
                             source, i + 1)
        row = tokens[0]
        if not _label(row):
            raise ParseError(f"{testcase}: row label {row!r} is not a device number", source, i + 1)
        for col, token in zip(columns, tokens[1:], strict=True):
            values[(row, col)] = _cell(token, source, i + 1)
        i += 1
    if not values:
        raise ParseError(f"{testcase}: matrix header without rows", source, title_line)
    return NvbMatrix(testcase, title, unit, tuple(columns), values, None, title_line), i

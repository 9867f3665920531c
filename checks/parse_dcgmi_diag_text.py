"""The reader of the text table `dcgmi diag -r N` prints without -j, into the DiagRun of checks/parse_dcgmi_diag.py
(which holds the JSON reader and the shapes both forms take)."""
from __future__ import annotations

import re
from dataclasses import field
from typing import Iterable

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_dcgmi_diag import (
    _STATUS_WORDS,
    MAX_GPUS,
    RANK,
    DiagError,
    DiagRun,
    TestResult,
    named_gpus,
)
from gpuwarden.checks.parse_limits import bounded_int, check_size, text_lines

_WRAP = 45  # DATA_INFO_TAG_LEN in dcgmi/Diag.cpp: text messages wrap every 45 characters
_MAX_ROWS = 10_000  # table rows of one text output; a level-4 run on a full node prints well under a thousand

_TEXT_MARKS = re.compile(r"^\|\s*Diagnostic\s+\|\s*Result\s+\||^[+|]-{3,}\s+(Metadata|Deployment|Hardware|Integration"
                         r"|Stress)\s+-|^\|[^|\n]{1,40}\|\s*(Pass|Fail|Warn|Skip)( - (All|GPUs?: \d))?", re.M)


def looks_like_dcgmi_diag_text(text: str) -> bool:
    return _TEXT_MARKS.search(text[:65536]) is not None


# Linear in the length of a row: possessive quantifiers (*+, ++) where what follows could fail; the lazy entity
# names try a fixed tail at each step. Ids are ASCII digits, bounded when converted.
_BAND = re.compile(r"^[+|]-++\s++([^-+|]*+)-++[+|]")  # the name, with the spaces after it
_BORDER = re.compile(r"^\+[-=+]*+\+?$")
_STATUS_SPEC = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)(?:\s*+-\s*+(All|GPUs?:\s*+([0-9][0-9,\s]*+)))?+$")
_ENTITY_STATUS = re.compile(r"^([A-Za-z][A-Za-z_ ]*?)\s?([0-9]++):\s*+(Pass|Fail|Warn|Skip|Not Run)$")
_MESSAGE_ROW = re.compile(r"^(Warning|Error|Info)(?::\s*+([A-Za-z][A-Za-z_ ]*?)\s?([0-9]++))?+$")
_METADATA = re.compile(r"^(DCGM Version|Driver Version Detected|(\w+ )?Device IDs Detected|Number of CPUs Detected|"
                       r".*(Test|Package) Version)$")


@dataclass
class _Message:
    kind: str  # Warning | Error | Info
    entity: tuple[str, int] | None
    chunks: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join("".join(self.chunks).split())


@dataclass
class _Test:
    category: str
    name: str
    summary: str | None = None  # the status on the test's own row
    specific: list[tuple[tuple[str, int] | None, str]] = field(default_factory=list)  # (entity, status); None: all
    messages: list[_Message] = field(default_factory=list)


def parse_dcgmi_diag_text(text: str, source: str) -> DiagRun:
    """The table `dcgmi diag -r N` prints without -j; fragments (rows without header or category) parse too. A row
    that cannot be read (a stray byte, a cut line, an id past its bound) goes to `problems` and the rest is read:
    it must not hide what the other rows say. ParseError when no row at all could be read."""
    check_size(text, source, "dcgmi diag output")
    table = _Table(source)
    error_lines: list[str] = []
    rows = 0
    for lineno, line in enumerate(text_lines(text), 1):
        line = line.strip()
        if not line.startswith(("|", "+")):
            if line.startswith("Error:") and not table.tests:
                error_lines.append(line)
            continue
        rows += 1
        if rows > _MAX_ROWS:
            raise ParseError(f"more than {_MAX_ROWS:,} table rows: not a dcgmi diag output", source, lineno)
        try:
            table.row(line, lineno)
        except ParseError as err:
            table.problems.append(err)
            table.message = None
    gpu_count = len(_device_ids(table.meta))
    results = tuple(r for t in table.tests for r in _results(t, gpu_count))
    runtime_error = " ".join(error_lines) or None
    if not results and not table.meta and runtime_error is None:
        if table.problems:
            raise table.problems[0]
        raise ParseError("no dcgmi diag result row (expected '| <test> | Pass/Fail/... |')", source)
    return DiagRun(source, "text", table.meta.get("DCGM Version") or None,
                   table.meta.get("Driver Version Detected") or None, results,
                   tuple(range(gpu_count)) if gpu_count else (), runtime_error, tuple(table.problems),
                   sum(1 for t in table.tests if t.name))


@dataclass
class _Table:
    source: str
    category: str = ""
    tests: list[_Test] = field(default_factory=list)
    message: _Message | None = None  # the message the next continuation row belongs to
    meta: dict[str, str] = field(default_factory=dict)
    problems: list[ParseError] = field(default_factory=list)

    def fail(self, what: str, lineno: int) -> ParseError:
        return ParseError(what, self.source, lineno)

    def entity(self, kind: str, number: str, lineno: int) -> tuple[str, int]:
        kind = kind.strip()
        ident = bounded_int(number, f"{kind} id", self.source, lineno, 6)
        if kind.upper() == "GPU" and ident >= MAX_GPUS:
            raise self.fail(f"GPU id {ident} is past the {MAX_GPUS} GPUs DCGM could diagnose on a node", lineno)
        return kind, ident

    def row(self, line: str, lineno: int) -> None:
        band = _BAND.match(line)
        if band and band[1].strip():
            self.category, self.message = band[1].strip(), None
            return
        if _BORDER.match(line):
            return
        if not line.startswith("|"):
            raise self.fail(f"unexpected table line {line[:60]!r}", lineno)
        name, chunk = _split_row(line, self.source, lineno)
        info = chunk.strip()
        if name == "Diagnostic" and info == "Result":
            return
        if self.category == "Metadata" or _METADATA.match(name):
            self.message = None
            if name == "GPU Device IDs Detected" and len(ids := _device_ids({name: info})) > MAX_GPUS:
                raise self.fail(f"{name} lists {len(ids)} GPUs, more than the {MAX_GPUS} DCGM could diagnose",
                                lineno)
            self.meta[name] = info
            return
        kind = _MESSAGE_ROW.match(name)
        if kind:
            entity = self.entity(kind[2], kind[3], lineno) if kind[3] else None
            if not self.tests or self.tests[-1].category != self.category:  # its test row was cut off (a fragment)
                self.tests.append(_Test(self.category, "", {"Error": "fail", "Warning": "warn"}.get(kind[1], "info")))
            self.message = _Message(kind[1], entity, [chunk])
            self.tests[-1].messages.append(self.message)
        elif name:
            self.message = None
            # The rows under it are this test's, read or not: a test is never credited with another's results.
            self.tests.append(_Test(self.category, name))
            status = _STATUS_SPEC.match(info)
            if not status:
                raise self.fail(f"test {name[:40]!r}: unrecognised result {info[:50]!r}", lineno)
            self.add_status(self.tests[-1], status, lineno)
        elif status := (_STATUS_SPEC.match(info) or _ENTITY_STATUS.match(info)):
            self.message = None
            if not self.tests:
                raise self.fail(f"result {info[:50]!r} outside any test", lineno)
            self.add_status(self.tests[-1], status, lineno)
        elif self.message is not None:
            self.message.chunks.append(chunk)
        elif info:
            raise self.fail(f"continuation row {info[:50]!r} outside any test or message", lineno)

    def add_status(self, test: _Test, m: re.Match[str], lineno: int) -> None:
        if m.re is _ENTITY_STATUS:
            test.specific.append((self.entity(m[1], m[2], lineno), _norm(m[3])))
            return
        status, scope, ids = _norm(m[1]), m[2], m[3]
        if scope is None:
            test.summary = status
        elif ids is None:  # "All"
            test.specific.append((None, status))
        else:
            gpus = [self.entity("GPU", gpu, lineno) for gpu in re.findall(r"[0-9]++", ids)]
            test.specific.extend((gpu, status) for gpu in gpus)


def _split_row(line: str, source: str, lineno: int) -> tuple[str, str]:
    sep = line.find("|", 1)
    if sep < 0:
        raise ParseError("table row without a column separator", source, lineno)
    cell = line[sep + 1:]
    if cell.endswith("|"):
        cell = cell[:-1]
    cell = cell[1:] if cell.startswith(" ") else cell
    # A wrapped message fills exactly 45 characters a row; keep them (spaces included) so the pieces join back.
    if len(cell) > _WRAP and not cell[_WRAP:].strip():
        cell = cell[:_WRAP]
    return line[1:sep].strip(), cell


def _norm(word: str) -> str:
    return _STATUS_WORDS[word.lower()]


def _device_ids(meta: dict[str, str]) -> list[str]:
    return meta.get("GPU Device IDs Detected", "").replace(",", " ").split()


def _results(test: _Test, gpu_count: int) -> list[TestResult]:
    # Each message becomes its DiagError (or info text) once; results share them. What a result takes from the
    # test's loose messages depends only on which GPU it is (or none, or a non-GPU entity), so it is worked out
    # once per GPU (ids < MAX_GPUS): the work stays in step with the size of the output, whatever the rows repeat.
    error_of = {id(m): DiagError(m.text) for m in test.messages if m.kind != "Info" and m.text}
    info_of = {id(m): m.text for m in test.messages if m.kind == "Info" and m.text}

    def errs(msgs: Iterable[_Message]) -> tuple[DiagError, ...]:
        return tuple(error_of[id(m)] for m in msgs if id(m) in error_of)

    def infos(msgs: Iterable[_Message]) -> tuple[str, ...]:
        return tuple(info_of[id(m)] for m in msgs if id(m) in info_of)

    specific: list[tuple[tuple[str, int] | None, str]] = []
    for ent, status in test.specific:  # expand "All" when the metadata says how many GPUs there are
        specific += [(("GPU", g), status) for g in range(gpu_count)] if ent is None and gpu_count else [(ent, status)]
    loose = [m for m in test.messages if m.entity is None]
    loose_names = [named_gpus(errs([m])) for m in loose]
    own_of: dict[tuple[str, int] | None, list[_Message]] = {}
    for m in test.messages:
        own_of.setdefault(m.entity, []).append(m)
    own_cache: dict[tuple[str, int] | None, tuple[tuple[DiagError, ...], tuple[str, ...]]] = {}
    loose_cache: dict[int | None, tuple[tuple[DiagError, ...], tuple[str, ...]]] = {}

    def attached(ent: tuple[str, int] | None, failed: bool) -> tuple[tuple[DiagError, ...], tuple[str, ...]]:
        if ent not in own_cache:
            own = own_of.get(ent, [])
            own_cache[ent] = (errs(own), infos(own))
        if not failed:
            return own_cache[ent]
        # 3.x prints a test's warnings without saying whose they are: each goes to the GPU it names, one that
        # names none to every result that did not pass.
        gpu = None if ent is None else ent[1] if ent[0].upper() == "GPU" else -1
        if gpu not in loose_cache:
            mine = [m for m, names in zip(loose, loose_names, strict=True)
                    if not names or gpu is None or (gpu >= 0 and gpu in names)]
            loose_cache[gpu] = (errs(mine), infos(mine))
        (own_errors, own_infos), (more_errors, more_infos) = own_cache[ent], loose_cache[gpu]
        return own_errors + more_errors, own_infos + more_infos

    out: list[TestResult] = []
    for ent, status in specific:
        errors, info = attached(ent, status != "pass")
        if ent is None:
            out.append(TestResult(test.category, test.name, None, status, errors, info, all_gpus=True))
        elif ent[0].upper() == "GPU":
            out.append(TestResult(test.category, test.name, ent[1], status, errors, info, (ent[1],)))
        else:
            out.append(TestResult(test.category, test.name, None, status, errors, info, entity=f"{ent[0]} {ent[1]}"))
    summary = test.summary
    if summary is not None and (not out or RANK[summary] > max(RANK[r.status] for r in out)):
        claimed = {m for r in out for m in r.messages}
        errors = tuple(e for e in errs(loose) if e.message not in claimed)
        out.append(TestResult(test.category, test.name, None, summary, errors, infos(loose), named_gpus(errors)))
    return out

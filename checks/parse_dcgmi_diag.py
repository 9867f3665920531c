"""Parsers of `dcgmi diag` output: the JSON of `-j` (DCGM 3.x and 4.x schemas) here, the text table in
checks/parse_dcgmi_diag_text.py, both into one DiagRun of test x entity results with DCGM's own messages and error ids.

Shapes, from DCGM's dcgmi/Diag.cpp and testing/python3/dcgm_diag_schema.json (fixtures/tools/dcgmi/):
- 3.x: {"DCGM GPU Diagnostic": {"test_categories": [{"category", "tests": [{"name", "results": [{"status",
  "gpu_id" | "gpu_ids", "warnings": [{"warning", "error_id", "error_category", "error_severity"}], "info"}]}]}]},
  "version", "Driver Version Detected", "GPU Device IDs", "GPU Device Serials"}. Deployment results carry the
  GPU their error names in "gpu_id" (an int), per-GPU results the GPU as a string; old releases give "warnings"
  as a plain string.
- 4.x: {"DCGM Diagnostic": {"test_categories": [... "results": [{"entity_group", "entity_group_id", "entity_id",
  "status", "warnings", "info": [str]}], "test_summary": {"status", "warnings", "info"}]}, "entity_groups",
  "metadata": {"version", "Driver Version Detected"}}; test names are plugin names ("software", "memory").
- Either: {"<root>": {"runtime_error": "...", "version"}} when dcgmi could not run the diagnostic.
  Both JSON forms print a warning result as "Fail" (HelperDisplayDiagResult without DDR_DISPLAY_WARN); only the
  text form says "Warn".
- Text: "| <name, 26 wide> | <info, 46 wide> |" rows under category bands ("|-----  Deployment  ---+...|");
  messages wrap every 45 characters onto rows with an empty name; 3.x lists GPUs per status ("Pass - GPUs: 1, 2",
  "Fail - All"), 4.x prints the test's status, then "GPU0: Pass" and "Warning: GPU0" rows per entity.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Iterable

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_limits import MAX_DIGITS, bounded_int, check_size, is_decimal

ROOT_3X = "DCGM GPU Diagnostic"
ROOT_4X = "DCGM Diagnostic"
STATUSES = ("pass", "fail", "warn", "skip", "info", "not_run")
_STATUS_WORDS = {"pass": "pass", "passed": "pass", "fail": "fail", "failed": "fail", "warn": "warn",
                 "warning": "warn", "skip": "skip", "skipped": "skip", "info": "info", "not run": "not_run",
                 "not_run": "not_run", "notrun": "not_run"}
RANK = {"pass": 0, "info": 0, "skip": 1, "not_run": 1, "warn": 2, "fail": 3}  # how bad a status is
FE_GPU = 1  # DCGM_FE_GPU, dcgm_fields.h
_GPU_IN_TEXT = re.compile(r"\bGPU ?([0-9]{1,4})\b")
# Far more than DCGM diagnoses on one node (it numbers GPUs from 0 and handles a few dozen at most); a bound on ids
# and counts keeps the work per row, and what a row can fan out to, small.
MAX_GPUS = 1024
_INTEGER = re.compile(r"\s*+(-?+[0-9]++)\s*+")


@dataclass(frozen=True)
class DiagError:
    """One error/warning DCGM attached to a result. Ids are DCGM_FR_* codes (dcgm_errors.h); None in text."""

    message: str
    error_id: int | None = None
    category: int | None = None  # DCGM_FR_EC_*: 10 = hardware memory
    severity: int | None = None  # DCGM_ERROR_*: 1 monitor, 2 isolate, 4 triage, 5 config, 6 reset


@dataclass(frozen=True)
class TestResult:
    category: str  # "Deployment", "Hardware", "Integration", "Stress" ("" when the output did not say)
    test: str  # DCGM's name: "GPU Memory" (3.x), "memory" (4.x); "" for an error row outside any test (text)
    gpu: int | None  # DCGM GPU id of a per-GPU result; None for a system-wide result
    status: str  # one of STATUSES
    errors: tuple[DiagError, ...] = ()
    info: tuple[str, ...] = ()
    gpu_ids: tuple[int, ...] = ()  # GPUs the result applies to: its own, or those its errors name
    entity: str | None = None  # a non-GPU entity DCGM names ("CPU 0"), else None
    all_gpus: bool = False  # text "Pass - All" when the output does not say how many GPUs there are

    __test__ = False  # not a pytest test class

    @property
    def messages(self) -> tuple[str, ...]:
        return tuple(e.message for e in self.errors)

    @property
    def error_ids(self) -> tuple[int, ...]:
        return tuple(e.error_id for e in self.errors if e.error_id)


@dataclass(frozen=True)
class DiagRun:
    source: str
    schema: str  # "dcgm-3.x-json", "dcgm-4.x-json", "text"
    version: str | None = None
    driver_version: str | None = None
    results: tuple[TestResult, ...] = ()
    gpus_listed: tuple[int, ...] = ()  # GPU ids DCGM says it saw (entity list, serials, device ids)
    runtime_error: str | None = None  # dcgmi ran but the diagnostic did not (JSON "runtime_error", text "Error:")
    problems: tuple[ParseError, ...] = ()  # text rows that could not be read (the rest was), each naming its line
    tests: int = 0  # tests the output lists, with a result or not ("results": [] is a test that gave none)


_JSON_ROOT = re.compile(r'"DCGM (GPU )?Diagnostic"\s*:\s*[{\[]')


def looks_like_dcgmi_diag_json(text: str) -> bool:
    head = text[:4096]
    return _JSON_ROOT.search(head) is not None and '"$schema"' not in head  # DCGM's schema files are no output


# ---------------------------------------------------------------------------------------------------- JSON


def parse_dcgmi_diag_json(text: str, source: str) -> DiagRun:
    """`dcgmi diag -j` output. Lines before the first one starting with "{" (a banner) are skipped."""
    check_size(text, source, "dcgmi diag output")
    lines = text.split("\n")  # as json counts lines
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("{")), None)
    if start is None:
        first = next((line.strip() for line in lines if line.strip()), "")
        raise ParseError(f"no JSON object in dcgmi output{': ' + repr(first[:120]) if first else ' (empty)'}",
                         source, 1 if first else None)
    try:
        data = json.loads("\n".join(lines[start:]))
    except json.JSONDecodeError as exc:
        raise ParseError(f"malformed JSON: {exc.msg}", source, exc.lineno + start) from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of thousands of digits
        raise ParseError(f"malformed JSON: {type(exc).__name__}", source) from None
    return diag_from_json(data, source)


def diag_from_json(data: Any, source: str) -> DiagRun:
    """Walk a decoded `dcgmi diag -j` document (as `Dcgm.diag` returns it)."""
    if not isinstance(data, dict):
        raise ParseError(f"dcgmi JSON is {_kind(data)}, not an object", source)
    if ROOT_4X in data:
        root, schema = ROOT_4X, "dcgm-4.x-json"
    elif ROOT_3X in data:
        root, schema = ROOT_3X, "dcgm-3.x-json"
    else:
        raise ParseError(f"neither '{ROOT_3X}' (DCGM 3.x) nor '{ROOT_4X}' (DCGM 4.x) at the top level: "
                         "not dcgmi diag -j output", source)
    body = data[root]
    if not isinstance(body, dict):
        raise ParseError(f"'{root}' is {_kind(body)}, not an object: the 'test_categories' level is missing",
                         source)
    walk = _Walk(source, schema == "dcgm-3.x-json")
    meta = data.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    version = walk.opt_str(meta.get("version"), "metadata.version") or walk.opt_str(
        data.get("version"), "version") or walk.opt_str(body.get("version"), f"{root}.version")
    driver = walk.opt_str(meta.get("Driver Version Detected"), "metadata.Driver Version Detected") or walk.opt_str(
        data.get("Driver Version Detected"), "Driver Version Detected")
    runtime_error = walk.opt_str(body.get("runtime_error"), f"{root}.runtime_error")
    run = DiagRun(source, schema, version, driver, gpus_listed=walk.gpus_listed(data), runtime_error=runtime_error)
    categories = body.get("test_categories")
    if categories is None:
        if runtime_error:
            return run
        raise ParseError(f"'{root}' has no 'test_categories' (and no 'runtime_error')", source)
    results: list[TestResult] = []
    tests = 0
    for ci, cat in enumerate(walk.array(categories, f"{root}.test_categories")):
        where = f"test_categories[{ci}]"
        if cat is None:
            continue
        cat = walk.obj(cat, where)
        name = walk.string(cat.get("category"), f"{where}.category")
        for ti, test in enumerate(walk.array(cat.get("tests"), f"{where}.tests")):
            if test is not None:
                tests += 1
                results.extend(walk.test(walk.obj(test, f"{where}.tests[{ti}]"), name, f"{where}.tests[{ti}]"))
    return replace(run, results=tuple(results), tests=tests)


class _Walk:
    def __init__(self, source: str, v3: bool):
        self.source, self.v3 = source, v3

    def fail(self, what: str) -> ParseError:
        return ParseError(what, self.source)

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} is {_kind(value)}, not an object")
        return value

    def array(self, value: Any, where: str) -> list[Any]:
        if value is None:
            raise self.fail(f"{where} is missing")
        if not isinstance(value, list):
            raise self.fail(f"{where} is {_kind(value)}, not a list")
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{where} is {'missing' if value is None else _kind(value) + ', not a string'}")
        return value

    def opt_str(self, value: Any, where: str) -> str | None:
        return None if value is None else self.string(value, where).strip() or None

    def integer(self, value: Any, where: str) -> int | None:
        """An int, or a string of ASCII digits ("²" and "١" are not numbers here); at most MAX_DIGITS digits."""
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            if -10 ** MAX_DIGITS < value < 10 ** MAX_DIGITS:
                return value
            raise self.fail(f"{where}: an integer of more than {MAX_DIGITS} digits")
        if isinstance(value, str) and (m := _INTEGER.fullmatch(value)) is not None:
            digits = m[1].lstrip("-")
            return bounded_int(digits, where, self.source, None) * (-1 if m[1].startswith("-") else 1)
        raise self.fail(f"{where} is {_kind(value)}, not an integer")

    def gpu_ids(self, value: Any, where: str) -> tuple[int, ...]:
        """"0", "0,1", 0 or [0, 1]; negative ids (no GPU) are dropped."""
        if value is None:
            return ()
        items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
        ids = [self.integer(v.strip() if isinstance(v, str) else v, where) for v in items
               if not (isinstance(v, str) and not v.strip())]
        return tuple(i for i in ids if i is not None and i >= 0)

    def status(self, value: Any, where: str) -> str:
        raw = self.string(value, where)
        word = raw.split(" - ")[0].strip().lower()  # the CPU EUD reports "Skip - All"
        if word not in _STATUS_WORDS:
            raise self.fail(f"{where}: unknown status {raw[:40]!r}")
        return _STATUS_WORDS[word]

    def errors(self, value: Any, where: str) -> tuple[DiagError, ...]:
        if value is None:
            return ()
        if isinstance(value, str):  # old releases: one plain string
            return (DiagError(value.strip()),) if value.strip() else ()
        out = []
        for i, item in enumerate(self.array(value, where)):
            here = f"{where}[{i}]"
            if item is None:  # jsoncpp fills skipped array slots with null
                continue
            if isinstance(item, str):
                out.append(DiagError(item.strip()))
                continue
            item = self.obj(item, here)
            # 3.x deployment entries carry the text under "warnings" (a typo in Diag.cpp), the rest under "warning"
            text = item.get("warning", item.get("warnings"))
            out.append(DiagError(self.string(text, f"{here}.warning").strip(), self.integer(item.get("error_id"), here),
                                 self.integer(item.get("error_category"), here),
                                 self.integer(item.get("error_severity"), here)))
        return tuple(out)

    def info(self, value: Any, where: str) -> tuple[str, ...]:
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else self.array(value, where)
        return tuple(self.string(v, f"{where}[]").strip() for v in items if v is not None)

    def test(self, test: dict[str, Any], category: str, where: str) -> list[TestResult]:
        name = self.string(test.get("name"), f"{where}.name").strip()
        raw = test.get("results")
        results: list[TestResult] = []
        for ri, res in enumerate([] if raw is None else self.array(raw, f"{where}.results")):
            if res is not None:
                results.extend(self.result(self.obj(res, f"{where}.results[{ri}]"), category, name,
                                           f"{where}.results[{ri}]"))
        summary = test.get("test_summary")
        if summary is not None:  # 4.x: the overall result, with every error of the test repeated
            s = self.obj(summary, f"{where}.test_summary")
            status = self.status(s.get("status"), f"{where}.test_summary.status")
            if not results or RANK[status] > max(RANK[r.status] for r in results):
                seen = {m for r in results for m in r.messages}
                errors = tuple(e for e in self.errors(s.get("warnings"), f"{where}.test_summary.warnings")
                               if e.message not in seen)
                results.append(TestResult(category, name, None, status, errors,
                                          self.info(s.get("info"), f"{where}.test_summary.info"),
                                          named_gpus(errors)))
        return results

    def result(self, res: dict[str, Any], category: str, test: str, where: str) -> list[TestResult]:
        status = self.status(res.get("status"), f"{where}.status")
        errors = self.errors(res.get("warnings"), f"{where}.warnings")
        info = self.info(res.get("info"), f"{where}.info")
        base = TestResult(category, test, None, status, errors, info, named_gpus(errors))
        if any(k in res for k in ("entity_group", "entity_group_id", "entity_id")):  # 4.x
            group = self.opt_str(res.get("entity_group"), f"{where}.entity_group")
            group_id = self.integer(res.get("entity_group_id"), f"{where}.entity_group_id")
            entity_id = self.integer(res.get("entity_id"), f"{where}.entity_id")
            if entity_id is None:
                return [base]
            if group == "GPU" or (group is None and group_id == FE_GPU):
                return [replace(base, gpu=entity_id, gpu_ids=(entity_id,))]
            return [replace(base, entity=f"{group or f'entity group {group_id}'} {entity_id}")]
        if "cpu_id" in res:  # 3.x CPU EUD
            return [replace(base, entity=f"CPU {self.string(res['cpu_id'], f'{where}.cpu_id')}")]
        ids = self.gpu_ids(res.get("gpu_id", res.get("gpu_ids")), f"{where}.gpu_id")
        if self.v3 and category == "Deployment":  # system-wide test; the id is the GPU its error names
            return [replace(base, gpu_ids=tuple(dict.fromkeys(ids + base.gpu_ids)))]
        return [replace(base, gpu=i, gpu_ids=(i,)) for i in ids] or [base]

    def gpus_listed(self, data: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        groups = data.get("entity_groups")
        for gi, group in enumerate([] if groups is None else self.array(groups, "entity_groups")):
            group = self.obj(group, f"entity_groups[{gi}]")
            if group.get("entity_group") == "GPU" or group.get("entity_group_id") == FE_GPU:
                for ei, ent in enumerate(self.array(group.get("entities"), f"entity_groups[{gi}].entities")):
                    eid = self.integer(self.obj(ent, f"entity_groups[{gi}].entities[{ei}]").get("entity_id"),
                                   f"entity_groups[{gi}].entities[{ei}].entity_id")
                    if eid is not None:
                        ids.append(eid)
        serials = data.get("GPU Device Serials")
        if isinstance(serials, dict):
            ids += [int(k) for k in serials if isinstance(k, str) and is_decimal(k) and len(k) < 6]
        devices = data.get("GPU Device IDs")
        if not ids and isinstance(devices, list):
            ids = list(range(min(len(devices), 4096)))
        return tuple(sorted(set(ids)))


def named_gpus(errors: Iterable[DiagError]) -> tuple[int, ...]:
    """GPU ids DCGM's messages name ("GPU 3 has uncorrectable memory errors ...")."""
    return tuple(dict.fromkeys(int(m) for e in errors for m in _GPU_IN_TEXT.findall(e.message)))


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")

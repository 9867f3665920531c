"""The job-log patterns of data/joblog_patterns.toml (each form a job's log prints, with the source it was learned
from), read and compiled once at import; agent/jobs/joblog_lines.py interprets them. A malformed file is a
ValueError naming the file and the entry that is wrong."""
from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from gpuwarden.agent.core.records import dataclass

PATTERNS_FILE = Path(__file__).parent / "data" / "joblog_patterns.toml"
_PATTERN_KEYS = {"regex", "form", "source"}
_HARDWARE_KEYS = {"text", "part", "what", "source"}
_FRAGMENT = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True)
class JobLogPatterns:
    origin: str  # the file read, for the errors that name it
    needles: tuple[bytes, ...]  # the fixed texts of which every line of interest holds one
    hardware_cuda: tuple[tuple[str, str, str], ...]  # (text in CUDA's message, part, what it means), in order
    patterns: Mapping[str, re.Pattern[str]]

    def get(self, name: str) -> re.Pattern[str]:
        """The compiled pattern `name`; ValueError naming the file where it has none."""
        try:
            return self.patterns[name]
        except KeyError:
            raise ValueError(f"{self.origin}: no [pattern.{name}]") from None


def parse_patterns(doc: Mapping[str, Any], origin: str) -> JobLogPatterns:
    """The patterns of a joblog_patterns.toml document; ValueError naming the entry and key that is wrong."""
    unknown = sorted(set(doc) - {"needles", "hardware_cuda", "fragments", "pattern"})
    if unknown:
        raise ValueError(f"{origin}: unknown table {unknown[0]!r}")
    texts = _table(doc.get("needles"), f"{origin}: [needles]").get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{origin}: [needles] texts: needs a list of texts, none empty")
    hardware = []
    entries = doc.get("hardware_cuda", [])
    if not isinstance(entries, list):
        raise ValueError(f"{origin}: hardware_cuda: needs [[hardware_cuda]] entries")
    for i, h in enumerate(entries):
        where = f"{origin}: [[hardware_cuda]] #{i + 1}"
        _keys(_table(h, where), _HARDWARE_KEYS, where)
        hardware.append((h["text"], h["part"], h["what"]))
    fragments = _table(doc.get("fragments", {}), f"{origin}: [fragments]")
    for name, text in fragments.items():
        if not isinstance(text, str):
            raise ValueError(f"{origin}: [fragments] {name}: not a string")
    compiled: dict[str, re.Pattern[str]] = {}
    for name, entry in _table(doc.get("pattern"), f"{origin}: [pattern]").items():
        where = f"{origin}: [pattern.{name}]"
        _keys(_table(entry, where), _PATTERN_KEYS - {"source"}, where, optional=frozenset({"source"}))
        source = entry.get("source")
        if not (isinstance(source, list) and source and all(isinstance(s, str) and s for s in source)):
            raise ValueError(f"{where}: source: needs a list of where the form was seen")

        def fragment(m: re.Match[str], where: str = where) -> str:
            if m.group(1) not in fragments:
                raise ValueError(f"{where}: regex: no fragment {m.group(1)!r} in [fragments]")
            return fragments[m.group(1)]

        try:
            compiled[name] = re.compile(_FRAGMENT.sub(fragment, entry["regex"]))
        except re.error as exc:
            raise ValueError(f"{where}: regex does not compile: {exc}") from None
    return JobLogPatterns(origin, tuple(t.encode() for t in texts), tuple(hardware), compiled)


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: not a table" if value is not None else f"{where}: missing")
    return value


def _keys(entry: Mapping[str, Any], required: set[str], where: str, optional: frozenset[str] = frozenset()) -> None:
    unknown = sorted(set(entry) - required - optional)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    for key in sorted(required):
        if not isinstance(entry.get(key), str) or not entry[key]:
            raise ValueError(f"{where}: {key}: needs a text")


def load_patterns(path: Path = PATTERNS_FILE) -> JobLogPatterns:
    """The patterns of `path` (the shipped file by default); ValueError naming the file and the entry, also for a
    file that is not TOML."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML: {exc}") from None
    return parse_patterns(doc, str(path))


@functools.cache
def shipped() -> JobLogPatterns:
    """The shipped file's patterns, read once for the modules that interpret them (joblog_prefix, joblog_lines)."""
    return load_patterns()

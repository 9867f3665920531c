"""Log-line patterns kept as data (checks/data/<name>.toml, each entry with its source), compiled for the code that
interprets them: the SXid lines (nvswitch_sxid.py) and the PCIe AER lines (pcie_aer.py).

A file holds [fragments] (pieces of regular expression several patterns share, written ${name} in a pattern) and one
[pattern.<name>] table a pattern: `regex`, `source` (where the form of the line comes from), `examples` (lines it must
match: the data is checked against what it claims when it is loaded), and optionally `ignore_case`. The code names the
patterns it reads and the number of groups each must have, so a file that drifts from the code fails at load with
its path and the entry, not with a wrong finding.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Mapping

DATA = Path(__file__).parent / "data"
_KEYS = {"regex", "source", "examples", "ignore_case"}
_FRAGMENT = re.compile(r"\$\{(\w+)\}")


class PatternFileError(ValueError):
    """A pattern file that is not what its reader needs: the message names the file and the entry."""


def load_patterns(name: str, groups: Mapping[str, int], folder: Path = DATA) -> dict[str, re.Pattern[str]]:
    """The patterns of checks/data/<name>.toml that `groups` names ({pattern: its number of groups}), compiled."""
    path = folder / f"{name}.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatternFileError(f"{path}: {exc}") from None
    fragments = data.get("fragments", {})
    tables = data.get("pattern", {})
    if not isinstance(fragments, dict) or not all(isinstance(v, str) for v in fragments.values()):
        raise PatternFileError(f"{path}: [fragments] must map names to strings")
    if not isinstance(tables, dict) or sorted(tables) != sorted(groups):
        raise PatternFileError(f"{path}: the patterns are {sorted(tables)}; its reader needs {sorted(groups)}")
    return {key: _compiled(path, key, table, fragments, groups[key]) for key, table in tables.items()}


def _compiled(path: Path, key: str, table: object, fragments: Mapping[str, str], ngroups: int) -> re.Pattern[str]:
    where = f"{path}: [pattern.{key}]"
    if not isinstance(table, dict):
        raise PatternFileError(f"{where}: not a table")
    unknown = sorted(set(table) - _KEYS)
    missing = sorted({"regex", "source", "examples"} - set(table))
    if unknown or missing:
        raise PatternFileError(f"{where}: " + "; ".join([*(f"unknown key '{k}'" for k in unknown),
                                                         *(f"missing key '{k}'" for k in missing)]))
    regex, source, examples = table["regex"], table["source"], table["examples"]
    if not isinstance(regex, str) or not isinstance(source, str) or not source.strip():
        raise PatternFileError(f"{where}: 'regex' and 'source' must be strings, 'source' not empty")
    if not isinstance(examples, list) or not examples or not all(isinstance(e, str) for e in examples):
        raise PatternFileError(f"{where}: 'examples' must be a list of the lines it matches")

    def fragment(m: re.Match[str]) -> str:
        if m[1] not in fragments:
            raise PatternFileError(f"{where}: no fragment '{m[1]}' in [fragments]")
        return fragments[m[1]]

    try:
        pattern = re.compile(_FRAGMENT.sub(fragment, regex), re.IGNORECASE if table.get("ignore_case") else 0)
    except re.error as exc:
        raise PatternFileError(f"{where}: not a regular expression: {exc}") from None
    if pattern.groups != ngroups:
        raise PatternFileError(f"{where}: {pattern.groups} groups; its reader reads {ngroups}")
    for example in examples:
        if not pattern.search(example):
            raise PatternFileError(f"{where}: does not match its example {example!r}")
    return pattern

"""The job-log patterns are data (agent/jobs/data/joblog_patterns.toml, agent/jobs/joblog_patterns.py): each with the
source it was learned from, the shipped file whole, and a malformed file a clear error naming the file and the
entry."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from gpuwarden.agent.jobs import joblog_lines, joblog_prefix
from gpuwarden.agent.jobs.joblog_patterns import PATTERNS_FILE, load_patterns

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_pattern_names_its_source_and_the_reader_uses_it():
    doc = tomllib.loads(PATTERNS_FILE.read_text())
    # the modules that interpret them: a line's prefix and stamp (joblog_prefix), what the rest of it means
    used = {p.pattern for m in (joblog_prefix, joblog_lines) for p in vars(m).values() if isinstance(p, re.Pattern)}
    loaded = load_patterns()
    for name, entry in doc["pattern"].items():
        assert entry["form"] and entry["source"], name
        for source in entry["source"]:
            if source.startswith("fixtures/") and source.endswith(".log"):
                assert (ROOT / source).is_file(), f"{name}: {source}"
        assert loaded.get(name).pattern in used, f"{name} is read by neither joblog_prefix.py nor joblog_lines.py"
    assert all(h["source"] for h in doc["hardware_cuda"])
    assert joblog_lines.NEEDLES == tuple(t.encode() for t in doc["needles"]["texts"])


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "joblog_patterns.toml"
    path.write_text(PATTERNS_FILE.read_text() + text)
    return path


@pytest.mark.parametrize(("extra", "said"), [
    ("[pattern.broken]\nregex = '(unclosed'\nform = \"x\"\nsource = [\"y\"]\n",
     "[pattern.broken]: regex does not compile"),
    ("[pattern.nosource]\nregex = 'x'\nform = \"x\"\n", "[pattern.nosource]: source: needs a list"),
    ("[pattern.typo]\nregex = 'x'\nfrom = \"x\"\nsource = [\"y\"]\n", "[pattern.typo]: unknown key 'from'"),
    ("[pattern.nofragment]\nregex = '${nope} x'\nform = \"x\"\nsource = [\"y\"]\n",
     "[pattern.nofragment]: regex: no fragment 'nope'"),
    ("[[hardware_cuda]]\ntext = \"x\"\npart = \"gpu\"\n", "[[hardware_cuda]] #7: source: needs a text"),
    ("[pattern.watchdog\n", "not TOML"),
])
def test_a_malformed_patterns_file_names_the_file_and_the_entry(tmp_path, extra, said):
    path = _write(tmp_path, "\n" + extra)
    with pytest.raises(ValueError) as err:
        load_patterns(path)
    assert str(err.value).startswith(str(path)) and said in str(err.value), str(err.value)


def test_a_pattern_the_reader_needs_missing_is_named(tmp_path):
    path = tmp_path / "joblog_patterns.toml"
    path.write_text(PATTERNS_FILE.read_text().replace("[pattern.watchdog]", "[pattern.watchdog_renamed]"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: no [pattern.watchdog]")):
        load_patterns(path).get("watchdog")

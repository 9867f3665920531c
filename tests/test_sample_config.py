"""The shipped /etc/gpuwarden/gpuwarden.toml (packaging/gpuwarden.toml): every key of the code is in it, commented out
with its default; uncommented, the real loader accepts it and changes nothing; it is what the generator writes now."""
from __future__ import annotations

import re
import tomllib

import pytest
from conftest import ROOT
from gpuwarden.agent.cli import sample_config
from gpuwarden.agent.core import config
from gpuwarden.checks import all_specs

SAMPLE = ROOT / "packaging" / "gpuwarden.toml"
KEY_LINE = re.compile(r"#([a-z][a-z0-9_]*) = ")  # a commented-out key; descriptions are "# text"


def leaves(table: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def uncommented(text: str) -> str:
    return "\n".join(line[1:] if KEY_LINE.match(line) else line for line in text.splitlines()) + "\n"


def default_leaves() -> dict[str, object]:
    cfg = config.defaults(all_specs())
    return leaves({"agent": cfg.agent, "remediation": cfg.remediation, "jobs": cfg.jobs, "topology": cfg.topology,
                   "sweep": cfg.sweep, "checks": cfg.checks})


def test_every_key_is_commented_out():
    text = SAMPLE.read_text()
    assert tomllib.loads(text) == tomllib.loads(re.sub(r"(?m)^#.*$", "", text))  # only comments and table headers
    assert leaves(tomllib.loads(text)) == {}
    assert len([line for line in text.splitlines() if KEY_LINE.match(line)]) == len(default_leaves())


def test_uncommented_the_loader_accepts_it_and_every_value_is_the_default(tmp_path):
    path = tmp_path / "gpuwarden.toml"
    path.write_text(uncommented(SAMPLE.read_text()))
    written = leaves(tomllib.loads(path.read_text()))
    defaults = default_leaves()
    assert sorted(written) == sorted(defaults)  # every key of the code, and no other
    for key, value in written.items():
        assert value == defaults[key] and type(value) is type(defaults[key]), key

    loaded = config.load(all_specs(), path, explicit=True)  # the real loader: types, ranges, choices
    assert loaded.files == [str(path)]
    fresh = config.defaults(all_specs())
    assert (loaded.agent, loaded.remediation, loaded.topology, loaded.sweep, loaded.checks) == \
        (fresh.agent, fresh.remediation, fresh.topology, fresh.sweep, fresh.checks)


def test_a_changed_key_takes_effect_once_uncommented(tmp_path):
    """The shipped lines are the ones an operator edits: uncommenting one with a new value changes that key only."""
    text = SAMPLE.read_text().replace('#mode = "dry-run"', 'mode = "act"').replace("#hold_s = 3600.0",
                                                                                    "hold_s = 60.0", 1)
    path = tmp_path / "gpuwarden.toml"
    path.write_text(text)
    loaded = config.load(all_specs(), path, explicit=True)
    assert loaded.remediation["mode"] == "act"
    changed = {k for k, v in leaves({"checks": loaded.checks}).items() if default_leaves()[k] != v}
    assert len(changed) == 1 and changed.pop().endswith(".hold_s")


def test_each_table_says_what_it_is():
    lines = SAMPLE.read_text().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("[")]
    assert headers
    for i in headers:
        assert lines[i - 1].startswith("# ") and lines[i - 1][2:].strip(), lines[i]


def test_the_file_is_what_the_code_writes_now():
    expected = sample_config.render(ROOT / "docs" / "configuration.md")
    if SAMPLE.read_text() != expected:
        pytest.fail("packaging/gpuwarden.toml is out of step with the code's defaults: regenerate it with\n"
                    "  python -m gpuwarden.agent.cli.sample_config docs/configuration.md > packaging/gpuwarden.toml")


def test_toml_values_round_trip():
    for value in (0.1, 1e-05, 600.0, 2**53, -1, "", 'a "b"', [], ["systemctl", "reboot"], True):
        assert tomllib.loads(f"k = {sample_config.toml_value(value)}")["k"] == value

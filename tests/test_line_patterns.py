"""The SXid and AER line patterns are data (checks/data/*.toml) with their sources; a file that is not what its
reader needs fails at load with the file and the entry named."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from gpuwarden.checks import nvswitch_sxid, pcie_aer
from gpuwarden.checks.line_patterns import DATA, PatternFileError, load_patterns

GOOD = """\
[fragments]
num = '(\\d+)'

[pattern.count]
regex = 'count=${num}'
source = "a test"
examples = ["count=3"]
"""


def test_the_shipped_files_load_with_a_source_for_every_pattern():
    assert nvswitch_sxid._SXID.pattern.startswith("(?:(nvidia-nvswitch")
    assert pcie_aer._PORT.groups == 4
    for name in ("nvswitch_sxid", "pcie_aer"):
        assert (DATA / f"{name}.toml").is_file()
    assert load_patterns("x", {"count": 1}, folder=_write(GOOD))["count"].search("count=12")[1] == "12"


def _write(text: str, folder=None):
    folder = Path(folder or tempfile.mkdtemp())
    (folder / "x.toml").write_text(text)
    return folder


@pytest.mark.parametrize(("text", "error"), [
    (GOOD.replace("regex = 'count=${num}'", "regex = 'count=${nun}'"), r"\[pattern.count\]: no fragment 'nun'"),
    (GOOD.replace('source = "a test"\n', ""), r"\[pattern.count\]: missing key 'source'"),
    (GOOD.replace('source = "a test"', 'source = "a test"\nsauce = 1'), r"\[pattern.count\]: unknown key 'sauce'"),
    (GOOD.replace('"count=3"', '"total=3"'), r"\[pattern.count\]: does not match its example 'total=3'"),
    (GOOD.replace("${num}", "(${num}"), r"\[pattern.count\]: not a regular expression"),
    (GOOD.replace("${num}", "${num}(x)?"), r"\[pattern.count\]: 2 groups; its reader reads 1"),
    (GOOD.replace("[pattern.count]", "[pattern.cnt]"), r"the patterns are \['cnt'\]; its reader needs \['count'\]"),
    (GOOD + "[[", r"x.toml: "),
])
def test_a_malformed_pattern_file_names_the_file_and_the_entry(tmp_path, text, error):
    folder = _write(text, tmp_path)
    with pytest.raises(PatternFileError, match=error) as exc:
        load_patterns("x", {"count": 1}, folder=folder)
    assert str(folder / "x.toml") in str(exc.value)


def test_a_shipped_file_edited_wrong_fails_naming_its_entry(tmp_path):
    shutil.copy(DATA / "pcie_aer.toml", tmp_path / "pcie_aer.toml")
    path = tmp_path / "pcie_aer.toml"
    path.write_text(path.read_text().replace("error (?:received: |", "error (?:got: |", 1))
    with pytest.raises(PatternFileError, match=r"pcie_aer.toml: \[pattern.port\]: does not match its example"):
        load_patterns("pcie_aer", {"port": 4, "device": 2, "ghes_severity": 1, "ghes_section": 1, "ghes_device": 1},
                      folder=tmp_path)

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.json from the current output instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def scenario_copy(tmp_path: Path):
    """A writable copy of a bundled scenario, for tests that inject a fault by editing it. The recorded tool
    outputs (tools/) are left out unless asked for: a test of a full-level check writes the output it is about."""

    def copy(name: str, with_tools: bool = False) -> Path:
        dst = tmp_path / name
        shutil.copytree(NODES / name, dst, symlinks=True,
                        ignore=None if with_tools else shutil.ignore_patterns("tools"))
        return dst

    return copy

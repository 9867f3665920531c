"""The code stays lint-clean (pyflakes, pycodestyle, bugbear; settings in pyproject.toml)."""
import shutil
import subprocess

import pytest
from conftest import ROOT


@pytest.mark.skipif(shutil.which("ruff") is None and not (ROOT / ".venv/bin/ruff").exists(),
                    reason="ruff not installed (it is in the [test] extra)")
def test_ruff_clean():
    ruff = shutil.which("ruff") or str(ROOT / ".venv/bin/ruff")
    proc = subprocess.run([ruff, "check", "agent", "checks", "tests", "bench"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

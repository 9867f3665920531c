"""The distribution works outside the source tree: a wheel and an editable install, each in a fresh venv."""
from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import NODES, ROOT

pytestmark = pytest.mark.slow


def make_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin"


def run(*cmd, cwd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_wheel_in_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, ROOT,
                cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("gpuwarden-*.whl")
    bin_ = make_venv(tmp_path / "venv")
    installed = run(bin_ / "pip", "install", "--quiet", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    # From an unrelated folder, so nothing can come from the source tree.
    version = run(bin_ / "gpuwarden", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("gpuwarden 0."), version.stderr
    where = run(bin_ / "python", "-c", "import gpuwarden.agent, gpuwarden.checks; print(gpuwarden.agent.__file__)",
                cwd=tmp_path)
    assert "site-packages" in where.stdout, where.stdout + where.stderr
    proc = run(bin_ / "gpuwarden", "preflight", "--root", NODES / "gb200-nvl72-faulty", "--json", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    codes = {f["code"] for f in json.loads(proc.stdout)["findings"]}
    assert {"79", "row-remap-pending", "ib-port-down"} <= codes  # the XID catalogue data file was packaged


def test_editable_install_in_a_fresh_venv(tmp_path):
    bin_ = make_venv(tmp_path / "venv")
    installed = run(bin_ / "pip", "install", "--quiet", "-e", ROOT, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    where = run(bin_ / "python", "-c", "import gpuwarden.agent, gpuwarden.checks.xid; print(gpuwarden.agent.__file__)",
                cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve() == (ROOT / "agent" / "__init__.py").resolve()
    assert run(bin_ / "gpuwarden", "--version", cwd=tmp_path).returncode == 0

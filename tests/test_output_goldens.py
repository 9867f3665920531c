"""Goldens for what a person or a tool reads: the real `gpuwarden` command's table and JSON output of preflight,
analyze (every bundled kernel log, NVSwitch log and tool output), explain (every bundled job log), jobs, sweep --plan,
plan capacity and checks, each diffed against tests/golden/outputs/. A change to any output shows as a diff in
review. Refresh deliberately with `pytest tests/test_output_goldens.py --update-golden` and read the diff.

Only what changes run to run is normalised: durations (`duration_s`, the table's `ran in`) and, in JSON, the times
taken from the clock of the run (a window that ends now, when a reading was made): any epoch time within two days of
the run reads "<now>". Times from the inputs themselves (years past) are kept exactly."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NODES, ROOT

GOLDEN = ROOT / "tests" / "golden" / "outputs"
SCENARIOS = sorted(p.name for p in NODES.iterdir() if (p / "node.toml").exists())
FIXTURES = ROOT / "fixtures"


def _inputs(*folders: str, suffix: str = "") -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for folder in folders for p in (FIXTURES / folder).rglob("*")
                  if p.is_file() and not p.name.endswith((".source.txt", ".md")) and p.name.endswith(suffix))


LOGS = _inputs("logs", "tools")
JOB_LOGS = _inputs("job_logs", "jobs", suffix=".log")
HOSTS = ",".join(f"node{n:02d}" for n in range(1, 9))


def _cases() -> list[tuple[str, tuple[str, ...]]]:
    cases: list[tuple[str, tuple[str, ...]]] = []
    for name in SCENARIOS:
        cases.append((f"preflight-table-{name}", ("preflight", "--root", f"fixtures/nodes/{name}")))
    for log in LOGS:
        stem = Path(log).relative_to("fixtures").as_posix().replace("/", "__")
        cases.append((f"analyze-table-{stem}", ("analyze", log)))
        cases.append((f"analyze-json-{stem}", ("analyze", "--json", log)))
    for log in JOB_LOGS:
        stem = Path(log).name
        cases.append((f"explain-table-{stem}", ("explain", log)))
        cases.append((f"explain-json-{stem}", ("explain", "--json", log)))
    job = ("jobs", "--root", "fixtures/nodes/gb200-nvl72-job", "--state-dir", "/nonexistent")
    cases += [("jobs-table-gb200-nvl72-job", job), ("jobs-json-gb200-nvl72-job", (*job, "--json"))]
    sweep = ("sweep", "--plan", "--hosts", HOSTS, "--state-dir", "/nonexistent")
    cases += [("sweep-plan-table", sweep), ("sweep-plan-json", (*sweep, "--json"))]
    capacity = ("plan", "capacity", "--racks", "4", "--unavailable", "0..5")
    cases += [("plan-capacity-table", capacity), ("plan-capacity-json", (*capacity, "--json"))]
    cases.append(("checks-table", ("checks",)))
    return cases


CASES = _cases()
_DURATION = re.compile(r'"duration_s": [0-9.e+-]+')
_RAN_IN = re.compile(r"ran in [0-9.]+s")
_EPOCH = re.compile(r'(?<=": )1[0-9]{9}(?:\.[0-9]+)?(?=[,\n}])')
_NEAR_NOW_S = 2 * 86400


def _run(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    # From the repository root, so paths stay relative and the goldens do not depend on where the checkout lives;
    # a fixed width, so the table wraps alike on every terminal; no config of this machine's.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWARDEN_", "NCCL_", "SLURM_"))}
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", *argv], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env={**env, "COLUMNS": "160", "TZ": "UTC"})


def _shown(proc: subprocess.CompletedProcess) -> str:
    """What the golden holds: the exit code, then standard output, durations zeroed."""
    now = time.time()
    out = _RAN_IN.sub("ran in 0.00s", _DURATION.sub('"duration_s": 0.0', proc.stdout))
    out = _EPOCH.sub(lambda m: '"<now>"' if abs(float(m.group()) - now) < _NEAR_NOW_S else m.group(), out)
    return f"exit {proc.returncode}\n" + out


def test_every_case_has_a_distinct_golden_and_no_golden_is_left_over():
    names = [name for name, _ in CASES]
    assert len(names) == len(set(names))
    if GOLDEN.exists():
        # metrics-* and status-* are the daemon's, tests/test_output_goldens_daemon.py's
        left = sorted({p.stem for p in GOLDEN.glob("*.txt") if not p.stem.startswith(("metrics-", "status-"))}
                      - set(names))
        assert not left, f"goldens of no case (remove them): {left}"


@pytest.mark.parametrize("name, argv", CASES, ids=[name for name, _ in CASES])
def test_output_matches_its_golden(name, argv, update_golden):
    proc = _run(argv)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = _shown(proc)
    if "--json" in argv:
        json.loads(proc.stdout)  # the JSON outputs are JSON
    golden = GOLDEN / f"{name}.txt"
    if update_golden:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"{golden} is missing: create it with --update-golden and review it"
    assert text == golden.read_text(), (f"{name}: `gpuwarden {' '.join(argv)}` differs from {golden} (rerun with "
                                        "--update-golden if intended, and review the diff)")

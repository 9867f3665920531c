"""External tools are never left running: a real tool that ignores SIGTERM and leaves a grandchild that ignores it
too, run through the real ToolRunner, the perftest pair, the runner and the `gpuwarden preflight` command, ended by
its own timeout, its check's timeout, the budget, a cancelled check, or SIGTERM/SIGINT to preflight. "Gone" is asked
of the kernel: no process of the tool's group is left (os.killpg(pgid, 0) fails)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT
from gpuwarden.agent.core import config
from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.errors import ToolError
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources import tools as tools_mod
from gpuwarden.agent.sources.perftest import loopback_pair
from gpuwarden.agent.sources.tools import ToolRunner

# Ignores TERM (inherited across fork and exec), starts a grandchild that ignores it too, says who they are, then
# waits forever: only SIGKILL to the whole group ends it.
STUBBORN = """#!/bin/sh
trap '' TERM
sleep 1000 &
echo "$$ $! $*" > "$GW_TOOL_PIDS/$$.tmp" && mv "$GW_TOOL_PIDS/$$.tmp" "$GW_TOOL_PIDS/$$"
echo started
exec sleep 1000
"""
WAIT_S = 60.0  # generous: how long a test waits for something that happens at once when the code is right


@dataclass(frozen=True)
class Started:
    pgid: int  # the tool's pid, leader of its own process group
    grandchild: int
    args: str


class Stubborn:
    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.pids = tmp_path / "pids"
        self.bin.mkdir()
        self.pids.mkdir()

    def install(self, *names: str) -> None:
        for name in names:
            path = self.bin / name
            path.write_text(STUBBORN)
            path.chmod(0o755)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}", "GW_TOOL_PIDS": str(self.pids)}

    def started(self) -> list[Started]:
        out = []
        for f in self.pids.iterdir():
            if f.suffix != ".tmp":
                pgid, grandchild, *args = f.read_text().split(" ", 2) + [""]
                out.append(Started(int(pgid), int(grandchild), " ".join(args).strip()))
        return out

    def wait_started(self, n: int = 1) -> list[Started]:
        end = time.monotonic() + WAIT_S
        while len(self.started()) < n and time.monotonic() < end:
            time.sleep(0.02)
        assert len(self.started()) >= n, f"the tool did not start within {WAIT_S:g}s"
        return self.started()

    def assert_all_gone(self) -> None:
        started = self.started()
        assert started, "the tool never started: nothing was tested"
        for s in started:
            assert not group_alive(s.pgid), f"a process of the tool's group {s.pgid} ({s.args}) is still there"
            with pytest.raises(ProcessLookupError):
                os.kill(s.grandchild, 0)

    def kill_leftovers(self) -> None:
        for s in self.started():
            for kill, pid in ((os.killpg, s.pgid), (os.kill, s.grandchild)):
                try:
                    kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def stubborn(tmp_path, monkeypatch):
    monkeypatch.setattr(tools_mod, "TERM_GRACE_S", 1.0)  # in this process; `preflight` below runs with its own
    tool = Stubborn(tmp_path)
    monkeypatch.setenv("PATH", tool.env()["PATH"])
    monkeypatch.setenv("GW_TOOL_PIDS", str(tool.pids))
    yield tool
    tool.kill_leftovers()  # only after a failure: do not leave them to the next test


def within(fn, *args, **kwargs):
    """fn(*args) in a thread: a call that would hang (the fault under test) fails the test instead."""
    box: dict[str, object] = {}

    def call():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {WAIT_S:g}s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


def tool_check(name: str, call, timeout_s: float, resources: tuple[str, ...] = ()) -> CheckSpec:
    def run(node, cfg):
        call(node, name)
        return []
    return CheckSpec(name=name, summary=name, run=run, timeout_s=timeout_s, resources=resources)


# -- the tool runner ---------------------------------------------------------------------------------------------
def test_a_tool_past_its_own_timeout_is_ended_with_its_grandchild(stubborn):
    stubborn.install("dcgmi")
    with pytest.raises(ToolError, match="no answer within 2s"):
        within(ToolRunner().run, "dcgmi", ["dcgmi", "diag"], timeout_s=2.0)
    stubborn.assert_all_gone()


def test_a_tool_that_exits_takes_what_it_started_with_it(stubborn, tmp_path):
    # The tool returns at once but leaves a TERM-ignoring process behind in its group.
    script = tmp_path / "bin" / "nvbandwidth"
    script.write_text(STUBBORN.replace("exec sleep 1000", "exit 3"))
    script.chmod(0o755)
    out = within(ToolRunner().run, "nvbandwidth", ["nvbandwidth"], timeout_s=60)
    assert out.output.strip() == "started" and out.returncode == 3
    stubborn.assert_all_gone()


# -- through the runner -----------------------------------------------------------------------------------------
def test_a_check_that_times_out_ends_its_tool_before_the_next_check_takes_the_gpu(stubborn):
    stubborn.install("dcgmi")
    seen: dict[str, list[tuple[int, bool]]] = {}

    def call(node, name):
        # What this check finds when it gets the GPU: the groups of the tools started before it, and whether alive.
        seen[name] = [(s.pgid, group_alive(s.pgid)) for s in stubborn.started()]
        node.tools.run("dcgmi", ["dcgmi", name], 600)  # its own timeout is far beyond the check's

    specs = [tool_check(n, call, timeout_s=2.0, resources=("gpu",)) for n in ("first", "second")]
    node = SimpleNamespace(tools=ToolRunner())
    results = within(run_checks, node, specs, config.defaults(specs))
    assert [r.status for r in results] == [Status.UNKNOWN, Status.UNKNOWN]
    assert all("timed out after 2s" in r.error for r in results)
    # Whichever ran second found the first one's tool gone: the GPU was held until then.
    assert sorted(len(v) for v in seen.values()) == [0, 1]
    assert [alive for v in seen.values() for _, alive in v] == [False]
    assert len(stubborn.started()) == 2
    stubborn.assert_all_gone()


def test_the_budget_bounds_a_tools_time_and_ends_it(stubborn):
    stubborn.install("all_reduce_perf")
    specs = [tool_check("nccl", lambda node, name: node.tools.run("all_reduce_perf", ["all_reduce_perf"], 570),
                        timeout_s=600)]
    (result,) = within(run_checks, SimpleNamespace(tools=ToolRunner()), specs, config.defaults(specs), budget_s=2.0)
    assert result.status is Status.UNKNOWN and "budget" in result.error
    stubborn.assert_all_gone()


def test_a_recorded_hang_ends_when_its_check_times_out(tmp_path):
    (tmp_path / "dcgmi.hang").write_text("")
    ended = threading.Event()
    why: list[str] = []

    def call(node, name):
        try:
            node.tools.run("dcgmi", ["dcgmi", "diag"], 600)
        except ToolError as exc:
            why.append(str(exc))
            ended.set()
            raise

    specs = [tool_check("hangs", call, timeout_s=0.5)]
    (result,) = within(run_checks, SimpleNamespace(tools=ToolRunner(recorded_dir=tmp_path)), specs,
                       config.defaults(specs))
    assert result.status is Status.UNKNOWN and "timed out after 0.5s" in result.error
    # The replay stopped waiting with its check, not at its own 600 s.
    assert ended.wait(WAIT_S) and "recorded hang" in why[0]


def test_a_recorded_gemm_hang_ends_when_its_check_times_out(scenario_copy):
    from gpuwarden.agent.node.host import Node
    from gpuwarden.checks import burnin

    root = scenario_copy("h100-hgx-healthy")
    (root / "tools").mkdir()
    (root / "tools" / "burnin.hang").write_text("")
    before = set(threading.enumerate())
    cfg = config.defaults([burnin.CHECK])
    cfg.agent["check_timeout_s"] = 0.5
    (result,) = within(run_checks, Node.recorded_at(root), [burnin.CHECK], cfg)
    assert result.status is Status.UNKNOWN and "timed out after 0.5s" in result.error
    check_threads = [t for t in set(threading.enumerate()) - before if t.name == "check-burnin"]
    for t in check_threads:  # the replay stopped waiting with its check, not after its hour
        t.join(WAIT_S)
        assert not t.is_alive()


def test_perftest_server_and_client_are_ended_with_their_check(stubborn):
    stubborn.install("ib_write_bw")

    def call(node, name):
        loopback_pair(node.tools, "mlx5_0", 1, ["-d", "mlx5_0", "-i", "1"], 600, startup_s=0.2)

    specs = [tool_check("rdma", call, timeout_s=3.0, resources=("network",))]
    (result,) = within(run_checks, SimpleNamespace(tools=ToolRunner()), specs, config.defaults(specs))
    assert result.status is Status.UNKNOWN and "timed out after 3s" in result.error
    started = stubborn.started()
    assert len(started) == 2 and sum("localhost" in s.args for s in started) == 1  # the server and the client
    stubborn.assert_all_gone()


# -- the preflight command ----------------------------------------------------------------------------------------
def preflight(stubborn: Stubborn, *args: str) -> subprocess.Popen:
    # A live node (this machine): dcgm_diag runs `dcgmi diag` first, whatever else the node has.
    return subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "preflight", "--checks", "dcgm_diag",
                             "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=stubborn.env(), cwd=ROOT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_preflight_interrupted_ends_its_tools_before_it_exits(stubborn, sig):
    stubborn.install("dcgmi")
    proc = preflight(stubborn)
    try:
        stubborn.wait_started()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and f"interrupted by {sig.name}" in err
    stubborn.assert_all_gone()


@pytest.mark.parametrize("flag", ["--check-timeout", "--budget"])
def test_preflight_that_runs_out_of_time_exits_with_its_tools_gone(stubborn, flag):
    stubborn.install("dcgmi")
    proc = preflight(stubborn, flag, "2")
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 2, err
    (result,) = json.loads(out)["results"]
    assert result["status"] == "unknown" and "timed out after 2s" in result["error"]
    stubborn.assert_all_gone()


def test_no_tool_starts_in_a_check_that_was_ended(stubborn):
    stubborn.install("dcgmi")
    scope = tools_mod.Scope()
    scope.end_tools("its check timed out after 1s")
    with scope.entered(), pytest.raises(ToolError, match="not started: its check timed out"):
        ToolRunner().run("dcgmi", ["dcgmi"], timeout_s=60)
    assert stubborn.started() == []

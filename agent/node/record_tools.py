"""`gpuwarden record`'s tools/ folder: the external tool runs a recorded node replays (docs/scenario-format.md).

Always (seconds): `nvidia-smi topo -m` and `systemctl is-active nvidia-fabricmanager`, with the names, argv and
timeouts of the checks that run them. With --with-tools (minutes, loads the GPUs): every full-level check runs once
through the real runner with a recording tool runner and burn-in source in place of the node's, so each tool runs
with exactly the argv, timeout and conditions its check uses and is saved under the name the check replays. On a
recorded node the same code re-records what the node replays.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import NvmlError, SourceError, ToolError, ToolMissing
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.dcgm import Dcgm
from gpuwarden.agent.sources.gemm import Gemm, GemmResult
from gpuwarden.agent.sources.tools import ToolOutput, ToolRunner, ToolTimeout
from gpuwarden.checks import fabric_manager, pcie_link

log = logs.get_logger("gpuwarden.record")
TOOL_SUFFIXES = (".out", ".rc", ".hang")
GEMM_NAME, GEMM_SUFFIXES = "burnin", (".json", ".hang")


class RecordedFiles:
    """tools/<name>.* written as each run ends. A run still going when the recording closes is saved as a hang: that
    is how the check saw it (its timeout fired first), and a late answer must not change a finished recording."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._running: dict[str, tuple[str, ...]] = {}
        self._closed = False

    def begin(self, name: str, suffixes: tuple[str, ...]) -> None:
        with self._lock:
            self._running[name] = suffixes

    def end(self, name: str, suffixes: tuple[str, ...], contents: dict[str, str | bytes],
            problem: str | None = None) -> None:
        """Replace whatever tools/<name>.* held by `contents` ({} = nothing: replayed as not installed)."""
        with self._lock:
            self._running.pop(name, None)
            if not self._closed:
                self._write(name, suffixes, contents)
                if problem:
                    self.problems.append(problem)

    def close(self) -> None:
        with self._lock:
            for name, suffixes in self._running.items():
                self._write(name, suffixes, {".hang": ""})
                self.problems.append(f"tools/{name}: still running when the check ended; recorded as a hang")
            self._running, self._closed = {}, True

    def _write(self, name: str, suffixes: tuple[str, ...], contents: dict[str, str | bytes]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for suffix in suffixes:
            (self.folder / f"{name}{suffix}").unlink(missing_ok=True)
        for suffix, data in contents.items():
            path = self.folder / f"{name}{suffix}"
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)


class RecordingTools(ToolRunner):
    """The node's tool runner (live or replaying), saving each run: .out + .rc for a run that returned, .hang for
    one killed at its timeout, nothing for a tool that is not installed (the replay's "not installed")."""

    def __init__(self, inner: ToolRunner, files: RecordedFiles):
        super().__init__(inner.recorded_dir)  # perftest looks at recorded_dir to pick live or replay
        self.inner, self.files = inner, files

    def run(self, name: str, argv: Sequence[str], timeout_s: float) -> ToolOutput:
        if self.recorded_dir is not None and (self.recorded_dir / f"{name}.hang").exists():
            self.files.end(name, TOOL_SUFFIXES, {".hang": ""})  # re-recorded without sitting out the timeout
            raise ToolError(f"{argv[0]}: no answer within {timeout_s:g}s (killed) [recorded hang]")
        self.files.begin(name, TOOL_SUFFIXES)
        start = time.monotonic()
        try:
            out = self.inner.run(name, argv, timeout_s)
        except ToolMissing:
            self.files.end(name, TOOL_SUFFIXES, {})
            raise
        except ToolError as exc:
            hung = time.monotonic() - start >= timeout_s  # killed at its timeout (a failure to start is at once)
            if isinstance(exc, ToolTimeout):  # its check ran out of time (or was stopped) first
                self.files.end(name, TOOL_SUFFIXES, {".hang": ""}, f"tools/{name}: {exc}; recorded as a hang")
            else:
                self.files.end(name, TOOL_SUFFIXES, {".hang": ""} if hung else {},
                               None if hung else f"tools/{name}: {exc}; not recorded (replays as not installed)")
            raise
        self.files.end(name, TOOL_SUFFIXES, {".out": out.output, ".rc": f"{out.returncode}\n"})
        return out


class RecordingGemm(Gemm):
    """A burn-in source (live torch or a recorded node's) that saves tools/burnin.json, each device named by NVML
    index as a recorded node asks for it, or tools/burnin.hang for a GEMM that had not returned when the check
    ended."""

    def __init__(self, source: Gemm, files: RecordedFiles):
        super().__init__(source.recorded_dir, source.use_torch)
        self.source, self.files = source, files
        self._index: dict[str, int] = {}  # torch device -> NVML index

    def why_unavailable(self, device: str = "cuda") -> str:
        return self.source.why_unavailable(device)

    def cuda_device(self, gpu: Any) -> str:
        device = self.source.cuda_device(gpu)
        self._index[device] = gpu.index
        return device

    def run(self, devices: Sequence[str], n: int, dtype: str, seconds: float, seed: int,
            parallel: bool = True) -> dict[str, GemmResult | SourceError]:
        if self.recorded_dir is not None:  # re-recording: the file itself, errors and all
            inside = confine.scenario_prefix(self.recorded_dir.parent)
            saved = {s: confine.read_bytes(self.recorded_dir / f"{GEMM_NAME}{s}", inside) for s in GEMM_SUFFIXES
                     if (self.recorded_dir / f"{GEMM_NAME}{s}").exists()}
            self.files.end(GEMM_NAME, GEMM_SUFFIXES, saved)
            if ".hang" in saved:
                raise SourceError("GEMM did not return [recorded hang]")
            return self.source.run(devices, n, dtype, seconds, seed, parallel)
        self.files.begin(GEMM_NAME, GEMM_SUFFIXES)
        results = self.source.run(devices, n, dtype, seconds, seed, parallel)
        entries = []
        for device, res in results.items():
            name = f"cuda:{self._index[device]}" if device in self._index else device
            if isinstance(res, GemmResult):
                entries.append({**res.to_dict(), "device": name})
            else:  # the replay prefixes "<device>: GEMM failed: " again
                entries.append({"device": name, "error": str(res).removeprefix(f"{device}: GEMM failed: ")})
        self.files.end(GEMM_NAME, GEMM_SUFFIXES, {".json": json.dumps(entries, indent=2) + "\n"})
        return results


@contextmanager
def _recording(node: Any, tools: RecordingTools) -> Iterator[None]:
    saved = node.tools, node.dcgm
    node.tools, node.dcgm = tools, Dcgm(tools)
    try:
        yield
    finally:
        node.tools, node.dcgm = saved


@contextmanager
def tools_recorded(node: Any, folder: Path) -> Iterator[RecordedFiles]:
    """Every tool the node runs within saved under `folder` as the replay reads it (RecordingTools); the files'
    problems once it ends."""
    files = RecordedFiles(folder)
    with _recording(node, RecordingTools(node.tools, files)):
        yield files
    files.close()


def capture_always(node: Any, out: Path, cfg: Any) -> list[str]:
    """tools/nvidia-smi-topo-m.* and tools/systemctl-fabricmanager.*, as pcie_link and fabric run them."""
    files = RecordedFiles(out / "tools")
    tools = RecordingTools(node.tools, files)
    for name, argv, timeout_s in (
            (pcie_link.TOPO_TOOL, pcie_link.TOPO_ARGV, cfg.for_check(pcie_link.CHECK_NAME)["topo_timeout_s"]),
            (fabric_manager.FM_TOOL, fabric_manager.FM_ARGV, cfg.for_check("fabric")["tool_timeout_s"])):
        try:
            tools.run(name, list(argv), float(timeout_s))
        except ToolMissing as exc:
            log.info("tool not installed: recorded as missing", tool=name, reason=str(exc))
        except ToolError:
            pass  # a hang is recorded; any other failure is in files.problems
    files.close()
    return files.problems


def capture_full(node: Any, out: Path, cfg: Any, budget_s: float | None = None, gemm: Gemm | None = None) -> list[str]:
    """Run every full-level check once, recording its tools; returns the problems met. A check not started within
    `budget_s` records nothing (its tools replay as not installed); one cut short records its running tool as hung.
    `gemm`: the burn-in source (default: the node's)."""
    # at use: the full checks' modules, +20 ms (-X importtime) to every recording made without the full checks
    from gpuwarden.checks import ALL, burnin, peer_p2p

    files = RecordedFiles(out / "tools")
    tools = RecordingTools(node.tools, files)
    use_torch = cfg.for_check(burnin.CHECK_NAME)["use_torch"]
    recording_gemm = RecordingGemm(gemm or Gemm.for_node(node, use_torch=use_torch), files)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    problems: list[str] = []
    with _recording(node, tools):
        for spec in (s for s in ALL if s.level == "full"):
            if spec.name == burnin.CHECK_NAME:
                spec = replace(spec, run=partial(burnin.run, gemm=recording_gemm))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            (result,) = run_checks(node, [spec], cfg, budget_s=left)
            log.info("recorded the tools of a check", check=spec.name, status=result.status.value,
                     duration_s=round(result.duration_s, 1), error=result.error)
            if result.error and result.error.startswith("not run:"):
                problems.append(f"{spec.name}: {result.error}; its tools are not recorded")
            elif spec.name == peer_p2p.CHECK_NAME and result.error is None:  # it ran to the end: it read them too
                problems += _nvlink_after(node, out / "tools" / peer_p2p.NVLINK_AFTER)
    files.close()
    return problems + files.problems


def _nvlink_after(node: Any, path: Path) -> list[str]:
    """NVLink counters right after the peer copies (peer_p2p judges their increase over nvml.json's)."""
    if node.recorded:
        source = Path(node.root) / "tools" / path.name
        if source.exists():
            shutil.copyfile(source, path)
        else:
            path.unlink(missing_ok=True)
        return []
    after: dict[str, Any] = {}
    problems = []
    try:
        for gpu in node.gpus():
            try:
                if gpu.error is None:
                    after[str(gpu.index)] = node.nvml.nvlinks(gpu)
            except NvmlError as exc:  # the live check makes it a finding of that GPU; the replay has no delta
                problems.append(f"tools/{path.name}: GPU {gpu.index}: {exc}")
    except NvmlError as exc:
        return [f"tools/{path.name}: {exc}"]
    path.write_text(json.dumps(after, indent=2) + "\n")
    return problems

"""External tools (nccl-tests, perftest, dcgmi, nvbandwidth): run with a timeout and no shell.

On a recorded node the same call reads tools/<name>.out (+ .rc); tools/<name>.hang makes the call
behave like a tool that never returns, so the timeout path is exercised without a real hang.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import SourceError, ToolError, ToolMissing
from . import confine


@dataclass(frozen=True)
class ToolOutput:
    name: str
    argv: tuple[str, ...]
    output: str  # stdout and stderr, interleaved as the tool wrote them
    returncode: int
    duration_s: float


class ToolRunner:
    def __init__(self, recorded_dir: Path | None = None):
        self.recorded_dir = recorded_dir

    def run(self, name: str, argv: Sequence[str], timeout_s: float) -> ToolOutput:
        """Run argv (argv[0] is looked up on PATH); `name` keys the recorded output."""
        if self.recorded_dir is not None:
            return self._replay(name, tuple(argv), timeout_s)
        exe = shutil.which(argv[0])
        if exe is None:
            raise ToolMissing(f"{argv[0]}: not installed (not on PATH)")
        start = time.monotonic()
        try:
            proc = subprocess.run([exe, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ToolError(f"{argv[0]}: no answer within {timeout_s:g}s (killed)") from None
        except OSError as exc:
            raise ToolError(f"{argv[0]}: cannot run: {exc.strerror or exc}") from None
        return ToolOutput(name, tuple(argv), proc.stdout.decode(errors="replace"), proc.returncode,
                          time.monotonic() - start)

    def _replay(self, name: str, argv: tuple[str, ...], timeout_s: float) -> ToolOutput:
        assert self.recorded_dir is not None
        base = self.recorded_dir / name
        if base.with_suffix(".hang").exists():
            time.sleep(timeout_s)
            raise ToolError(f"{argv[0]}: no answer within {timeout_s:g}s (killed) [recorded hang]")
        out = base.with_suffix(".out")
        if not out.exists():
            # Scenario-relative: the message lands in findings, which must not depend on where a scenario lives.
            raise ToolMissing(f"{argv[0]}: not installed (no recorded tools/{out.name})")
        rc_file = base.with_suffix(".rc")
        inside = confine.scenario_prefix(self.recorded_dir.parent)  # a scenario's tools/: nothing outside it is read
        try:
            rc_text = confine.read_text(rc_file, inside) if rc_file.exists() else "0"
            output = confine.read_text(out, inside)
        except OSError as exc:
            raise ToolError(f"{exc.filename or out}: cannot read the recorded run: {exc.strerror or exc}") from None
        except SourceError as exc:  # refused: a link out of the scenario
            raise ToolError(str(exc)) from None
        try:
            rc = int(rc_text.strip())
        except ValueError:
            raise ToolError(f"{rc_file}: not an exit status") from None
        return ToolOutput(name, argv, output, rc, 0.0)

"""Running Slurm's command-line tools for the adapter: no shell, a process group of its own ended when the call runs
past timeout_s, output read up to a bound, a failure classified by its message (`Transient`: slurmctld could not be
asked; `Refused`: it answered no), and text made safe for scontrol's own parser."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from gpuwarden.agent.act.adapters.slurm_hostlist import _check_node
from gpuwarden.agent.act.adapters.slurm_json import MAX_OUTPUT, _Node, parse_sinfo_json
from gpuwarden.agent.core.scheduler import Refused, Transient

MAX_REASON = 200  # characters of a reason the adapter writes (the finding is cut to fit)
MAX_STDERR = 64 << 10

# scontrol/sinfo messages that mean "slurmctld could not be asked" (retry later) ...
_TRANSIENT = ("unable to contact slurm controller", "connection refused", "connect failure", "socket timed out",
              "timed out", "not responding", "zero bytes were transmitted", "temporarily unavailable",
              "try again", "standby mode", "communication", "configuration source", "slurmctld is down",
              "unspecified error")
# ... and those that mean slurmctld answered no.
_REFUSED = ("invalid", "permission denied", "access denied", "duplicate reservation name", "overlaps",
            "not found", "busy", "not subset", "does not exist", "unknown", "not allowed", "requested nodes",
            "presently disabled")


def _clean(text: str) -> str:
    """Printable ASCII with single spaces: no quotes, backslashes or control characters, which scontrol's own
    parser, `scontrol show node` readers and sinfo format strings would take apart."""
    out = [c if ("!" <= c <= "~" and c not in "\"'\\`") else " " for c in text[: 4 * MAX_REASON]]
    return " ".join("".join(out).split())


def _classify(what: str, message: str) -> Exception:
    low = message.lower()
    if any(m in low for m in _TRANSIENT):
        return Transient(f"{what}: {message}")
    if any(m in low for m in _REFUSED):
        return Refused(f"{what}: {message}")
    return Transient(f"{what}: {message or 'failed with no message'}")  # an unknown failure is retried, not dropped


class SlurmTools:
    """The tool calls and the fleet's reading every part of the Slurm adapter shares (agent/act/adapters/slurm.py puts
    the parts together; it sets timeout_s, tools and env)."""

    timeout_s: float
    tools: dict[str, str]
    env: dict[str, str]

    def _fleet(self) -> list[_Node]:
        return parse_sinfo_json(self._run("sinfo", ["--json"]))

    def _find(self, fleet: list[_Node], node: str) -> _Node:
        for n in fleet:
            if n.view.name == node:
                return n
        raise Refused(f"{node}: slurmctld does not know this node")

    def _get(self, node: str) -> _Node:
        return self._find(self._fleet(), _check_node(node))

    def _scontrol(self, what: str, args: list[str]) -> str:
        return self._run("scontrol", args, what)

    def read(self, tool: str, args: list[str]) -> str:
        """stdout of a read-only Slurm tool (`sinfo`, `squeue`, `scontrol show ...`), run as every call of this
        adapter runs its tools (no shell, own process group, timeout_s, errors classified): for readers of the
        cluster's view outside the adapter (gpuwarden plan defrag)."""
        return self._run(tool, args)

    def _run(self, tool: str, args: list[str], what: str | None = None) -> str:
        """Runs one Slurm tool with no shell, in a process group of its own, for at most timeout_s; returns its
        stdout. A tool that runs out is killed with its group and is Transient; a failure is classified by its
        message."""
        what = f"{tool} {what or args[0]}"
        exe = shutil.which(self.tools[tool], path=self.env.get("PATH"))
        if exe is None:
            raise Transient(f"{self.tools[tool]}: not installed (not on PATH); install slurm-client")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([exe, *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=self.env,
                                        start_new_session=True)
            except OSError as exc:
                raise Transient(f"{what}: cannot run: {exc.strerror or exc}") from None
            try:
                proc.wait(timeout=self.timeout_s)
            except BaseException as exc:
                # Killed as a group before it is reaped, so the group id cannot name another process yet.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                if isinstance(exc, subprocess.TimeoutExpired):
                    raise Transient(f"{what}: no answer within {self.timeout_s:g}s (killed); slurmctld busy or "
                                    "hung") from None
                raise
            out.seek(0)
            stdout = out.read(MAX_OUTPUT + 1)
            err.seek(0)
            stderr = err.read(MAX_STDERR).decode(errors="replace")
        if len(stdout) > MAX_OUTPUT:
            raise Transient(f"{what}: printed more than {MAX_OUTPUT >> 20} MiB; not read")
        text = stdout.decode(errors="replace")
        if proc.returncode != 0:
            message = " ".join((stderr.strip() or text.strip()).split())[:500]
            raise _classify(what, message)
        return text

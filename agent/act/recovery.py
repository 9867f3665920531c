"""The quarantine ladder's actions on this node: reset GPUs, reboot, open a service ticket.

Each action is bounded in time and says what happened as a `StepOutcome`: done (ok True), refused or failed (ok
False, with why), or not known to be done (ok None: the tool is missing, it did not answer in time, the processes
holding a GPU could not be read). None is never taken as done.

GPU reset (`nvidia-smi --gpu-reset -i <bus ids>`, one command for every GPU to reset):
- refused while NVML counts a process on any of the GPUs (compute or graphics context), and refused when that could
  not be read (an error, NOT_SUPPORTED included): "could not look" is not "nothing holds it".
- NVML's lists are not every holder: nvidia-persistenced, DCGM, a device plugin or a loaded nvidia_drm keep the
  device open without a context, and nvidia-smi then answers "In use by another client" (NVIDIA/NVSentinel#1690,
  NVIDIA/mig-parted#181): that is a failed reset of that GPU, read from nvidia-smi's answer.
- All GPUs go in one command: where Fabric Manager is not running (or on GPUs older than Ampere) every GPU with an
  NVLink connection to a GPU being reset must be reset in the same command (nvidia-smi(1), --gpu-reset). With
  NVLink active some boards answer "Not Supported" per GPU (yandex-cloud/docs, gpu-mig-troubleshooting.md).
- nvidia-smi's answer is read per GPU: "GPU 00000000:1A:00.0 was successfully reset." for each GPU reset, and after
  "The following GPUs could not be reset:" a line "GPU <bus id>: <why>" for each that was not (exit status 255).
  A GPU the answer names neither way was not reset: the answer's first line says why.
Reading the holders is bounded by the same timeout: an NVML call has none of its own, and a wedged driver can block
one for good, which is "could not look" too.
On a recorded node the reset is replayed from tools/nvidia-smi-gpu-reset.out (+ .rc, .hang) and the holders come
from nvml.json's per-GPU "processes" (docs/scenario-format.md).

Reboot runs the configured command (DEFAULT_REBOOT_COMMAND): the reboot itself ends the agent, so ok True means the
command was accepted (exit status 0), nothing more.

Service ticket: an operator's hook command gets the finding as JSON on its standard input (at most
MAX_TICKET_INPUT bytes); exit status 0 means a ticket was opened, and the first line it prints is the ticket's id or
detail.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import SourceError, ToolError, ToolMissing
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.nvml.gpu import Gpu, canonical_bdf
from gpuwarden.agent.sources.tools import ToolRunner

log = logs.get_logger("gpuwarden.recovery")
T = TypeVar("T")

RESET_TOOL = "nvidia-smi"
RESET_NAME = "nvidia-smi-gpu-reset"  # the recorded answer's name on a recorded node: tools/<RESET_NAME>.out
DEFAULT_REBOOT_COMMAND = ("systemctl", "reboot")
MAX_TICKET_INPUT = 64 << 10  # the finding as JSON; a hook reads it whole, so it stays small
MAX_ANSWER_CHARS = 1 << 20  # of a tool's answer read at all (72 GPUs answer in a few KiB)
MAX_LINE_CHARS = 512  # of one line of an answer
MAX_DETAIL_CHARS = 2048  # of a StepOutcome's detail
MAX_ID_CHARS = 256  # of the ticket id / detail a hook prints
MAX_DEPTH = 16  # of a finding's nesting written to a ticket hook (deeper parts go as text)
MIN_TOOL_S = 0.1  # a tool always gets at least this long, even when reading the holders used the time up
_RESET_OK = "was successfully reset."
_BDF_CHARS = frozenset("0123456789abcdefABCDEF:.")

_runner = ToolRunner()  # reboot and ticket hooks run on this node whatever node is being judged


@dataclass(frozen=True)
class StepOutcome:
    ok: bool | None  # None: could not run (tool missing, timed out) - never taken as done
    detail: str


class HoldersUnknown(SourceError):
    """Which processes hold a GPU could not be read (NVML failed, does not support it, or the GPU is not there)."""


def gpu_holders(node: Any, gpu_indices: Iterable[int]) -> dict[int, list[int]]:
    """GPU index -> the PIDs NVML counts on it (compute and graphics contexts), sorted; [] for a GPU none holds.
    Raises HoldersUnknown, naming every GPU it could not look at and why, when any of them could not be read."""
    wanted = _indices(gpu_indices)
    gpus = _gpus(node)
    out: dict[int, list[int]] = {}
    problems = []
    for index in wanted:
        gpu = gpus.get(index)
        if gpu is None:
            problems.append(f"GPU {index}: not on this node (NVML counts {len(gpus)})")
            continue
        try:
            procs = node.nvml.processes(gpu)
        except SourceError as exc:
            problems.append(f"{_name(gpu)}: {exc}")
            continue
        out[index] = sorted({p["pid"] for p in procs})
    if problems:
        raise HoldersUnknown("; ".join(problems))
    return out


def reset_gpus(node: Any, gpu_indices: Iterable[int], timeout_s: float) -> StepOutcome:
    """Reset the GPUs with one `nvidia-smi --gpu-reset -i <bus id>,...`, refused while any process holds one of them
    (or while that cannot be read). ok True only when nvidia-smi said every one of them was reset."""
    start = time.monotonic()
    try:
        wanted = _indices(gpu_indices)
    except ValueError as exc:
        return StepOutcome(False, f"not reset: {exc}")
    if not wanted:
        return StepOutcome(False, "not reset: no GPU named")
    try:
        holders, gpus = _within(timeout_s, lambda: (gpu_holders(node, wanted), _gpus(node)))
    except SourceError as exc:
        return _outcome(None, f"not reset: could not read which processes hold the GPUs: {exc}")
    held = [f"{_name(gpus[i])}: PID {', '.join(map(str, pids))}" for i, pids in sorted(holders.items()) if pids]
    if held:
        return _outcome(False, "not reset: held by running processes: " + "; ".join(held))
    unnamed = [_name(gpus[i]) for i in wanted if not gpus[i].bus_id]
    if unnamed:  # nvidia-smi is told which GPUs by bus id: without one it could reset another GPU, or all of them
        return _outcome(None, f"not reset: NVML gave no PCI bus id for {', '.join(unnamed)}")
    targets = {canonical_bdf(str(gpus[i].bus_id)): gpus[i] for i in wanted}
    argv = [RESET_TOOL, "--gpu-reset", "-i", ",".join(str(gpus[i].bus_id) for i in wanted)]
    left = max(MIN_TOOL_S, timeout_s - (time.monotonic() - start))
    try:
        answer = node.tools.run(RESET_NAME, argv, left)
    except ToolMissing as exc:
        return _outcome(None, f"not reset: {exc}")
    except ToolError as exc:  # ToolTimeout included: it may have reset some of them; not known, so not done
        return _outcome(None, f"reset not confirmed: {exc}")
    verdicts = parse_reset(answer.output, list(targets), answer.returncode)
    failed = [f"{_name(targets[b])}: {why}" for b, why in verdicts.items() if why is not None]
    done = [_name(targets[b]) for b, why in verdicts.items() if why is None]
    if failed:
        return _outcome(False, "not reset: " + "; ".join(failed) + (f" (reset: {', '.join(done)})" if done else ""))
    return _outcome(True, "reset " + ", ".join(done))


def parse_reset(text: str, bus_ids: Sequence[str], returncode: int) -> dict[str, str | None]:
    """nvidia-smi --gpu-reset's answer, per GPU asked for (canonical bus ids, in the order given): None when it said
    the GPU was reset, else why not. Reads at most MAX_ANSWER_CHARS, a line at most MAX_LINE_CHARS; linear."""
    said: dict[str, str | None] = {}
    first = ""
    for raw in text[:MAX_ANSWER_CHARS].split("\n"):
        line = raw[:MAX_LINE_CHARS].strip()
        if not line:
            continue
        first = first or _printable(line, MAX_LINE_CHARS)
        if not line.startswith("GPU "):
            continue
        rest = line[4:].lstrip()
        token, _, tail = rest.partition(" ")
        if tail.strip() == _RESET_OK:
            bus = _bus(token)
            if bus is not None and bus not in said:
                said[bus] = None
            continue
        token, sep, why = rest.partition(": ")
        bus = _bus(token) if sep else None
        if bus is not None:
            said[bus] = _printable(why.strip(), MAX_LINE_CHARS) or "not reset"  # a failure outweighs a success
    out: dict[str, str | None] = {}
    for bus in bus_ids:
        if bus in said:
            out[bus] = said[bus]
        else:
            status = f"exit status {returncode}"
            out[bus] = f"nvidia-smi did not say it was reset ({status}{': ' + first if first else ''})"
    return out


def reboot(command: Sequence[str], timeout_s: float) -> StepOutcome:
    """Run the configured reboot command. ok True: it was accepted (exit status 0); the reboot then ends the agent."""
    answer = _run("reboot", command, timeout_s, None)
    if isinstance(answer, StepOutcome):
        return answer
    rc, first = answer
    if rc != 0:
        return _outcome(False, f"reboot refused: {_exit(command, rc)}" + (f": {first}" if first else ""))
    return _outcome(True, f"reboot accepted: {_printable(' '.join(command), MAX_LINE_CHARS)}")


def open_ticket(command: Sequence[str], finding: Mapping[str, Any], timeout_s: float) -> StepOutcome:
    """Run the service-ticket hook with `finding` as JSON on its standard input. ok True: exit status 0, and the
    detail is the first line it printed (the ticket's id), bounded."""
    payload = ticket_input(finding)
    if isinstance(payload, StepOutcome):
        return payload
    answer = _run("ticket", command, timeout_s, payload)
    if isinstance(answer, StepOutcome):
        return answer
    rc, first = answer
    if rc != 0:
        return _outcome(False, f"no ticket: {_exit(command, rc)}" + (f": {first}" if first else ""))
    return _outcome(True, first[:MAX_ID_CHARS] if first else "ticket opened (the hook printed no id)")


def ticket_input(finding: Mapping[str, Any]) -> bytes | StepOutcome:
    """The finding as JSON of at most MAX_TICKET_INPUT bytes: whole when it fits, else its top-level plain values
    (strings cut to 1 KiB) with "truncated": true; a StepOutcome (ok False) saying why when not even that fits.
    Values JSON has no form for (NaN, a date, a set) are written as their text, so a ticket is never lost to them."""
    plain = _plain(finding, MAX_DEPTH)
    if not isinstance(plain, dict):
        return _outcome(False, f"no ticket: the finding is not a table ({type(finding).__name__})")
    data = _json(plain)
    if len(data) > MAX_TICKET_INPUT:
        brief = {k: (v[:1024] if isinstance(v, str) else v) for k, v in plain.items()
                 if not isinstance(v, (dict, list))}
        data = _json({**brief, "truncated": True})
    if len(data) > MAX_TICKET_INPUT:
        return _outcome(False, f"no ticket: the finding is larger than {MAX_TICKET_INPUT} bytes as JSON")
    return data


# -- helpers ---------------------------------------------------------------------------------------------------


def _indices(gpu_indices: Iterable[int]) -> list[int]:
    out = set()
    for index in gpu_indices:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 16:
            raise ValueError(f"not a GPU index: {index!r}"[:100])
        out.add(index)
    return sorted(out)


def _within(timeout_s: float, read: Callable[[], T]) -> T:
    """`read()` (NVML calls, which no timeout bounds: a wedged driver can block one for good) in a thread of its own,
    waited for at most `timeout_s`; HoldersUnknown when it has not returned by then (the thread is left behind)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = read()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it was
            box["error"] = exc

    thread = threading.Thread(target=run, name="gpuwarden-recovery-nvml", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if thread.is_alive():
        raise HoldersUnknown(f"NVML did not answer within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _gpus(node: Any) -> dict[int, Gpu]:
    try:
        return {g.index: g for g in node.gpus()}
    except SourceError as exc:
        raise HoldersUnknown(f"cannot list the GPUs: {exc}") from None


def _name(gpu: Gpu) -> str:
    return f"GPU {gpu.index}" + (f" ({gpu.pci})" if gpu.pci else "")


def _bus(token: str) -> str | None:
    """A PCI bus id as nvidia-smi prints it ("00000000:1A:00.0"), canonical; None for anything else."""
    if not 7 <= len(token) <= 24 or not set(token) <= _BDF_CHARS or token.count(":") != 2 or token.count(".") != 1:
        return None
    domain = token.partition(":")[0]
    return canonical_bdf(token) if domain else None


def _printable(text: str, limit: int) -> str:
    cut = text[:limit]
    return "".join(c if c.isprintable() else "?" for c in cut) + ("..." if len(text) > limit else "")


def _plain(value: Any, depth: int) -> Any:
    """`value` as JSON can hold it: tables with text keys, lists, finite numbers, text; anything else (and anything
    nested deeper than `depth`) as its text."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 64 else "an integer too large to write"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth > 0 and isinstance(value, Mapping):
        return {str(k): _plain(v, depth - 1) for k, v in value.items()}
    if depth > 0 and isinstance(value, (list, tuple)):
        return [_plain(v, depth - 1) for v in value]
    return _printable(str(value), MAX_LINE_CHARS)


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, allow_nan=False).encode()


def _exit(command: Sequence[str], rc: int) -> str:
    what = _printable(str(command[0]), 200)
    return f"{what} was killed by signal {-rc}" if rc < 0 else f"{what} exited with status {rc}"


def _run(name: str, command: Sequence[str], timeout_s: float, stdin: bytes | None) -> tuple[int, str] | StepOutcome:
    """Run a configured command: (exit status, first line it printed) or the StepOutcome of why it did not run."""
    if isinstance(command, (str, bytes)) or not command or not all(
            isinstance(w, str) and w and "\0" not in w for w in command):
        return _outcome(False, f"{name}: no command configured (want a list of words, got {command!r})"[:300])
    try:
        answer = _runner.run(name, list(command), timeout_s, stdin=stdin)
    except ToolMissing as exc:
        return _outcome(None, f"{name} not run: {exc}")
    except ToolError as exc:  # ToolTimeout included: ended, and not known to be done
        return _outcome(None, f"{name} not confirmed: {exc}")
    first = ""
    for raw in answer.output[:MAX_ANSWER_CHARS].split("\n"):
        first = _printable(raw[:MAX_LINE_CHARS].strip(), MAX_LINE_CHARS)
        if first:
            break
    return answer.returncode, first


def _outcome(ok: bool | None, detail: str) -> StepOutcome:
    outcome = StepOutcome(ok, _printable(detail, MAX_DETAIL_CHARS))
    log.info("recovery step", ok=ok, detail=outcome.detail)
    return outcome

"""nvml.json, the recorded NVML of a scenario (docs/scenario-format.md): its format number, and its reading as
untrusted input (the writer is Nvml.snapshot(), the server of its calls RecordedNvml)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.sources import confine

SNAPSHOT_FORMAT = 1
MAX_SNAPSHOT_BYTES = 64 << 20  # a 72-GPU recording is a few MB; anything far larger is not an nvml.json


def load_snapshot(path: Path) -> dict[str, Any]:
    """nvml.json, read as untrusted input: it must resolve inside its own folder (a scenario is a bundle from another
    machine), be UTF-8 JSON of bounded size and nesting; every failure is a SourceError naming the file."""
    try:
        raw = confine.read_bytes(path, confine.scenario_prefix(Path(path).parent), limit=MAX_SNAPSHOT_BYTES)
    except OSError as exc:
        raise SourceError(f"{path}: cannot read recorded NVML: {exc.strerror}") from None
    if len(raw) > MAX_SNAPSHOT_BYTES:
        raise SourceError(f"{path}: larger than {MAX_SNAPSHOT_BYTES >> 20} MiB; not an nvml.json snapshot")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise SourceError(f"{path}:{line}: not UTF-8 text (byte {exc.start}: {raw[exc.start]:#04x})") from None
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg}") from None
    except RecursionError:
        raise SourceError(f"{path}: malformed JSON: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SourceError(f"{path}: malformed JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise SourceError(f"{path}: not an nvml.json snapshot (no 'gpus' list)")
    return data


def mtime(path: Path | None) -> int | None:
    """nvml.json's mtime in ns (None: no file, or none to look at): a recorded NVML re-reads the file when it moves."""
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None

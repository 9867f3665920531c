"""NVML's error numbers by name, and the one place a failure of a library call becomes the project's NvmlError:
pynvml.NVMLError, a ctypes.ArgumentError, anything else the bindings raise. No error type of ctypes or pynvml leaves
agent/sources/nvml."""
from __future__ import annotations

from typing import Any, Callable

import pynvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.sources.nvml.bindings import const

# NVML error number -> its name without the NVML_ERROR_ prefix, from the installed bindings.
ERROR_NAMES: dict[int, str] = {
    const(n): n[len("NVML_ERROR_"):] for n in dir(pynvml) if n.startswith("NVML_ERROR_")
}
ERROR_CODES: dict[str, int] = {v: k for k, v in ERROR_NAMES.items()}


def call_nvml(lib: Any, name: str, *args: Any, device: int | None = None) -> Any:
    """`lib.name(*args)` (lib: pynvml or a RecordedNvml); any failure is an NvmlError naming the call and `device`."""
    try:
        fn: Callable[..., Any] = getattr(lib, name)
    except AttributeError:
        raise NvmlError(name, "FUNCTION_NOT_FOUND", device, "not in the installed nvidia-ml-py") from None
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        value = getattr(exc, "value", None)
        code = ERROR_NAMES.get(value, f"CODE_{value}") if isinstance(value, int) else "UNKNOWN"
        raise NvmlError(name, code, device) from None
    except Exception as exc:  # noqa: BLE001 - no library error type may leave the source
        # ctypes.ArgumentError (a constant the bindings define wrongly), a broken library install, a malformed
        # recorded scenario: still the project's error, with the reason.
        raise NvmlError(name, "UNKNOWN", device, f"{type(exc).__name__}: {exc}") from None

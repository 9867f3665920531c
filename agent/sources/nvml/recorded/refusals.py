"""How the recorded NVML refuses what the live library refuses: NVML's errors as the real pynvml.NVMLError
subclasses, and ctypes' ArgumentError for an argument a C function would not take."""
from __future__ import annotations

import ctypes
from typing import Any

import pynvml
from gpuwarden.agent.sources.nvml.bindings import const


def nvml_error(name: str) -> pynvml.NVMLError:
    code = const(f"NVML_ERROR_{name}") if hasattr(pynvml, f"NVML_ERROR_{name}") else const("NVML_ERROR_UNKNOWN")
    return pynvml.NVMLError(code)


def c_uint(value: Any, position: int) -> int:
    """An integer argument as ctypes takes it: the live bindings hand it to a C function, which refuses anything
    else (a tuple constant) with ctypes.ArgumentError. The recorded node must refuse it alike."""
    if isinstance(value, ctypes._SimpleCData):
        value = value.value
    if not isinstance(value, int):
        raise ctypes.ArgumentError(f"argument {position}: TypeError: wrong type {type(value).__name__}")
    return value


def uint_in(value: Any, bits: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << bits

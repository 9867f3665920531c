"""nvmlDeviceGetFieldValues: the field ids the counters of a poll are read by, and the decoding of the array NVML
fills (one call per GPU instead of one per counter; a field that fails on its own is that counter's error)."""
from __future__ import annotations

import math
import struct
from typing import Any, Sequence

import pynvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.sources.nvml.bindings import const
from gpuwarden.agent.sources.nvml.errors import ERROR_NAMES

# HBM temperature is only exposed as a field value (no nvmlTemperatureSensors_t for memory).
FI_MEMORY_TEMP = const("NVML_FI_DEV_MEMORY_TEMP")

# Per-link NVLink fields (nvml.h NVML_FI_DEV_NVLINK_*, scopeId = the link), all in every supported nvidia-ml-py.
# DL_CRC is the link's flow-control (FLIT) CRC count, the "CRC Errors" nvidia-smi nvlink -e prints; the data CRC count
# has a field only for links 0-11 (NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L0..L11, unscoped).
NVLINK_STATE_FIELD = const("NVML_FI_DEV_NVLINK_GET_STATE")
NVLINK_COUNTER_FIELDS = {
    "replay": const("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY"),
    "recovery": const("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY"),
    "crc_flit": const("NVML_FI_DEV_NVLINK_ERROR_DL_CRC"),
}
NVLINK_CRC_DATA_FIELDS: dict[int, int] = {
    n: const(f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{n}") for n in range(64)
    if hasattr(pynvml, f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{n}")
}
# ECC counts (single bit = corrected, double bit = uncorrected in NVML's field names), mode and remapped rows.
ECC_FIELDS = {
    ("mode", "current"): const("NVML_FI_DEV_ECC_CURRENT"),
    ("mode", "pending"): const("NVML_FI_DEV_ECC_PENDING"),
    ("volatile", "corrected"): const("NVML_FI_DEV_ECC_SBE_VOL_TOTAL"),
    ("volatile", "uncorrected"): const("NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
    ("aggregate", "corrected"): const("NVML_FI_DEV_ECC_SBE_AGG_TOTAL"),
    ("aggregate", "uncorrected"): const("NVML_FI_DEV_ECC_DBE_AGG_TOTAL"),
    ("remapped", "correctable"): const("NVML_FI_DEV_REMAPPED_COR"),
    ("remapped", "uncorrectable"): const("NVML_FI_DEV_REMAPPED_UNC"),
    ("remapped", "pending"): const("NVML_FI_DEV_REMAPPED_PENDING"),
    ("remapped", "failure"): const("NVML_FI_DEV_REMAPPED_FAILURE"),
}
# nvmlFieldValue_t as nvml.h lays it out (fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn, value: 40
# bytes, native order): valueType, nvmlReturn and the 8 bytes of the value union.
_FV_LAYOUT = struct.Struct("=8x8x8xII8s")
_FV_SIZE = _FV_LAYOUT.size
# nvmlValueType_t -> how the union holds it (UNSIGNED_SHORT exists only in newer releases; unsigned long is 64-bit
# on the Linux the agent runs on).
_VALUE_DECODE = {const(f"NVML_VALUE_TYPE_{t}"): struct.Struct(f"={c}") for t, c in (
    ("DOUBLE", "d"), ("UNSIGNED_INT", "I"), ("UNSIGNED_LONG", "Q"), ("UNSIGNED_LONG_LONG", "Q"),
    ("SIGNED_LONG_LONG", "q"), ("SIGNED_INT", "i"), ("UNSIGNED_SHORT", "H"))
    if hasattr(pynvml, f"NVML_VALUE_TYPE_{t}")}
_VALUE_UNPACK = {kind: layout.unpack_from for kind, layout in _VALUE_DECODE.items()}
_DOUBLE = const("NVML_VALUE_TYPE_DOUBLE")
_SUCCESS = const("NVML_SUCCESS")
# Field ids by number -> name, for error messages.
FIELD_NAMES: dict[int, str] = {}
for _n in dir(pynvml):
    if _n.startswith("NVML_FI_DEV_") and isinstance(const(_n), int):
        FIELD_NAMES.setdefault(const(_n), _n)


def decode_field_values(values: Any, fields: Sequence[tuple[Any, int, int | None]], index: int
                        ) -> dict[Any, int | float | NvmlError]:
    """The array nvmlDeviceGetFieldValues filled for `fields` ([(key, field id, scope or None)]) on GPU `index`: each
    key's value, or the NvmlError of that field alone. Raises NvmlError when the array is not one of `fields`."""
    out: dict[Any, int | float | NvmlError] = {}
    # The array read as bytes in one pass (nvmlFieldValue_t: the layout every supported release declares),
    # rather than a few hundred attribute reads through the bindings' structure class.
    try:
        raw = bytes(memoryview(values))
    except TypeError:
        raw = b""
    if len(raw) != len(fields) * _FV_SIZE:
        raise NvmlError("nvmlDeviceGetFieldValues", "UNKNOWN", index,
                        f"{len(raw)} bytes for {len(fields)} fields")
    unpack = _VALUE_UNPACK.get
    for (key, fid, scope), (kind, ret, value) in zip(fields, _FV_LAYOUT.iter_unpack(raw), strict=True):
        decode = unpack(kind) if ret == _SUCCESS else None
        if decode is not None:
            number = decode(value)[0]
            if kind != _DOUBLE or math.isfinite(number):  # only a double can be NaN or infinite
                out[key] = number
                continue
            what = f"{FIELD_NAMES.get(fid, fid)}: not a finite number ({number})"
        elif ret != _SUCCESS:
            where = FIELD_NAMES.get(fid, f"field {fid}") + ("" if scope is None else f" scope {scope}")
            out[key] = NvmlError("nvmlDeviceGetFieldValues", ERROR_NAMES.get(ret, f"CODE_{ret}"), index, where)
            continue
        else:
            what = f"{FIELD_NAMES.get(fid, fid)}: value type {kind} not known"
        out[key] = NvmlError("nvmlDeviceGetFieldValues", "UNKNOWN", index, what)
    return out

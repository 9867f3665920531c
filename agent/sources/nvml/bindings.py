"""The installed nvidia-ml-py's constants, read defensively: every release from 12.550.52 on must work alike."""
from __future__ import annotations

import ctypes
from typing import Any

import pynvml


def const(name: str) -> Any:
    """pynvml's constant `name`, with the bindings' slips undone: every release so far defines
    `NVML_P2P_CAPS_INDEX_READ = 0,` (a stray comma makes it the tuple (0,)), which ctypes refuses as a call argument.
    A tuple of one int is that int."""
    value = getattr(pynvml, name)
    if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], int):
        return value[0]
    return value


class GpuFabricInfoV2(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t as nvml.h lays it out. The bindings' own copy is wrong in some releases (12.550 to
    12.560 give clusterUuid 80 bytes, shifting every later field), so NVML fills this one instead."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_ubyte * 16),  # NVML_GPU_FABRIC_UUID_LEN
        ("status", ctypes.c_uint),  # nvmlReturn_t
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_ubyte),  # nvmlGpuFabricState_t is an unsigned char
        ("healthMask", ctypes.c_uint32),
    ]


# NVML_STRUCT_VERSION(GpuFabricInfo, 2): the size in the low 24 bits, the version in the top byte (0x02000024).
GPU_FABRIC_INFO_V2 = (2 << 24) | ctypes.sizeof(GpuFabricInfoV2)

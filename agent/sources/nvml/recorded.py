"""A recorded NVML: serves a scenario's nvml.json through pynvml's own function names and types.

It must not be laxer than the real library: it offers only functions the installed nvidia-ml-py has
(tests/test_nvml_recorded.py proves it), returns the same ctypes structures (device handles and event sets
are ctypes pointers, as pynvml's, so code that compares handles by identity fails here as it would live),
and raises the real pynvml.NVMLError subclasses (NotSupported, GPU is lost, ...) where the scenario says so.
XID events (the scenario's "xid_events") are served through the same event-set calls as the live library. Unlike
live NVML the list is a backlog: each entry is handed over once per process, and a daemon that persists the
subscription's `events_resume_token` and hands it back at its next start (`events_resume`) is not handed an
entry again after a restart (docs/scenario-format.md).
"""
from __future__ import annotations

import ctypes
import json
import threading
import time
from dataclasses import field
from pathlib import Path
from typing import Any

import pynvml
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.inotify import FolderWaiter
from gpuwarden.agent.sources.nvml.bindings import const

EVENT_KEYS = {"gpu", "xid"}  # one entry of nvml.json "xid_events" (docs/scenario-format.md)
_EVENT_POLL_S = 0.02  # how often a waiting recorded event set looks at nvml.json (a sleep, not a spin)


def _error(name: str) -> pynvml.NVMLError:
    code = const(f"NVML_ERROR_{name}") if hasattr(pynvml, f"NVML_ERROR_{name}") else const("NVML_ERROR_UNKNOWN")
    return pynvml.NVMLError(code)


def _uint(value: Any, position: int) -> int:
    """An integer argument as ctypes takes it: the live bindings hand it to a C function, which refuses anything
    else (a tuple constant) with ctypes.ArgumentError. The recorded node must refuse it alike."""
    if isinstance(value, ctypes._SimpleCData):
        value = value.value
    if not isinstance(value, int):
        raise ctypes.ArgumentError(f"argument {position}: TypeError: wrong type {type(value).__name__}")
    return value


# The structure the installed bindings fill for a running process: the newest they define.
_PROCESS_INFO = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None) or pynvml.c_nvmlProcessInfo_t

def _uint_in(value: Any, bits: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << bits


# Field id -> (the function that reads the same counter, the nvml.json key, the path below it).
_ECC_FIELDS: dict[int, tuple[str, str, tuple[str, ...]]] = {
    const("NVML_FI_DEV_ECC_CURRENT"): ("nvmlDeviceGetEccMode", "ecc_mode", ("current",)),
    const("NVML_FI_DEV_ECC_PENDING"): ("nvmlDeviceGetEccMode", "ecc_mode", ("pending",)),
    const("NVML_FI_DEV_ECC_SBE_VOL_TOTAL"): ("nvmlDeviceGetTotalEccErrors", "ecc_errors", ("volatile", "corrected")),
    const("NVML_FI_DEV_ECC_DBE_VOL_TOTAL"): ("nvmlDeviceGetTotalEccErrors", "ecc_errors", ("volatile", "uncorrected")),
    const("NVML_FI_DEV_ECC_SBE_AGG_TOTAL"): ("nvmlDeviceGetTotalEccErrors", "ecc_errors", ("aggregate", "corrected")),
    const("NVML_FI_DEV_ECC_DBE_AGG_TOTAL"): ("nvmlDeviceGetTotalEccErrors", "ecc_errors",
                                            ("aggregate", "uncorrected")),
    const("NVML_FI_DEV_REMAPPED_COR"): ("nvmlDeviceGetRemappedRows", "remapped_rows", ("correctable",)),
    const("NVML_FI_DEV_REMAPPED_UNC"): ("nvmlDeviceGetRemappedRows", "remapped_rows", ("uncorrectable",)),
    const("NVML_FI_DEV_REMAPPED_PENDING"): ("nvmlDeviceGetRemappedRows", "remapped_rows", ("pending",)),
    const("NVML_FI_DEV_REMAPPED_FAILURE"): ("nvmlDeviceGetRemappedRows", "remapped_rows", ("failure",)),
}
# NVLink field id -> (the function that reads the same value, the nvlinks entry's name, the link: None = scopeId).
_NVLINK_FIELDS: dict[int, tuple[str, str, int | None]] = {
    const("NVML_FI_DEV_NVLINK_GET_STATE"): ("nvmlDeviceGetNvLinkState", "state", None),
    const("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY"): ("nvmlDeviceGetNvLinkErrorCounter", "replay", None),
    const("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY"): ("nvmlDeviceGetNvLinkErrorCounter", "recovery", None),
    const("NVML_FI_DEV_NVLINK_ERROR_DL_CRC"): ("nvmlDeviceGetNvLinkErrorCounter", "crc_flit", None),
    **{const(f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{n}"): ("nvmlDeviceGetNvLinkErrorCounter", "crc_data", n)
       for n in range(64) if hasattr(pynvml, f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{n}")},
}


_MEMORY_TEMP = const("NVML_FI_DEV_MEMORY_TEMP")
_SUCCESS = const("NVML_SUCCESS")
_NOT_SUPPORTED = const("NVML_ERROR_NOT_SUPPORTED")
_INVALID_ARGUMENT = const("NVML_ERROR_INVALID_ARGUMENT")
_ULL = const("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG")
_write = ctypes.Structure.__setattr__  # past pynvml's Python __setattr__ (str to bytes): ints only here


_DEVICES: list[Any] = []
_DEVICES_LOCK = threading.Lock()


def _device_table(count: int) -> list[Any]:
    with _DEVICES_LOCK:
        while len(_DEVICES) < count:
            _DEVICES.append(pynvml.struct_c_nvmlDevice_t())
        return _DEVICES[:count]


class RecordedNvml:
    """Duck-types the subset of the pynvml module that agent/sources/nvml uses."""

    def __init__(self, snapshot: dict[str, Any], origin: str = "<memory>", path: Path | None = None):
        self._snap = snapshot
        self._origin = origin
        self._gpus = snapshot.get("gpus", [])
        self._initialized = False
        # One opaque device per GPU index, shared by every instance: handles point at these, as live handles point
        # into NVML's device table. Shared, because a recorded node re-reads nvml.json into a new instance while
        # other threads still hold handles of the last one (live handles likewise outlive nothing but the GPU).
        self._devices = _device_table(len(self._gpus))
        self._index_at = {ctypes.addressof(d): i for i, d in enumerate(self._devices)}
        # Events: the file is watched for appended "xid_events" (a scenario test injects an XID by editing it).
        self._path, self._view, self._stamp = path, snapshot, _mtime(path)
        self._sets: dict[int, _EventSet] = {}
        self._delivered = 0  # "xid_events" entries this instance has handed out: a new set never repeats them
        self._field_answers: dict[int, dict[tuple[int, int], tuple[int, int | None]]] = {}
        self._field_arrays: dict[tuple[int, tuple[Any, ...]], bytes] = {}
        self._links_of: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}  # (GPU, call) -> link -> its entry
        # Wakes a waiting event set when nvml.json's folder is written (a test appends an XID to the file).
        self._waiter = FolderWaiter(Path(path).parent) if path is not None else None

    @classmethod
    def from_file(cls, path: Path) -> "RecordedNvml":
        from gpuwarden.agent.sources.nvml import load_snapshot  # the loader lives with the snapshot writer

        stamp = _mtime(path)  # before reading: a change while reading is seen at the next look
        nvml = cls(load_snapshot(path), str(path), path)
        nvml._stamp = stamp
        return nvml

    # -- helpers ------------------------------------------------------------------------------
    def _system(self, call: str, key: str) -> Any:
        self._require_init()
        if call in self._snap.get("errors", {}):
            raise _error(self._snap["errors"][call])
        if key not in self._snap:
            raise KeyError(f"{self._origin}: no '{key}' recorded (needed by {call})")
        return self._snap[key]

    def _require_init(self) -> None:
        if not self._initialized:
            raise _error("UNINITIALIZED")

    def _index(self, handle: Any) -> int:
        """The GPU index a handle points at; INVALID_ARGUMENT for anything that is not one of ours."""
        address = ctypes.cast(handle, ctypes.c_void_p).value if isinstance(handle, pynvml.c_nvmlDevice_t) else None
        if address not in self._index_at:
            raise _error("INVALID_ARGUMENT")
        return self._index_at[address]

    def _gpu(self, handle: Any, call: str, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self._require_init()
        gpus = self._gpus if gpus is None else gpus
        index = self._index(handle)
        if index >= len(gpus):
            raise _error("INVALID_ARGUMENT")
        gpu = gpus[index]
        errors = gpu.get("errors", {})
        for key in (call, "*"):
            if key in errors:
                raise _error(errors[key])
        return gpu

    def _field(self, handle: Any, call: str, key: str) -> Any:
        gpu = self._gpu(handle, call)
        if key not in gpu:
            raise KeyError(f"{self._origin}: GPU {self._index(handle)} has no '{key}' recorded (needed by {call})")
        return gpu[key]

    # -- pynvml functions -----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if "nvmlInit" in self._snap.get("errors", {}):
            raise _error(self._snap["errors"]["nvmlInit"])
        self._initialized = True

    def nvmlShutdown(self) -> None:
        self._require_init()
        self._initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._system("nvmlSystemGetDriverVersion", "driver_version"))

    def nvmlSystemGetNVMLVersion(self) -> str:
        return str(self._system("nvmlSystemGetNVMLVersion", "nvml_version"))

    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        if "nvmlDeviceGetCount" in self._snap.get("errors", {}):
            raise _error(self._snap["errors"]["nvmlDeviceGetCount"])
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._require_init()
        index = _uint(index, 1)
        if not 0 <= index < len(self._devices):
            raise _error("INVALID_ARGUMENT")
        handle = ctypes.pointer(self._devices[index])  # a new pointer object each call, as pynvml returns
        self._gpu(handle, "nvmlDeviceGetHandleByIndex")  # a lost GPU cannot even be opened
        return handle

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._field(handle, "nvmlDeviceGetUUID", "uuid"))

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._field(handle, "nvmlDeviceGetName", "name"))

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return str(self._field(handle, "nvmlDeviceGetSerial", "serial"))

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        bus_id = str(self._field(handle, "nvmlDeviceGetPciInfo_v3", "pci_bus_id"))
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id.encode()[:15]
        domain, bus, rest = bus_id.split(":")
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        total = int(self._field(handle, "nvmlDeviceGetMemoryInfo", "memory_total_bytes"))
        # "memory_used_bytes" (optional): absent, the 0 of a GPU nothing uses
        used = int(self._gpu(handle, "nvmlDeviceGetMemoryInfo").get("memory_used_bytes", 0))
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = total, max(0, total - used), used
        return mem

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        mode = self._field(handle, "nvmlDeviceGetEccMode", "ecc_mode")
        return [int(mode["current"]), int(mode["pending"])]

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        errorType, counterType = _uint(errorType, 2), _uint(counterType, 3)
        errors = self._field(handle, "nvmlDeviceGetTotalEccErrors", "ecc_errors")
        counter = {const("NVML_VOLATILE_ECC"): "volatile", const("NVML_AGGREGATE_ECC"): "aggregate"}.get(counterType)
        kind = {const("NVML_MEMORY_ERROR_TYPE_CORRECTED"): "corrected",
                const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"): "uncorrected"}.get(errorType)
        if counter is None or kind is None:
            raise _error("INVALID_ARGUMENT")
        return int(errors[counter][kind])

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        rows = self._field(device, "nvmlDeviceGetRemappedRows", "remapped_rows")
        return (int(rows["correctable"]), int(rows["uncorrectable"]), int(bool(rows["pending"])),
                int(bool(rows["failure"])))

    def nvmlDeviceGetRowRemapperHistogram(self, device: Any) -> Any:
        hist = self._field(device, "nvmlDeviceGetRowRemapperHistogram", "row_remapper_histogram")
        values = pynvml.c_nvmlRowRemapperHistogramValues()
        for key in ("max", "high", "partial", "low", "none"):
            setattr(values, key, int(hist[key]))
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._field(handle, "nvmlDeviceGetCurrentClocksEventReasons", "clocks_event_reasons"))

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        sensor = _uint(sensor, 2)
        temps = self._field(handle, "nvmlDeviceGetTemperature", "temperature")
        if sensor != const("NVML_TEMPERATURE_GPU"):
            raise _error("INVALID_ARGUMENT")
        return int(temps["gpu"])

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """The fields nvml.json holds (memory temperature, ECC mode and counts, remapped rows, NVLink state and error
        counters), each from the same record the per-counter functions read. As live, a field fails on its own inside
        a call that succeeds: with the error nvml.json records for the function that reads the same counter, with
        INVALID_ARGUMENT for a link the GPU does not have, NOT_SUPPORTED for a field not recorded."""
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        # The answers are fixed for the life of this instance (nvml.json read once; a rewritten file makes a new
        # instance): the same request is answered with a copy of the array built the first time.
        index = self._index(handle)
        array = pynvml.c_nvmlFieldValue_t * len(fieldIds)
        request = (index, tuple(fieldIds))
        built = self._field_arrays.get(request)
        if built is not None:
            return array.from_buffer_copy(built)
        answers = self._field_answers.setdefault(index, {})
        values = array()
        for i, entry in enumerate(fieldIds):
            # pynvml takes a field id or a (field id, scope id) pair.
            field_id, scope = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, 0)
            fv = values[i]
            field_id, scope = _uint(field_id, 2), _uint(scope, 2)
            _write(fv, "fieldId", field_id)
            _write(fv, "scopeId", scope)
            answer = answers.get((field_id, scope))
            if answer is None:
                try:
                    answer = self._field_value(gpu, index, field_id, scope)
                except pynvml.NVMLError as exc:
                    answer = (0, exc.value)
                answers[(field_id, scope)] = answer
            if answer[1] is not None:
                _write(fv, "nvmlReturn", answer[1])
                continue
            _write(fv, "nvmlReturn", _SUCCESS)
            _write(fv, "valueType", _ULL)
            ctypes.Structure.__getattribute__(fv, "value").ullVal = answer[0]
        if len(self._field_arrays) < 4096:  # bounded: a caller asking ever new field lists is answered afresh
            self._field_arrays[request] = bytes(values)
        return values

    def _field_value(self, gpu: dict[str, Any], index: int, field_id: int, scope: int) -> tuple[int, int | None]:
        """One field's (value, None), or (0, the error NVML would report for it). An error recorded for the function
        that reads the same counter is raised (NVMLError). The codes of the common answers are returned, not raised:
        a preflight asks some 150 fields of each GPU, most of them links and counters it does not have."""
        if field_id == _MEMORY_TEMP:
            temps = self._record(gpu, "temperature", "nvmlDeviceGetFieldValues")
            if temps.get("memory") is None:
                return 0, _NOT_SUPPORTED  # no HBM sensor reported
            return int(temps["memory"]), None
        ecc = _ECC_FIELDS.get(field_id)
        if ecc is not None:
            call, key, path = ecc
            value = self._record(gpu, key, call)
            for part in path:
                value = value[part]
            return int(value), None
        link_field = _NVLINK_FIELDS.get(field_id)
        if link_field is None:
            return 0, _NOT_SUPPORTED
        call, name, link = link_field
        by_link = self._links_of.get((index, call))
        if by_link is None:
            by_link = {}
            for e in self._record(gpu, "nvlinks", call):
                by_link.setdefault(int(e["link"]), e)  # the first entry of a link, as a scan in order finds it
            self._links_of[(index, call)] = by_link
        entry = by_link.get(scope if link is None else link)
        if entry is None:
            return 0, _INVALID_ARGUMENT  # what NVML answers for a link the GPU does not have
        if name == "state":
            return int(entry["state"]), None
        if name in (entry.get("unread") or {}):
            return 0, _error(str(entry["unread"][name])).value  # recorded as NVML failed to read it
        if name not in entry["errors"]:
            return 0, _NOT_SUPPORTED  # a counter NVML did not offer when recorded
        return int(entry["errors"][name]), None

    def _record(self, gpu: dict[str, Any], key: str, call: str) -> Any:
        """gpu[key] for a field that reads what `call` reads: the error nvml.json records for `call` fails the field."""
        errors = gpu.get("errors", {})
        if call in errors:
            raise _error(errors[call])
        if key not in gpu:
            raise KeyError(f"{self._origin}: GPU {gpu.get('index')} has no '{key}' recorded (needed by {call})")
        return gpu[key]

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        # "temperature_thresholds" {"shutdown", "slowdown", "gpu_max", "mem_max"}: a limit not recorded (a scenario
        # from before they were recorded, or null) is one the board does not report: NOT_SUPPORTED, as live.
        limits = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold").get("temperature_thresholds") or {}
        names = {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "shutdown",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "gpu_max",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max"}
        if threshold not in names or limits.get(names[threshold]) is None:
            raise _error("NOT_SUPPORTED")
        return int(limits[names[threshold]])

    def _link(self, handle: Any, call: str, link: int) -> dict[str, Any]:
        link = _uint(link, 2)
        for entry in self._field(handle, call, "nvlinks"):
            if int(entry["link"]) == int(link):
                return entry
        raise _error("INVALID_ARGUMENT")  # what NVML answers for a link the GPU does not have

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        return int(self._link(device, "nvmlDeviceGetNvLinkState", link)["state"])

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        counter = _uint(counter, 3)
        entry = self._link(device, "nvmlDeviceGetNvLinkErrorCounter", link)
        names = {const("NVML_NVLINK_ERROR_DL_REPLAY"): "replay", const("NVML_NVLINK_ERROR_DL_RECOVERY"): "recovery",
                 const("NVML_NVLINK_ERROR_DL_CRC_FLIT"): "crc_flit", const("NVML_NVLINK_ERROR_DL_CRC_DATA"): "crc_data"}
        if counter not in names:
            raise _error("INVALID_ARGUMENT")
        name = names[counter]
        if name in (entry.get("unread") or {}):
            raise _error(str(entry["unread"][name]))  # recorded as NVML failed to read it
        if name not in entry["errors"]:
            raise _error("NOT_SUPPORTED")  # a counter NVML did not offer when recorded
        return int(entry["errors"][name])

    def _pcie(self, handle: Any, call: str, key: str) -> int:
        return int(self._field(handle, call, "pcie")[key])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", "max_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", "max_width")

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._pcie(handle, "nvmlDeviceGetPcieReplayCounter", "replay")

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        p2pIndex = _uint(p2pIndex, 3)
        matrix = self._field(device1, "nvmlDeviceGetP2PStatus", "p2p")
        self._gpu(device2, "nvmlDeviceGetP2PStatus")  # a lost peer fails the call too
        peer = self._index(device2)
        names = {const("NVML_P2P_CAPS_INDEX_NVLINK"): "nvlink", const("NVML_P2P_CAPS_INDEX_READ"): "read",
                 const("NVML_P2P_CAPS_INDEX_WRITE"): "write", const("NVML_P2P_CAPS_INDEX_ATOMICS"): "atomics"}
        if p2pIndex not in names or str(peer) not in matrix:
            raise _error("INVALID_ARGUMENT")
        status = matrix[str(peer)][names[p2pIndex]]
        name = f"NVML_P2P_STATUS_{status}"
        code = const(name) if hasattr(pynvml, name) else None
        if code is None:
            raise KeyError(f"{self._origin}: GPU {self._index(device1)}: unknown P2P status {status!r}")
        return int(code)

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        fabric = self._field(device, "nvmlDeviceGetGpuFabricInfoV", "fabric")
        info = getattr(gpuFabricInfo, "_obj", gpuFabricInfo)  # ctypes.byref(...) or the struct itself
        if int(fabric.get("state", 0)) == 0:
            raise _error("NOT_SUPPORTED")  # no NVSwitch fabric on this GPU
        info.clusterUuid[:] = list(bytes.fromhex(str(fabric["cluster_uuid"]).replace("-", "")))
        info.cliqueId = int(fabric["clique_id"])
        info.state = int(fabric["state"])
        info.status = int(fabric.get("status", 0))
        if hasattr(info, "healthMask"):
            info.healthMask = int(fabric.get("health_mask", 0))
        return const("NVML_SUCCESS")

    def _processes(self, handle: Any, call: str, kind: str) -> list[Any]:
        # "processes" (docs/scenario-format.md): [{"pid", "type": "compute" | "graphics", "used_memory_bytes"}];
        # absent = none. Served as pynvml serves them: friendly objects made from nvmlProcessInfo structures.
        procs = self._gpu(handle, call).get("processes", [])
        if not isinstance(procs, list):
            raise ValueError(f"{self._origin}: GPU {self._index(handle)}: 'processes' must be a list")
        out = []
        for entry in procs:
            used = entry.get("used_memory_bytes") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or entry.get("type") not in ("compute", "graphics") or not (
                    _uint_in(entry.get("pid"), 32) and (used is None or _uint_in(used, 64))):
                raise ValueError(f"{self._origin}: GPU {self._index(handle)}: a process needs an unsigned 'pid', a "
                                 f"'type' of compute or graphics and 'used_memory_bytes' (or null), got {entry!r}")
            if entry["type"] != kind:
                continue
            info = _PROCESS_INFO()
            info.pid = entry["pid"]
            info.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else int(used)
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # as the bindings hand it over
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetComputeRunningProcesses", "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return self._processes(handle, "nvmlDeviceGetGraphicsRunningProcesses", "graphics")

    # -- XID events -----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> Any:
        self._require_init()
        if "nvmlEventSetCreate" in self._snap.get("errors", {}):
            raise _error(self._snap["errors"]["nvmlEventSetCreate"])
        event_set = _EventSet(self._delivered)
        self._sets[ctypes.addressof(event_set.raw)] = event_set
        return ctypes.pointer(event_set.raw)  # pynvml's c_nvmlEventSet_t

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        view = self._events_view()
        self._gpu(handle, "nvmlDeviceRegisterEvents", view.get("gpus", []))  # a GPU lost since start refuses
        event_set = self._event_set(eventSet)
        # A node whose nvml.json has no "xid_events" has no event support; only XID events are ever recorded.
        # NVML registers none of the asked types when it answers NOT_SUPPORTED, and the set stays usable.
        if "xid_events" not in view or int(eventTypes) & ~pynvml.nvmlEventTypeXidCriticalError:
            raise _error("NOT_SUPPORTED")
        event_set.gpus.add(self._index(handle))

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """The next XID listed for a registered GPU, else the first error that holds, else NVML_ERROR_TIMEOUT
        once `timeoutms` has passed. Events come before a lost-GPU error: the driver's XID 79 is delivered,
        then the waits fail (as mock NVML in NVIDIA/k8s-test-infra#746 models the real driver)."""
        event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, int(timeoutms)) / 1000
        while True:
            view = self._events_view()
            data = self._next_event(event_set, view)
            if data is not None:
                return data
            errors = view.get("errors", {})
            if "nvmlEventSetWait_v2" in errors:
                raise _error(errors["nvmlEventSetWait_v2"])
            gpus = view.get("gpus", [])
            for index in sorted(event_set.gpus):
                gpu_errors = gpus[index].get("errors", {}) if index < len(gpus) else {}
                if "nvmlEventSetWait_v2" in gpu_errors:
                    raise _error(gpu_errors["nvmlEventSetWait_v2"])
                if gpu_errors.get("*") == "GPU_IS_LOST":
                    raise _error("GPU_IS_LOST")  # nvml.h: the wait fails while a GPU of the set is off the bus
            left = deadline - time.monotonic()
            if left <= 0:
                raise _error("TIMEOUT")
            self._sleep_until_rewritten(left)

    def events_resume_token(self, eventSet: Any) -> dict[str, Any]:
        """Where a set stands in "xid_events": the entries it has looked at, and a digest of them (so a token is
        not applied to a different list)."""
        event_set = self._event_set(eventSet)
        events = self._events_view().get("xid_events") or []
        return {"position": event_set.position, "digest": _digest(events[:event_set.position])}

    def events_resume(self, eventSet: Any, token: Any) -> bool:
        """Moves a set (and every later one) past the entries a token says were handed over; False, and nothing
        moved, when the token does not fit this list (another scenario, an edited past)."""
        event_set = self._event_set(eventSet)
        events = self._events_view().get("xid_events") or []
        if not isinstance(token, dict) or not isinstance(token.get("position"), int) or isinstance(
                token.get("position"), bool):
            return False
        position = token["position"]
        if not 0 <= position <= len(events) or token.get("digest") != _digest(events[:position]):
            return False
        event_set.position = max(event_set.position, position)
        self._delivered = max(self._delivered, position)
        return True

    def _sleep_until_rewritten(self, seconds: float) -> None:
        """Sleeps until nvml.json's folder is written (inotify), at most `seconds`; polls where it cannot watch."""
        if self._waiter is None:
            time.sleep(min(seconds, _EVENT_POLL_S))
        else:
            self._waiter.wait(seconds, _EVENT_POLL_S)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._event_set(eventSet)
        del self._sets[ctypes.cast(eventSet, ctypes.c_void_p).value]
        if not self._sets and self._waiter is not None:  # no set left to wait on: give the descriptor back
            self._waiter.close()

    def _event_set(self, pointer: Any) -> "_EventSet":
        self._require_init()
        address = ctypes.cast(pointer, ctypes.c_void_p).value if isinstance(pointer, pynvml.c_nvmlEventSet_t) else None
        if address not in self._sets:
            raise _error("INVALID_ARGUMENT")  # not a set of ours, or one already freed
        return self._sets[address]

    def _events_view(self) -> dict[str, Any]:
        """nvml.json as it is now (re-read when its mtime moves). A file caught half-written keeps the last good
        view until the next look; a file that stays malformed is reported by every other NVML read of the node."""
        if self._path is not None:
            stamp = _mtime(self._path)
            if stamp != self._stamp:
                from gpuwarden.agent.sources.nvml import load_snapshot

                try:
                    self._view, self._stamp = load_snapshot(self._path), stamp
                except SourceError:
                    pass
        return self._view

    def _next_event(self, event_set: "_EventSet", view: dict[str, Any]) -> Any:
        events = view.get("xid_events") or []
        if not isinstance(events, list):
            raise ValueError(f"{self._origin}: 'xid_events' must be a list")
        while event_set.position < len(events):
            entry = events[event_set.position]
            where = f"{self._origin}: xid_events[{event_set.position}]"
            if not isinstance(entry, dict) or set(entry) != EVENT_KEYS:
                raise ValueError(f"{where}: want exactly the keys {sorted(EVENT_KEYS)}, got {entry!r}")
            gpu, xid = entry["gpu"], entry["xid"]
            if not isinstance(gpu, int) or not 0 <= gpu < len(self._devices) or not isinstance(xid, int) or xid < 0:
                raise ValueError(f"{where}: 'gpu' must be a GPU index of this file and 'xid' a number, got {entry!r}")
            event_set.position += 1
            self._delivered = max(self._delivered, event_set.position)
            if gpu in event_set.gpus:  # NVML delivers only what a set registered for
                data = pynvml.c_nvmlEventData_t()
                data.device = ctypes.pointer(self._devices[gpu])
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                data.eventData = xid
                return data
        return None


@dataclass
class _EventSet:
    position: int  # index of the next "xid_events" entry to look at
    gpus: set[int] = field(default_factory=set)
    raw: Any = field(default_factory=pynvml.struct_c_nvmlEventSet_t)  # what the returned pointer points at


def _digest(entries: list[Any]) -> str:
    import hashlib  # here: OpenSSL's libcrypto is megabytes of a daemon's memory; only a node with XID events asks

    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:32]


def _mtime(path: Path | None) -> int | None:
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None

"""A recorded NVML: serves a scenario's nvml.json through pynvml's own function names and types.

It must not be laxer than the real library: it offers only functions the installed nvidia-ml-py has
(tests/test_nvml_recorded.py proves it), returns the same ctypes structures (device handles and event sets
are ctypes pointers, as pynvml's, so code that compares handles by identity fails here as it would live),
and raises the real pynvml.NVMLError subclasses (NotSupported, GPU is lost, ...) where the scenario says so.
The field values are fields.py's; XID events (the scenario's "xid_events") are served through the same event-set
calls as the live library (events.py); refusals.py raises what the library would.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import pynvml
from gpuwarden.agent.sources.inotify import FolderWaiter
from gpuwarden.agent.sources.nvml.bindings import const
from gpuwarden.agent.sources.nvml.recorded.events import EventSet, RecordedEvents
from gpuwarden.agent.sources.nvml.recorded.fields import RecordedFieldValues
from gpuwarden.agent.sources.nvml.recorded.refusals import c_uint, nvml_error, uint_in
from gpuwarden.agent.sources.nvml.snapshot import load_snapshot, mtime

# The structure the installed bindings fill for a running process: the newest they define.
_PROCESS_INFO = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None) or pynvml.c_nvmlProcessInfo_t


_DEVICES: list[Any] = []
_DEVICES_LOCK = threading.Lock()


def _device_table(count: int) -> list[Any]:
    with _DEVICES_LOCK:
        while len(_DEVICES) < count:
            _DEVICES.append(pynvml.struct_c_nvmlDevice_t())
        return _DEVICES[:count]


class RecordedNvml(RecordedFieldValues, RecordedEvents):
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
        self._path, self._view, self._stamp = path, snapshot, mtime(path)
        self._sets: dict[int, EventSet] = {}
        self._delivered = 0  # "xid_events" entries this instance has handed out: a new set never repeats them
        self._field_answers: dict[int, dict[tuple[int, int], tuple[int, int | None]]] = {}
        self._field_arrays: dict[tuple[int, tuple[Any, ...]], bytes] = {}
        self._links_of: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}  # (GPU, call) -> link -> its entry
        # Wakes a waiting event set when nvml.json's folder is written (a test appends an XID to the file).
        self._waiter = FolderWaiter(Path(path).parent) if path is not None else None

    @classmethod
    def from_file(cls, path: Path) -> "RecordedNvml":
        stamp = mtime(path)  # before reading: a change while reading is seen at the next look
        nvml = cls(load_snapshot(path), str(path), path)
        nvml._stamp = stamp
        return nvml

    # -- helpers ------------------------------------------------------------------------------
    def _system(self, call: str, key: str) -> Any:
        self._require_init()
        if call in self._snap.get("errors", {}):
            raise nvml_error(self._snap["errors"][call])
        if key not in self._snap:
            raise KeyError(f"{self._origin}: no '{key}' recorded (needed by {call})")
        return self._snap[key]

    def _require_init(self) -> None:
        if not self._initialized:
            raise nvml_error("UNINITIALIZED")

    def _index(self, handle: Any) -> int:
        """The GPU index a handle points at; INVALID_ARGUMENT for anything that is not one of ours."""
        address = ctypes.cast(handle, ctypes.c_void_p).value if isinstance(handle, pynvml.c_nvmlDevice_t) else None
        if address not in self._index_at:
            raise nvml_error("INVALID_ARGUMENT")
        return self._index_at[address]

    def _gpu(self, handle: Any, call: str, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self._require_init()
        gpus = self._gpus if gpus is None else gpus
        index = self._index(handle)
        if index >= len(gpus):
            raise nvml_error("INVALID_ARGUMENT")
        gpu = gpus[index]
        errors = gpu.get("errors", {})
        for key in (call, "*"):
            if key in errors:
                raise nvml_error(errors[key])
        return gpu

    def _field(self, handle: Any, call: str, key: str) -> Any:
        gpu = self._gpu(handle, call)
        if key not in gpu:
            raise KeyError(f"{self._origin}: GPU {self._index(handle)} has no '{key}' recorded (needed by {call})")
        return gpu[key]

    # -- pynvml functions -----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if "nvmlInit" in self._snap.get("errors", {}):
            raise nvml_error(self._snap["errors"]["nvmlInit"])
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
            raise nvml_error(self._snap["errors"]["nvmlDeviceGetCount"])
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._require_init()
        index = c_uint(index, 1)
        if not 0 <= index < len(self._devices):
            raise nvml_error("INVALID_ARGUMENT")
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
        errorType, counterType = c_uint(errorType, 2), c_uint(counterType, 3)
        errors = self._field(handle, "nvmlDeviceGetTotalEccErrors", "ecc_errors")
        counter = {const("NVML_VOLATILE_ECC"): "volatile", const("NVML_AGGREGATE_ECC"): "aggregate"}.get(counterType)
        kind = {const("NVML_MEMORY_ERROR_TYPE_CORRECTED"): "corrected",
                const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"): "uncorrected"}.get(errorType)
        if counter is None or kind is None:
            raise nvml_error("INVALID_ARGUMENT")
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
        sensor = c_uint(sensor, 2)
        temps = self._field(handle, "nvmlDeviceGetTemperature", "temperature")
        if sensor != const("NVML_TEMPERATURE_GPU"):
            raise nvml_error("INVALID_ARGUMENT")
        return int(temps["gpu"])

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        # "temperature_thresholds" {"shutdown", "slowdown", "gpu_max", "mem_max"}: a limit not recorded (a scenario
        # from before they were recorded, or null) is one the board does not report: NOT_SUPPORTED, as live.
        limits = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold").get("temperature_thresholds") or {}
        names = {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "shutdown",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "gpu_max",
                 pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max"}
        if threshold not in names or limits.get(names[threshold]) is None:
            raise nvml_error("NOT_SUPPORTED")
        return int(limits[names[threshold]])

    def _link(self, handle: Any, call: str, link: int) -> dict[str, Any]:
        link = c_uint(link, 2)
        for entry in self._field(handle, call, "nvlinks"):
            if int(entry["link"]) == int(link):
                return entry
        raise nvml_error("INVALID_ARGUMENT")  # what NVML answers for a link the GPU does not have

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        return int(self._link(device, "nvmlDeviceGetNvLinkState", link)["state"])

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        counter = c_uint(counter, 3)
        entry = self._link(device, "nvmlDeviceGetNvLinkErrorCounter", link)
        names = {const("NVML_NVLINK_ERROR_DL_REPLAY"): "replay", const("NVML_NVLINK_ERROR_DL_RECOVERY"): "recovery",
                 const("NVML_NVLINK_ERROR_DL_CRC_FLIT"): "crc_flit", const("NVML_NVLINK_ERROR_DL_CRC_DATA"): "crc_data"}
        if counter not in names:
            raise nvml_error("INVALID_ARGUMENT")
        name = names[counter]
        if name in (entry.get("unread") or {}):
            raise nvml_error(str(entry["unread"][name]))  # recorded as NVML failed to read it
        if name not in entry["errors"]:
            raise nvml_error("NOT_SUPPORTED")  # a counter NVML did not offer when recorded
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
        p2pIndex = c_uint(p2pIndex, 3)
        matrix = self._field(device1, "nvmlDeviceGetP2PStatus", "p2p")
        self._gpu(device2, "nvmlDeviceGetP2PStatus")  # a lost peer fails the call too
        peer = self._index(device2)
        names = {const("NVML_P2P_CAPS_INDEX_NVLINK"): "nvlink", const("NVML_P2P_CAPS_INDEX_READ"): "read",
                 const("NVML_P2P_CAPS_INDEX_WRITE"): "write", const("NVML_P2P_CAPS_INDEX_ATOMICS"): "atomics"}
        if p2pIndex not in names or str(peer) not in matrix:
            raise nvml_error("INVALID_ARGUMENT")
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
            raise nvml_error("NOT_SUPPORTED")  # no NVSwitch fabric on this GPU
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
                    uint_in(entry.get("pid"), 32) and (used is None or uint_in(used, 64))):
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

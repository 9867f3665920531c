"""A recorded NVML: serves a scenario's nvml.json through pynvml's own function names and types.

It must not be laxer than the real library: it offers only functions the installed nvidia-ml-py has
(tests/test_nvml_recorded.py proves it), returns the same ctypes structures, and raises the real
pynvml.NVMLError subclasses (NotSupported, GPU is lost, ...) where the scenario says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml


@dataclass(frozen=True)
class RecordedHandle:
    index: int


def _error(name: str) -> pynvml.NVMLError:
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if code is None:
        code = pynvml.NVML_ERROR_UNKNOWN
    return pynvml.NVMLError(code)


class RecordedNvml:
    """Duck-types the subset of the pynvml module that agent/sources/nvml uses."""

    def __init__(self, snapshot: dict[str, Any], origin: str = "<memory>"):
        self._snap = snapshot
        self._origin = origin
        self._gpus = snapshot.get("gpus", [])
        self._initialized = False

    @classmethod
    def from_file(cls, path: Path) -> "RecordedNvml":
        from . import load_snapshot  # the loader lives with the snapshot writer

        return cls(load_snapshot(path), str(path))

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

    def _gpu(self, handle: RecordedHandle, call: str) -> dict[str, Any]:
        self._require_init()
        if not isinstance(handle, RecordedHandle) or not 0 <= handle.index < len(self._gpus):
            raise _error("INVALID_ARGUMENT")
        gpu = self._gpus[handle.index]
        errors = gpu.get("errors", {})
        for key in (call, "*"):
            if key in errors:
                raise _error(errors[key])
        return gpu

    def _field(self, handle: RecordedHandle, call: str, key: str) -> Any:
        gpu = self._gpu(handle, call)
        if key not in gpu:
            raise KeyError(f"{self._origin}: GPU {handle.index} has no '{key}' recorded (needed by {call})")
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

    def nvmlDeviceGetHandleByIndex(self, index: int) -> RecordedHandle:
        handle = RecordedHandle(int(index))
        self._gpu(handle, "nvmlDeviceGetHandleByIndex")  # a lost GPU cannot even be opened
        return handle

    def nvmlDeviceGetUUID(self, handle: RecordedHandle) -> str:
        return str(self._field(handle, "nvmlDeviceGetUUID", "uuid"))

    def nvmlDeviceGetName(self, handle: RecordedHandle) -> str:
        return str(self._field(handle, "nvmlDeviceGetName", "name"))

    def nvmlDeviceGetSerial(self, handle: RecordedHandle) -> str:
        return str(self._field(handle, "nvmlDeviceGetSerial", "serial"))

    def nvmlDeviceGetPciInfo_v3(self, handle: RecordedHandle) -> Any:
        bus_id = str(self._field(handle, "nvmlDeviceGetPciInfo_v3", "pci_bus_id"))
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = bus_id.encode()[:15]
        domain, bus, rest = bus_id.split(":")
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: RecordedHandle, version: Any = None) -> Any:
        total = int(self._field(handle, "nvmlDeviceGetMemoryInfo", "memory_total_bytes"))
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = total, total, 0
        return mem

    def nvmlDeviceGetEccMode(self, handle: RecordedHandle) -> list[int]:
        mode = self._field(handle, "nvmlDeviceGetEccMode", "ecc_mode")
        return [int(mode["current"]), int(mode["pending"])]

    def nvmlDeviceGetTotalEccErrors(self, handle: RecordedHandle, errorType: int, counterType: int) -> int:
        errors = self._field(handle, "nvmlDeviceGetTotalEccErrors", "ecc_errors")
        counter = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}.get(counterType)
        kind = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}.get(errorType)
        if counter is None or kind is None:
            raise _error("INVALID_ARGUMENT")
        return int(errors[counter][kind])

    def nvmlDeviceGetRemappedRows(self, device: RecordedHandle) -> tuple[int, int, int, int]:
        rows = self._field(device, "nvmlDeviceGetRemappedRows", "remapped_rows")
        return (int(rows["correctable"]), int(rows["uncorrectable"]), int(bool(rows["pending"])),
                int(bool(rows["failure"])))

    def nvmlDeviceGetRowRemapperHistogram(self, device: RecordedHandle) -> Any:
        hist = self._field(device, "nvmlDeviceGetRowRemapperHistogram", "row_remapper_histogram")
        values = pynvml.c_nvmlRowRemapperHistogramValues()
        for key in ("max", "high", "partial", "low", "none"):
            setattr(values, key, int(hist[key]))
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: RecordedHandle) -> int:
        return int(self._field(handle, "nvmlDeviceGetCurrentClocksEventReasons", "clocks_event_reasons"))

    def nvmlDeviceGetTemperature(self, handle: RecordedHandle, sensor: int) -> int:
        temps = self._field(handle, "nvmlDeviceGetTemperature", "temperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error("INVALID_ARGUMENT")
        return int(temps["gpu"])

    def nvmlDeviceGetFieldValues(self, handle: RecordedHandle, fieldIds: list[Any]) -> Any:
        temps = self._field(handle, "nvmlDeviceGetFieldValues", "temperature")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            values[i].fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP and temps.get("memory") is not None:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = int(temps["memory"])
            else:
                # Real NVML reports a per-field failure inside a successful call.
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def _link(self, handle: RecordedHandle, call: str, link: int) -> dict[str, Any]:
        for entry in self._field(handle, call, "nvlinks"):
            if int(entry["link"]) == int(link):
                return entry
        raise _error("INVALID_ARGUMENT")  # what NVML answers for a link the GPU does not have

    def nvmlDeviceGetNvLinkState(self, device: RecordedHandle, link: int) -> int:
        return int(self._link(device, "nvmlDeviceGetNvLinkState", link)["state"])

    def nvmlDeviceGetNvLinkErrorCounter(self, device: RecordedHandle, link: int, counter: int) -> int:
        entry = self._link(device, "nvmlDeviceGetNvLinkErrorCounter", link)
        names = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
                 pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data"}
        if counter not in names:
            raise _error("INVALID_ARGUMENT")
        return int(entry["errors"][names[counter]])

    def _pcie(self, handle: RecordedHandle, call: str, key: str) -> int:
        return int(self._field(handle, call, "pcie")[key])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: RecordedHandle) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: RecordedHandle) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", "max_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: RecordedHandle) -> int:
        return self._pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", "width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: RecordedHandle) -> int:
        return self._pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", "max_width")

    def nvmlDeviceGetPcieReplayCounter(self, handle: RecordedHandle) -> int:
        return self._pcie(handle, "nvmlDeviceGetPcieReplayCounter", "replay")

    def nvmlDeviceGetP2PStatus(self, device1: RecordedHandle, device2: RecordedHandle, p2pIndex: int) -> int:
        matrix = self._field(device1, "nvmlDeviceGetP2PStatus", "p2p")
        self._gpu(device2, "nvmlDeviceGetP2PStatus")  # a lost peer fails the call too
        names = {pynvml.NVML_P2P_CAPS_INDEX_NVLINK: "nvlink", pynvml.NVML_P2P_CAPS_INDEX_READ: "read",
                 pynvml.NVML_P2P_CAPS_INDEX_WRITE: "write", pynvml.NVML_P2P_CAPS_INDEX_ATOMICS: "atomics"}
        if p2pIndex not in names or str(device2.index) not in matrix:
            raise _error("INVALID_ARGUMENT")
        status = matrix[str(device2.index)][names[p2pIndex]]
        code = getattr(pynvml, f"NVML_P2P_STATUS_{status}", None)
        if code is None:
            raise KeyError(f"{self._origin}: GPU {device1.index}: unknown P2P status {status!r}")
        return int(code)

    def nvmlDeviceGetGpuFabricInfoV(self, device: RecordedHandle, gpuFabricInfo: Any) -> int:
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
        return pynvml.NVML_SUCCESS

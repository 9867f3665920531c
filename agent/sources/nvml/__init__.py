"""NVML source: the only code that imports pynvml.

`Nvml` runs the same reading code over two backends: the real pynvml module (live) or
`RecordedNvml` (a scenario's nvml.json served through the same pynvml function names and return
types). Every failure of a library call (pynvml.NVMLError, a ctypes.ArgumentError, anything else the bindings
raise) becomes an `NvmlError` naming the call and the GPU: no error type of ctypes or pynvml leaves this package.
The translation is errors.py; `Gpu` (gpu.py) is a GPU as NVML enumerates it. `Nvml.xid_events()` subscribes to
NVML's XID events (events.py); the reads of a GPU's links are links.py's; nvml.json is read by snapshot.py.

Counters a poll reads (NVLink state and error counters, ECC counts and remapped rows) come from one
nvmlDeviceGetFieldValues call per GPU (`field_values`, decoded by fields.py), not one library call per counter: a
field that fails on its own inside the call is that counter's error, the others still count.

Works with every nvidia-ml-py from 12.550.52 (the first with nvmlDeviceGetGpuFabricInfoV) to the newest: constants
are read through `const()`, which undoes the bindings' slips (every release defines `NVML_P2P_CAPS_INDEX_READ = 0,`,
a tuple, which ctypes refuses), and the fabric info is read into nvml.h's own layout (bindings.py).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Sequence

import pynvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.sources.nvml.bindings import const
from gpuwarden.agent.sources.nvml.errors import call_nvml
from gpuwarden.agent.sources.nvml.events import XidEvents
from gpuwarden.agent.sources.nvml.fields import ECC_FIELDS, FI_MEMORY_TEMP, FIELD_NAMES, decode_field_values
from gpuwarden.agent.sources.nvml.gpu import Gpu, canonical_bdf
from gpuwarden.agent.sources.nvml.links import LinkReads
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml
from gpuwarden.agent.sources.nvml.snapshot import SNAPSHOT_FORMAT

# The limits each GPU reports for itself (nvmlTemperatureThresholds_t; nvidia-smi -q "GPU Shutdown Temp",
# "GPU Slowdown Temp", "GPU Max Operating Temp", "Memory Max Operating Temp").
TEMPERATURE_THRESHOLDS = {
    "shutdown": const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
    "slowdown": const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
    "gpu_max": const("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
    "mem_max": const("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
}
# A GPU listing no process while this much of its memory is in use is one whose processes NVML did not list (a PID
# namespace that hides them, MIG instances, bindings that take a SUCCESS size answer for "none"): could not look.
# nvmlDeviceGetMemoryInfo's "used" counts the driver's reserved memory too (a few hundred MiB on an idle H100 or
# GB200) and an idle CUDA context holds about 0.5 GiB (CUDA 12, lazy loading): 2 GiB is well above both, and far
# below what a job holds (each rank of the bundled gb200-nvl72-job: 67 GiB).
MEMORY_USED_WITHOUT_PROCESSES_MAX = 2 << 30


class Nvml(LinkReads):
    """High-level NVML reads; identical code for the live library and a recorded scenario."""

    def __init__(self, backend: Any, origin: str):
        self._lib = backend
        self.origin = origin
        self._gpus: list[Gpu] | None = None
        self._lock = threading.Lock()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def live(cls) -> "Nvml":
        nvml = cls(pynvml, "live")
        nvml._call("nvmlInit")
        return nvml

    @classmethod
    def recorded(cls, path: Path) -> "Nvml":
        nvml = cls(RecordedNvml.from_file(path), str(path))
        nvml._call("nvmlInit")
        return nvml

    def close(self) -> None:
        try:
            self._call("nvmlShutdown")
        except NvmlError:
            pass

    # -- the one place pynvml errors are translated (errors.py) ---------------------------
    def _call(self, name: str, *args: Any, device: int | None = None) -> Any:
        return call_nvml(self._lib, name, *args, device=device)

    def _dev(self, gpu: Gpu, name: str, *args: Any) -> Any:
        if gpu.handle is None:
            raise gpu.error or NvmlError(name, "UNKNOWN", gpu.index, "no device handle")
        return self._call(name, gpu.handle, *args, device=gpu.index)

    # -- system -------------------------------------------------------------------------
    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def nvml_version(self) -> str:
        return _text(self._call("nvmlSystemGetNVMLVersion"))

    def gpus(self) -> list[Gpu]:
        """Every GPU NVML counts, in NVML index order; a GPU that cannot be opened keeps its error."""
        with self._lock:
            if self._gpus is None:
                self._gpus = [self._open(i) for i in range(self._call("nvmlDeviceGetCount"))]
            return list(self._gpus)

    def _open(self, index: int) -> Gpu:
        gpu = Gpu(index)
        try:
            gpu.handle = self._call("nvmlDeviceGetHandleByIndex", index, device=index)
            gpu.uuid = _text(self._dev(gpu, "nvmlDeviceGetUUID"))
            gpu.bus_id = _text(self._dev(gpu, "nvmlDeviceGetPciInfo_v3").busId)
            gpu.pci = canonical_bdf(gpu.bus_id)
        except NvmlError as exc:
            gpu.error = exc
            return gpu
        for attr, call in (("name", "nvmlDeviceGetName"), ("serial", "nvmlDeviceGetSerial")):
            try:
                setattr(gpu, attr, _text(self._dev(gpu, call)))
            except NvmlError as exc:
                gpu._errors[call] = exc  # optional identity: a board without a serial is fine
        return gpu

    # -- per-device reads (raise NvmlError) -------------------------------------------------
    def memory_total_bytes(self, gpu: Gpu) -> int:
        return int(self._dev(gpu, "nvmlDeviceGetMemoryInfo").total)

    def memory_used_bytes(self, gpu: Gpu) -> int:
        """Memory in use (the driver's reserve included): recorded so that a replay judges an empty process list as
        the live read did (processes())."""
        return int(self._dev(gpu, "nvmlDeviceGetMemoryInfo").used)

    def ecc_mode(self, gpu: Gpu) -> dict[str, int]:
        current, pending = self._dev(gpu, "nvmlDeviceGetEccMode")
        return {"current": int(current), "pending": int(pending)}

    def field_values(self, gpu: Gpu, fields: Sequence[tuple[Any, int, int | None]]
                     ) -> dict[Any, int | float | NvmlError]:
        """One nvmlDeviceGetFieldValues call for `fields` ([(key, field id, scope or None)]): each key's value, or the
        NvmlError of that field alone (NVML reports a per-field failure inside a call that succeeds). Raises NvmlError
        when the call itself fails (GPU lost, no field values on this driver)."""
        ids = [fid if scope is None else (fid, scope) for _, fid, scope in fields]
        values = self._dev(gpu, "nvmlDeviceGetFieldValues", ids)
        return decode_field_values(values, fields, gpu.index)

    def ecc_counters(self, gpu: Gpu) -> dict[str, Any]:
        """ECC mode, counts and remapped rows in one field read: {"ecc_mode", "ecc_errors", "remapped_rows"} in the
        shapes of ecc_mode(), ecc_errors() and remapped_rows(); "remapped_rows" None where the GPU has no row remapper
        (NOT_SUPPORTED). Raises NvmlError for a mode or count NVML could not read, naming its field."""
        try:
            got = self.field_values(gpu, [(key, fid, None) for key, fid in ECC_FIELDS.items()])
        except NvmlError as exc:
            if not exc.not_supported:
                raise
            return self._ecc_counters_each(gpu)  # no field values on this GPU or driver
        remapped: dict[str, Any] | None = {}
        out: dict[str, Any] = {"ecc_mode": {}, "ecc_errors": {"volatile": {}, "aggregate": {}}}
        for (group, name), value in got.items():
            if isinstance(value, NvmlError):
                if group == "remapped" and value.not_supported:
                    remapped = None  # before Ampere: no row remapper
                    continue
                what = "ECC mode" if group == "mode" else "remapped rows" if group == "remapped" else "ECC errors"
                raise NvmlError(value.call, value.code, gpu.index,
                                f"{what}, {group} {name}: {FIELD_NAMES.get(ECC_FIELDS[(group, name)])}")
            if group == "mode":
                out["ecc_mode"][name] = int(value)
            elif group == "remapped":
                if remapped is not None:
                    remapped[name] = bool(value) if name in ("pending", "failure") else int(value)
            else:
                out["ecc_errors"][group][name] = int(value)
        out["remapped_rows"] = remapped
        return out

    def _ecc_counters_each(self, gpu: Gpu) -> dict[str, Any]:
        try:
            remapped: dict[str, Any] | None = self.remapped_rows(gpu)
        except NvmlError as exc:
            if not exc.not_supported:
                raise
            remapped = None
        return {"ecc_mode": self.ecc_mode(gpu), "ecc_errors": self.ecc_errors(gpu), "remapped_rows": remapped}

    def ecc_errors(self, gpu: Gpu) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for counter, ctype in (("volatile", const("NVML_VOLATILE_ECC")), ("aggregate", const("NVML_AGGREGATE_ECC"))):
            out[counter] = {
                kind: int(self._dev(gpu, "nvmlDeviceGetTotalEccErrors", etype, ctype))
                for kind, etype in (
                    ("corrected", const("NVML_MEMORY_ERROR_TYPE_CORRECTED")),
                    ("uncorrected", const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED")),
                )
            }
        return out

    def remapped_rows(self, gpu: Gpu) -> dict[str, Any]:
        corr, unc, pending, failure = self._dev(gpu, "nvmlDeviceGetRemappedRows")
        return {"correctable": int(corr), "uncorrectable": int(unc), "pending": bool(pending), "failure": bool(failure)}

    def row_remapper_histogram(self, gpu: Gpu) -> dict[str, int]:
        h = self._dev(gpu, "nvmlDeviceGetRowRemapperHistogram")
        return {k: int(getattr(h, k)) for k in ("max", "high", "partial", "low", "none")}

    def clocks_event_reasons(self, gpu: Gpu) -> int:
        return int(self._dev(gpu, "nvmlDeviceGetCurrentClocksEventReasons"))

    def temperatures(self, gpu: Gpu) -> dict[str, int | None]:
        core = int(self._dev(gpu, "nvmlDeviceGetTemperature", const("NVML_TEMPERATURE_GPU")))
        try:
            (fv,) = self._dev(gpu, "nvmlDeviceGetFieldValues", [FI_MEMORY_TEMP])
        except NvmlError as exc:
            if not exc.not_supported:
                raise
            return {"gpu": core, "memory": None}  # no field values on this GPU/driver: the core still counts
        # A field can fail on its own while the call succeeds (HBM sensor absent on PCIe boards).
        memory = int(fv.value.uiVal) if fv.nvmlReturn == const("NVML_SUCCESS") else None
        return {"gpu": core, "memory": memory}

    def temperature_thresholds(self, gpu: Gpu) -> dict[str, int | None]:
        """The GPU's own temperature limits in C (TEMPERATURE_THRESHOLDS), from its driver: None where the board
        reports none (NOT_SUPPORTED, or a 0 as some boards answer, or a value no GPU could run at)."""
        out: dict[str, int | None] = {}
        for name, kind in TEMPERATURE_THRESHOLDS.items():
            try:
                value = int(self._dev(gpu, "nvmlDeviceGetTemperatureThreshold", kind))
            except NvmlError as exc:
                if not exc.not_supported:
                    raise
                value = 0
            out[name] = value if 0 < value < 200 else None
        return out


    def processes(self, gpu: Gpu) -> list[dict[str, Any]]:
        """The processes NVML counts on the GPU: compute contexts (CUDA, MPS servers) and graphics contexts, each
        {"pid", "type": "compute" | "graphics", "used_memory_bytes": int | None}. Raises NvmlError when either list
        cannot be read (NOT_SUPPORTED included): a list that could not be read is not an empty one. It is not every
        holder of the device: nvidia-persistenced, DCGM and monitoring agents keep it open without a context.
        Nor is an empty list from a GPU with more than MEMORY_USED_WITHOUT_PROCESSES_MAX of its memory in use an
        idle GPU: that raises NvmlError too (code UNKNOWN, the memory in use in its message)."""
        out = []
        for kind, call in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                           ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
            for proc in self._dev(gpu, call):
                used = getattr(proc, "usedGpuMemory", None)
                out.append({"pid": int(proc.pid), "type": kind,
                            "used_memory_bytes": None if used is None else int(used)})
        if not out:
            try:
                in_use = int(self._dev(gpu, "nvmlDeviceGetMemoryInfo").used)
            except NvmlError as exc:
                if not exc.not_supported:
                    raise
                in_use = 0  # no memory figure on this board: the empty list is all there is to go by
            if in_use > MEMORY_USED_WITHOUT_PROCESSES_MAX:
                raise NvmlError("nvmlDeviceGetComputeRunningProcesses", "UNKNOWN", gpu.index,
                                f"no process listed while {in_use >> 20} MiB of the GPU's memory is in use: the "
                                "processes could not be listed, not none")
        return out

    # -- events ---------------------------------------------------------------------------
    def xid_events(self) -> XidEvents:
        """A subscription to NVML's XID events on every GPU that supports them (events.py); not `available`
        where none does. Raises NvmlError when NVML fails."""
        return XidEvents(self).subscribe()

    # -- recording ------------------------------------------------------------------------
    PER_GPU_READS: tuple[str, ...] = (
        "memory_total_bytes", "memory_used_bytes", "ecc_mode", "ecc_errors", "remapped_rows", "row_remapper_histogram",
        "clocks_event_reasons", "temperatures", "temperature_thresholds", "nvlinks", "fabric_info", "pcie_link",
        "p2p_matrix", "processes",
    )
    # snapshot key differs from method name for these
    _SNAPSHOT_KEY = {"temperatures": "temperature", "fabric_info": "fabric", "pcie_link": "pcie", "p2p_matrix": "p2p"}

    def snapshot(self) -> dict[str, Any]:
        """Everything the checks read, as nvml.json (docs/scenario-format.md). Failed calls are kept as errors."""
        snap: dict[str, Any] = {"format": SNAPSHOT_FORMAT}
        for key, method in (("driver_version", self.driver_version), ("nvml_version", self.nvml_version)):
            try:
                snap[key] = method()
            except NvmlError as exc:
                snap.setdefault("errors", {})[exc.call] = exc.code
        gpus = []
        for gpu in self.gpus():
            identity = {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "serial": gpu.serial,
                        "pci_bus_id": gpu.bus_id}
            entry: dict[str, Any] = {k: v for k, v in identity.items() if v is not None}
            errors: dict[str, str] = {call: e.code for call, e in gpu._errors.items()}
            if gpu.error is not None:
                errors["*"] = gpu.error.code
            else:
                for method in self.PER_GPU_READS:
                    try:
                        entry[self._SNAPSHOT_KEY.get(method, method)] = getattr(self, method)(gpu)
                    except NvmlError as exc:
                        errors[exc.call] = exc.code
            if errors:
                entry["errors"] = errors
            gpus.append(entry)
        snap["gpus"] = gpus
        return snap

    def write_snapshot(self, path: Path) -> None:
        path.write_text(json.dumps(self.snapshot(), indent=2) + "\n")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

"""NVML source: the only code that imports pynvml.

`Nvml` runs the same reading code over two backends: the real pynvml module (live) or
`RecordedNvml` (a scenario's nvml.json served through the same pynvml function names and return
types). Every failure of a library call (pynvml.NVMLError, a ctypes.ArgumentError, anything else the bindings
raise) becomes an `NvmlError` naming the call and the GPU: no error type of ctypes or pynvml leaves this package.
`Nvml.xid_events()` subscribes to NVML's XID events (events.py).

Counters a poll reads (NVLink state and error counters, ECC counts and remapped rows) come from one
nvmlDeviceGetFieldValues call per GPU (`field_values`), not one library call per counter: a field that fails on its
own inside the call is that counter's error, the others still count.

Works with every nvidia-ml-py from 12.550.52 (the first with nvmlDeviceGetGpuFabricInfoV) to the newest: constants
are read through `const()`, which undoes the bindings' slips (every release defines `NVML_P2P_CAPS_INDEX_READ = 0,`,
a tuple, which ctypes refuses), and the fabric info is read into nvml.h's own layout (bindings.py).
"""
from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
import threading
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Sequence

import pynvml
from gpuwarden.agent.core.errors import NvmlError, SourceError
from gpuwarden.agent.core.model import Entity
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.nvml.bindings import GPU_FABRIC_INFO_V2, GpuFabricInfoV2, const
from gpuwarden.agent.sources.nvml.events import XidEvents
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml

# NVML error number -> its name without the NVML_ERROR_ prefix, from the installed bindings.
ERROR_NAMES: dict[int, str] = {
    const(n): n[len("NVML_ERROR_"):] for n in dir(pynvml) if n.startswith("NVML_ERROR_")
}
ERROR_CODES: dict[str, int] = {v: k for k, v in ERROR_NAMES.items()}

NVLINK_COUNTERS = {
    "replay": const("NVML_NVLINK_ERROR_DL_REPLAY"),
    "recovery": const("NVML_NVLINK_ERROR_DL_RECOVERY"),
    "crc_flit": const("NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    "crc_data": const("NVML_NVLINK_ERROR_DL_CRC_DATA"),
}
# Peer-to-peer capabilities NVML reports per ordered GPU pair (nvmlGpuP2PCapsIndex_t).
P2P_CAPS = {
    "nvlink": const("NVML_P2P_CAPS_INDEX_NVLINK"),
    "read": const("NVML_P2P_CAPS_INDEX_READ"),
    "write": const("NVML_P2P_CAPS_INDEX_WRITE"),
    "atomics": const("NVML_P2P_CAPS_INDEX_ATOMICS"),
}
P2P_STATUS_NAMES: dict[int, str] = {
    const(n): n[len("NVML_P2P_STATUS_"):] for n in dir(pynvml)
    if n.startswith("NVML_P2P_STATUS_") and n != "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED"  # the bindings' typo alias
}
P2P_STATUS_CODES: dict[str, int] = {v: k for k, v in P2P_STATUS_NAMES.items()}
# HBM temperature is only exposed as a field value (no nvmlTemperatureSensors_t for memory).
FI_MEMORY_TEMP = const("NVML_FI_DEV_MEMORY_TEMP")
# The limits each GPU reports for itself (nvmlTemperatureThresholds_t; nvidia-smi -q "GPU Shutdown Temp",
# "GPU Slowdown Temp", "GPU Max Operating Temp", "Memory Max Operating Temp").
TEMPERATURE_THRESHOLDS = {
    "shutdown": const("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
    "slowdown": const("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
    "gpu_max": const("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
    "mem_max": const("NVML_TEMPERATURE_THRESHOLD_MEM_MAX"),
}
SNAPSHOT_FORMAT = 1
# A GPU listing no process while this much of its memory is in use is one whose processes NVML did not list (a PID
# namespace that hides them, MIG instances, bindings that take a SUCCESS size answer for "none"): could not look.
# nvmlDeviceGetMemoryInfo's "used" counts the driver's reserved memory too (a few hundred MiB on an idle H100 or
# GB200) and an idle CUDA context holds about 0.5 GiB (CUDA 12, lazy loading): 2 GiB is well above both, and far
# below what a job holds (each rank of the bundled gb200-nvl72-job: 67 GiB).
MEMORY_USED_WITHOUT_PROCESSES_MAX = 2 << 30

# Per-link NVLink fields (nvml.h NVML_FI_DEV_NVLINK_*, scopeId = the link), all in every supported nvidia-ml-py.
# DL_CRC is the link's flow-control (FLIT) CRC count, the "CRC Errors" nvidia-smi nvlink -e prints; the data CRC count
# has a field only for links 0-11 (NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L0..L11, unscoped).
NVLINK_STATE_FIELD = const("NVML_FI_DEV_NVLINK_GET_STATE")
NVLINK_COUNTER_FIELDS = {
    "replay": const("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY"),
    "recovery": const("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY"),
    "crc_flit": const("NVML_FI_DEV_NVLINK_ERROR_DL_CRC"),
}
NVLINK_RELEARN_EVERY = 20  # every 20th read asks for every link again (a link the driver offers late is seen)
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


def canonical_bdf(nvml_bus_id: str) -> str:
    """NVML prints an 8-hex-digit domain ("00000008:01:00.0"); sysfs and findings use 4 ("0008:01:00.0")."""
    text = nvml_bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    return f"{int(domain, 16):04x}:{rest}" if domain else rest


@dataclass
class Gpu:
    """A GPU as NVML enumerates it. Identity fields are None when NVML could not read them."""

    index: int
    handle: Any = None
    uuid: str | None = None
    name: str | None = None
    serial: str | None = None
    pci: str | None = None  # canonical BDF, "0008:01:00.0"
    bus_id: str | None = None  # as NVML prints it, "00000008:01:00.0"
    error: NvmlError | None = None  # set when the device could not be opened or identified
    _errors: dict[str, NvmlError] = field(default_factory=dict, repr=False)
    # The NVLinks the GPU has (fixed by the board), learnt at a read of every link: the reads between ask for those
    # alone (NVML_NVLINK_MAX_LINKS is 36 in newer bindings, twice what any GPU has).
    _links: tuple[int, ...] | None = field(default=None, repr=False)
    _link_reads: int = field(default=0, repr=False)

    @property
    def entity(self) -> Entity:
        return Entity("gpu", self.uuid or self.pci or f"index-{self.index}", self.index, self.pci)


_ABSENT = object()


@functools.lru_cache(maxsize=8)
def _nvlink_fields(links: tuple[int, ...]) -> tuple[tuple[Any, int, int | None], ...]:
    """The field read of nvlinks() for these links: (key, field id, scope) of each link's state and counters. The
    same few link sets are read every poll (all links at a relearn, else the GPU's own), so it is built once."""
    fields: list[tuple[Any, int, int | None]] = []
    for link in links:
        fields.append(((link, "state"), NVLINK_STATE_FIELD, link))
        fields += [((link, name), fid, link) for name, fid in NVLINK_COUNTER_FIELDS.items()]
        if link in NVLINK_CRC_DATA_FIELDS:
            fields.append(((link, "crc_data"), NVLINK_CRC_DATA_FIELDS[link], None))
    return tuple(fields)  # shared by every caller through the cache: not to be changed


class Nvml:
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

    # -- the one place pynvml errors are translated --------------------------------------
    def _call(self, name: str, *args: Any, device: int | None = None) -> Any:
        try:
            fn: Callable[..., Any] = getattr(self._lib, name)
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
        out: dict[Any, int | float | NvmlError] = {}
        # The array read as bytes in one pass (nvmlFieldValue_t: the layout every supported release declares),
        # rather than a few hundred attribute reads through the bindings' structure class.
        try:
            raw = bytes(memoryview(values))
        except TypeError:
            raw = b""
        if len(raw) != len(fields) * _FV_SIZE:
            raise NvmlError("nvmlDeviceGetFieldValues", "UNKNOWN", gpu.index,
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
                out[key] = NvmlError("nvmlDeviceGetFieldValues", ERROR_NAMES.get(ret, f"CODE_{ret}"), gpu.index, where)
                continue
            else:
                what = f"{FIELD_NAMES.get(fid, fid)}: value type {kind} not known"
            out[key] = NvmlError("nvmlDeviceGetFieldValues", "UNKNOWN", gpu.index, what)
        return out

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

    def nvlinks(self, gpu: Gpu) -> list[dict[str, Any]]:
        """Every NVLink the GPU has: {"link", "state", "errors": {counter: count}}, read in one field call. A link
        NVML answers NOT_SUPPORTED / INVALID_ARGUMENT for is one the SKU does not have: left out. A counter NVML
        does not offer (NOT_SUPPORTED) is left out of "errors"; one it failed to read is in "unread" with NVML's error
        name (a lost GPU raises).
        The data CRC count of a link without a field of its own (12 and up) is the one count read by its own call;
        where NVML has no field values at all (NOT_SUPPORTED), every value is."""
        every = gpu._links is None or not gpu._links or gpu._link_reads % NVLINK_RELEARN_EVERY == 0
        links = tuple(range(const("NVML_NVLINK_MAX_LINKS"))) if every else gpu._links
        gpu._link_reads += 1
        try:
            got = self.field_values(gpu, _nvlink_fields(links))
        except NvmlError as exc:
            if not exc.not_supported:
                raise
            got = {}  # no field values on this GPU or driver: each value by its own call below
        out = []
        for link in links:
            try:
                state = got[(link, "state")] if got else int(self._dev(gpu, "nvmlDeviceGetNvLinkState", link))
            except NvmlError as exc:
                state = exc
            if isinstance(state, NvmlError):
                # Links a SKU does not have answer NOT_SUPPORTED / INVALID_ARGUMENT: not a fault.
                if state.not_supported or state.code == "INVALID_ARGUMENT":
                    continue
                raise state
            entry: dict[str, Any] = {"link": link, "state": int(state), "errors": {}}
            for name in NVLINK_COUNTERS:
                value: Any = got.get((link, name), _ABSENT)
                if value is _ABSENT:
                    try:
                        value = int(self._dev(gpu, "nvmlDeviceGetNvLinkErrorCounter", link, NVLINK_COUNTERS[name]))
                    except NvmlError as exc:
                        value = exc
                if isinstance(value, NvmlError):
                    if value.gpu_lost:
                        raise value  # the GPU's fact, not one counter's
                    if not value.not_supported:
                        entry.setdefault("unread", {})[name] = value.code
                    continue
                entry["errors"][name] = int(value)
            out.append(entry)
        if every:
            gpu._links = tuple(e["link"] for e in out)
        return out

    def fabric_info(self, gpu: Gpu) -> dict[str, Any]:
        info = GpuFabricInfoV2(version=GPU_FABRIC_INFO_V2)
        self._dev(gpu, "nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info))
        return {
            "cluster_uuid": _uuid_text(bytes(info.clusterUuid)),
            "clique_id": int(info.cliqueId),
            "state": int(info.state),
            "status": int(info.status),
            "health_mask": int(info.healthMask),
        }

    def pcie_link(self, gpu: Gpu) -> dict[str, int]:
        """Current vs maximum PCIe generation and width (max = what GPU and slot both support), and the
        replay counter (link-level retransmissions: a marginal link shows them before it downtrains)."""
        return {
            "gen": int(self._dev(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")),
            "max_gen": int(self._dev(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")),
            "width": int(self._dev(gpu, "nvmlDeviceGetCurrPcieLinkWidth")),
            "max_width": int(self._dev(gpu, "nvmlDeviceGetMaxPcieLinkWidth")),
            "replay": int(self._dev(gpu, "nvmlDeviceGetPcieReplayCounter")),
        }

    def p2p_status(self, gpu: Gpu, peer: Gpu) -> dict[str, str]:
        """NVML's peer-to-peer status from `gpu` to `peer` per capability: "OK" or why not
        (e.g. NOT_SUPPORTED for NVLink on a pair that only reaches over PCIe)."""
        if peer.handle is None:
            raise peer.error or NvmlError("nvmlDeviceGetP2PStatus", "UNKNOWN", peer.index, "no device handle")
        out = {}
        for name, cap in P2P_CAPS.items():
            code = int(self._call("nvmlDeviceGetP2PStatus", gpu.handle, peer.handle, cap, device=gpu.index))
            out[name] = P2P_STATUS_NAMES.get(code, f"CODE_{code}")
        return out

    def p2p_matrix(self, gpu: Gpu) -> dict[str, dict[str, str]]:
        """p2p_status from `gpu` to every other GPU NVML can open, keyed by the peer's index."""
        return {str(peer.index): self.p2p_status(gpu, peer) for peer in self.gpus()
                if peer.index != gpu.index and peer.handle is not None}

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


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


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

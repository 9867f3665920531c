"""nvmlDeviceGetFieldValues served from nvml.json: each field answered from the same record the function that reads
the same counter serves, failing on its own inside a call that succeeds as live. Mixed into RecordedNvml
(agent/sources/nvml/recorded/__init__.py), whose _gpu and _index find the GPU of a handle."""
from __future__ import annotations

import ctypes
from typing import Any

import pynvml
from gpuwarden.agent.sources.nvml.bindings import const
from gpuwarden.agent.sources.nvml.recorded.refusals import c_uint, nvml_error

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


class RecordedFieldValues:
    """RecordedNvml's field values (its _field_answers, _field_arrays and _links_of caches are set by its __init__)."""

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
            field_id, scope = c_uint(field_id, 2), c_uint(scope, 2)
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
            return 0, nvml_error(str(entry["unread"][name])).value  # recorded as NVML failed to read it
        if name not in entry["errors"]:
            return 0, _NOT_SUPPORTED  # a counter NVML did not offer when recorded
        return int(entry["errors"][name]), None

    def _record(self, gpu: dict[str, Any], key: str, call: str) -> Any:
        """gpu[key] for a field that reads what `call` reads: the error nvml.json records for `call` fails the field."""
        errors = gpu.get("errors", {})
        if call in errors:
            raise nvml_error(errors[call])
        if key not in gpu:
            raise KeyError(f"{self._origin}: GPU {gpu.get('index')} has no '{key}' recorded (needed by {call})")
        return gpu[key]

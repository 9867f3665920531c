"""XID events served from nvml.json's "xid_events" through the live library's event-set calls. Unlike live NVML
the list is a backlog: each entry is handed over once per process, and a daemon that persists the subscription's
`events_resume_token` and hands it back at its next start (`events_resume`) is not handed an entry again after a
restart (docs/scenario-format.md). Mixed into RecordedNvml (agent/sources/nvml/recorded/__init__.py)."""
from __future__ import annotations

import ctypes
import json
import time
from dataclasses import field
from typing import Any

import pynvml
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.sources.nvml.recorded.refusals import nvml_error
from gpuwarden.agent.sources.nvml.snapshot import load_snapshot, mtime

EVENT_KEYS = {"gpu", "xid"}  # one entry of nvml.json "xid_events" (docs/scenario-format.md)
_EVENT_POLL_S = 0.02  # how often a waiting recorded event set looks at nvml.json (a sleep, not a spin)


class RecordedEvents:
    """RecordedNvml's event sets (its _sets, _delivered, _path, _view, _stamp and _waiter are set by its __init__)."""

    def nvmlEventSetCreate(self) -> Any:
        self._require_init()
        if "nvmlEventSetCreate" in self._snap.get("errors", {}):
            raise nvml_error(self._snap["errors"]["nvmlEventSetCreate"])
        event_set = EventSet(self._delivered)
        self._sets[ctypes.addressof(event_set.raw)] = event_set
        return ctypes.pointer(event_set.raw)  # pynvml's c_nvmlEventSet_t

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        view = self._events_view()
        self._gpu(handle, "nvmlDeviceRegisterEvents", view.get("gpus", []))  # a GPU lost since start refuses
        event_set = self._event_set(eventSet)
        # A node whose nvml.json has no "xid_events" has no event support; only XID events are ever recorded.
        # NVML registers none of the asked types when it answers NOT_SUPPORTED, and the set stays usable.
        if "xid_events" not in view or int(eventTypes) & ~pynvml.nvmlEventTypeXidCriticalError:
            raise nvml_error("NOT_SUPPORTED")
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
                raise nvml_error(errors["nvmlEventSetWait_v2"])
            gpus = view.get("gpus", [])
            for index in sorted(event_set.gpus):
                gpu_errors = gpus[index].get("errors", {}) if index < len(gpus) else {}
                if "nvmlEventSetWait_v2" in gpu_errors:
                    raise nvml_error(gpu_errors["nvmlEventSetWait_v2"])
                if gpu_errors.get("*") == "GPU_IS_LOST":
                    raise nvml_error("GPU_IS_LOST")  # nvml.h: the wait fails while a GPU of the set is off the bus
            left = deadline - time.monotonic()
            if left <= 0:
                raise nvml_error("TIMEOUT")
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

    def _event_set(self, pointer: Any) -> "EventSet":
        self._require_init()
        address = ctypes.cast(pointer, ctypes.c_void_p).value if isinstance(pointer, pynvml.c_nvmlEventSet_t) else None
        if address not in self._sets:
            raise nvml_error("INVALID_ARGUMENT")  # not a set of ours, or one already freed
        return self._sets[address]

    def _events_view(self) -> dict[str, Any]:
        """nvml.json as it is now (re-read when its mtime moves). A file caught half-written keeps the last good
        view until the next look; a file that stays malformed is reported by every other NVML read of the node."""
        if self._path is not None:
            stamp = mtime(self._path)
            if stamp != self._stamp:
                try:
                    self._view, self._stamp = load_snapshot(self._path), stamp
                except SourceError:
                    pass
        return self._view

    def _next_event(self, event_set: "EventSet", view: dict[str, Any]) -> Any:
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
class EventSet:
    position: int  # index of the next "xid_events" entry to look at
    gpus: set[int] = field(default_factory=set)
    raw: Any = field(default_factory=pynvml.struct_c_nvmlEventSet_t)  # what the returned pointer points at


def _digest(entries: list[Any]) -> str:
    # at use: hashlib (OpenSSL's libcrypto) is +4 ms (python -X importtime) and +3.7 MB RSS to every process that
    # reads a recorded NVML; only a daemon's resume token asks for a digest
    import hashlib

    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:32]

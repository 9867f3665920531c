"""NVML XID events: a subscription on every GPU NVML can register, a second XID source beside the kernel log.

NVML facts this leans on (nvml.h, docs.nvidia.com/deploy/nvml-api group__nvmlEvents):
- nvmlDeviceRegisterEvents is Linux-only; NOT_SUPPORTED registers none of the asked types and the set stays
  usable, so one GPU that refuses does not stop the others. After UNKNOWN the set is undefined and must be freed.
- Only events after registration are delivered: there is no backlog and no cursor (the kernel log has both).
- nvmlEventSetWait_v2 returns TIMEOUT when nothing arrived (not an error) and GPU_IS_LOST while a GPU of the set
  is off the bus, at once and on every wait: the set has to be rebuilt without that GPU.
- nvmlEventData_t carries device, eventType, eventData (the XID), gpuInstanceId, computeInstanceId: no
  timestamp, no process, no message text; the time here is when the wait returned.
- The wait's GPU_IS_LOST does not say which GPU, and registering a GPU that is off the bus may succeed (NVIDIA's
  mock NVML does so): the caller finds the lost GPU by reading it and hands it to `leave_out()`, so the next
  `subscribe()` goes on without it instead of failing every wait again.
"""
from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Any

import pynvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.records import dataclass

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.sources.nvml import Nvml
    from gpuwarden.agent.sources.nvml.gpu import Gpu

XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
_DRAIN_MAX = 256  # events taken in one wait() once the first arrived (a burst is handed over as one batch)


@dataclass(frozen=True)
class NvmlXid:
    """One XID as NVML delivered it. gpu/uuid/pci are None only when NVML's device matches no GPU it listed."""

    gpu: int | None
    uuid: str | None
    pci: str | None  # canonical BDF, "0008:01:00.0", the form the kernel-log XIDs are keyed by
    xid: int
    received_at: float  # wall time the wait returned it (NVML events carry no timestamp)


class XidEvents:
    """An XID event subscription. `available` is False where NVML has no events for any GPU (`reason` says
    why); `unsubscribed` names each GPU that could not be registered and the error it answered."""

    def __init__(self, nvml: "Nvml"):
        self._nvml = nvml
        self._set: Any = None
        self.subscribed: list[Gpu] = []
        self.unsubscribed: dict[int, NvmlError] = {}
        self.reason = ""
        self._by_address: dict[int | None, Gpu] = {}
        self._pending: NvmlError | None = None
        self._left_out: dict[int, NvmlError] = {}  # GPUs known to be off the bus: not registered again

    @property
    def left_out(self) -> dict[int, NvmlError]:
        return dict(self._left_out)

    def leave_out(self, lost: dict[int, NvmlError]) -> None:
        """The GPUs (index -> the error that showed them lost) the next subscribe() leaves out; replaces the last
        set, so a GPU that answers again is taken back."""
        self._left_out = dict(lost)

    def resume(self, token: Any) -> None:
        """Goes on after what an earlier subscription handed over (`token` from resume_token()). Live NVML keeps
        no backlog, so there the token is None and this does nothing; a recorded node's list of events is a
        backlog, and without this a restarted daemon would be handed it again."""
        resume = getattr(self._nvml._lib, "events_resume", None)
        if token is not None and resume is not None and self._set is not None:
            resume(self._set, token)

    def resume_token(self) -> Any:
        """Where this subscription stands, for resume() after a restart; None live (nothing to resume)."""
        token = getattr(self._nvml._lib, "events_resume_token", None)
        return token(self._set) if token is not None and self._set is not None else None

    @property
    def available(self) -> bool:
        return bool(self.subscribed)

    @property
    def closed(self) -> bool:
        return self._set is None

    def subscribe(self) -> "XidEvents":
        """(Re)subscribes every GPU: after a wait error, a set without the GPU that fell off the bus. Raises
        NvmlError when NVML fails as a whole, or when no GPU could be subscribed and not for lack of support."""
        self.close()
        self.subscribed, self.unsubscribed, self.reason, self._pending = [], {}, "", None
        gpus = self._nvml.gpus()
        if not gpus:
            self.reason = "NVML lists no GPU"
            return self
        while True:  # at most once more per GPU: each restart leaves one more GPU out
            try:
                event_set = self._nvml._call("nvmlEventSetCreate")
            except NvmlError as exc:
                if not exc.not_supported:
                    raise
                self.reason = str(exc)
                return self
            self.unsubscribed.update({i: e for i, e in self._left_out.items() if i not in self.unsubscribed})
            if self._register(event_set, [g for g in gpus if g.index not in self.unsubscribed]):
                break
        if not self.subscribed:
            self._free(event_set)
            # A GPU that fell off the bus is a finding of every GPU check already; with the others unsupported, the
            # node has no XID events to watch (not a failure to watch them).
            errors = [e for e in self.unsubscribed.values() if not e.not_supported and not e.gpu_lost]
            if errors:
                raise errors[0]
            self.reason = f"no GPU supports XID events ({next(iter(self.unsubscribed.values()))})"
            return self
        self._set = event_set
        self._by_address = {_address(g.handle): g for g in self.subscribed}
        return self

    def _register(self, event_set: Any, gpus: list["Gpu"]) -> bool:
        """Registers each GPU; False (set freed) when one answered UNKNOWN, after which nvml.h calls the set
        undefined: the caller builds a new one without that GPU."""
        self.subscribed = []
        for gpu in gpus:
            try:
                self._nvml._dev(gpu, "nvmlDeviceRegisterEvents", XID_EVENT, event_set)
            except NvmlError as exc:
                self.unsubscribed[gpu.index] = exc
                if exc.code == "UNKNOWN" and gpu.handle is not None:
                    self._free(event_set)
                    return False
            else:
                self.subscribed.append(gpu)
        return True

    def wait(self, timeout_s: float) -> list[NvmlXid]:
        """XIDs that arrived within `timeout_s` (blocks in NVML, no polling; [] when none did). A burst is
        returned at once. Raises NvmlError naming the call (GPU_IS_LOST: subscribe() again to go on with the others)."""
        if self._set is None:
            raise NvmlError("nvmlEventSetWait_v2", "UNINITIALIZED", None, "the XID subscription is closed")
        if self._pending is not None:
            pending, self._pending = self._pending, None
            raise pending
        out: list[NvmlXid] = []
        timeout_ms = max(0, int(timeout_s * 1000))
        while len(out) < _DRAIN_MAX:
            try:
                data = self._nvml._call("nvmlEventSetWait_v2", self._set, timeout_ms if not out else 0)
            except NvmlError as exc:
                if exc.code == "TIMEOUT":
                    break
                if exc.gpu_lost:
                    exc = NvmlError(exc.call, exc.code, None, "a subscribed GPU is off the bus; subscribe() again")
                if not out:
                    raise exc from None
                self._pending = exc  # hand over what arrived first; the next wait says what went wrong
                break
            if int(data.eventType) & XID_EVENT:
                out.append(self._xid(data))
        return out

    def close(self) -> None:
        if self._set is not None:
            event_set, self._set = self._set, None
            self._free(event_set)

    def __enter__(self) -> "XidEvents":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _free(self, event_set: Any) -> None:
        try:
            self._nvml._call("nvmlEventSetFree", event_set)
        except NvmlError:
            pass  # nothing left to do with a set NVML will not free

    def _xid(self, data: Any) -> NvmlXid:
        gpu = self._by_address.get(_address(data.device))
        if gpu is None:
            # Not one of the handles we registered (should not happen): ask NVML whose it is.
            try:
                uuid = _text(self._nvml._call("nvmlDeviceGetUUID", data.device))
                gpu = next((g for g in self.subscribed if g.uuid == uuid), None)
            except NvmlError:
                gpu = None
        return NvmlXid(gpu.index if gpu else None, gpu.uuid if gpu else None, gpu.pci if gpu else None,
                       int(data.eventData), time.time())


def _address(handle: Any) -> int | None:
    """Handles are compared by the address they hold: pynvml makes a new pointer object for each handle."""
    return ctypes.cast(handle, ctypes.c_void_p).value if handle is not None else None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

"""The RDMA devices' asynchronous events (a port going down or coming up, a LID, P_Key or SM change, a fatal device
error), through libibverbs: what lets the IB port poll sleep while every port is up, instead of reading each port's
state every second (a read of a port's sysfs `state` is an ib_query_port, a query the driver puts to the HCA).

Each device is opened as any verbs program opens it (ibv_open_device), only for its asynchronous event file, which
the kernel makes readable when it queues an event for the device; the events are then read and acknowledged
(ibv_get_async_event, ibv_ack_async_event). Their kinds are not needed: any event means look at the ports now.

The event file's descriptor is a field of libibverbs' `struct ibv_context` (after the device pointer, the 32
pointers of its operations table and the command descriptor: the ABI of libibverbs.so.1 since 2006). It is taken
only after the kernel confirms it: /proc/self/fd names it `anon_inode:[infinibandevent]`. Where there is no
libibverbs, no RDMA device, a device that cannot be opened (the service's device policy, permissions), or a layout
that does not check out, open_port_events raises SourceError saying why, and the poll goes on every second.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

from gpuwarden.agent.core.errors import SourceError

LIBRARY = "libibverbs.so.1"
_EVENT_FILE = "anon_inode:[infinibandevent]"
_POINTER = ctypes.sizeof(ctypes.c_void_p)
# struct ibv_context { struct ibv_device *device; struct ibv_context_ops ops (32 pointers); int cmd_fd;
#                      int async_fd; ... }
_ASYNC_FD_AT = _POINTER * (1 + 32) + ctypes.sizeof(ctypes.c_int)


class _AsyncEvent(ctypes.Structure):
    # struct ibv_async_event { union { cq, qp, srq, wq pointers; int port_num } element; enum event_type; }
    _fields_ = [("element", ctypes.c_void_p), ("event_type", ctypes.c_int)]


_lib: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(LIBRARY, use_errno=True)
        except OSError as exc:
            raise SourceError(f"{LIBRARY} could not be loaded ({exc}): rdma-core's libibverbs is not "
                              "installed") from None
        lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
        lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.ibv_get_device_name.restype = ctypes.c_char_p
        lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
        lib.ibv_open_device.restype = ctypes.c_void_p
        lib.ibv_open_device.argtypes = [ctypes.c_void_p]
        lib.ibv_close_device.argtypes = [ctypes.c_void_p]
        lib.ibv_get_async_event.argtypes = [ctypes.c_void_p, ctypes.POINTER(_AsyncEvent)]
        lib.ibv_ack_async_event.argtypes = [ctypes.POINTER(_AsyncEvent)]
        lib.ibv_ack_async_event.restype = None
        _lib = lib
    return _lib


class PortEvents:
    """The event files of the RDMA devices named at open. `fds()` are readable when an event waits; `drain()` reads
    and acknowledges every waiting event (raising SourceError when a device's file fails: the caller then polls)."""

    def __init__(self, lib: ctypes.CDLL, contexts: dict[str, tuple[int, int]]):
        self._lib = lib
        self._contexts = contexts  # device name -> (struct ibv_context address, its event file's descriptor)
        self._event = _AsyncEvent()

    @property
    def devices(self) -> list[str]:
        return sorted(self._contexts)

    def fds(self) -> list[int]:
        return [fd for _, fd in self._contexts.values()]

    def drain(self) -> int:
        events = 0
        for name, (context, _) in self._contexts.items():
            ctypes.set_errno(0)
            while self._lib.ibv_get_async_event(context, ctypes.byref(self._event)) == 0:
                self._lib.ibv_ack_async_event(ctypes.byref(self._event))
                events += 1
            err = ctypes.get_errno()
            if err not in (0, os.EAGAIN, os.EWOULDBLOCK):
                raise SourceError(f"{name}: reading its events failed: {os.strerror(err)}")
        return events

    def close(self) -> None:
        contexts, self._contexts = self._contexts, {}
        for context, _ in contexts.values():
            self._lib.ibv_close_device(context)


def open_port_events(devices: list[str]) -> PortEvents:
    """The event files of the RDMA devices named (each HCA under /sys/class/infiniband), opened non-blocking."""
    try:
        return _open(devices)
    except (OSError, AttributeError, ValueError) as exc:  # a library without these calls, a descriptor refused
        raise SourceError(f"{LIBRARY}: {type(exc).__name__}: {exc}") from None


def _open(devices: list[str]) -> PortEvents:
    lib = _load()
    count = ctypes.c_int(0)
    listed = lib.ibv_get_device_list(ctypes.byref(count))
    if not listed:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            raise SourceError("this kernel has no RDMA device support (ibv_get_device_list: ENOSYS)")
        raise SourceError(f"ibv_get_device_list failed: {os.strerror(err)}")
    contexts: dict[str, tuple[int, int]] = {}
    events = PortEvents(lib, contexts)
    try:
        found = {(lib.ibv_get_device_name(listed[i]) or b"").decode(errors="replace"): listed[i]
                 for i in range(max(0, count.value))}
        for name in devices:
            if name not in found:
                raise SourceError(f"{name}: not among libibverbs' devices ({', '.join(sorted(found)) or 'none'})")
            context = lib.ibv_open_device(found[name])
            if not context:
                raise SourceError(f"{name}: ibv_open_device failed: {os.strerror(ctypes.get_errno())}")
            fd = ctypes.c_int.from_address(context + _ASYNC_FD_AT).value
            contexts[name] = (context, fd)
            try:
                what = os.readlink(f"/proc/self/fd/{fd}")
            except OSError as exc:
                raise SourceError(f"{name}: its event file could not be confirmed ({exc.strerror})") from None
            if what != _EVENT_FILE:
                raise SourceError(f"{name}: the context's event file is not where this libibverbs is known to keep "
                                  f"it (descriptor {fd} is {what[:60]!r})")
            os.set_blocking(fd, False)
    except BaseException:
        events.close()
        raise
    finally:
        lib.ibv_free_device_list(listed)
    if not contexts:
        raise SourceError("no RDMA device to watch")
    return events


class WatchedFolders:
    """A recorded node's stand-in for the devices' events: its port folders watched (inotify), so that a test or a
    replay that writes a port's `state` is an event, as a port going down is one live."""

    def __init__(self, watch: Any):
        self._watch = watch  # an inotify DirWatch (agent/sources/inotify.py)

    def fds(self) -> list[int]:
        return [self._watch.fd] if self._watch.fd >= 0 else []

    def drain(self) -> int:
        self._watch.drain()
        return 0

    def close(self) -> None:
        self._watch.close()

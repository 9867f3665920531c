"""The daemon's device-event loop (a mixin of agent.daemon.Daemon): a GPU that falls off the bus or an HCA that goes
away is a udev `remove` the moment the kernel drops it (agent/sources/udev.py); the polls that read such a device are
woken at once instead of at their next tick. Only a wake-up: the checks still decide from what they read.
"""
from __future__ import annotations

import select

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.sources.udev import UdevEvent

log = logs.get_logger("gpuwarden.daemon")
DEVICE_LOOP = "udev"
IDLE_S = 60.0  # the loop's longest sleep: its heartbeat (and a look where no descriptor can be watched)
NO_FD_LOOK_S = 1.0  # a monitor without a descriptor (a recorded node without inotify) is looked at this often
ACTIONS = frozenset({"add", "remove", "bind", "unbind", "online", "offline"})  # a device came or went


def polls_to_wake(event: UdevEvent, passive: list[str]) -> list[str]:
    """Which polls read the device of `event`: an RDMA device or netdev is the IB ports' poll; a PCI device may be
    a GPU (every NVML poll) or an HCA (the IB ports) or a link under AER watch, so every poll looks again."""
    if event.action not in ACTIONS:
        return []
    if event.subsystem in ("infiniband", "net"):
        return [name for name in passive if name == "ib_port"]
    return list(passive)


class DeviceLoop:
    """Needs from the daemon: node, passive, stop_event, _stop_r, wake(), _beat(), _beat_off() and _fail_loop()."""

    def _device_loop(self) -> None:
        try:
            monitor = self.node.udev_monitor()
        except GpuwardenError as exc:
            log.info("no device events; the polls alone see devices come and go", reason=str(exc))
            return
        names = [spec.name for spec in self.passive]
        try:
            while not self.stop_event.is_set():
                fd = monitor.fileno()
                wait = IDLE_S if fd is not None else NO_FD_LOOK_S
                self._beat(DEVICE_LOOP, wait)
                select.select([self._stop_r] + ([fd] if fd is not None else []), [], [], wait)
                if self.stop_event.is_set():
                    break
                try:
                    events = monitor.poll()
                except Exception as exc:  # noqa: BLE001 - no loop dies; the polls still look at their pace
                    self._fail_loop(DEVICE_LOOP, None, exc)
                    select.select([self._stop_r], [], [], NO_FD_LOOK_S)  # a monitor that keeps failing is not spun
                    continue
                wake = sorted({name for event in events for name in polls_to_wake(event, names)})
                if wake:
                    log.info("device event", events=[f"{e.action} {e.subsystem} {e.name}" for e in events[:10]],
                             woken=wake)
                    self.wake(wake)
        finally:
            self._beat_off(DEVICE_LOOP)
            monitor.close()

"""sd_notify without libsystemd: one datagram per message to $NOTIFY_SOCKET (the socket protocol of
sd_notify(3)). READY=1 once the daemon runs, STATUS= for `systemctl status`, WATCHDOG=1 within WatchdogSec."""
from __future__ import annotations

import ctypes
import os
import socket


def notify(message: str) -> bool:
    """Send one notification; False when not started by systemd (no NOTIFY_SOCKET) or the send failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC (as systemd recommends), or None when the watchdog is off or meant for another pid."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None


def name_this_thread(name: str) -> None:
    """Give the calling thread a kernel name (/proc/<pid>/task/<tid>/comm, `top -H`, `ps -L`): CPython does not,
    so an operator (and bench/daemon.py's per-thread breakdown) could not tell the agent's threads apart.
    The kernel keeps 15 bytes. Best effort: nothing happens where prctl is not there."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass

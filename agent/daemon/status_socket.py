"""What only the running daemon's memory knows of its state store, told to `gpuwarden status`: whether its writes
succeed, since when, and why not. The daemon answers on a Unix socket in its state folder (`gpuwarden.sock`, made at
start while the disk still takes it); asking and answering write nothing, so the answer comes when the disk is full,
the file system read-only or the database locked, when no file beside the store could be written (a file written
beforehand and rewritten in place still needs blocks on a copy-on-write file system, and is read half-written).
"""
from __future__ import annotations

import json
import os
import select
import socket
import threading
from pathlib import Path
from typing import Any, Callable

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.render import iso_utc, when

SOCKET_NAME = "gpuwarden.sock"
ASK_TIMEOUT_S = 2.0  # a daemon answers from memory at once; one that does not within this is said to not answer
_MAX_ANSWER = 1 << 16
_SUN_PATH = 100  # sockaddr_un holds 108 bytes; a longer folder is reached through its descriptor (/proc/self/fd)
log = logs.get_logger("gpuwarden.daemon")


class StatusSocket:
    """The daemon's side: answers each connection with one JSON line, `answer()` (which reads memory only)."""

    def __init__(self, folder: Path, answer: Callable[[], dict[str, Any]]):
        self.folder, self._answer = Path(folder), answer
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Binds the socket (the caller holds the state folder's lock: a socket left there is a dead daemon's)."""
        self._sock = self._bind()
        self._thread = threading.Thread(target=self._serve, name="status-socket", daemon=True)
        self._thread.start()

    def rebind(self) -> None:
        """The socket again, in a state folder recreated under the daemon (the old one went with the folder)."""
        fresh = self._bind()
        with self._lock:
            old, self._sock = self._sock, fresh
        if old is not None:
            old.close()
        os.write(self._wake_w, b"x")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sock, self._sock = self._sock, None
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        if sock is not None:
            sock.close()
            try:
                os.unlink(self.folder / SOCKET_NAME)
            except OSError:
                pass
        if self._thread is None or not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            try:
                os.unlink(self.folder / SOCKET_NAME)
            except FileNotFoundError:
                pass
            with _address(self.folder) as where:
                sock.bind(where)
            os.chmod(self.folder / SOCKET_NAME, 0o600)
            sock.listen(8)
        except OSError:
            sock.close()
            raise
        return sock

    def _serve(self) -> None:
        while True:
            with self._lock:
                sock, stopped = self._sock, self._stopped
            if stopped or sock is None:
                return
            try:
                ready = select.select([sock, self._wake_r], [], [])[0]
            except (OSError, ValueError):  # the socket was closed by rebind(): take the new one
                continue
            if self._wake_r in ready:
                os.read(self._wake_r, 64)
                continue
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(json.dumps(self._answer()).encode() + b"\n")
                except Exception as exc:  # noqa: BLE001 - a reader that went away, or a bug: never end the thread
                    log.debug("status socket: answer not sent", error=f"{type(exc).__name__}: {exc}")


def ask(folder: Path, timeout_s: float = ASK_TIMEOUT_S) -> tuple[dict[str, Any] | None, str | None]:
    """The running daemon's answer, or (None, None) when no daemon runs on `folder` (no socket, nobody listening),
    or (None, why) when one is there but its answer could not be had."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        try:
            with _address(folder) as where:
                sock.connect(where)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return None, None
        data = b""
        while b"\n" not in data and len(data) < _MAX_ANSWER:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        return None, f"{folder / SOCKET_NAME}: {exc.strerror or exc or type(exc).__name__}"
    finally:
        sock.close()
    try:
        answer = json.loads(data.decode())
    except ValueError:
        return None, f"{folder / SOCKET_NAME}: the answer is not JSON: {data[:80]!r}"
    if not isinstance(answer, dict) or not isinstance(answer.get("store"), dict):
        return None, f"{folder / SOCKET_NAME}: the answer says nothing of the store: {data[:80]!r}"
    return answer, None


def store_writes(folder: Path, now: float) -> tuple[dict[str, Any] | None, str, bool]:
    """For `status`: what the running daemon says of its store's writes, as JSON (None: no daemon runs), as the text
    to show first, and whether it is a failure or could not be asked (status then exits 2: the state shown is not
    known to be the daemon's)."""
    answer, problem = ask(folder)
    if problem is not None:
        return ({"ok": None, "error": f"could not ask the running daemon: {problem}"},
                f"state store: could not ask the running daemon whether its writes succeed: {problem}\n\n", True)
    if answer is None:
        return None, "", False
    store = answer["store"]
    since = store.get("since")
    view = {"ok": store.get("ok") is True, "error": store.get("error"), "since": since, "since_utc": iso_utc(since),
            "failed_writes": store.get("failed_writes"), "pid": answer.get("pid")}
    if view["ok"]:
        return view, "", False
    return view, (f"state store: FAILING since {when(since, now)}: {view['error']} ({view['failed_writes']} failed "
                  "write(s), retried with a backoff; detection goes on in the daemon's memory: what follows is the "
                  "state as last written)\n\n"), True


class _address:
    """The socket's address for bind/connect: its path, or (a folder path too long for sockaddr_un) the same file
    reached through a descriptor of the folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._fd: int | None = None

    def __enter__(self) -> str:
        path = str(self.folder / SOCKET_NAME)
        if len(os.fsencode(path)) <= _SUN_PATH:
            return path
        self._fd = os.open(self.folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self._fd}/{SOCKET_NAME}"

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)

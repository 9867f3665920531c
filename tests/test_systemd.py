"""systemd integration: the unit file is valid, and sd_notify speaks the socket protocol to a real datagram
socket the test owns."""
import os
import shutil
import socket
import subprocess

import pytest

from conftest import ROOT
from gpuwarden.agent import systemd


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_verifies(tmp_path):
    unit = tmp_path / "gpuwarden.service"
    # ExecStart must exist for verify; the installed console script may live elsewhere on a test machine.
    unit.write_text((ROOT / "systemd/gpuwarden.service").read_text().replace("/usr/bin/gpuwarden", "/bin/true"))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_notify_sends_datagrams_to_notify_socket(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert systemd.notify("READY=1\nSTATUS=watching")
        assert server.recv(4096) == b"READY=1\nSTATUS=watching"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert systemd.notify("READY=1") is False  # not under systemd: a no-op, not an error


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert systemd.watchdog_interval_s() is None

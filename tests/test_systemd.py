"""systemd integration: the units verify with nothing on stderr (the sweep's service and timer too);
`systemd-analyze security --offline=true` rates the daemon and the preflight at most 3.0, every item still exposed
justified in a comment of the unit; sd_notify speaks the socket protocol to a real datagram socket the test owns."""
import json
import os
import shutil
import socket
import subprocess

import pytest
from conftest import ROOT
from gpuwarden.agent.sources import systemd

UNITS = ("gpuwarden.service", "gpuwarden-preflight.service", "gpuwarden.slice", "gpuwarden-sweep.service",
         "gpuwarden-sweep.timer")
MAX_EXPOSURE = 3.0
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _units_with_program(folder):
    """The shipped units, ExecStart's program swapped for one that exists: verify checks that it does, and the
    installed console script may live elsewhere (or nowhere) on a test machine."""
    for name in UNITS:
        text = (ROOT / "systemd" / name).read_text()
        (folder / name).write_text(text.replace("/usr/bin/gpuwarden", "/bin/true"))
    return [str(folder / name) for name in UNITS]


def _analyze(*args, cwd):
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@needs_analyze
def test_units_verify_with_nothing_on_stderr(tmp_path):
    proc = _analyze("verify", *_units_with_program(tmp_path), cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, "")


def _exposure_items(unit_path, cwd):
    """systemd-analyze security --offline=true (systemd >= 250): (overall exposure, the items that still
    expose something, by name)."""
    text = _analyze("security", "--offline=true", "--no-pager", unit_path, cwd=cwd)
    assert text.returncode == 0, text.stderr
    overall = None
    for line in text.stdout.splitlines():
        if line.startswith("\u2192 Overall exposure level for "):
            overall = float(line.rsplit(":", 1)[1].split()[0])
    proc = _analyze("security", "--offline=true", "--json=short", unit_path, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    exposed = [item["name"] for item in json.loads(proc.stdout) if float(item.get("exposure") or 0) > 0]
    return overall, exposed


def _comment_text(name):
    return "\n".join(line for line in (ROOT / "systemd" / name).read_text().splitlines() if line.startswith("#"))


def _needle(item):
    """What a comment of the unit names for an exposure item: "CapabilityBoundingSet=~CAP_SYSLOG" -> CAP_SYSLOG,
    "RestrictAddressFamilies=~AF_(INET|INET6)" -> AF_INET, "User=/DynamicUser=" -> User=, "ProtectProc=" itself."""
    if "=~" in item:
        return item.split("=~", 1)[1].split("(")[0] + ("INET" if item.endswith("(INET|INET6)") else "")
    return item.split("/", 1)[0]


@needs_analyze
@pytest.mark.parametrize("name", ["gpuwarden.service", "gpuwarden-preflight.service"])
def test_exposure_is_low_and_each_remaining_item_is_justified(tmp_path, name):
    _units_with_program(tmp_path)
    overall, exposed = _exposure_items(str(tmp_path / name), tmp_path)
    assert overall is not None and overall <= MAX_EXPOSURE, (overall, exposed)
    comments = _comment_text(name if name == "gpuwarden.service" else "gpuwarden.service") + _comment_text(name)
    unexplained = [item for item in exposed if _needle(item) not in comments]
    assert not unexplained, f"exposures without a comment saying why: {unexplained}"
    assert "User=" in [_needle(i) for i in exposed]  # the review ran and saw the unit (root is the one known)


@needs_analyze
def test_exposure_parse_sees_an_unhardened_unit(tmp_path):
    """The parse is not vacuous: a bare service is far above the limit."""
    (tmp_path / "bare.service").write_text("[Service]\nExecStart=/bin/true\n")
    overall, exposed = _exposure_items(str(tmp_path / "bare.service"), tmp_path)
    assert overall > 9.0 and "PrivateNetwork=" in exposed


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

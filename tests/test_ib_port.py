"""ib_port on a real sysfs capture (gpud's H100 node, files without trailing newline) and on edits of it."""
import shutil
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.checks import ib_port

CAPTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs" / "gpud-h100"
POLICY = dict(ib_port.CHECK.defaults)


class SysfsNode:
    """The one attribute ib_port reads from a node."""

    def __init__(self, root):
        self.sysfs = Sysfs(root)


@pytest.fixture
def capture(tmp_path):
    dst = tmp_path / "node"
    shutil.copytree(CAPTURE, dst)
    return dst


def port_file(root, hca, name):
    return root / "sys/class/infiniband" / hca / "ports/1" / name


def test_real_capture_reads_every_port_and_is_healthy(capture):
    ports, unreadable = ib_port.read_ports(Sysfs(capture))
    assert not unreadable
    assert [p.port for p in ports] == ["mlx5_0/1", "mlx5_1/1", "mlx5_4/1", "mlx5_5/1", "mlx5_6/1", "mlx5_7/1",
                                       "mlx5_8/1", "mlx5_9/1", "mlx5_bond_0/1"]
    by = {p.port: p for p in ports}
    assert by["mlx5_0/1"].rate_gbps == 400.0 and by["mlx5_0/1"].state == "ACTIVE"
    assert by["mlx5_bond_0/1"].link_layer == "Ethernet" and by["mlx5_bond_0/1"].rate_gbps == 200.0
    assert by["mlx5_1/1"].link_downed == 255  # saturated 8-bit PMA counter, as captured
    # The RoCE bond runs 200 Gb/s but is judged against Ethernet ports only, not the 400G IB rails.
    assert list(ib_port.run(SysfsNode(capture), POLICY)) == []


def test_down_port_is_a_fail_with_drain(capture):
    port_file(capture, "mlx5_5", "state").write_text("1: DOWN\n")
    port_file(capture, "mlx5_5", "phys_state").write_text("3: Disabled\n")
    (f,) = list(ib_port.run(SysfsNode(capture), POLICY))
    assert (f.code, f.entity.id, f.status, f.action) == ("ib-port-down", "mlx5_5/1", Status.FAIL, Action.DRAIN)
    assert f.evidence["phys_state"] == "Disabled" and f.evidence["state"] == "DOWN"


def test_slow_port_against_inferred_and_configured_rate(capture):
    port_file(capture, "mlx5_7", "rate").write_text("200 Gb/sec (4X HDR)\n")
    (f,) = list(ib_port.run(SysfsNode(capture), POLICY))
    assert f.code == "ib-port-slow" and f.entity.id == "mlx5_7/1" and f.evidence["expected_rate_gbps"] == 400.0
    # A configured expectation applies to every port, the RoCE bond included.
    found = list(ib_port.run(SysfsNode(capture), {**POLICY, "expected_rate_gbps": 400.0}))
    assert sorted(x.entity.id for x in found) == ["mlx5_7/1", "mlx5_bond_0/1"]
    # ...unless the operator says the bond is not a rail.
    found = list(ib_port.run(SysfsNode(capture), {**POLICY, "expected_rate_gbps": 400.0,
                                                  "ignore_ports": ["mlx5_bond_0/1"]}))
    assert [x.entity.id for x in found] == ["mlx5_7/1"]


def test_unreadable_port_is_unknown_not_healthy(capture):
    port_file(capture, "mlx5_9", "state").unlink()
    (f,) = list(ib_port.run(SysfsNode(capture), POLICY))
    assert f.status is Status.UNKNOWN and f.code == "ib-port-unreadable" and "mlx5_9/ports/1/state" in f.message


def test_no_hca_is_not_applicable(tmp_path):
    with pytest.raises(NotApplicable, match="no InfiniBand"):
        list(ib_port.run(SysfsNode(tmp_path), POLICY))


@pytest.mark.parametrize("text, gbps", [("400 Gb/sec (4X NDR)", 400.0), ("200 Gb/sec (2X NDR)", 200.0),
                                        ("2.5 Gb/sec (1X SDR)", 2.5), ("garbage", None), ("", None)])
def test_parse_rate(text, gbps):
    assert ib_port.parse_rate(text) == gbps


@pytest.mark.parametrize("garbage", ["", "garbage", "4: BOGUS", "2: ACTIVE", "4: UNKNOWN", "4444: ACTIVE", "4:",
                                     "\u0664: ACTIVE"])
def test_state_that_is_not_a_port_state_is_unknown_not_a_down_port(capture, garbage):
    port_file(capture, "mlx5_5", "state").write_text(garbage)
    (f,) = list(ib_port.run(SysfsNode(capture), POLICY))
    assert (f.code, f.entity.id, f.status, f.action) == ("ib-port-unreadable", "mlx5_5/1", Status.UNKNOWN, Action.NONE)
    assert "not a port state" in f.message


@pytest.mark.parametrize("rate", ["fast", "", "1.2.3 Gb/sec", "9" * 400 + " Gb/sec", "400 Gb/secX"])
def test_rate_that_is_not_a_rate_is_unknown_for_that_port(capture, rate):
    port_file(capture, "mlx5_7", "rate").write_text(rate)
    found = list(ib_port.run(SysfsNode(capture), POLICY))
    assert [(f.code, f.entity.id, f.status) for f in found] == [("ib-port-rate-unreadable", "mlx5_7/1",
                                                                  Status.UNKNOWN)]


def test_a_down_port_with_a_garbage_rate_is_still_down(capture):
    port_file(capture, "mlx5_5", "state").write_text("1: DOWN\n")
    port_file(capture, "mlx5_5", "rate").write_text("fast\n")
    (f,) = list(ib_port.run(SysfsNode(capture), POLICY))
    assert (f.code, f.status) == ("ib-port-down", Status.FAIL)


@pytest.mark.parametrize("text, state", [("4: ACTIVE", "ACTIVE"), ("1: DOWN\n", "DOWN"), ("ACTIVE", "ACTIVE"),
                                         ("5: ACTIVE_DEFER", "ACTIVE_DEFER"), ("0: NOP", "NOP"), ("", None)])
def test_parse_state(text, state):
    assert ib_port.parse_state(text) == state

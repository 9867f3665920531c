"""ib_downtime driven through time on a recorded H100 node (real sysfs IB files from gpud's capture): the port
state is edited between steps, `now` advances one poll at a time, and the state goes through JSON every step."""
import json
import re
import shutil

import pytest
from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import step
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import ib_downtime

SPEC = ib_downtime.SPEC
T0 = 1_700_000_000.0
PORT = "mlx5_5/1"


class Clock:
    """Steps the check like the daemon: one sample and judgement per tick, state persisted as JSON in between."""

    def __init__(self, root, **cfg):
        self.root, self.node = root, Node.recorded_at(root)
        # Most tests here are about downtime accounting: they judge "down now" at NCCL's 7 s, where the
        # window rules get room to show; test_default_fails_a_down_port_within_two_polls covers the default.
        self.cfg = {**SPEC.defaults, "down_fail_s": 7.0, **cfg}
        self.state: dict = {}
        self.now = T0 - ib_downtime.INTERVAL_S  # the first tick is at T0
        self.j = None

    def tick(self, to: float | None = None):
        self.now = self.now + ib_downtime.INTERVAL_S if to is None else to
        self.j = step(SPEC, self.node, self.cfg, self.state, self.now)
        self.state = json.loads(json.dumps(self.j.state))  # what the daemon stores and reads back
        return self.j

    def restart(self):
        """A new process: a new Node over the same files, the state as read back from the store."""
        self.node = Node.recorded_at(self.root)

    def findings(self, port=PORT):
        return [f for f in self.j.findings if f.entity.id == port]

    def metric(self, name, port=PORT):
        (m,) = [m for m in self.j.metrics if m.name == name and m.labels["port"] == port]
        return m.value

    def set_port(self, state="ACTIVE", phys=None, downed=None, port=PORT):
        hca, num = port.split("/")
        base = self.root / "sys/class/infiniband" / hca / "ports" / num
        code = {"ACTIVE": "4", "DOWN": "1", "INIT": "2"}[state]
        (base / "state").write_text(f"{code}: {state}\n")
        (base / "phys_state").write_text((phys or ("5: LinkUp" if state == "ACTIVE" else "2: Polling")) + "\n")
        if downed is not None:
            (base / "counters/link_downed").write_text(f"{downed}\n")


@pytest.fixture
def clock(scenario_copy):
    return lambda **cfg: Clock(scenario_copy("h100-hgx-healthy"), **cfg)


def test_healthy_node_has_no_findings_and_exports_every_port(clock):
    c = clock()
    for _ in range(3):
        c.tick()
    assert c.j.findings == ()
    ports = {m.labels["port"] for m in c.j.metrics}
    assert ports == {"mlx5_0/1", "mlx5_1/1", "mlx5_4/1", "mlx5_5/1", "mlx5_6/1", "mlx5_7/1", "mlx5_8/1",
                     "mlx5_9/1", "mlx5_bond_0/1"}
    assert c.metric("gpuwarden_ib_port_up") == 1.0 and c.metric("gpuwarden_ib_port_down_seconds") == 0.0
    # mlx5_1's counter is saturated as captured: exported as is, and no flap is invented from it.
    assert c.metric("gpuwarden_ib_port_link_downed", "mlx5_1/1") == 255.0
    assert c.metric("gpuwarden_ib_port_flaps_in_window", "mlx5_1/1") == 0.0
    for m in c.j.metrics:
        assert re.fullmatch(r"gpuwarden_[a-z_]+", m.name) and not m.name.endswith("_total") and m.kind == "gauge"
        assert m.help.endswith(".") and set(m.labels) == {"port"}


def test_three_second_outage_is_charged_three_seconds_and_warns_only_above_its_threshold(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN", downed=1)
    for _ in range(3):
        c.tick()  # seen down at T0+1, +2, +3
    assert c.metric("gpuwarden_ib_port_up") == 0.0 and c.metric("gpuwarden_ib_port_down_seconds") == 2.0
    assert c.findings() == []  # 2 s < window_warn_s 5 s, and far from down_fail_s
    c.set_port("ACTIVE")
    c.tick()  # up again at T0+4: the outage ran from the first sample that saw it to the first that did not
    assert c.metric("gpuwarden_ib_port_down_seconds") == 3.0 and c.metric("gpuwarden_ib_port_flaps_in_window") == 1
    assert c.findings() == []
    c.cfg["window_warn_s"] = 3.0
    c.tick()
    (f,) = c.findings()
    assert (f.code, f.status, f.action) == ("ib-port-flapping", Status.WARN, Action.MONITOR)
    assert f.evidence["down_s_in_window"] == 3.0 and f.evidence["flaps_in_window"] == 1
    assert f.evidence["window_s"] == 3600.0 and f.evidence["link_downed"] == 1
    c.cfg["window_fail_s"] = 3.0
    (f,) = [x for x in c.tick().findings if x.entity.id == PORT]
    assert (f.code, f.status, f.action) == ("ib-port-flapping", Status.FAIL, Action.DRAIN)


def test_flap_between_polls_is_seen_through_link_downed(clock):
    c = clock()
    c.tick()
    c.set_port("ACTIVE", downed=1)  # ACTIVE at both polls, but the link went down and up in between
    c.tick()
    assert c.metric("gpuwarden_ib_port_flaps_in_window") == 1.0
    assert c.metric("gpuwarden_ib_port_down_seconds") == SPEC.defaults["flap_charge_s"]
    c.set_port("ACTIVE", downed=4)  # three more in one interval: 3 x 0.5 s, but never more than the 1 s elapsed
    c.tick()
    assert c.metric("gpuwarden_ib_port_flaps_in_window") == 4.0
    assert c.metric("gpuwarden_ib_port_down_seconds") == 1.5
    assert c.findings() == []
    # Flapping is judged by the downtime it adds up to: 12 flaps a second for a few seconds crosses the warning.
    for n in range(5):
        c.set_port("ACTIVE", downed=10 + 12 * n)
        c.tick()
    (f,) = c.findings()
    assert f.code == "ib-port-flapping" and f.status is Status.WARN and f.evidence["flaps_in_window"] == 58
    assert f.evidence["down_s_in_window"] == 6.5


def test_down_transition_increment_is_not_a_second_flap(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN", downed=1)
    c.tick()
    c.set_port("ACTIVE", downed=1)
    c.tick()
    assert c.metric("gpuwarden_ib_port_flaps_in_window") == 1.0 and c.metric("gpuwarden_ib_port_down_seconds") == 1.0


def test_long_outage_fails_at_the_sample_that_crosses_the_nccl_timeout(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN", downed=1)
    seen = []
    for _ in range(9):
        c.tick()
        seen.append((c.now - T0, [(f.code, f.status) for f in c.findings()]))
    # Seen down from T0+1. Cumulative 5 s warns at T0+6; 7 s down fails at T0+8, the first sample at 7 s.
    assert seen[:4] == [(1.0, []), (2.0, []), (3.0, []), (4.0, [])]
    assert seen[5] == (6.0, [("ib-port-flapping", Status.WARN)])
    assert seen[6] == (7.0, [("ib-port-flapping", Status.WARN)])
    assert seen[7] == (8.0, [("ib-port-down", Status.FAIL)])
    (f,) = c.findings()
    assert f.action is Action.DRAIN and f.evidence["down_for_s"] == 8.0 and f.evidence["state"] == "DOWN"
    assert f.entity.pci == "0000:5e:00.0"
    # A faster NCCL timeout is a config key away.
    c.cfg["down_fail_s"] = 4.0
    assert [f.code for f in c.tick().findings if f.entity.id == PORT] == ["ib-port-down"]


def test_default_fails_a_down_port_within_two_polls(clock):
    c = clock(down_fail_s=SPEC.defaults["down_fail_s"])
    c.tick()
    c.set_port("DOWN", downed=1)
    c.tick()  # first seen down: one sample may be a glitch
    assert c.findings() == []
    c.tick()
    c.tick()
    (f,) = c.findings()  # 2 s after it was first seen: the scheduler hears long before NCCL's ~7 s timeout
    assert (f.code, f.status, f.action) == ("ib-port-down", Status.FAIL, Action.DRAIN)
    assert f.evidence["down_for_s"] == 2.0


def test_restart_mid_outage_keeps_the_outage_start(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN")
    for _ in range(4):
        c.tick()  # down since T0+1
    c.restart()  # the process dies; the state comes back from the store
    c.tick(to=T0 + 6)
    assert [f.code for f in c.findings()] == ["ib-port-flapping"]  # 5 s so far
    c.tick(to=T0 + 8)
    (f,) = c.findings()
    assert f.code == "ib-port-down" and f.evidence["down_for_s"] == 7.0


def test_outage_ending_across_an_unwatched_gap_is_not_charged_for_the_gap(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN")
    c.tick()  # down at T0+1
    c.set_port("ACTIVE")
    c.tick(to=T0 + 600)  # the daemon was stopped for ten minutes
    assert c.metric("gpuwarden_ib_port_down_seconds") == ib_downtime.MAX_GAP_S


def test_counter_saturation_and_reset_invent_nothing(clock):
    c = clock()
    c.set_port("ACTIVE", downed=255)
    c.tick()
    c.tick()
    (f,) = [m for m in c.j.metrics if m.name == "gpuwarden_ib_port_link_downed" and m.labels["port"] == PORT]
    assert f.value == 255.0
    c.set_port("ACTIVE", downed=0)  # cleared (perfquery -R, driver reload): not 1 flap, not 255
    c.tick()
    assert c.metric("gpuwarden_ib_port_flaps_in_window") == 0.0 and c.metric("gpuwarden_ib_port_down_seconds") == 0
    assert c.state["ports"][PORT]["resets"] == 1
    c.set_port("ACTIVE", downed=1)  # counting again from the new baseline
    c.tick()
    assert c.metric("gpuwarden_ib_port_flaps_in_window") == 1.0


def test_driver_reload_port_missing_then_back_with_a_reset_counter(clock):
    c = clock()
    hca = c.root / "sys/class/infiniband/mlx5_5"
    saved = c.root / "mlx5_5.saved"
    c.set_port("ACTIVE", downed=7)
    c.tick()
    shutil.move(hca, saved)  # the HCA leaves sysfs
    for _ in range(3):
        c.tick()
    assert c.metric("gpuwarden_ib_port_up") == 0.0 and c.findings() == []
    assert c.metric("gpuwarden_ib_port_link_downed") == 7.0  # last known value
    shutil.move(saved, hca)
    c.set_port("ACTIVE", downed=0)
    c.tick()
    assert c.metric("gpuwarden_ib_port_down_seconds") == 3.0 and c.metric("gpuwarden_ib_port_flaps_in_window") == 1
    assert c.state["ports"][PORT]["resets"] == 1


def test_hca_gone_for_good_fails_as_missing(clock):
    c = clock()
    c.tick()
    shutil.rmtree(c.root / "sys/class/infiniband/mlx5_5")
    for _ in range(8):  # gone from T0+1; 7 s at T0+8
        c.tick()
    (f,) = c.findings()
    assert (f.code, f.status, f.action) == ("ib-port-missing", Status.FAIL, Action.DRAIN)
    assert f.evidence["state"] == "MISSING" and f.entity.pci == "0000:5e:00.0"
    c.cfg["ignore_ports"] = [PORT]  # removed on purpose: the operator says so, and it is forgotten
    c.tick()
    assert c.findings() == [] and PORT not in c.state["ports"]


def test_downtime_ages_out_of_the_window(clock):
    c = clock(window_s=600.0)
    c.tick()
    c.set_port("DOWN")
    for _ in range(40):
        c.tick()  # down from T0+1 to T0+41 (40 s)
    c.set_port("ACTIVE")
    c.tick()
    (f,) = c.findings()
    assert f.code == "ib-port-flapping" and f.status is Status.FAIL and f.evidence["down_s_in_window"] == 40.0
    c.tick(to=T0 + 1 + 600 + 20)  # half of the outage has left the 600 s window
    (f,) = c.findings()
    assert f.status is Status.WARN and f.evidence["down_s_in_window"] == 20.0
    c.tick(to=T0 + 600 + 40)
    assert c.findings() == [] and c.metric("gpuwarden_ib_port_down_seconds") == 1.0
    c.tick(to=T0 + 2000)
    assert c.metric("gpuwarden_ib_port_down_seconds") == 0.0 and c.state["ports"][PORT]["intervals"] == []


def test_state_stays_bounded_under_endless_flapping(clock):
    c = clock()
    c.tick()
    for n in range(1, 301):
        c.set_port("ACTIVE", downed=n % 250)  # wraps through resets too
        c.tick()
    intervals = c.state["ports"][PORT]["intervals"]
    assert len(intervals) <= ib_downtime.MAX_INTERVALS
    down, flaps = ib_downtime.window_totals(c.state["ports"][PORT], c.now, 3600.0)
    assert flaps == 299 and down == pytest.approx(149.5)  # every flap but the reset one, 0.5 s each, none lost


def test_ignored_port_down_is_nothing(clock):
    c = clock(ignore_ports=[PORT])
    c.tick()
    c.set_port("DOWN")
    for _ in range(10):
        c.tick()
    assert c.j.findings == () and PORT not in c.state["ports"]
    assert not [m for m in c.j.metrics if m.labels["port"] == PORT]


def test_unreadable_port_is_unknown_and_its_state_kept(clock):
    c = clock()
    c.tick()
    c.set_port("DOWN")
    c.tick()
    before = c.state["ports"][PORT]
    (c.root / "sys/class/infiniband/mlx5_5/ports/1/state").unlink()
    c.tick()
    (f,) = c.findings()
    assert f.check == "ib_port" and f.code == "ib-port-unreadable" and f.status is Status.UNKNOWN
    assert c.state["ports"][PORT] == before


def test_no_infiniband_is_not_applicable(tmp_path):
    root = tmp_path / "node"
    root.mkdir()
    (root / "node.toml").write_text('hostname = "n1"\n')
    with pytest.raises(NotApplicable, match="no InfiniBand"):
        step(SPEC, Node.recorded_at(root), dict(SPEC.defaults), {}, T0)


@pytest.mark.parametrize("garbage", ["", "\n", "garbage", "1: ACTIVE", "4: UNKNOWN", "9: DOWN", "\x00\x00"])
def test_a_state_file_that_cannot_be_read_as_a_state_is_unknown_not_down(clock, garbage):
    """Bytes that are not a port state cannot tell up from down: never an outage (a drain), UNKNOWN, the port's
    accounting untouched."""
    c = clock(down_fail_s=2.0)
    c.tick()
    before = c.state["ports"][PORT]
    (c.root / "sys/class/infiniband/mlx5_5/ports/1/state").write_text(garbage)
    for _ in range(5):
        c.tick()
    (f,) = c.findings()
    assert (f.check, f.code, f.status) == ("ib_port", "ib-port-unreadable", Status.UNKNOWN)
    assert "not a port state" in f.message
    assert c.state["ports"][PORT]["up"] and c.state["ports"][PORT]["intervals"] == before["intervals"]

"""pcie_aer driven through time on a recorded H100 node (aer_dev_* in the kernel's short-name format, all 0): counters
edited between steps, `now` advancing, the state through JSON every step; and the kernel-log part on real captures."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import NotApplicable, ParseError
from gpuwarden.agent.core.kernel_log import LogRecord, parse_kmsg_text, parse_log_text
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import step
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import pcie_aer

SPEC = pcie_aer.SPEC
T0 = 1_700_000_000.0
AER = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs" / "aer"
GPU0, GPU0_UUID = "0000:19:00.0", "GPU-566e6f65-c38e-b12f-4824-6944218668b9"
HCA0 = "0000:1a:00.0"  # mlx5_0
COUNTER = {"fatal": "SDES", "nonfatal": "CmpltTO", "correctable": "RxErr"}


def set_aer(root, bdf, **counts):
    """Rewrite a device's aer_dev_* files with `counts` (severity -> n) on one counter and its TOTAL_ERR_*."""
    for sev, n in counts.items():
        path = root / "sys/bus/pci/devices" / bdf / pcie_aer.FILES[sev][0]
        lines = []
        for line in path.read_text().splitlines():
            name = line.rsplit(" ", 1)[0]
            lines.append(f"{name} {n if name in (COUNTER[sev], pcie_aer.FILES[sev][1]) else 0}")
        path.write_text("\n".join(lines) + "\n")


class Clock:
    def __init__(self, root, **cfg):
        self.root, self.node = root, Node.recorded_at(root)
        self.cfg = {**SPEC.defaults, **cfg}
        self.state: dict = {}
        self.now = T0 - pcie_aer.INTERVAL_S
        self.j = None

    def _keep(self, j):
        self.j = j
        self.state = json.loads(json.dumps(j.state))
        return j

    def tick(self, to=None):
        self.now = self.now + pcie_aer.INTERVAL_S if to is None else to
        return self._keep(step(SPEC, self.node, self.cfg, self.state, self.now))

    def kernel(self, *messages, boot_id=None, to=None):
        self.now = self.now if to is None else to
        records = [LogRecord(m, i, "kmsg", seq=i, usec=1_000_000 + i) for i, m in enumerate(messages)]
        return self._keep(pcie_aer.judge_kernel_records(self.state, records, self.cfg, self.now, boot_id=boot_id))

    def findings(self, bdf):
        return [(f.code, f.status, f.action) for f in self.j.findings if f.entity.pci == bdf]

    def finding(self, bdf):
        (f,) = [f for f in self.j.findings if f.entity.pci == bdf]
        return f


@pytest.fixture
def clock(scenario_copy):
    return lambda name="h100-hgx-healthy", **cfg: Clock(scenario_copy(name), **cfg)


# ---------------------------------------------------------------- parsing the sysfs files
def _node_exporter_files():
    text = (AER / "node_exporter__sysfs-aer_dev_-files__fixture.txt").read_text()
    return re.findall(r"==> (\S+) <==\n(.*?)(?=\n==> |\Z)", text, re.S)


def test_node_exporter_capture_parses():
    files = _node_exporter_files()
    assert len(files) == 6
    for path, body in files:
        total, nonzero = pcie_aer.parse_aer_file(body, path)
        assert total == 0 and nonzero == {}


def test_kernel_doc_sample_with_the_old_long_counter_names_parses():
    doc = (AER / "linux__Documentation-ABI-sysfs-bus-pci-devices-aer_stats.txt").read_text()
    block = doc.split("# cat aer_dev_correctable\n", 1)[1].split("\n\n", 1)[0]
    total, nonzero = pcie_aer.parse_aer_file("\n".join(line.strip() for line in block.splitlines()), "doc")
    assert total == 2 and nonzero == {"Receiver Error": 2}


@pytest.mark.parametrize("text", ["RxErr zero\nTOTAL_ERR_COR 0\n", "RxErr 0\n", "garbage", "RxErr -1\nTOTAL_ERR_COR 0"])
def test_malformed_file_is_a_parse_error(text):
    with pytest.raises(ParseError):
        pcie_aer.parse_aer_file(text, "f")


def test_every_fixture_has_its_source():
    for p in AER.iterdir():
        if not p.name.endswith(".source.txt"):
            assert p.with_name(p.name + ".source.txt").is_file(), p.name


# ---------------------------------------------------------------- sysfs through time
def test_healthy_node_baseline_has_no_findings_and_exports_totals(clock):
    c = clock()
    c.tick()
    c.tick()
    assert c.j.findings == ()
    devices = sorted(os.listdir(c.root / "sys/bus/pci/devices"))
    assert {(m.labels["pci"], m.labels["severity"]) for m in c.j.metrics} == {
        (b, s) for b in devices for s in pcie_aer.SEVERITIES}
    for m in c.j.metrics:
        assert m.name == "gpuwarden_pcie_aer_errors" and m.kind == "gauge" and m.value == 0.0
    assert c.state["devices"][GPU0]["entity"] == {"kind": "gpu", "id": GPU0_UUID, "index": 0, "pci": GPU0}
    assert c.state["devices"][HCA0]["hca"] == "mlx5_0"


def test_counts_that_predate_gpuwarden_warn_as_history_not_fail(clock):
    c = clock()
    set_aer(c.root, GPU0, nonfatal=2)
    c.tick()
    f = c.finding(GPU0)
    assert (f.code, f.status, f.action) == ("pcie-aer-uncorrectable-history", Status.WARN, Action.MONITOR)
    assert f.evidence["predating_gpuwarden"]["nonfatal"] == 2 and f.evidence["new_nonfatal"] == 0
    assert f.evidence["counters"] == {"nonfatal": {"CmpltTO": 2}}


def test_nonfatal_increase_on_a_gpu_drains_then_ages_into_history(clock):
    c = clock()
    c.tick()
    set_aer(c.root, GPU0, nonfatal=1)
    c.tick()
    f = c.finding(GPU0)
    assert (f.code, f.status, f.action) == ("pcie-aer-uncorrectable", Status.FAIL, Action.DRAIN)
    assert f.entity.kind == "gpu" and f.entity.id == GPU0_UUID and f.entity.index == 0
    assert f.evidence["new_nonfatal"] == 1 and f.evidence["sysfs_totals"]["nonfatal"] == 1
    assert "GPU 0" in f.message and "non-fatal" in f.message
    assert [m.value for m in c.j.metrics if m.labels == {"pci": GPU0, "severity": "nonfatal"}] == [1.0]
    # Held for uncorrectable_hold_s after the error, through a restart (state from the store, a new Node).
    c.node = Node.recorded_at(c.root)
    c.tick(to=T0 + 3000)
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable", Status.FAIL, Action.DRAIN)]
    c.tick(to=T0 + 3700)
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable-history", Status.WARN, Action.MONITOR)]


def test_hold_zero_keeps_the_fail_until_the_next_boot(clock):
    c = clock(uncorrectable_hold_s=0.0)
    c.tick()
    for n in range(1, 4):
        set_aer(c.root, GPU0, nonfatal=n)
        c.tick(to=T0 + 86400 * n)
    f = c.finding(GPU0)
    assert f.status is Status.FAIL and f.evidence["new_nonfatal"] == 3
    assert len(c.state["sysfs"][GPU0]["events"]) == 1  # one bucket, however long the node stays up
    c.tick(to=T0 + 86400 * 30)
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable", Status.FAIL, Action.DRAIN)]


def test_device_that_leaves_the_bus_keeps_its_error_until_the_hold_ends(clock):
    c = clock()
    c.tick()
    set_aer(c.root, GPU0, fatal=1)
    c.tick()
    shutil.rmtree(c.root / "sys/bus/pci/devices" / GPU0)  # surprise removal after the fatal error
    c.tick()
    f = c.finding(GPU0)
    assert f.action is Action.REBOOT and f.evidence["gone_from_sysfs"] is True
    assert not [m for m in c.j.metrics if m.labels["pci"] == GPU0]
    c.tick(to=T0 + 4000)
    assert c.findings(GPU0) == [] and GPU0 not in c.state["sysfs"]


def test_fatal_on_the_hca_asks_for_a_reboot_and_names_it(clock):
    c = clock()
    c.tick()
    set_aer(c.root, HCA0, fatal=1, nonfatal=3)
    c.tick()
    f = c.finding(HCA0)
    assert (f.code, f.status, f.action) == ("pcie-aer-uncorrectable", Status.FAIL, Action.REBOOT)
    assert f.entity.kind == "pcie" and f.entity.id == HCA0 and f.evidence["hca"] == "mlx5_0"
    assert "mlx5_0" in f.message and f.evidence["new_fatal"] == 1 and f.evidence["new_nonfatal"] == 3


def test_correctable_rate_warns_per_hour_and_ages_out(clock):
    c = clock()
    c.tick()
    for i in range(1, 7):  # 100 every 10 minutes
        set_aer(c.root, GPU0, correctable=100 * i)
        c.tick(to=T0 + 600 * i)
    f = c.finding(GPU0)  # 600 in the last hour (>= 480, DCGM's 8 replays a minute)
    assert (f.code, f.status, f.action) == ("pcie-aer-correctable", Status.WARN, Action.MONITOR)
    assert f.evidence["correctable_last_hour"] == 600
    c.tick(to=T0 + 600 * 6 + 1800)  # no new errors for half an hour: 300 left in the hour
    assert c.findings(GPU0) == []
    c.cfg["correctable_warn_per_hour"] = 0  # off
    set_aer(c.root, GPU0, correctable=100_000)
    c.tick()
    assert c.findings(GPU0) == []


def test_counter_reset_counts_what_came_after_it(clock):
    c = clock()
    set_aer(c.root, GPU0, nonfatal=5)
    c.tick()  # history
    set_aer(c.root, GPU0, nonfatal=1)  # the device was removed and rescanned: its counters restarted
    c.tick()
    f = c.finding(GPU0)
    assert f.code == "pcie-aer-uncorrectable" and f.evidence["new_nonfatal"] == 1
    assert c.state["sysfs"][GPU0]["resets"] == 1


def test_a_new_boot_is_a_new_baseline(clock):
    c = clock()
    c.tick()
    set_aer(c.root, GPU0, fatal=1)
    c.tick()
    assert c.findings(GPU0)[0][2] is Action.REBOOT
    toml = c.root / "node.toml"
    toml.write_text(toml.read_text().replace("3f6c2a4e", "0badb007"))  # rebooted (the error happened again early)
    c.node = Node.recorded_at(c.root)
    c.tick()
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable-history", Status.WARN, Action.MONITOR)]


def test_unreadable_device_is_unknown_and_others_still_judged(clock):
    c = clock()
    c.tick()
    (c.root / "sys/bus/pci/devices" / HCA0 / "aer_dev_nonfatal").write_text("garbage\n")
    set_aer(c.root, GPU0, nonfatal=1)
    c.tick()
    f = c.finding(HCA0)
    assert (f.code, f.status, f.check) == ("pcie-aer-unreadable", Status.UNKNOWN, "pcie_aer")
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable", Status.FAIL, Action.DRAIN)]
    assert c.state["sysfs"][HCA0]["totals"]["nonfatal"] == 0  # what we knew is kept


def test_ignored_device(clock):
    c = clock(ignore_pci=[GPU0])
    c.tick()
    set_aer(c.root, GPU0, fatal=4)
    c.tick()
    c.kernel(f"pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: {GPU0}")
    c.kernel(f"pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: {GPU0}")
    assert c.findings(GPU0) == [] and GPU0 not in c.state["sysfs"]


def test_no_aer_statistics_is_not_applicable(tmp_path):
    root = tmp_path / "node"
    (root / "sys/bus/pci/devices/0000:00:00.0").mkdir(parents=True)
    (root / "node.toml").write_text('hostname = "n1"\n')
    with pytest.raises(NotApplicable, match="aer_dev_"):
        step(SPEC, Node.recorded_at(root), dict(SPEC.defaults), {}, T0)


def test_nvml_down_still_names_gpus_from_the_driver(clock):
    c = clock()
    (c.root / "nvml.json").unlink()  # no NVML: the GPUs are still named (vendor/class + the driver's UUID)
    c.node = Node.recorded_at(c.root)
    c.tick()
    assert c.state["devices"][GPU0]["entity"] == {"kind": "gpu", "id": GPU0_UUID, "pci": GPU0}


def test_bridge_names_the_gpu_and_nic_below_it(clock):
    """Live sysfs: bus/pci/devices/<bdf> links into /sys/devices/pci…/<bridge>/<bdf>; errors the link partner logs
    (the kernel's note in sysfs-bus-pci-devices-aer_stats) are named by what sits below that port."""
    c = clock()
    devs = c.root / "sys/bus/pci/devices"
    tree = c.root / "sys/devices/pci0000:15/0000:15:01.0"
    tree.mkdir(parents=True)
    for name in pcie_aer.FILES.values():
        shutil.copy(devs / GPU0 / name[0], tree / name[0])
    os.symlink("../../../devices/pci0000:15/0000:15:01.0", devs / "0000:15:01.0")
    for bdf in (GPU0, HCA0):
        shutil.move(devs / bdf, tree / bdf)
        os.symlink(f"../../../devices/pci0000:15/0000:15:01.0/{bdf}", devs / bdf)
    c.tick()
    set_aer(c.root, "0000:15:01.0", correctable=1000)
    c.tick()
    f = c.finding("0000:15:01.0")
    assert f.code == "pcie-aer-correctable" and f.evidence["behind"] == ["GPU 0", "mlx5_0"]
    assert "upstream of GPU 0, mlx5_0" in f.message and f.entity.kind == "pcie"


# ---------------------------------------------------------------- the kernel log
def _records(name):
    records, errors = parse_log_text((AER / name).read_text(), name)
    assert not errors
    return records


def test_firmware_first_ghes_block_is_one_correctable_event():
    (ev,) = pcie_aer.aer_events_from_records(_records("lambdalabs__dmesg__apei-ghes-firmware-first-pcie-corrected.txt"))
    assert (ev.bdf, ev.severity, ev.via) == ("0000:2c:00.0", "correctable", "ghes")


def test_howto_example_device_line_alone_is_a_fatal_event():
    (ev,) = pcie_aer.aer_events_from_records(_records("linux__pcieaer-howto__example-uncorrectable-fatal.txt"))
    assert (ev.bdf, ev.severity, ev.via) == ("0000:50:00.0", "fatal", "device")


def test_old_detail_lines_without_a_severity_line_are_no_event():
    records = _records("lambdalabs__dmesg__native-aer-nvme-rxerr-tab-separated.txt")
    assert pcie_aer.aer_events_from_records(records) == []


# The root port's line as aer.c prints it (aer_print_port_info / aer_print_source) across kernel versions, followed
# by the device's own line (aer_print_error); kmsg records as in docs/scenario-format.md.
KMSG = """\
3,2001,5000000,-;pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: 0000:19:00.0
3,2002,5000100,-;nvidia 0000:19:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Data Link Layer, (Receiver ID)
3,2003,5000200,-;nvidia 0000:19:00.0:   device [10de:2330] error status/mask=00000020/00000000
4,2004,9000000,-;pcieport 0000:18:01.0: AER: Multiple Correctable error message received from 0000:1a:00.0
4,2005,9000100,-;mlx5_core 0000:1a:00.0: PCIe Bus Error: severity=Correctable, type=Physical Layer, (Receiver ID)
4,2006,9500000,-;pcieport 0000:00:03.0: AER: Corrected error received: id=0018
3,2007,9600000,-;pcieport 0000:18:01.0: AER: Uncorrectable (Non-Fatal) error received: 0000:1a:00.0
4,2008,9700000,-;acpi PNP0A08:29: _OSC: platform does not support [SHPCHotplug AER DPC]
"""


def test_kernel_lines_one_event_per_error():
    records, errors = parse_kmsg_text(KMSG, "kmsg")
    assert not errors
    events = pcie_aer.aer_events_from_records(records)
    assert [(e.bdf, e.severity, e.reporter, e.seq) for e in events] == [
        ("0000:19:00.0", "fatal", "0000:18:01.0", 2001),
        ("0000:1a:00.0", "correctable", "0000:18:01.0", 2004),
        ("0000:00:03.0", "correctable", "0000:00:03.0", 2006),  # id=0018: bus 00, device 3, function 0
        ("0000:1a:00.0", "nonfatal", "0000:18:01.0", 2007),
    ]


def test_kernel_part_first_batch_is_history_then_news_is_a_fail(clock):
    c = clock()
    c.tick()  # the sysfs part names the devices
    c.kernel(f"pcieport 0000:18:01.0: AER: Uncorrected (Non-Fatal) error received: {GPU0}")  # since boot
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable-history", Status.WARN, Action.MONITOR)]
    c.kernel(f"pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: {GPU0}",
             f"nvidia {GPU0}: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)",
             to=T0 + 5)
    f = c.finding(GPU0)
    assert (f.code, f.status, f.action) == ("pcie-aer-uncorrectable", Status.FAIL, Action.REBOOT)
    assert f.entity.id == GPU0_UUID and f.evidence["kernel_log"] == {"fatal": 1, "nonfatal": 1, "correctable": 0}
    assert "error received" in f.evidence["kernel_log_last"]
    # The sysfs counter then shows the same error: counted once (the larger of the two sources), not twice.
    set_aer(c.root, GPU0, fatal=1)
    c.tick(to=T0 + 10)
    assert c.finding(GPU0).evidence["new_fatal"] == 1
    # A device the sysfs part does not list is still reported, by its BDF.
    c.kernel("pcieport 0000:80:01.0: AER: Uncorrectable (Non-Fatal) error message received from 0000:81:00.0",
             to=T0 + 11)
    assert c.findings("0000:81:00.0") == [("pcie-aer-uncorrectable", Status.FAIL, Action.DRAIN)]
    # A new boot (the daemon passes the follower's boot_id): what that boot logged so far is history again.
    c.kernel(f"pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: {GPU0}", boot_id="new", to=T0 + 12)
    assert c.findings(GPU0) == [("pcie-aer-uncorrectable-history", Status.WARN, Action.MONITOR)]


def test_a_backlog_read_after_a_restart_counts_from_when_it_was_logged():
    """After a restart the daemon reads what the kernel logged while it was down: an uncorrectable error logged two
    hours ago (past uncorrectable_hold_s) is history, not a FAIL as if it had happened now."""
    from gpuwarden.agent.core.passive import KernelBatch, event_clock

    cfg = dict(pcie_aer.SPEC.defaults)
    line = "3,{seq},{usec},-;pcieport 0000:18:01.0: AER: Uncorrected (Fatal) error received: 0000:19:00.0\n"
    first, _ = parse_log_text("6,1,1000000,-;boot\n", "kmsg")
    state = pcie_aer.judge_kernel_records({}, first, cfg, T0, boot_id="b").state  # the first batch: history
    # Logged at 100 s after boot; the node has now been up 2 h 100 s.
    records, _ = parse_log_text(line.format(seq=2, usec=100_000_000), "kmsg")
    clock = event_clock(T0, 7_300_000_000, records)
    old = pcie_aer.KERNEL_CONSUMER.judge(state, KernelBatch(records, [], "b", event_time=clock), cfg, T0)
    assert not [f for f in old.findings if f.status is Status.FAIL]
    # The same line logged just now fails.
    records, _ = parse_log_text(line.format(seq=2, usec=7_300_000_000), "kmsg")
    clock = event_clock(T0, 7_300_000_000, records)
    new = pcie_aer.KERNEL_CONSUMER.judge(state, KernelBatch(records, [], "b", event_time=clock), cfg, T0)
    assert [f.status for f in new.findings] == [Status.FAIL]

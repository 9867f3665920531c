"""nvswitch_sxid: NVSwitch SXid errors parsed from real kernel and Fabric Manager logs, and the incidents the
consumer keeps when fed through the node's kernel-log follower."""
import json
from pathlib import Path

import pytest
from conftest import exposition, promtool_lint
from gpuwarden import checks
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import parse_log_text
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import KernelBatch
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import nvswitch_sxid
from gpuwarden.checks.nvswitch_sxid import SXID_CONSUMER
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "fixtures" / "logs" / "kernel"
NVSWITCH = ROOT / "fixtures" / "logs" / "nvswitch"
DMESG_SXID = KERNEL / "gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt"
FM_LOG = NVSWITCH / "gpud__nvidia-fabricmanager-log__nvswitch-nonfatal-errors.txt"
SXID_CFG = dict(SXID_CONSUMER.defaults)
T0 = 1_750_000_000.0


def test_registered_as_a_kernel_consumer_under_its_own_name():
    assert SXID_CONSUMER.name == "nvswitch_sxid" and SXID_CONSUMER in checks.KERNEL_CONSUMERS
    assert {s.name for s in checks.all_specs()} >= {"fabric", "nvswitch_sxid"}


# ---------------------------------------------------------------- SXid parsing
def test_sxid_lines_of_a_real_dmesg():
    records, errors = parse_log_text(DMESG_SXID.read_text(), DMESG_SXID.name)
    assert errors == []
    events = nvswitch_sxid.sxid_events_from_records(records)
    assert [(e.switch, e.pci, e.sxid, e.fatal, e.link) for e in events] == [
        ("nvidia-nvswitch1", "0000:06:00.0", 20034, True, 48),
        ("nvidia-nvswitch0", "0000:05:00.0", 20034, True, 63),
        ("nvidia-nvswitch2", "0000:07:00.0", 20034, None, None),
        ("nvidia-nvswitch0", "0000:05:00.0", 20034, None, None),
        ("nvidia-nvswitch2", "0000:07:00.0", 20034, True, 37),
        ("nvidia-nvswitch0", "0000:05:00.0", 20034, True, 62),
        ("nvidia-nvswitch2", "0000:07:00.0", 20034, None, None),
        ("nvidia-nvswitch0", "0000:05:00.0", 20034, None, None),
    ]
    assert events[0].detail == "LTSSM Fault Up" and events[0].origin == "kernel"
    assert events[2].detail == "Severity 1 Engine instance 60 Sub-engine instance 00"
    assert events[3].detail.startswith("Data {0x10000000, 0x10000000,")
    assert events[0].record.usec == 6781753400584


def test_nvswitch_noise_is_no_sxid():
    records, _ = parse_log_text((KERNEL / "gpud__kmsg-raw__noise-nvswitch.log").read_text(), "kmsg")
    assert any("nvidia-nvswitch" in r.message for r in records)
    assert nvswitch_sxid.sxid_events_from_records(records) == []


def test_fabric_manager_log():
    records, _ = parse_log_text(FM_LOG.read_text(), FM_LOG.name)
    (e,) = nvswitch_sxid.sxid_events_from_records(records)
    assert (e.sxid, e.pci, e.fatal, e.link, e.switch, e.origin) == \
        (12028, "0000:86:00.0", False, 61, "physical id 3", "fabricmanager")
    findings, errors = nvswitch_sxid.analyze_text(FM_LOG.read_text(), FM_LOG.name)
    assert errors == [] and [(f.code, f.status) for f in findings] == [("sxid-12028", Status.WARN)]


@pytest.mark.parametrize("line, expected", [
    ("[73309.599396] nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04 RX Short Error Rate",
     (20009, "0000:06:00.0", False, 4, "RX Short Error Rate")),
    ("nvidia-nvswitch3: SXid (PCI:0000:C1:00.0): 28006, non-fatal, Link 46 MC TS crumbstore MCTO (First)",
     (28006, "0000:c1:00.0", False, 46, "MC TS crumbstore MCTO (First)")),
    ("nvidia-nvswitch0: SXid (PCI:0004:00:00.0): 26006, SOE HALTED",  # no severity, no link
     (26006, "0004:00:00.0", None, None, "SOE HALTED")),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Li",  # truncated
     (20009, "0000:06:00.0", False, None, "Li")),
    ("kernel: nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error (First)",
     (24007, "0000:c3:00.0", True, 28, "sourcetrack timeout error (First)")),
])
def test_sxid_line_shapes(line, expected):
    e = nvswitch_sxid.parse_sxid(line)
    assert (e.sxid, e.pci, e.fatal, e.link, e.detail) == expected


@pytest.mark.parametrize("line", [
    "nvidia-nvswitch2: open (major=510)",
    "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "nvidia-nvswitch0: SXid (PCI:zz:00:00.0): 1, Fatal",
    "detected NVSwitch warning 5 on NVSwitch pci bus id 00000000:86:00.0",
])
def test_not_sxid(line):
    assert nvswitch_sxid.parse_sxid(line) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.builds(lambda a, b: f"nvidia-nvswitch1: SXid (PCI:{a}): {b}",
                                         st.text(max_size=30), st.text(max_size=80)))
def test_fuzz_only_parse_errors_escape(text):
    try:
        records, _ = parse_log_text(text, "fuzz")
        nvswitch_sxid.sxid_events_from_records(records)
        nvswitch_sxid.judge_kernel_records({}, records, SXID_CFG, T0)
        nvswitch_sxid.analyze_text(text, "fuzz")
    except ParseError:
        pass


# ---------------------------------------------------------------- SXid incidents through the follower
def kmsg_lines(text, first_seq, prio=3):
    """dmesg text -> raw /dev/kmsg records with consecutive sequence numbers."""
    records, _ = parse_log_text(text, "x")
    return "".join(f"{prio},{first_seq + i},{r.usec or 0},-;{r.message}\n" for i, r in enumerate(records))


class KernelDriver:
    def __init__(self, root):
        self.node, self.state = Node.recorded_at(root), {}
        self.follower = self.node.kmsg_follower(None)
        self.follower.poll()  # the records of the boot before the faults
        self.boot_id = self.node.info.boot_id

    def at(self, now, boot_id=None):
        batch = KernelBatch(self.follower.poll(), list(self.node.gpus()), boot_id or self.boot_id)
        j = SXID_CONSUMER.judge(self.state, batch, SXID_CFG, now)
        self.state = json.loads(json.dumps(j.state))
        assert self.state == j.state
        return j


def test_fatal_sxids_drain_per_switch_until_the_next_boot(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    k = KernelDriver(root)
    assert k.at(T0).findings == ()
    with open(root / "kmsg", "a") as f:
        f.write(kmsg_lines(DMESG_SXID.read_text(), 3704))
    j = k.at(T0 + 1)
    by_pci = {f.entity.id: f for f in j.findings}
    assert sorted(by_pci) == ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0"]
    sw0 = by_pci["0000:05:00.0"]
    assert (sw0.code, sw0.status, sw0.action, sw0.entity.kind) == ("sxid-20034", Status.FAIL, Action.DRAIN, "nvswitch")
    assert sw0.evidence["links"] == [63, 62] and sw0.evidence["events"] == 2 and len(sw0.evidence["details"]) == 2
    assert "link(s) 62, 63" in sw0.message and "nvidia-nvswitch0" in sw0.message
    assert sw0.evidence["first_seq"] == 3710  # the 7th line of the capture
    assert {m.labels["pci"]: m.value for m in j.metrics} == {"0000:06:00.0": 1.0, "0000:05:00.0": 2.0,
                                                             "0000:07:00.0": 1.0}
    assert len(k.at(T0 + 86400).findings) == 3  # fatal: stands until the boot changes
    assert k.at(T0 + 86430, boot_id="a-new-boot").findings == ()


def test_non_fatal_sxid_warns_and_ages_out(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    k = KernelDriver(root)
    with open(root / "kmsg", "a") as f:
        f.write("4,3704,235958200000,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link 61 "
                "egress non-posted PRIV error (First)\n")
    (f,) = k.at(T0).findings
    assert (f.code, f.status, f.action) == ("sxid-12028", Status.WARN, Action.MONITOR)
    assert len(k.at(T0 + 3600).findings) == 1
    assert k.at(T0 + 3601).findings == ()  # hold_s after its last event


def test_sxid_policy_and_plain_record_lists():
    records, _ = parse_log_text(FM_LOG.read_text(), FM_LOG.name)
    (f,) = nvswitch_sxid.judge_kernel_records({}, records, {**SXID_CFG, "fail_sxids": [12028]}, T0).findings
    assert (f.status, f.action) == (Status.FAIL, Action.DRAIN)
    assert nvswitch_sxid.judge_kernel_records({}, records, {**SXID_CFG, "ignore_sxids": [12028]}, T0).findings == ()


# ---------------------------------------------------------------- metrics
def test_metrics_are_lint_clean():
    records, _ = parse_log_text(DMESG_SXID.read_text(), "dmesg")
    metrics = nvswitch_sxid.judge_kernel_records({}, records, SXID_CFG, T0).metrics
    assert {m.name for m in metrics} == {"gpuwarden_nvswitch_sxid_events"}
    text = exposition(metrics)
    assert 'gpuwarden_nvswitch_sxid_events{pci="0000:05:00.0",sxid="20034"} 2.0' in text
    promtool_lint(text)


# ---------------------------------------------------------------- one decision in preflight, analyze and the daemon
def _codes(findings):
    return sorted((f.entity.id, f.code, f.status, f.action) for f in findings)


def test_preflight_analyze_and_the_daemon_give_the_same_sxid_verdict():
    from gpuwarden.agent.cli import analyze
    from gpuwarden.agent.core import config
    from gpuwarden.agent.node.runner import run_checks

    node = Node.recorded_at(ROOT / "fixtures" / "nodes" / "gb200-nvl72-faulty")
    cfg = config.defaults(checks.all_specs())
    (pre,) = run_checks(node, [nvswitch_sxid.CHECK], cfg)
    assert nvswitch_sxid.CHECK in checks.ALL and nvswitch_sxid.CHECK.level == "quick"
    assert pre.status is Status.FAIL
    daemon = SXID_CONSUMER.judge({}, KernelBatch(node.kmsg.records(), [], node.kmsg.boot_id), SXID_CFG, T0)
    assert _codes(pre.findings) == _codes(daemon.findings)
    assert {pci for pci, *_ in _codes(pre.findings)} == {"0000:05:00.0", "0000:06:00.0", "0000:07:00.0"}
    # analyze of the same log as a saved dmesg
    result = analyze.analyze_file(DMESG_SXID)
    assert _codes(f for f in result.findings if f.check == "nvswitch_sxid") == _codes(pre.findings)
    assert {f.check for f in result.findings} == {"xid", "nvswitch_sxid"}


@pytest.mark.parametrize("line", [
    "nvidia-nvswitch1: SXid (PCI:0000:06:00): 20034, Fatal, Link 48",  # no function: a form not read here
    "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): Fatal error somewhere",
])
def test_an_sxid_line_that_cannot_be_read_is_unknown(line):
    findings, _ = nvswitch_sxid.analyze_text(f"[ 5.0] {line}\n", "dmesg.txt")
    assert [(f.code, f.status) for f in findings] == [("sxid-unreadable", Status.UNKNOWN)]
    assert "dmesg.txt:1" in findings[0].message

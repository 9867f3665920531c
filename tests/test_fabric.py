"""fabric (NVML GPU fabric info + Fabric Manager) driven through time on recorded nodes, and the NVSwitch SXid
consumer on real kernel / Fabric Manager logs, fed through the node's kernel-log follower."""
import json
import shutil
import subprocess
from pathlib import Path

import pynvml
import pytest
from conftest import edit_nvml, exposition as render, record_tool
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.agent.errors import ConfigError, NotApplicable, ParseError
from gpuwarden.agent.kernel_log import parse_log_text
from gpuwarden.agent.model import Action, Status
from gpuwarden.agent.node import Node
from gpuwarden.agent.passive import KernelBatch, step
from gpuwarden.checks import fabric
from gpuwarden.checks.fabric import SPEC as CHECK
from gpuwarden.checks.fabric import SXID_CONSUMER

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "fixtures" / "logs" / "kernel"
NVSWITCH = ROOT / "fixtures" / "logs" / "nvswitch"
DMESG_SXID = KERNEL / "gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt"
FM_LOG = NVSWITCH / "gpud__nvidia-fabricmanager-log__nvswitch-nonfatal-errors.txt"
CFG = dict(CHECK.defaults)
SXID_CFG = dict(SXID_CONSUMER.defaults)
T0 = 1_750_000_000.0
HEALTHY_MASK = 0x1AA  # NVIDIA's mock GB200 profile, and the bundled GB200 scenario
ZERO = "00000000-0000-0000-0000-000000000000"


def set_fabric(root, gpu, **fields):
    edit_nvml(root, lambda data: data["gpus"][gpu]["fabric"].update(fields))


def with_mask(**fields):
    """The healthy mask with some fields replaced (values as in nvml.h)."""
    mask = HEALTHY_MASK
    for name, shift, width, _ in fabric.HEALTH_FIELDS:
        if name in fields:
            mask = (mask & ~(width << shift)) | (fields[name] << shift)
    return mask


class Driver:
    def __init__(self, root, cfg=None):
        self.root, self.cfg, self.state = root, cfg or CFG, {}
        self.node = Node.recorded_at(root)

    def at(self, now, restart=False):
        if restart:
            self.node = Node.recorded_at(self.root)
        j = step(CHECK, self.node, self.cfg, self.state, now)
        self.state = json.loads(json.dumps(j.state))
        assert self.state == j.state
        return j


def codes(j):
    return sorted((f.code, f.entity.index) for f in j.findings)


# ---------------------------------------------------------------- NVML fabric info
def test_health_mask_table_matches_the_installed_nvml_bindings():
    names = {"degraded_bandwidth": "DEGRADED_BW", "route_recovery": "ROUTE_RECOVERY",
             "route_unhealthy": "ROUTE_UNHEALTHY", "access_timeout_recovery": "ACCESS_TIMEOUT_RECOVERY",
             "incorrect_configuration": "INCORRECT_CONFIGURATION", "partition_assigned": "PARTITION_ASSIGNED",
             "gfm_state": "GFM_STATE"}
    prefix = "NVML_GPU_FABRIC_HEALTH_MASK_"
    for name, shift, width, _ in fabric.HEALTH_FIELDS:
        assert getattr(pynvml, f"{prefix}SHIFT_{names[name]}") == shift
        assert getattr(pynvml, f"{prefix}WIDTH_{names[name]}") == width
    reasons = {"INCORRECT_SYSGUID": "incorrect SysGUID", "INCORRECT_CHASSIS_SN": "incorrect chassis serial number",
               "NO_PARTITION": "no partition", "INSUFFICIENT_NVLINKS": "insufficient NVLinks",
               "INCOMPATIBLE_GPU_FW": "incompatible GPU firmware", "INVALID_LOCATION": "invalid location",
               "GPU_STATE_INVALID": "GPU state invalid"}
    incorrect = next(bad for name, _, _, bad in fabric.HEALTH_FIELDS if name == "incorrect_configuration")
    for const, words in reasons.items():
        meaning = incorrect[getattr(pynvml, f"{prefix}INCORRECT_CONFIGURATION_{const}")][0]
        assert meaning == f"incorrect configuration: {words}"
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED == 2
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INSUFFICIENT_NVLINKS == 5
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_GPU_STATE_INVALID == 8
    assert pynvml.NVML_GPU_FABRIC_STATE_COMPLETED == fabric.COMPLETED
    assert fabric.decode_health_mask(HEALTHY_MASK) == {
        "degraded_bandwidth": 2, "route_recovery": 2, "route_unhealthy": 2, "access_timeout_recovery": 2,
        "incorrect_configuration": 1, "partition_assigned": 0, "gfm_state": 0}


def test_healthy_gb200_tray(scenario_copy):
    j = Driver(scenario_copy("gb200-nvl72-healthy")).at(T0)
    assert j.findings == ()
    cliques = [m for m in j.metrics if m.name == "gpuwarden_gpu_fabric_clique_info"]
    assert len(cliques) == 4 and {m.labels["cluster_uuid"] for m in cliques} == {"62c4efc6-d460-488d-b7d7-69de49edd641"}
    assert {m.value for m in j.metrics if m.name == "gpuwarden_gpu_fabric_state"} == {3.0}
    assert not any(m.name == "gpuwarden_fabric_manager_up" for m in j.metrics)  # FM runs in the switch trays


def test_registration_not_completed_fails_after_settle_s(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 1, state=2, cluster_uuid=ZERO, clique_id=0, health_mask=0)  # in progress after boot
    d = Driver(root)
    assert d.at(T0).findings == ()
    assert d.at(T0 + 299, restart=True).findings == ()  # the first-seen time survives a restart
    (f,) = d.at(T0 + 300).findings
    assert (f.code, f.status, f.action, f.entity.index) == ("fabric-not-ready", Status.FAIL, Action.DRAIN, 1)
    assert f.evidence["state_name"] == "in progress" and f.evidence["not_ready_seconds"] == 300
    set_fabric(root, 1, state=3, cluster_uuid="62c4efc6-d460-488d-b7d7-69de49edd641", clique_id=32766,
               health_mask=HEALTHY_MASK)
    assert d.at(T0 + 330).findings == () and d.state["not_ready_since"] == {}


def test_completed_with_an_error_status(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 0, status=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action) == ("fabric-error", Status.FAIL, Action.DRAIN)
    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in f.message and f.evidence["status_name"] in f.message


@pytest.mark.parametrize("fields, code, status", [
    ({"route_unhealthy": 1}, "fabric-route-unhealthy", Status.FAIL),
    ({"degraded_bandwidth": 1}, "fabric-degraded-bandwidth", Status.WARN),
    ({"route_recovery": 1}, "fabric-route-recovery", Status.WARN),
    ({"access_timeout_recovery": 1}, "fabric-access-timeout-recovery", Status.WARN),
    ({"incorrect_configuration": 5}, "fabric-incorrect-configuration", Status.FAIL),
    ({"gfm_state": 2}, "fabric-gfm-state", Status.WARN),
])
def test_health_mask_fields(scenario_copy, fields, code, status):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 2, health_mask=with_mask(**fields))
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.entity.index) == (code, status, 2)
    assert f.action is (Action.DRAIN if status is Status.FAIL else Action.MONITOR)
    if code == "fabric-incorrect-configuration":
        assert "insufficient NVLinks" in f.message and f.evidence["value"] == 5


def test_a_gpu_in_another_clique_is_the_odd_one_out(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 3, clique_id=32767)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action, f.entity.index) == ("fabric-clique-mismatch", Status.FAIL, Action.DRAIN, 3)
    assert f.evidence["majority_domain"] == "62c4efc6-d460-488d-b7d7-69de49edd641.32766"
    # A GB200 GPU with a zero cluster UUID is outside the tray's domain too.
    set_fabric(root, 3, clique_id=0, cluster_uuid=ZERO)
    (f,) = Driver(root).at(T0).findings
    assert f.entity.index == 3 and "no NVLink domain" in f.message
    # Two against two: no majority, one finding for the node.
    set_fabric(root, 2, clique_id=0, cluster_uuid=ZERO)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.entity.kind) == ("fabric-clique-mismatch", "node") and len(f.evidence["domains"]) == 2


def hgx_recent_driver(scenario_copy):
    """The H100 scenario as a recent driver reports it: fabric state completed, zero cluster UUID, clique 0."""
    root = scenario_copy("h100-hgx-healthy")

    def change(data):
        for gpu in data["gpus"]:
            gpu["fabric"] = {"cluster_uuid": ZERO, "clique_id": 0, "state": 3, "status": 0, "health_mask": 0}
            gpu["errors"].pop("nvmlDeviceGetGpuFabricInfoV", None)
    edit_nvml(root, change)
    return root


def test_hgx_fabric_manager_state(scenario_copy):
    root = hgx_recent_driver(scenario_copy)
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    d = Driver(root)
    j = d.at(T0)
    assert j.findings == ()  # eight GPUs with a zero UUID: no NVLink domain, not a mismatch
    assert [m.value for m in j.metrics if m.name == "gpuwarden_fabric_manager_up"] == [1.0]
    record_tool(root, "systemctl-fabricmanager", "activating\n", 3)  # a restart: grace of settle_s
    assert d.at(T0 + 30).findings == ()
    (f,) = d.at(T0 + 330).findings
    assert (f.code, f.status, f.action, f.entity.kind) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN,
                                                           "node")
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    assert d.at(T0 + 360).findings == ()
    record_tool(root, "systemctl-fabricmanager", "failed\n", 3)  # failed or inactive: no grace
    (f,) = d.at(T0 + 390).findings
    assert f.code == "fabric-manager-inactive" and f.evidence["systemctl"] == "failed"
    assert Driver(root, {**CFG, "fabric_manager": "off"}).at(T0).findings == ()


def test_fabric_manager_that_cannot_be_looked_at_is_unknown(scenario_copy):
    root = hgx_recent_driver(scenario_copy)  # no tools/systemctl-fabricmanager.out: no systemctl here
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status) == ("fabric-manager-unknown", Status.UNKNOWN) and "not installed" in f.message


def test_applicability(scenario_copy):
    h100 = scenario_copy("h100-hgx-healthy")  # the bundled driver: fabric info NOT_SUPPORTED on every GPU
    record_tool(h100, "systemctl-fabricmanager", "active\n", 0)
    assert Driver(h100).at(T0).findings == ()  # still watches Fabric Manager
    with pytest.raises(NotApplicable):
        Driver(h100, {**CFG, "fabric_manager": "off"}).at(T0)
    gb200 = scenario_copy("gb200-nvl72-healthy")
    edit_nvml(gb200, lambda data: [g["errors"].update(nvmlDeviceGetGpuFabricInfoV="NOT_SUPPORTED")
                                   for g in data["gpus"]])
    with pytest.raises(NotApplicable):
        Driver(gb200).at(T0)
    with pytest.raises(ConfigError):
        Driver(gb200, {**CFG, "fabric_manager": "yes"}).at(T0)


def test_lost_gpu_is_reported_and_the_others_judged(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")
    set_fabric(root, 0, health_mask=with_mask(route_unhealthy=1))
    assert codes(Driver(root).at(T0)) == [("fabric-route-unhealthy", 0), ("gpu-lost", 2)]


# ---------------------------------------------------------------- SXid parsing
def test_sxid_lines_of_a_real_dmesg():
    records, errors = parse_log_text(DMESG_SXID.read_text(), DMESG_SXID.name)
    assert errors == []
    events = fabric.sxid_events_from_records(records)
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
    assert fabric.sxid_events_from_records(records) == []


def test_fabric_manager_log():
    records, _ = parse_log_text(FM_LOG.read_text(), FM_LOG.name)
    (e,) = fabric.sxid_events_from_records(records)
    assert (e.sxid, e.pci, e.fatal, e.link, e.switch, e.origin) == \
        (12028, "0000:86:00.0", False, 61, "physical id 3", "fabricmanager")
    findings, errors = fabric.analyze_text(FM_LOG.read_text(), FM_LOG.name)
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
    e = fabric.parse_sxid(line)
    assert (e.sxid, e.pci, e.fatal, e.link, e.detail) == expected


@pytest.mark.parametrize("line", [
    "nvidia-nvswitch2: open (major=510)",
    "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "nvidia-nvswitch0: SXid (PCI:zz:00:00.0): 1, Fatal",
    "detected NVSwitch warning 5 on NVSwitch pci bus id 00000000:86:00.0",
])
def test_not_sxid(line):
    assert fabric.parse_sxid(line) is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.builds(lambda a, b: f"nvidia-nvswitch1: SXid (PCI:{a}): {b}",
                                         st.text(max_size=30), st.text(max_size=80)))
def test_fuzz_only_parse_errors_escape(text):
    try:
        records, _ = parse_log_text(text, "fuzz")
        fabric.sxid_events_from_records(records)
        fabric.judge_kernel_records({}, records, SXID_CFG, T0)
        fabric.analyze_text(text, "fuzz")
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
    (f,) = fabric.judge_kernel_records({}, records, {**SXID_CFG, "fail_sxids": [12028]}, T0).findings
    assert (f.status, f.action) == (Status.FAIL, Action.DRAIN)
    assert fabric.judge_kernel_records({}, records, {**SXID_CFG, "ignore_sxids": [12028]}, T0).findings == ()


# ---------------------------------------------------------------- metrics
def exposition(metrics):
    return render(metrics)


def test_metrics_are_lint_clean(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 1, state=2)
    metrics = list(Driver(root).at(T0).metrics)
    h100 = hgx_recent_driver(scenario_copy)
    record_tool(h100, "systemctl-fabricmanager", "inactive\n", 3)
    metrics += Driver(h100).at(T0).metrics
    records, _ = parse_log_text(DMESG_SXID.read_text(), "dmesg")
    metrics += fabric.judge_kernel_records({}, records, SXID_CFG, T0).metrics
    assert {m.name for m in metrics} == {
        "gpuwarden_gpu_fabric_state", "gpuwarden_gpu_fabric_not_ready_seconds", "gpuwarden_gpu_fabric_clique_info",
        "gpuwarden_fabric_manager_up", "gpuwarden_nvswitch_sxid_events"}
    text = exposition(metrics)
    if shutil.which("promtool"):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr

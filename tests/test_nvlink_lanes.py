"""nvlink_lanes driven through time on recorded nodes: nvml.json is edited between steps to take links down and
raise error counters, and the state goes through json between steps as the daemon persists it. Link layouts and
counter values come from real `nvidia-smi nvlink` outputs (fixtures/logs/nvswitch/)."""
import json
import re
from pathlib import Path

import pytest
from conftest import edit_nvml, promtool_lint
from conftest import exposition as render
from gpuwarden.agent.core.errors import NotApplicable
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import step
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import nvlink_lanes
from gpuwarden.checks.nvlink_lanes import SPEC as CHECK

SMI = Path(__file__).resolve().parent.parent / "fixtures" / "logs" / "nvswitch"
CFG = dict(CHECK.defaults)
T0 = 1_750_000_000.0


def set_link(root, gpu, link, state=None, **counters):
    def change(data):
        entry = next(e for e in data["gpus"][gpu]["nvlinks"] if e["link"] == link)
        if state is not None:
            entry["state"] = state
        entry["errors"].update(counters)
    edit_nvml(root, change)


class Driver:
    """Steps the check like the daemon: sample + judge, the state persisted as JSON in between."""

    def __init__(self, root, cfg=None):
        self.root, self.cfg, self.state = root, cfg or CFG, {}
        self.node = Node.recorded_at(root)

    def at(self, now, restart=False):
        if restart:  # a new daemon process: a fresh node, only the persisted state survives
            self.node = Node.recorded_at(self.root)
        j = step(CHECK, self.node, self.cfg, self.state, now)
        self.state = json.loads(json.dumps(j.state))
        assert self.state == j.state
        return j


def metric(j, name, **labels):
    (value,) = [m.value for m in j.metrics if m.name == name and all(m.labels[k] == v for k, v in labels.items())]
    return value


# ---------------------------------------------------------------- real nvidia-smi nvlink outputs
_GPU = re.compile(r"^GPU (\d+): (.*) \(UUID: (GPU-[0-9a-f-]+)\)$")
_LINK = re.compile(r"^\s+Link (\d+): (.*)$")


def smi_links(text):
    """`nvidia-smi nvlink -s` / `-e` text -> {gpu: {link: [what it said]}}; a GPU whose links are all inactive
    ("NVML: Unable to retrieve NVLink information as all links are inactive") maps to None."""
    out, gpu = {}, None
    for line in text.splitlines():
        if m := _GPU.match(line):
            gpu = int(m[1])
            out[gpu] = {}
        elif "all links are inactive" in line:
            out[gpu] = None
        elif (m := _LINK.match(line)) and gpu is not None:
            out[gpu].setdefault(int(m[1]), []).append(m[2])
    return out


def test_real_smi_outputs_parse_as_the_tests_use_them():
    a100 = smi_links((SMI / "gpud__nvidia-smi-nvlink-status__8xA100-SXM4-80GB.txt").read_text())
    assert sorted(a100) == list(range(8)) and all(sorted(links) == list(range(12)) for links in a100.values())
    assert all(v == ["25 GB/s"] for links in a100.values() for v in links.values())
    assert smi_links((SMI / "azurehpc__nvidia-smi-nvlink-s__A100-1gpu__BAD-all-links-inactive.txt").read_text()) \
        == {6: None}
    assert sorted(smi_links((SMI / "azurehpc__nvidia-smi-nvlink-s__A100-1gpu__good.txt").read_text())[7]) \
        == list(range(12))
    # H100's `nvidia-smi nvlink -e` numbers links up to 17 (18 links, as SKU_LINKS says) with zero counters.
    h100 = smi_links((SMI / "stas00__nvidia-smi-nvlink-e__H100-FRAGMENT.txt").read_text())[0]
    assert max(h100) + 1 == nvlink_lanes.SKU_LINKS["H100-SXM-HGX"] == 18
    assert h100[17] == ["Replay Errors: 0", "Recovery Errors: 0", "CRC Errors: 0"]


# ---------------------------------------------------------------- links up / down
def test_healthy_gb200_tray_has_no_finding_and_exports_per_gpu_series_only(scenario_copy):
    d = Driver(scenario_copy("gb200-nvl72-healthy"))
    j = d.at(T0)
    assert j.findings == ()
    assert [metric(j, "gpuwarden_nvlink_links_active", gpu=str(i)) for i in range(4)] == [18.0] * 4
    assert [metric(j, "gpuwarden_nvlink_links_down", gpu=str(i)) for i in range(4)] == [0.0] * 4
    assert d.state["gpus"]["GPU-7f56209f-bfaa-0234-486e-9d778f65ba32"]["baseline_active"] == 18
    assert metric(j, "gpuwarden_nvlink_errors", gpu="0", counter="crc_flit") == 0.0
    # Every link is clean: no per-link series (4 GPUs x 18 links x 9 series would be 648 of them).
    assert not [m for m in j.metrics if "link" in m.labels]
    assert len(j.metrics) == 4 * (2 + 2 * 4)
    assert d.at(T0 + 30).findings == ()


def test_a_link_that_drops_is_reset_gpu_until_it_is_back(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    set_link(root, 1, 5, state=0)
    (f,) = d.at(T0 + 30).findings
    assert (f.code, f.status, f.action) == ("nvlink-down", Status.FAIL, Action.RESET_GPU)
    uuid = "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32"
    assert (f.entity.kind, f.entity.id, f.entity.index, f.entity.pci, f.entity.link) == \
        ("nvlink", f"{uuid}/link5", 1, "0009:01:00.0", 5)
    assert f.evidence["was_active"] is True and f.evidence["down_seconds"] == 0
    assert f.evidence["active_at_first_sample"] == 18 and f.evidence["state"] == 0
    j = d.at(T0 + 90, restart=True)  # the down time survives a daemon restart
    (f,) = j.findings
    assert f.evidence["down_seconds"] == 60 and f.evidence["down_since"] == T0 + 30
    assert metric(j, "gpuwarden_nvlink_link_up", gpu="1", link="5") == 0.0
    assert metric(j, "gpuwarden_nvlink_links_down", gpu="1") == 1.0
    assert metric(j, "gpuwarden_nvlink_links_active", gpu="1") == 17.0
    assert {m.labels["link"] for m in j.metrics if "link" in m.labels} == {"5"}  # the one link not clean
    set_link(root, 1, 5, state=1)
    j = d.at(T0 + 120)
    assert j.findings == () and metric(j, "gpuwarden_nvlink_links_down", gpu="1") == 0.0
    assert not [m for m in j.metrics if "link" in m.labels]  # clean again: its series go


def test_links_of_a_gpu_still_registering_with_the_fabric_are_not_judged_at_boot(scenario_copy):
    """At boot the agent can look before Fabric Manager has trained the links: every link inactive while the GPU's
    fabric registration is in progress is the boot, not a fault (the check `fabric` fails a registration that
    does not complete). Once registered, a link still down fails."""
    root = scenario_copy("h100-hgx-healthy")

    def booting(state):
        def change(data):
            for gpu in data["gpus"]:
                gpu.get("errors", {}).pop("nvmlDeviceGetGpuFabricInfoV", None)  # recorded on driver 535
                gpu["fabric"] = {"cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": 0,
                                 "state": state, "status": 0, "health_mask": 0}
                for link in gpu["nvlinks"]:
                    link["state"] = 0 if state != 3 else 1
        edit_nvml(root, change)

    booting(2)  # IN_PROGRESS, links not trained yet
    d = Driver(root)
    assert not [f for f in d.at(T0).findings if f.code == "nvlink-down"]
    booting(1)  # NOT_STARTED (Fabric Manager not up yet)
    assert not [f for f in d.at(T0 + 30).findings if f.code == "nvlink-down"]
    booting(3)  # COMPLETED: the links trained
    assert d.at(T0 + 60).findings == ()
    set_link(root, 3, 17, state=0)  # a link that drops after registration is judged again
    (f,) = d.at(T0 + 90).findings
    assert (f.code, f.status, f.entity.index, f.entity.link) == ("nvlink-down", Status.FAIL, 3, 17)


def test_links_the_sku_has_are_expected_from_the_first_sample(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    set_link(root, 3, 17, state=0)  # never came up after boot
    edit_nvml(root, lambda data: data["gpus"][5]["nvlinks"].pop())  # link 17 not reported at all
    findings = Driver(root).at(T0).findings
    assert sorted((f.entity.index, f.entity.link, f.evidence["reported"], f.evidence["state"]) for f in findings) \
        == [(3, 17, True, 0), (5, 17, False, None)]
    assert all(f.code == "nvlink-down" and not f.evidence["was_active"] and "the SKU has 18 links" in f.message
               for f in findings)
    # Configured: a 12-link layout (e.g. A100) expects no link 17.
    assert Driver(root, {**CFG, "expected_links": 12}).at(T0).findings == ()


def a100_node(scenario_copy):
    """The H100 scenario with its SKU unknown and the NVLink layout of a real 8x A100 node (12 active links each,
    gpud's `nvidia-smi nvlink --status` capture)."""
    root = scenario_copy("h100-hgx-healthy")
    toml = root / "node.toml"
    toml.write_text(toml.read_text().replace('sku = "H100-SXM-HGX"', 'sku = "unknown"'))
    layout = smi_links((SMI / "gpud__nvidia-smi-nvlink-status__8xA100-SXM4-80GB.txt").read_text())

    def change(data):
        for gpu in data["gpus"]:
            gpu["nvlinks"] = [{"link": n, "state": 1, "errors": {c: 0 for c in nvlink_lanes.COUNTERS}}
                              for n in sorted(layout[gpu["index"]])]
    edit_nvml(root, change)
    return root


def test_unknown_sku_expects_the_links_it_saw_active(scenario_copy):
    root = a100_node(scenario_copy)
    assert "unknown" in (root / "node.toml").read_text()
    set_link(root, 2, 11, state=0)  # down before the first sample: no baseline says it should be up
    d = Driver(root)
    assert d.at(T0).findings == ()
    assert d.state["gpus"]["GPU-973565ff-45cf-12ea-4e91-33386720f7bb"]["baseline_active"] == 11
    # azurehpc's bad capture: GPU 6 with every link inactive.
    assert smi_links((SMI / "azurehpc__nvidia-smi-nvlink-s__A100-1gpu__BAD-all-links-inactive.txt").read_text())[6] \
        is None
    edit_nvml(root, lambda data: [e.update(state=0) for e in data["gpus"][6]["nvlinks"]])
    findings = d.at(T0 + 30).findings
    assert len(findings) == 12 and {f.entity.index for f in findings} == {6}
    assert all(f.evidence["was_active"] and "was active before" in f.message for f in findings)


def test_lost_gpu_is_reported_and_its_links_keep_their_state(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    edit_nvml(root, lambda data: data["gpus"][2]["errors"].update({"*": "GPU_IS_LOST"}))
    (f,) = d.at(T0 + 30).findings
    assert (f.code, f.status, f.entity.index) == ("gpu-lost", Status.FAIL, 2)
    assert "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957" in d.state["gpus"]  # baseline kept for its return


def test_no_nvlink_anywhere_is_not_applicable(scenario_copy):
    root = a100_node(scenario_copy)
    edit_nvml(root, lambda data: [g.update(nvlinks=[]) for g in data["gpus"]])
    node = Node.recorded_at(root)
    with pytest.raises(NotApplicable):
        CHECK.sample(node, CFG, {})
    # ...but not when links were seen before: then they are all down.
    state = {"gpus": {"GPU-566e6f65-c38e-b12f-4824-6944218668b9": {"links": {"0": {"active_seen": True}}}}}
    (f,) = CHECK.judge(state, CHECK.sample(node, CFG, state), CFG, T0).findings
    assert f.code == "nvlink-down" and f.evidence["reported"] is False


def no_links(root, *gpus):
    """GPUs whose NVLinks NVML does not expose: every link answers NOT_SUPPORTED / INVALID_ARGUMENT, which the
    source reads as no link at all (the real H200 VM capture records "nvlinks": [])."""
    edit_nvml(root, lambda data: [g.update(nvlinks=[]) for g in data["gpus"] if not gpus or g["index"] in gpus])


def test_the_only_gpu_reporting_no_link_is_skipped(scenario_copy):
    root = scenario_copy("h200-vm-1gpu")  # a real capture: one H200 passed through to a VM, "nvlinks": []
    with pytest.raises(NotApplicable, match="NOT_SUPPORTED or INVALID_ARGUMENT for every NVLink of GPU 0, the only "
                                            "GPU on this node: NVLink is not exposed to this system"):
        Driver(root).at(T0)
    # Told that the links exist, the check judges them: all 18 down.
    findings = Driver(root, {**CFG, "expect_nvlink": "yes"}).at(T0).findings
    assert len(findings) == 18 and {(f.code, f.status, f.action) for f in findings} == {
        ("nvlink-down", Status.FAIL, Action.RESET_GPU)}
    with pytest.raises(NotApplicable, match="expect_nvlink = \"no\""):
        Driver(root, {**CFG, "expect_nvlink": "no"}).at(T0)


def test_several_gpus_none_reporting_a_link_is_unknown_never_fail(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    no_links(root)
    d = Driver(root)
    for t in (T0, T0 + 30, T0 + 3600):  # stays UNKNOWN: time does not turn it into a fault
        (f,) = d.at(t).findings
        assert (f.code, f.status, f.action, f.entity.kind) == ("nvlink-not-exposed", Status.UNKNOWN, Action.NONE,
                                                               "node")
        assert 'expect_nvlink = "no"' in f.message and "each of the 8 GPUs" in f.message
        assert f.evidence == {"gpus": list(range(8)), "expected_links": 18, "sku": "H100-SXM-HGX"}
    with pytest.raises(NotApplicable):
        Driver(root, {**CFG, "expect_nvlink": "no"}).at(T0)
    assert len(Driver(root, {**CFG, "expect_nvlink": "yes"}).at(T0).findings) == 8 * 18


def test_one_gpu_without_links_beside_gpus_with_them_fails(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    no_links(root, 4)  # an asymmetry on one board is a fault, not a deployment
    findings = Driver(root).at(T0).findings
    assert len(findings) == 18 and {(f.entity.index, f.code, f.status) for f in findings} == {
        (4, "nvlink-down", Status.FAIL)}
    assert all(not f.evidence["reported"] for f in findings)


def test_links_once_reported_and_now_gone_fail_on_every_gpu(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    d = Driver(root)
    assert d.at(T0).findings == ()
    no_links(root)  # every GPU stops reporting its links: not "not exposed", they were there
    findings = d.at(T0 + 30).findings
    assert len(findings) == 8 * 18 and all(f.evidence["was_active"] and f.status is Status.FAIL for f in findings)
    # The same after a restart of the daemon: the persisted state remembers the links.
    assert len(d.at(T0 + 60, restart=True).findings) == 8 * 18


def test_a_single_gpu_that_had_links_is_not_skipped(scenario_copy):
    root = scenario_copy("h200-vm-1gpu")
    edit_nvml(root, lambda data: data["gpus"][0].update(nvlinks=[
        {"link": n, "state": 1, "errors": {c: 0 for c in nvlink_lanes.COUNTERS}} for n in range(18)]))
    d = Driver(root)
    assert d.at(T0).findings == ()
    no_links(root)
    findings = d.at(T0 + 30).findings
    assert len(findings) == 18 and all(f.evidence["was_active"] for f in findings)


def test_expect_nvlink_is_checked():
    from gpuwarden.agent.core.errors import ConfigError
    with pytest.raises(ConfigError, match="expect_nvlink must be auto, yes or no"):
        CHECK.sample(Node.recorded_at(Path(__file__).resolve().parent.parent / "fixtures/nodes/h100-hgx-healthy"),
                     {**CFG, "expect_nvlink": "maybe"}, {})


# ---------------------------------------------------------------- error rates
def test_error_rates_warn_and_fail_then_age_out(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    # Counters carried from before the agent started are not a rate: only increases after the first sample count.
    set_link(root, 0, 3, crc_flit=1000, replay=40, recovery=2)
    d = Driver(root)
    assert d.at(T0).findings == ()
    set_link(root, 0, 3, crc_flit=1003)
    (f,) = d.at(T0 + 30).findings
    assert (f.code, f.status, f.action) == ("nvlink-crc-errors", Status.WARN, Action.MONITOR)
    assert f.evidence["increase"]["crc_flit"] == 3 and f.evidence["per_minute"]["crc_flit"] == 6.0
    assert f.entity.link == 3 and f.entity.index == 0
    set_link(root, 0, 3, replay=42)
    j = d.at(T0 + 60)
    assert {f.code for f in j.findings} == {"nvlink-crc-errors", "nvlink-replay-errors"}  # CRC still in the window
    assert metric(j, "gpuwarden_nvlink_link_error_rate_per_minute", gpu="0", link="3", counter="replay") == 2.0
    assert metric(j, "gpuwarden_nvlink_link_errors", gpu="0", link="3", counter="replay") == 42.0
    assert metric(j, "gpuwarden_nvlink_error_rate_per_minute", gpu="0", counter="replay") == 2.0  # GPU 0's total
    assert metric(j, "gpuwarden_nvlink_errors", gpu="0", counter="crc_flit") == 1003.0
    assert {m.labels["link"] for m in j.metrics if "link" in m.labels} == {"3"}
    set_link(root, 0, 3, recovery=3)
    j = d.at(T0 + 90)
    rec = next(f for f in j.findings if f.code == "nvlink-recovery-errors")
    assert (rec.status, rec.action) == (Status.FAIL, Action.DRAIN)
    assert {f.code for f in j.findings} == {"nvlink-replay-errors", "nvlink-recovery-errors"}  # CRC aged out
    assert d.at(T0 + 150).findings == ()  # a quiet minute: the window is empty again


def test_crc_storm_fails_at_dcgms_100_per_second(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    set_link(root, 3, 0, crc_data=2_999)  # 100/s over 30 s would be 3000: still a warning
    (f,) = d.at(T0 + 30).findings
    assert f.status is Status.WARN
    set_link(root, 3, 0, crc_data=2_999 + 30 * 150)
    (f,) = d.at(T0 + 60).findings
    assert (f.code, f.status, f.action) == ("nvlink-crc-errors", Status.FAIL, Action.DRAIN)
    assert "above the 100/s" in f.message


def test_counter_reset_is_neither_negative_nor_huge(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_link(root, 1, 7, crc_flit=50_000, replay=9_000)
    d = Driver(root)
    d.at(T0)
    set_link(root, 1, 7, crc_flit=2, replay=0)  # GPU reset / driver reload: counters start again from zero
    (f,) = d.at(T0 + 30).findings
    assert f.code == "nvlink-crc-errors" and f.status is Status.WARN
    assert f.evidence["increase"] == {"replay": 0, "recovery": 0, "crc_flit": 2, "crc_data": 0}
    assert f.evidence["resets"] == 1
    rates = [m.value for m in d.at(T0 + 60).metrics if m.name == "gpuwarden_nvlink_error_rate_per_minute"]
    assert min(rates) >= 0.0 and max(rates) <= 4.0


def test_a_gap_while_the_daemon_was_down_is_averaged_over_the_gap(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    set_link(root, 2, 9, crc_flit=60)  # 60 CRC errors over the hour the daemon was down: 1/min, not 120/min
    (f,) = d.at(T0 + 3600, restart=True).findings
    assert f.code == "nvlink-crc-errors" and f.status is Status.WARN
    assert f.evidence["window_s"] == 3600 and f.evidence["per_minute"]["crc_flit"] == 1.0


def test_clock_standing_still_adds_no_interval(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    set_link(root, 0, 0, crc_flit=5)
    assert d.at(T0).findings == ()  # same timestamp: the counters move on, no rate from a zero-length interval
    assert d.state["gpus"]["GPU-f1f125ab-e3b5-c66a-ab3f-9862557b394e"]["links"]["0"]["counters"]["crc_flit"] == 5


# ---------------------------------------------------------------- metrics
def exposition(metrics):
    return render(metrics)


def test_metrics_are_lint_clean(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    d = Driver(root)
    d.at(T0)
    set_link(root, 1, 5, state=0)
    j = d.at(T0 + 30)
    names = {m.name for m in j.metrics}
    assert names == {"gpuwarden_nvlink_links_active", "gpuwarden_nvlink_links_down", "gpuwarden_nvlink_errors",
                     "gpuwarden_nvlink_error_rate_per_minute", "gpuwarden_nvlink_link_up",
                     "gpuwarden_nvlink_link_errors", "gpuwarden_nvlink_link_error_rate_per_minute"}
    assert all(m.kind == "gauge" and re.fullmatch(r"[a-z_]+", k) for m in j.metrics for k in m.labels)
    text = exposition(j.metrics)
    promtool_lint(text)


def test_judge_never_changes_the_state_it_is_given(scenario_copy):
    # The daemon hands judge the last judgement's state itself (no JSON in between): windows growing and ageing, a
    # counter reset and a link dropping must all leave that state as it was.
    import copy

    root = scenario_copy("gb200-nvl72-healthy")
    node, state = Node.recorded_at(root), {}
    steps = [(0, {}), (30, {"crc_flit": 5}), (60, {"replay": 9}), (90, {"crc_flit": 1}), (120, {"state": 0}),
             (400, {})]
    for t, change in steps:
        if change:
            set_link(root, 0, 3, **change)
        smp = CHECK.sample(node, CFG, state)
        given = copy.deepcopy(state)
        j = CHECK.judge(state, smp, CFG, T0 + t)
        assert state == given
        state = j.state
    assert state["gpus"] and any(f.code == "nvlink-down" for f in j.findings)

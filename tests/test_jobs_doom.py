"""The doom rules (agent/jobs/doom_rules.toml, applied by agent/jobs/doom.py): which findings end which job's
collectives. The findings are the real checks' (the xid check on real driver lines, ib_downtime's judgement of a port's
outage, the per-GPU reading of a lost GPU); the job is the bundled tray's (Slurm job 4242 on GPUs 0-3, two nodes)."""
from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest
from conftest import NODES
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.job import Figure
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.per_gpu import device_error_finding
from gpuwarden.agent.jobs import doom
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import ib_downtime, job_process, xid
from gpuwarden.checks import job_discovery as discover
from gpuwarden.checks.xid_catalog import load_catalog

BOOT = "8d2f4b61-0c3e-4a97-b5d8-2e61f09a7c14"
GPU0 = Entity("gpu", "GPU-f1f125ab-e3b5-c66a-ab3f-9862557b394e", 0, "0008:01:00.0")


@pytest.fixture(scope="module")
def job():
    job_process.forget()
    ports = [(f"mlx5_{i}/1", True) for i in range(4)]
    (found,) = discover.discover(Node.recorded_at(NODES / "gb200-nvl72-job"), ports, 0.0).jobs
    return found


def xid_finding(number: int, pci: str = "0008:01:00", text: str = "") -> Finding:
    line = f"NVRM: Xid (PCI:{pci}): {number}, pid=12596, name=python3, {text or 'a driver message'}"
    (f,) = xid.analyze_text(f"[ 100.000000] {line}\n", "kmsg")[0]
    return f


def test_xid_79_on_a_gpu_of_the_job_dooms_it(job):
    f = xid_finding(79, text="GPU has fallen off the bus.")
    (d,) = doom.decide([f], [job], 50.0, BOOT)
    assert d.rule == "xid" and d.job is job and d.reason == "xid 79 gpu 0008:01:00.0 (its GPU 0)"
    assert d.key == f"job:slurm:4242.0:xid:xid:79:0008:01:00.0:{BOOT}" and d.fault_at == 50.0


@pytest.mark.parametrize("number, dooms", [
    (79, True), (48, True), (95, True), (119, True), (62, True), (140, True),  # reset the GPU or restart the machine
    (13, False), (31, False), (43, False), (94, False),  # the application's own fault: it gets the error itself
    (45, False), (63, False), (92, False),  # teardown after another XID or a cancel; informational
    (74, False), (144, False),  # NVLink workflows: a human decodes which bits matter; a link down is nvlink-down's
])
def test_an_xid_dooms_by_its_catalogue_bucket(job, number, dooms):
    f = xid_finding(number)
    assert bool(doom.decide([f], [job], 0.0, BOOT)) is dooms, (number, load_catalog()[number].bucket, f.action)


def test_the_xid_rule_is_the_catalogues_buckets_not_a_list_of_xids():
    rules = tomllib.loads(doom.RULES_FILE.read_text())["rule"]
    (rule,) = [r for r in rules if r["name"] == "xid"]
    assert "codes" not in rule and set(rule["buckets"]) <= {info.bucket for info in load_catalog().values()}
    dooming = sorted(n for n, info in load_catalog().items() if info.bucket in rule["buckets"])
    assert 79 in dooming and 48 in dooming and 13 not in dooming and len(dooming) >= 15


def test_xid_154_dooms_by_the_recovery_the_driver_names(job):
    reset = xid_finding(154, text="GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    none = xid_finding(154, text="GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")
    assert [d.rule for d in doom.decide([reset], [job], 0.0, BOOT)] == ["xid"]
    assert doom.decide([none], [job], 0.0, BOOT) == []


def test_an_xid_on_a_gpu_the_job_does_not_use_is_not_its(job):
    elsewhere = replace(job, gpus=job.gpus[1:])  # the job on GPUs 1-3 only
    assert doom.decide([xid_finding(79)], [elsewhere], 0.0, BOOT) == []


def test_a_lost_gpu_dooms_its_job(job):
    lost = device_error_finding("ecc", GPU0, NvmlError("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST", 0))
    (d,) = doom.decide([lost], [job], 0.0, BOOT)
    assert d.rule == "gpu-lost" and d.reason == "ecc gpu-lost GPU0 0008:01:00.0 (its GPU 0)"


def nvlink_down(gpu: int = 0, link: int = 5) -> Finding:
    return Finding("nvlink_lanes", "nvlink-down", Entity("nvlink", f"GPU-x/link{link}", gpu, "0008:01:00.0", link),
                   Status.FAIL, "down", Action.RESET_GPU, {"down_since": 1.0})


def test_an_nvlink_down_dooms_a_job_that_talks_over_nvlink(job):
    (d,) = doom.decide([nvlink_down()], [job], 0.0, BOOT)
    assert d.rule == "nvlink-down" and d.reason.endswith("(its GPU 0's NVLink 5)")
    one_gpu_here = replace(job, gpus=job.gpus[:1], nodes=Figure(1, "test"))  # one GPU, one node: no NVLink traffic
    assert doom.decide([nvlink_down()], [one_gpu_here], 0.0, BOOT) == []
    # ... unless the job spans the nodes of one NVLink domain (an NVL72 rack): its traffic leaves the node over NVLink
    spanning = replace(one_gpu_here, nodes=Figure(2, "test"))
    assert doom.decide([nvlink_down()], [spanning], 0.0, BOOT, domain_spans_nodes=False) == []
    assert [d.rule for d in doom.decide([nvlink_down()], [spanning], 0.0, BOOT, domain_spans_nodes=True)] == \
        ["nvlink-down"]


def sxid(fatal: bool) -> Finding:
    return Finding("nvswitch_sxid", "sxid-20034", Entity("nvswitch", "0000:05:00.0", pci="0000:05:00.0"),
                   Status.FAIL if fatal else Status.WARN, "sxid", Action.DRAIN if fatal else Action.MONITOR,
                   {"sxid": 20034, "fatal": fatal})


def test_a_fatal_nvswitch_sxid_dooms_the_jobs_that_cross_it(job):
    assert [d.rule for d in doom.decide([sxid(True)], [job], 0.0, BOOT)] == ["nvswitch-fatal"]
    assert doom.decide([sxid(False)], [job], 0.0, BOOT) == []


def port_finding(down_for: float, since: float = 1000.0) -> Finding:
    """ib_downtime's own finding for mlx5_1/1 down `down_for` seconds (its judge's state, advanced)."""
    cfg = ib_downtime.SPEC.defaults
    state = ib_downtime.advance(None, False, "DOWN", 0, "0002:03:00.0", since, cfg)
    state = ib_downtime.advance(state, False, "DOWN", 0, "0002:03:00.0", since + down_for, cfg)
    f = ib_downtime.decide("mlx5_1/1", state, since + down_for, cfg)
    assert f is not None and f.code == "ib-port-down"
    return f


def test_a_port_down_dooms_the_job_only_past_its_effective_ib_timeout(job):
    seven = replace(job, effective_ib_timeout_s=Figure(7.516, "NCCL_IB_TIMEOUT=18"))
    assert doom.decide([port_finding(5.0)], [seven], 1005.0, BOOT) == []  # NCCL rides 5 s out
    (d,) = doom.decide([port_finding(8.0)], [seven], 1008.0, BOOT)
    assert d.rule == "ib-port-down" and d.incident == "ib-port-down:mlx5_1/1:1000.000"
    assert d.fault_at == pytest.approx(1007.516)  # when the outage passed the job's timeout, not when it was seen
    # The same outage a second later is the same incident: one action.
    assert doom.decide([port_finding(9.0)], [seven], 1009.0, BOOT)[0].key == d.key


def test_a_port_dooms_no_job_that_does_not_use_it_or_the_network(job):
    f = port_finding(60.0)
    assert doom.decide([f], [replace(job, ports=("mlx5_0/1",))], 0.0, BOOT) == []  # NCCL_IB_HCA leaves it out
    assert doom.decide([f], [replace(job, nodes=Figure(1, "t"))], 0.0, BOOT) == []  # one node: no network
    assert doom.decide([f], [replace(job, nodes=Figure(None, "t"))], 0.0, BOOT) == []  # not known: not guessed
    assert doom.decide([f], [replace(job, ib_disabled=True)], 0.0, BOOT) == []  # sockets
    never = replace(job, effective_ib_timeout_s=Figure(float("inf"), "NCCL_IB_TIMEOUT=0"))
    assert doom.decide([f], [never], 0.0, BOOT) == []  # NCCL never gives up on the rail


def test_what_does_not_end_collectives_never_touches_a_job(job):
    throttle = Finding("clock_events", "hw-slowdown", GPU0, Status.FAIL, "HW slowdown", Action.DRAIN, {})
    corrected = Finding("ecc", "ecc-corrected-rate", GPU0, Status.WARN, "corrected", Action.MONITOR, {})
    flap = replace(port_finding(60.0), status=Status.WARN, action=Action.MONITOR, code="ib-port-flapping")
    warned_xid = replace(xid_finding(79), status=Status.WARN)
    assert doom.decide([throttle, corrected, flap, warned_xid], [job], 0.0, BOOT) == []


def test_no_job_of_an_unknown_scheduler_is_doomed(job):
    unknown = replace(job, job=replace(job.job, scheduler="unknown", id="pid-12596"))
    assert doom.decide([xid_finding(79)], [unknown], 0.0, BOOT) == []


@pytest.mark.parametrize("data, message", [
    ({"rule": [{"name": "x", "hits": "gpu", "colour": "red"}]}, "unknown key 'colour'"),
    ({"rule": [{"name": "x", "hits": "rack"}]}, "hits = one of"),
    ({"rule": [{"name": "x", "hits": "gpu", "recovery_actions": ["FIX"]}]}, "'FIX' is not an action"),
    ({}, "no [[rule]]"),
])
def test_a_rules_file_that_is_wrong_says_where(data, message):
    with pytest.raises(ValueError) as exc:
        doom.parse_rules(data, "rules.toml")
    assert message in str(exc.value) and str(exc.value).startswith("rules.toml")

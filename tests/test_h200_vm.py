"""The real recording of one H200 passed through to a VM (fixtures/nodes/h200-vm-1gpu): a healthy GPU with no NVLink,
no NVSwitch, no Fabric Manager and no NIC. Preflight passes with nothing undecided, analyze of its kernel log agrees
with preflight's kernel-log checks, and the daemon keeps the node HEALTHY: nothing here may drain it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import ALL, KERNEL_CONSUMERS, PASSIVE, all_specs
from prometheus_client import generate_latest

VM = "fixtures/nodes/h200-vm-1gpu"
QUICK = {
    "xid": "ok", "nvswitch_sxid": "ok", "ecc": "ok",
    "ib_port": "skipped",  # no InfiniBand/RoCE port
    # The GPU link is at Gen5 x16 of Gen5 x16; with no RDMA NIC at all there is no GPU<->NIC placement to judge,
    # which is said as a note (OK), not as "could not look" (UNKNOWN).
    "pcie_link": "ok",
    "nvlink_lanes": "skipped",  # NVLink is not exposed to this system
    "fabric": "skipped",  # no NVSwitch here: Fabric Manager is not this system's
    "pcie_aer": "skipped",  # the VM's root port gives no AER statistics
    "jobs": "ok",  # no process on its GPU: no job to list
}


def gpuwarden(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "160"})


def test_preflight_quick_passes_with_nothing_undecided():
    proc = gpuwarden("preflight", "--root", VM, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert {r["check"]: r["status"] for r in report["results"]} == QUICK
    assert not [f for f in report["findings"] if f["status"] in ("fail", "unknown", "warn")]
    by_check = {r["check"]: r for r in report["results"]}
    assert "NOT_SUPPORTED or INVALID_ARGUMENT for every NVLink of GPU 0" in by_check["nvlink_lanes"]["error"]
    assert "NVLink is not exposed to this system" in by_check["nvlink_lanes"]["error"]
    assert "no NVSwitch on this system's PCI bus" in by_check["fabric"]["error"]
    (note,) = by_check["pcie_link"]["findings"]
    assert (note["code"], note["evidence"]["reason"]) == ("pcie-affinity-not-checked", "no-rdma-nic")


def test_full_level_replays_the_real_burn_in():
    proc = gpuwarden("preflight", "--root", VM, "--level", "full", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = {r["check"]: r["status"] for r in json.loads(proc.stdout)["results"]}
    assert statuses == {**QUICK, "burnin": "ok", "peer_p2p": "skipped", "nccl_allreduce": "skipped",
                        "rdma_loopback": "skipped", "dcgm_diag": "skipped", "ecc_memtest": "skipped"}
    assert list(statuses) == [spec.name for spec in ALL]


def test_analyze_of_its_kernel_log_agrees_with_preflight():
    analyzed = json.loads(gpuwarden("analyze", "--json", f"{VM}/kmsg").stdout)
    assert (analyzed["exit_code"], analyzed["findings"]) == (0, [])
    replayed = json.loads(gpuwarden("preflight", "--root", VM, "--json", "--checks", "xid,nvswitch_sxid").stdout)
    assert [(r["check"], r["status"], r["findings"]) for r in replayed["results"]] == [
        ("xid", "ok", []), ("nvswitch_sxid", "ok", [])]


@pytest.fixture
def daemon(scenario_copy, tmp_path):
    root = scenario_copy("h200-vm-1gpu")
    specs = all_specs()
    # Short graces, so a finding that would move the node shows within the test's wait.
    policy = dict(DEFAULT_POLICY, quarantine_after_s=0.5, unknown_grace_s=0.5)
    store = Store(tmp_path / "state" / "state.db")
    collector = DaemonCollector()
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(specs), store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), collector,
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, policy=policy))
    d.start()
    yield d, collector
    d.stop()
    store.close()


def test_the_daemon_keeps_the_vm_healthy(daemon):
    d, collector = daemon
    names = {spec.name for spec in PASSIVE} | {c.name for c in KERNEL_CONSUMERS}
    wait_for(lambda: names <= set(d.results()), what="a first result of every daemon check")
    results = d.results()
    assert results["nvlink_lanes"].status.value == "skipped" and results["fabric"].status.value == "skipped"
    assert not [(n, r.status.value) for n, r in results.items() if r.status.value in ("fail", "unknown", "warn")]
    # A second round of every check, past the graces: still nothing that moves the node.
    seen = {n: id(r) for n, r in results.items()}
    wait_for(lambda: sum(id(r) != seen.get(n) for n, r in d.results().items()) >= 1, what="later results")
    assert d.record.state is NodeState.HEALTHY
    assert d.adapter.actions() == []
    text = generate_latest(registry_for(collector)).decode()
    assert 'gpuwarden_node_state{state="healthy"} 1.0' in text
    assert "gpuwarden_fabric_manager_up" not in text


def test_a_nic_that_nvidia_smi_does_not_list_stays_unknown(scenario_copy):
    """No NIC at all is "nothing to place"; a NIC on the bus that `nvidia-smi topo -m` does not list is a view that
    could not be read."""
    from gpuwarden.checks.pcie_link import CHECK as PCIE

    root = scenario_copy("h200-vm-1gpu", with_tools=True)
    node_cfg = dict(PCIE.defaults)
    (note,) = PCIE.run(Node.recorded_at(root), node_cfg)
    assert (note.code, note.status.value) == ("pcie-affinity-not-checked", "ok")
    hca = root / "sys/bus/pci/devices/0000:00:07.0"  # a ConnectX-7 passed through too, its driver not bound
    hca.mkdir()
    for name, value in (("vendor", "0x15b3"), ("device", "0x1021"), ("class", "0x020700")):
        (hca / name).write_text(value + "\n")
    (f,) = PCIE.run(Node.recorded_at(root), node_cfg)
    assert (f.code, f.status.value) == ("pcie-affinity-unknown", "unknown") and "lists no NIC" in f.message

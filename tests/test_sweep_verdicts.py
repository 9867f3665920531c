"""The sweep's plan and verdicts, and the node's side of them: which idle nodes are grouped how, the findings a
sweep writes for each node, the daemon check that reads them back as hostile input, and a verdict moving a real
daemon's state machine on a recorded node."""
from __future__ import annotations

import json
import os
import time

import pytest
from conftest import wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.scheduler import NodeView, Service
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.fleet.sweep.model import Outcome
from gpuwarden.agent.fleet.sweep.sweep import Collective, Report, findings_for, idle_nodes, plan_phases, write_results
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs, nccl_sweep

IDLE = dict(service=Service.IN_SERVICE, jobs=0)


def view(name, domain=None, **kw):
    return NodeView(name, **{**IDLE, **kw}, domain=domain)


# -- which nodes, which groups ---------------------------------------------------------------------------------------
def test_sweep_takes_only_idle_nodes_unknown_work_is_not_idle():
    views = [view("n1"), view("n2", jobs=1), view("n3", jobs=None), view("n4", service=Service.CORDONED),
             view("n5", service=Service.DOWN), view("n6", quarantined=True, service=Service.DRAINED),
             view("n7", spare=True, service=Service.DRAINED, reason="gpuwarden: spare"), view("n8"),
             view("../etc")]
    assert [v.name for v in idle_nodes(views)] == ["n1", "n8"]
    assert [v.name for v in idle_nodes(views, include_spares=True)] == ["n1", "n7", "n8"]


def test_sweep_plans_domain_groups_then_groups_across_domains():
    nodes = [view(f"a{i}", "rackA") for i in range(1, 7)] + [view(f"b{i}", "rackB") for i in range(1, 7)]
    domain, fabric = plan_phases(nodes, group_nodes=4, cross_domain=True)
    assert domain.name == "domain" and fabric.name == "fabric"
    # each domain's six idle nodes in two groups of three, never across domains
    assert domain.groups == (("a1", "a2", "a3"), ("a4", "a5", "a6"), ("b1", "b2", "b3"), ("b4", "b5", "b6"))
    # across: every group holds nodes of both domains, disjoint, covering all
    assert all({n[0] for n in g} == {"a", "b"} for g in fabric.groups)
    flat = [n for g in fabric.groups for n in g]
    assert sorted(flat) == sorted(v.name for v in nodes) and len(flat) == len(set(flat))


def test_sweep_plans_hgx_nodes_only_across_the_fabric_and_never_a_group_of_one():
    nodes = [view(f"h{i}") for i in range(1, 6)]  # no NVLink domain across nodes
    (fabric,) = plan_phases(nodes, group_nodes=2, cross_domain=True)
    assert fabric.name == "fabric" and all(len(g) >= 2 for g in fabric.groups)
    assert sorted(n for g in fabric.groups for n in g) == [f"h{i}" for i in range(1, 6)]
    assert plan_phases([view("h1")], 8, True) == []
    assert plan_phases(nodes, 8, cross_domain=False) == []


# -- verdicts ---------------------------------------------------------------------------------------------------------
def ran(nodes, outcome, reasons=()):
    return Collective("domain", 1, "sweep", tuple(nodes), outcome, tuple(reasons), {}, "exited", 1.0, None)


def report():
    r = Report("20261201T000000Z-abc123", 1000.0, "slurm", ["n1", "n2", "n3", "n4", "n5", "n6"])
    r.tests = [ran(("n1", "n2", "n3"), Outcome.SLOW, ["busbw 120 GB/s < 0.8 x 400 GB/s (config)"]),
               ran(("n4", "n5", "n6"), Outcome.PASS), ran(("n3", "n4"), Outcome.SLOW, ["busbw low"]),
               ran(("n1", "n2"), Outcome.PASS), ran(("n5", "n6"), Outcome.WRONG)]
    r.culprit_nodes = {"n3": "sweep-slow"}
    r.culprit_links = [("n5", "n6")]
    r.passed = {"n1", "n2", "n4"}
    r.ended = 1100.0
    return r


def test_sweep_findings_name_the_bad_node_both_ends_of_a_bad_link_and_clear_the_rest():
    found = findings_for(report())
    assert found["n1"] == [] and found["n2"] == [] and found["n4"] == []
    (slow,) = found["n3"]
    assert (slow.code, slow.status, slow.action) == ("sweep-slow", Status.FAIL, Action.DRAIN)
    assert "busbw 120 GB/s" in slow.message and slow.evidence["failed"]
    ends = {n: found[n][0] for n in ("n5", "n6")}
    assert {f.code for f in ends.values()} == {"sweep-bad-link"}
    assert ends["n5"].evidence["peer"] == "n6" and ends["n6"].evidence["peer"] == "n5"
    monitor = findings_for(report(), link_action="monitor")
    assert monitor["n5"][0].status is Status.WARN and monitor["n5"][0].action is Action.MONITOR


def test_sweep_verdict_files_round_trip_through_the_nodes_check(tmp_path):
    written = write_results(tmp_path, report())
    assert set(written) == {"n1", "n2", "n3", "n4", "n5", "n6"}
    assert json.loads((tmp_path / "reports" / "20261201T000000Z-abc123.json").read_text())["exit_code"] == 1
    cfg = {"results_dir": str(tmp_path), "node_name": "n3", "hold_s": 600.0}

    class N:
        hostname = "ignored-when-node-name-is-set"

    j = nccl_sweep.judge({}, nccl_sweep.sample(N, cfg, {}), cfg, now=1200.0)
    (f,) = j.findings
    assert (f.code, f.entity.id, f.action) == ("sweep-slow", "n3", Action.DRAIN)
    assert j.wake_at == 1700.0 and f.evidence["holds_until"] == 1700.0
    assert nccl_sweep.judge({}, nccl_sweep.sample(N, cfg, {}), cfg, now=1700.0).findings == ()  # the hold ended
    passed = nccl_sweep.judge({}, nccl_sweep.sample(N, {**cfg, "node_name": "n1"}, {}), cfg, now=1200.0)
    assert passed.findings == () and passed.metrics[0].value == 1100.0
    missing = nccl_sweep.judge({}, nccl_sweep.sample(N, {**cfg, "node_name": "n9"}, {}), cfg, now=1200.0)
    assert missing.findings == ()  # no sweep has judged it: nothing to say


@pytest.mark.parametrize("write, why", [
    (lambda p: p.write_text("{not json"), "not JSON"),
    (lambda p: p.write_text("x" * (nccl_sweep.MAX_BYTES + 1)), "larger than"),
    (lambda p: p.write_text(json.dumps({"format": 1, "node": "n9", "sweep_id": "s", "time": 1.0, "findings": []})),
     "not n3"),
    (lambda p: p.write_text(json.dumps({"format": 1, "node": "n3", "sweep_id": "s", "time": 1e308 * 10,
                                        "findings": []})), "time"),
    (lambda p: p.write_text(json.dumps({"format": 1, "node": "n3", "sweep_id": "s", "time": 9e9, "findings": []})),
     "time"),
    (lambda p: p.write_text(json.dumps({"format": 1, "node": "n3", "sweep_id": "s", "time": 1.0, "findings": [
        {"check": "nccl_sweep", "code": "x", "entity": {"kind": "node", "id": "n3"}, "status": "fail",
         "message": "m", "action": "SERVICE", "evidence": {}}]})), "asks for a drain at most"),
    (lambda p: p.write_text(json.dumps({"format": 1, "node": "n3", "sweep_id": "s", "time": 1.0, "findings": [
        {"check": "xid", "code": "79", "entity": {"kind": "node", "id": "n3"}, "status": "fail",
         "message": "m", "action": "DRAIN", "evidence": {}}]})), "only nccl_sweep findings"),
    (lambda p: os.symlink("/etc/passwd", p), "symbolic link"),
    (lambda p: p.mkdir(), "not a regular file"),
])
def test_sweep_verdict_that_cannot_be_used_is_unknown_naming_the_file(tmp_path, write, why):
    path = tmp_path / "nodes" / "n3.json"
    path.parent.mkdir(parents=True)
    write(path)
    cfg = {"results_dir": str(tmp_path), "node_name": "n3", "hold_s": 600.0}
    j = nccl_sweep.judge({}, nccl_sweep.sample(None, cfg, {}), cfg, now=1000.0)
    (f,) = j.findings
    assert f.status is Status.UNKNOWN and f.code == "sweep-verdict-unreadable"
    assert str(path) in f.message and why in f.message


def test_sweep_node_name_that_would_leave_the_folder_is_refused(tmp_path):
    cfg = {"results_dir": str(tmp_path), "node_name": "../../etc/passwd", "hold_s": 600.0}
    (f,) = nccl_sweep.judge({}, nccl_sweep.sample(None, cfg, {}), cfg, now=1000.0).findings
    assert f.status is Status.UNKNOWN and "cannot name a verdict file" in f.message


def test_sweep_check_reads_where_the_sweep_writes_and_the_schedulers_node_name(tmp_path):
    cfg = config.load(all_specs(), None)
    assert cfg.for_check("nccl_sweep")["results_dir"] == cfg.sweep["results_dir"]
    path = tmp_path / "g.toml"
    path.write_text(f'[sweep]\nresults_dir = "{tmp_path}"\n[remediation]\nnode_name = "n3"\n')
    cfg = config.load(all_specs(), path, explicit=True)
    assert cfg.for_check("nccl_sweep")["results_dir"] == str(tmp_path)
    assert cfg.for_check("nccl_sweep")["node_name"] == "n3"


# -- a verdict through a real daemon --------------------------------------------------------------------------------
def test_sweep_verdict_drains_the_node_through_its_own_daemon_and_a_passing_sweep_clears_it(scenario_copy, tmp_path):
    root = scenario_copy("gb200-nvl72-healthy")
    node = Node.recorded_at(root)
    results = tmp_path / "sweep"
    cfg = config.defaults(all_specs())
    cfg.checks["nccl_sweep"]["results_dir"] = str(results)
    store = Store(tmp_path / "state" / "state.db")
    d = Daemon(node, list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE},
                             policy=dict(DEFAULT_POLICY, quarantine_after_s=0.5)))
    d.start()
    try:
        wait_for(lambda: "nccl_sweep" in d.results(), what="the sweep check's first look")
        assert d.record.state is NodeState.HEALTHY
        r = report()
        r.candidates = [node.hostname, "n9"]
        r.tests = [ran((node.hostname, "n9"), Outcome.HUNG, ["past its 900 s limit"])]
        r.culprit_nodes, r.culprit_links, r.passed = {node.hostname: "sweep-hang"}, [], {"n9"}
        r.ended = time.time()
        write_results(results, r)
        wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="the sweep's DRAIN to quarantine the node")
        (f,) = d.results()["nccl_sweep"].findings
        assert f.code == "sweep-hang" and f.entity.id == node.hostname
        wait_for(lambda: [a["action"] for a in d.adapter.actions()][:2] == ["cordon", "drain"],
                 what="the cordon and drain carried out")
        # A later sweep passes the node: its finding clears at the next look.
        r.culprit_nodes, r.passed, r.sweep_id = {}, {node.hostname, "n9"}, "20261201T010000Z-def456"
        r.tests = [ran((node.hostname, "n9"), Outcome.PASS)]
        write_results(results, r)
        wait_for(lambda: not d.results()["nccl_sweep"].findings, what="the passing verdict to clear the finding")
    finally:
        d.stop()
        store.close()


@pytest.mark.parametrize("line, needle", [
    ("latency_factor = 0.5", "latency_factor"),  # under 1: a group at its own baseline would be slow
    ("busbw_fraction = 1.5", "busbw_fraction"),
    ("small_max_bytes = 2147483648", "small_max_bytes"),  # not below large_min_bytes
    ("group_nodes = 1", "sweep.group_nodes"),
    ("launcher = \"ssh\"", "sweep.launcher"),
])
def test_sweep_config_out_of_range_is_an_error_naming_the_key_and_file(tmp_path, line, needle):
    from gpuwarden.agent.core.errors import ConfigError

    path = tmp_path / "g.toml"
    path.write_text(f"[sweep]\n{line}\n")
    with pytest.raises(ConfigError) as err:
        config.load(all_specs(), path, explicit=True)
    assert needle in str(err.value) and str(path) in str(err.value)

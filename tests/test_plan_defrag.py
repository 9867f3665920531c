"""`gpuwarden plan defrag`: the hostlist expander, the plan on hand-built fleets (checked against brute force), the
parsers on recorded Slurm 22.05 output and on hostile input, and the command on a real Slurm cluster with jobs placed
on it (tests/slurm_cluster.py)."""
from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
from pathlib import Path

import pytest
from gpuwarden.agent.act.adapters import slurm_hostlist
from gpuwarden.agent.act.adapters.slurm import SlurmAdapter
from gpuwarden.agent.cli import plan as plan_cli
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.scheduler import Service
from gpuwarden.agent.fleet.plan import defrag
from gpuwarden.agent.fleet.plan import defrag_model as pd
from gpuwarden.agent.fleet.plan import defrag_slurm as pds
from slurm_cluster import SlurmCluster, poll

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "slurm"
SQUEUE = FIXTURES / "squeue-22.05-defrag.json"
SINFO = FIXTURES / "sinfo-22.05-defrag.json"
PARTITIONS = FIXTURES / "scontrol-show-partition-22.05-defrag.txt"
RECORDED_AT = "1796095459"  # when the recorded files were taken (fixtures/slurm/README.md)
BATCH = pd.Policy(preemptible_partitions=frozenset({"batch"}))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    plan_cli.part_arguments(p, "defrag")
    return p


def run(capsys, *argv: str) -> tuple[int, str]:
    code = plan_cli.run_part(parser().parse_args(list(argv)))
    return code, capsys.readouterr().out


def rack(name: str, count: int, first: int = 1, **service: Service) -> list[pd.Node]:
    """`count` nodes `<name>-<i>` in domain `name`, in service unless named in `service` (spare: Service.DRAINED
    with the key `<node>_spare`)."""
    out = []
    for i in range(first, first + count):
        node = f"{name}-{i}"
        spare = f"{node.replace('-', '_')}_spare" in service
        state = service.get(f"{node.replace('-', '_')}_spare", service.get(node.replace("-", "_"), Service.IN_SERVICE))
        out.append(pd.Node(node, name, state, spare=spare, reason="gpuwarden: spare" if spare else None))
    return out


def job(jid: int, *nodes: str, partition: str = "batch", hours: float = 1.0, batch: bool = True,
        state: str = "RUNNING", requeue: bool = True) -> pd.Job:
    return pd.Job(str(jid), partition, tuple(nodes), state, batch, requeue, "", hours * 3600.0)


# -- hostlists -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, names", [
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("a,b", ["a", "b"]),
    ("n[01-03]", ["n01", "n02", "n03"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]n[1-2]", ["rack1n1", "rack1n2", "rack2n1", "rack2n2"]),
    ("gb-r1-[1-2],gb-r2-7,x[3]", ["gb-r1-1", "gb-r1-2", "gb-r2-7", "x3"]),
    ("", []),
    ("n5", ["n5"]),
])
def test_plan_defrag_hostlist_forms(text, names):
    assert slurm_hostlist.expand_hostlist(text) == names


@pytest.mark.parametrize("text, says", [
    ("n[0-999999999]", "more than"),  # refused from its count, never expanded
    ("a[0-9999]b[0-9999]", "more than"),
    ("n[1-3", "not closed"),
    ("n1-3]", "without '['"),
    ("n[[1-2]]", "nested"),
    ("n[3-1]", "backwards"),
    ("n[]", "bad range"),
    ("n[a-b]", "bad range"),
    ("n[1-3]x", "after the last"),
    ("n[1--3]", "bad range"),
    ("n[١-٣]", "bad range"),  # Arabic-Indic digits: str.isdigit, not ASCII
    ("a,,b", "empty name"),
    ("n1 m", "not a node name"),
    ("n[0000000001-0000000002]", "bad range"),  # more than nine digits
    ("x" * (slurm_hostlist.MAX_HOSTLIST + 1), "longer than"),
])
def test_plan_defrag_hostlist_hostile(text, says):
    with pytest.raises(ValueError) as exc:
        slurm_hostlist.expand_hostlist(text)
    assert says in str(exc.value)


def test_plan_defrag_hostlist_limit_counts_every_entry():
    with pytest.raises(ValueError, match="more than 5"):
        slurm_hostlist.expand_hostlist("a[1-3],b[1-3]", limit=5)
    assert len(slurm_hostlist.expand_hostlist("n[1-100000]")) == slurm_hostlist.MAX_HOSTS


# -- the plan on hand-built fleets -----------------------------------------------------------------------------------
def test_plan_defrag_fewest_jobs_first_then_node_hours_then_rack_name():
    nodes = rack("r1", 4) + rack("r2", 4) + rack("r3", 4)
    jobs = [
        job(1, "r1-1", "r1-2", "r1-3", hours=10),  # r1: one long job on three nodes (30 node-hours)
        job(2, "r2-1", hours=1), job(3, "r2-2", hours=1),  # r2: two short jobs (2 node-hours)
        job(4, "r3-1", "r3-2", "r3-3", hours=10),  # r3: as r1, same cost: r1 wins by name
    ]
    p = pd.plan(nodes, jobs, 4, BATCH)
    assert p.chosen.rack == "r1"
    assert [m.job.id for m in p.chosen.moves] == ["1"]
    assert p.chosen.slice_nodes == ("r1-4", "r1-1", "r1-2", "r1-3")
    assert p.chosen.free_now == ("r1-4",) and p.chosen.freed == ("r1-1", "r1-2", "r1-3")
    why = {r.rack: r.why for r in p.racks}
    assert why["r2"] == "needs 2 job(s) moved, r1 1"
    assert why["r3"] == "as good as r1, which comes first by name"
    # fewer node-hours decides between racks needing as many jobs
    jobs[0] = job(1, "r1-1", "r1-2", "r1-3", hours=11)
    p = pd.plan(nodes, jobs, 4, BATCH)
    assert p.chosen.rack == "r3"
    assert {r.rack: r.why for r in p.racks}["r1"] == "33.00 node-hours of work lost, r3 30.00"


def test_plan_defrag_free_rack_needs_no_move():
    nodes = rack("a", 3) + rack("b", 3)
    p = pd.plan(nodes, [job(1, "a-1")], 3, BATCH)
    assert p.chosen.rack == "b" and p.chosen.moves == () and p.chosen.slice_nodes == ("b-1", "b-2", "b-3")


def test_plan_defrag_never_moves_non_preemptible_or_interactive_work():
    nodes = rack("a", 4) + rack("b", 4)
    jobs = [job(1, "a-1", partition="prod"), job(2, "a-2"), job(3, "b-1", batch=False), job(4, "b-2"),
            job(5, "b-3", partition="interactive"), job(6, "a-3", state="COMPLETING")]
    policy = pd.Policy(frozenset({"batch", "interactive"}), interactive_partitions=frozenset({"interactive"}))
    assert pd.plan(nodes, jobs, 2, policy).chosen.moves[0].job.id == "2"  # a: a-4 free, a-2 freed
    p = pd.plan(nodes, jobs, 3, policy)
    assert p.chosen is None
    why = {r.rack: r.why for r in p.racks}
    assert "a-1 job 1 not preemptible (partition prod)" in why["a"] and "a-3 job 6 completing" in why["a"]
    assert "b-1 job 3 interactive (no batch script)" in why["b"]
    assert "b-3 job 5 interactive partition interactive" in why["b"]
    for size in range(1, 5):
        for policy_spares in (False, True):
            pol = pd.Policy(policy.preemptible_partitions, interactive_partitions=policy.interactive_partitions,
                            use_spares=policy_spares)
            p = pd.plan(nodes, jobs, size, pol)
            for r in p.racks:
                assert {m.job.id for m in r.moves} <= {"2", "4"}


def test_plan_defrag_job_spanning_racks_costs_all_its_nodes():
    nodes = rack("a", 2) + rack("b", 2)
    jobs = [job(1, "a-1", "b-1", "b-2", hours=1),  # spans both racks: 3 node-hours lost wherever it is moved
            job(2, "a-2", hours=2)]
    p = pd.plan(nodes, jobs, 2, BATCH)
    assert p.chosen.rack == "b"  # one job (job 1, 3 node-hours) frees b; a needs both
    assert p.chosen.moves[0].node_hours == pytest.approx(3.0)
    assert {r.rack: r.why for r in p.racks}["a"] == "needs 2 job(s) moved, b 1"
    p = pd.plan(nodes, [job(1, "a-1", "b-1", "b-2", hours=1), job(2, "a-2", hours=0.5)], 1, BATCH)
    assert p.chosen.rack == "a" and [m.job.id for m in p.chosen.moves] == ["2"]  # 0.5 < 3 node-hours


def test_plan_defrag_drained_and_down_nodes_never_in_the_slice():
    nodes = rack("a", 4, a_1=Service.DRAINED, a_2=Service.DOWN, a_3=Service.CORDONED) + rack("b", 3)
    jobs = [job(1, "b-1"), job(2, "b-2"), job(3, "b-3")]
    p = pd.plan(nodes, jobs, 1, BATCH)
    assert p.chosen.rack == "a" and p.chosen.slice_nodes == ("a-4",)
    p = pd.plan(nodes, jobs, 2, BATCH)
    assert p.chosen.rack == "b" and len(p.chosen.moves) == 2
    a = next(r for r in p.racks if r.rack == "a")
    assert not a.feasible and "a-1 drained" in a.why and "a-2 down" in a.why and "a-3 cordoned" in a.why


def test_plan_defrag_spares_only_with_use_spares():
    nodes = rack("a", 3, a_3_spare=Service.DRAINED) + rack("b", 3)
    jobs = [job(1, "a-1"), job(2, "b-1"), job(3, "b-2")]
    p = pd.plan(nodes, jobs, 2, BATCH)
    assert p.chosen.rack == "a" and p.chosen.slice_nodes == ("a-2", "a-1")  # the spare is not used
    assert "a-3" not in p.chosen.slice_nodes
    assert "a-3 spare" in pd.plan(nodes, jobs, 3, BATCH).racks[0].why
    p = pd.plan(nodes, jobs, 2, pd.Policy(BATCH.preemptible_partitions, use_spares=True))
    assert p.chosen.rack == "a" and p.chosen.moves == () and set(p.chosen.slice_nodes) == {"a-2", "a-3"}
    # a spare that does not answer is not usable either
    nodes = rack("a", 3, a_3_spare=Service.DOWN)
    p = pd.plan(nodes, [], 3, pd.Policy(use_spares=True))
    assert p.chosen is None and "a-3 spare, down" in p.racks[0].why


def test_plan_defrag_shared_node_frees_only_when_all_its_jobs_move():
    nodes = rack("a", 2)
    jobs = [job(1, "a-1", hours=1), job(2, "a-1", hours=1), job(3, "a-2", hours=5)]
    p = pd.plan(nodes, jobs, 1, BATCH)
    assert [m.job.id for m in p.chosen.moves] == ["3"]  # one job beats two, whatever their hours
    jobs[1] = job(2, "a-1", partition="prod")
    p = pd.plan(nodes, jobs, 2, BATCH)
    assert p.chosen is None and "a-1 job 2 not preemptible" in p.racks[0].why


def test_plan_defrag_no_rack_no_domain():
    nodes = [pd.Node("x1", None, Service.IN_SERVICE)]
    p = pd.plan(nodes, [], 1, BATCH)
    assert p.chosen is None and "no node carries an NVLink domain" in p.why and p.no_domain == ("x1",)
    p = pd.plan(rack("a", 2), [], 3, BATCH)
    assert p.chosen is None and p.racks[0].why.startswith("2 of 3 nodes can be freed (2 nodes; 2 healthy")


def _brute(nodes, jobs, size, policy):
    """Every set of movable jobs, each rack: the least (jobs, node-hours, rack)."""
    best = None
    for r in sorted({n.domain for n in nodes}):
        usable = [n.name for n in nodes if n.domain == r and pd._usable(n, policy)[0]]
        movable = [j for j in jobs if policy.movable(j)[0] and set(j.nodes) & set(usable)]
        for k in range(len(movable) + 1):
            for combo in itertools.combinations(movable, k):
                gone = {j.id for j in combo}
                free = [n for n in usable if all(j.id in gone for j in jobs if n in j.nodes)]
                if len(free) >= size:
                    cost = (k, round(sum(j.elapsed_s * len(j.nodes) for j in combo) / 3600, 6), r)
                    best = cost if best is None or cost < best else best
    return best


def test_plan_defrag_matches_brute_force_on_random_fleets():
    rng = random.Random(12)
    states = [Service.IN_SERVICE] * 6 + [Service.DRAINED, Service.DOWN]
    for _ in range(300):
        nodes = []
        for r in "abc":
            for i in range(rng.randint(2, 6)):
                spare = rng.random() < 0.1
                nodes.append(pd.Node(f"{r}{i}", r, Service.DRAINED if spare else rng.choice(states), spare))
        names = [n.name for n in nodes]
        if rng.random() < 0.5:  # nodes shared between jobs
            placed = [rng.sample(names, rng.choice([1, 1, 1, 2, 3])) for _ in range(rng.randint(0, 12))]
        else:  # whole nodes to one job each (the exact knapsack path)
            rng.shuffle(names)
            placed, at = [], 0
            while at < len(names) and rng.random() < 0.95:
                width = rng.choice([1, 1, 2, 3, 4])
                placed.append(names[at:at + width])
                at += width
        jobs = [job(j, *where, partition=rng.choice(["batch", "batch", "prod"]), hours=rng.choice([0.5, 1, 2, 3, 7]),
                    batch=rng.random() > 0.1) for j, where in enumerate(placed)]
        policy = pd.Policy(BATCH.preemptible_partitions, use_spares=rng.random() < 0.5)
        size = rng.randint(1, 4)
        p = pd.plan(nodes, jobs, size, policy)
        want = _brute(nodes, jobs, size, policy)
        if want is None:
            assert p.chosen is None
            continue
        assert (*p.chosen.cost, p.chosen.rack) == want
        assert len(p.chosen.slice_nodes) == size and p.chosen.exact
        moved = {m.job.id for m in p.chosen.moves}
        for n in p.chosen.slice_nodes:  # every node of the slice is usable and left with no job
            assert pd._usable(next(x for x in nodes if x.name == n), policy)[0]
            assert all(j.id in moved for j in jobs if n in j.nodes)


def test_plan_defrag_search_bound_gives_a_valid_plan_marked_not_exact():
    nodes = rack("a", 30)
    jobs = [job(i, f"a-{i}", hours=i) for i in range(1, 31)]
    p = pd.plan(nodes, jobs, 12, BATCH, search_limit=1000)
    assert not p.chosen.exact
    assert [m.job.id for m in p.chosen.moves] == [str(i) for i in range(1, 13)]  # the 12 cheapest
    exact = pd.plan(nodes, jobs, 2, BATCH, search_limit=1000)
    assert exact.chosen.exact and [m.job.id for m in exact.chosen.moves] == ["1", "2"]


def test_plan_defrag_full_rack_of_one_node_jobs_is_exact():
    nodes = rack("a", 18)
    jobs = [job(i, f"a-{i}", hours=(i * 7) % 18 + 1) for i in range(1, 19)]
    p = pd.plan(nodes, jobs, 16, BATCH)
    assert p.chosen.exact and len(p.chosen.moves) == 16
    moved = {m.job.id for m in p.chosen.moves}
    assert {j.id for j in jobs if j.id not in moved} == {"5", "10"}  # the two that ran longest (18 h, 17 h) stay


def test_plan_defrag_oversized_domain_not_planned():
    nodes = rack("huge", pd.MAX_RACK_NODES + 1) + rack("a", 2)
    p = pd.plan(nodes, [], 2, BATCH)
    assert p.chosen.rack == "a"
    assert next(r for r in p.racks if r.rack == "huge").why.startswith(f"{pd.MAX_RACK_NODES + 1} nodes: more than")


def test_plan_defrag_actions_and_commands():
    nodes = rack("a", 2)
    p = pd.plan(nodes, [job(1, "a-1"), job(2, "a-2", requeue=False)], 2, BATCH)
    assert [m.action for m in p.chosen.moves] == ["requeue", "cancel"]
    assert defrag.to_dict(p, BATCH)["commands"] == ["scontrol requeue 1", "scancel 2"]


# -- recorded Slurm output -------------------------------------------------------------------------------------------
def test_plan_defrag_parses_recorded_squeue_sinfo_partitions():
    jobs = {j.id: j for j in pds.parse_squeue_json(SQUEUE.read_text(), str(SQUEUE), float(RECORDED_AT))}
    assert set(jobs) == {"6", "7", "8", "9", "10"}
    assert jobs["7"].nodes == ("n2", "n4") and jobs["7"].partition == "batch" and jobs["7"].state == "RUNNING"
    assert jobs["7"].elapsed_s == 28.0 and jobs["7"].batch and jobs["7"].requeue
    assert jobs["9"].nodes == ("n3",) and not jobs["9"].batch  # salloc --no-shell
    assert jobs["10"].state == "PENDING" and jobs["10"].nodes == () and jobs["10"].elapsed_s == 0
    nodes = {n.name: n for n in pds.nodes_from_sinfo(SINFO.read_text(), str(SINFO))}
    assert {n: x.domain for n, x in nodes.items()} == {"n1": "rackA", "n2": "rackA", "n3": "rackA", "n4": "rackB",
                                                      "n5": "rackB", "n6": "rackB", "n7": "rackB", "n8": "rackB"}
    assert nodes["n6"].spare and nodes["n6"].service is Service.DRAINED
    assert nodes["n7"].service is Service.DOWN and nodes["n1"].service is Service.IN_SERVICE
    modes = pds.parse_partitions(PARTITIONS.read_text(), str(PARTITIONS))
    assert modes == {"all": {"OFF"}, "batch": {"REQUEUE"}, "debug": {"OFF"}}
    assert pds.preemptible_partitions(modes) == {"batch"}


def test_plan_defrag_run_on_recorded_files(capsys):
    files = ["--squeue", str(SQUEUE), "--sinfo", str(SINFO), "--now", RECORDED_AT]
    code, out = run(capsys, "--slice", "2", *files, "--partitions", str(PARTITIONS), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rack"] == "rackA" and doc["nodes"] == ["n1", "n2"]
    assert [m["job"] for m in doc["moves"]] == ["6", "7"] and doc["moves"][1]["nodes"] == ["n2", "n4"]
    assert doc["moves"][1]["node_hours"] == pytest.approx(2 * 28 / 3600, abs=1e-4)
    assert doc["commands"] == ["scontrol requeue 6,7"] and doc["advice_only"] is True
    assert doc["racks"][1]["why"].startswith("1 of 2 nodes can be freed")
    assert "n5 job 8 not preemptible (partition debug)" in doc["racks"][1]["why"]
    code, out = run(capsys, "--slice", "2", *files, "--preemptible-partitions", "batch", "--use-spares")
    assert code == 0 and out.startswith("slice of 2 nodes: rack rackB, nodes n6 n4\n")
    assert "scontrol requeue 7" in out and "rackA: needs 2 job(s) moved, rackB 1" in out
    code, out = run(capsys, "--slice", "3", *files, "--partitions", str(PARTITIONS))
    assert code == 1
    assert "rackA: 2 of 3 nodes can be freed" in out and "n3 job 9 interactive (no batch script)" in out
    # the debug partition declared preemptible: job 8 moves, job 9 (interactive) still does not
    code, out = run(capsys, "--slice", "3", *files, "--preemptible-partitions", "batch,debug", "--use-spares",
                    "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rack"] == "rackB" and {m["job"] for m in doc["moves"]} == {"7", "8"}


# -- hostile input ---------------------------------------------------------------------------------------------------
def _squeue(*jobs: dict) -> str:
    base = {"job_id": 1, "nodes": "n1", "partition": "batch", "job_state": "RUNNING", "batch_flag": True,
            "requeue": True, "start_time": 499_999_000}
    return json.dumps({"meta": {}, "errors": [], "jobs": [{**base, **j} for j in jobs]})


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[" * 100_000, "not JSON"),
    ("[]", "not a JSON object"),
    ('{"jobs": 3}', 'no "jobs" list'),
    ('{"errors": [{"error": "Unable to contact slurm controller"}], "jobs": []}', "slurmctld not reached"),
    (_squeue({"job_id": "x"}), "not a job id"),
    (_squeue({"job_id": 1.5}), "not a job id"),
    (_squeue({"job_id": 1 << 40}), "not a job id"),
    (_squeue({}, {}), "listed twice"),
    (_squeue({"job_state": 3}), "no job_state"),
    (_squeue({"nodes": "n[0-99999999]"}), "more than"),
    (_squeue({"nodes": ["n1"]}), "not a hostlist"),
    (_squeue({"nodes": "n[1-3"}), "not closed"),
    (_squeue({"partition": 7}), "partition is not a name"),
    (_squeue({"start_time": None}), "no start_time"),
    ('{"jobs": [{"job_id": 1, "nodes": "n1", "job_state": "RUNNING", "start_time": NaN}]}', "no start_time"),
    ('{"jobs": [{"job_id": 1, "nodes": "n1", "job_state": "RUNNING", "start_time": 1e400}]}', "no start_time"),
    (_squeue({"start_time": 1}), "ten years"),
    ("x" * (pds.MAX_FILE + 1), "MiB"),
])
def test_plan_defrag_squeue_hostile(text, says):
    with pytest.raises(ConfigError, match=says) as exc:
        pds.parse_squeue_json(text, "q.json", now=500_000_000.0)
    assert str(exc.value).startswith("q.json")


def test_plan_defrag_squeue_hostlists_bounded_across_jobs():
    text = _squeue(*({"job_id": i, "nodes": "n[1-60000]"} for i in range(1, 3)))
    with pytest.raises(ConfigError, match="jobs\\[1\\].*more than"):
        pds.parse_squeue_json(text, "q.json", now=2000.0)


def test_plan_defrag_squeue_newer_shapes():
    text = _squeue({"job_state": ["RUNNING"], "start_time": {"set": True, "infinite": False, "number": 1000},
                    "batch_flag": {"set": True, "number": 1}})
    (j,) = pds.parse_squeue_json(text, "q.json", now=4600.0)
    assert j.state == "RUNNING" and j.elapsed_s == 3600.0 and j.batch
    text = _squeue({"job_state": ["COMPLETED", "COMPLETING"], "nodes": "n[1-2],n1"})
    (j,) = pds.parse_squeue_json(text, "q.json", now=500_000_000.0)
    assert j.state == "COMPLETING" and j.nodes == ("n1", "n2")  # still on its nodes; each node once


@pytest.mark.parametrize("text, says", [
    ("PartitionName=a\n", "q.txt:1: not a"),
    ("x\n", "q.txt:1"),
    ("PartitionName=a PreemptMode=OFF\nPartitionName=b;rm PreemptMode=OFF\n", "q.txt:2"),
])
def test_plan_defrag_partitions_hostile(text, says):
    with pytest.raises(ConfigError, match=says):
        pds.parse_partitions(text, "q.txt")


def test_plan_defrag_bad_flags_and_files(capsys, tmp_path):
    files = ["--squeue", str(SQUEUE), "--sinfo", str(SINFO), "--preemptible-partitions", "batch"]
    for flag, value, says in (("--slice", "0", "--slice 0: expected a whole number in"),
                              ("--slice", "abc", "expected a whole number"),
                              ("--slice", "9" * 40, "expected a whole number"), ("--slice", "1e3", "a whole number"),
                              ("--now", "nan", "--now 'nan': expected a finite number in"),
                              ("--now", "inf", "--now 'inf': expected a finite")):
        argv = ["--slice", value, *files] if flag == "--slice" else ["--slice", "2", *files, flag, value]
        with pytest.raises(ConfigError, match=says):
            plan_cli.run_part(parser().parse_args(argv))
    with pytest.raises(ConfigError, match="--squeue and --sinfo go together"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", "--squeue", str(SQUEUE)]))
    with pytest.raises(ConfigError, match="which jobs may be moved"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", "--squeue", str(SQUEUE), "--sinfo", str(SINFO)]))
    with pytest.raises(ConfigError, match="--preemptible-partitions: 'a b'"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", *files, "--preemptible-partitions", "a b"]))
    with pytest.raises(ConfigError, match=f"--sinfo {tmp_path / 'none'}: cannot read"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", "--squeue", str(SQUEUE),
                                               "--sinfo", str(tmp_path / "none")]))
    bad = tmp_path / "sinfo.json"
    bad.write_text('{"errors": [{"error": "Unable to contact slurm controller"}], "nodes": []}')
    with pytest.raises(ConfigError, match=f"{bad}: sinfo --json: slurmctld not reached"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", *files[:2], "--sinfo", str(bad), *files[4:]]))
    assert capsys.readouterr().out == ""


# -- a real Slurm cluster --------------------------------------------------------------------------------------------
NODES = ("n1", "n2", "n3", "n4", "n5", "n6")


@pytest.fixture(scope="module")
def defrag_slurm(tmp_path_factory):
    """n1..n3 in rackA, n4..n6 in rackB; partitions `batch` (PreemptMode=REQUEUE) and `debug` (OFF) besides `all`;
    n6 a spare; jobs: batch on n1, batch across n2 and n4, debug on n5, an interactive allocation on n3."""
    cluster = SlurmCluster(
        tmp_path_factory.mktemp("slurm"), live=NODES, dead=(),
        settings={"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE"},
        all_options="PriorityTier=10 PreemptMode=OFF",
        partitions=(f"PartitionName=batch Nodes={','.join(NODES)} PriorityTier=1 PreemptMode=REQUEUE State=UP",
                    f"PartitionName=debug Nodes={','.join(NODES)} PriorityTier=1 PreemptMode=OFF State=UP"))
    try:
        cluster.start()
        adapter = SlurmAdapter(slurm_conf=str(cluster.conf), timeout_s=30)
        for n in NODES:
            adapter.publish_domain(n, "rackA" if n in ("n1", "n2", "n3") else "rackB")
        adapter.return_to_pool("n6", "rackB")
        ids = {}
        for key, argv in (("n1", ["sbatch", "-p", "batch", "-w", "n1"]),
                          ("n2n4", ["sbatch", "-p", "batch", "-N2", "-w", "n2,n4"]),
                          ("n5", ["sbatch", "-p", "debug", "-w", "n5"])):
            out = subprocess.run([*argv, "--parsable", "--output=/dev/null", "--wrap", "sleep 600"], env=cluster.env,
                                 cwd=cluster.base, check=True, capture_output=True, text=True, timeout=60).stdout
            ids[key] = out.strip().split(";")[0]
        out = subprocess.run(["salloc", "-p", "batch", "-w", "n3", "--no-shell"], env=cluster.env, cwd=cluster.base,
                             check=True, capture_output=True, text=True, timeout=60)
        ids["n3"] = out.stderr.split("Granted job allocation")[1].split()[0]

        def running():
            got = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], env=cluster.env, capture_output=True,
                                 text=True, timeout=30).stdout.split()
            return set(ids.values()) <= set(got)

        poll(running, "the four jobs running", timeout_s=120)
        yield cluster, ids
    finally:
        cluster.stop()


def test_plan_defrag_slurm_live_plan_names_the_preemptible_jobs(defrag_slurm, capsys):
    cluster, ids = defrag_slurm
    conf = ["--slurm-conf", str(cluster.conf)]
    code, out = run(capsys, "--slice", "2", *conf, "--json")
    doc = json.loads(out)
    assert code == 0, out
    assert doc["rack"] == "rackA" and doc["nodes"] == ["n1", "n2"]
    assert [m["job"] for m in doc["moves"]] == [ids["n1"], ids["n2n4"]]
    assert doc["moves"][1]["nodes"] == ["n2", "n4"] and doc["preemptible_partitions"] == ["batch"]
    assert doc["commands"] == [f"scontrol requeue {ids['n1']},{ids['n2n4']}"]
    code, out = run(capsys, "--slice", "3", *conf)
    assert code == 1
    assert f"n3 job {ids['n3']} interactive (no batch script)" in out
    assert f"n5 job {ids['n5']} not preemptible (partition debug)" in out
    code, out = run(capsys, "--slice", "2", *conf, "--use-spares", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rack"] == "rackB" and doc["nodes"] == ["n6", "n4"]
    assert [m["job"] for m in doc["moves"]] == [ids["n2n4"]]
    # the debug partition preemptible too: rackB with its spare, never the interactive job on n3
    code, out = run(capsys, "--slice", "3", *conf, "--preemptible-partitions", "batch,debug", "--use-spares",
                    "--json")
    doc = json.loads(out)
    assert code == 0 and doc["rack"] == "rackB" and doc["nodes"] == ["n6", "n4", "n5"]
    assert {m["job"] for m in doc["moves"]} == {ids["n2n4"], ids["n5"]}
    # it only advised: every job still runs where it was
    got = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i %N"], env=cluster.env, capture_output=True,
                         text=True, timeout=30).stdout
    assert {line.split()[0] for line in got.splitlines()} == set(ids.values())


def test_plan_defrag_slurm_hostlists_match_scontrol(defrag_slurm):
    cluster, _ = defrag_slurm
    for text in ("n[1-3,5]", "a,b", "n[01-03]", "rack[1-2]n[1-2]", "n[8-11],m[098-100]"):
        shown = subprocess.run(["scontrol", "show", "hostnames", text], env=cluster.env, capture_output=True,
                               text=True, timeout=30, check=True).stdout.split()
        assert slurm_hostlist.expand_hostlist(text) == shown
    for text in ("n[3-1]", "n[1-3]x"):
        shown = subprocess.run(["scontrol", "show", "hostnames", text], env=cluster.env, capture_output=True,
                               text=True, timeout=30)
        assert "Invalid hostlist" in shown.stdout + shown.stderr
        with pytest.raises(ValueError):
            slurm_hostlist.expand_hostlist(text)


def test_plan_defrag_slurm_unreachable_is_an_input_error(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\n")
    with pytest.raises(ConfigError, match="Slurm could not be asked"):
        plan_cli.run_part(parser().parse_args(["--slice", "2", "--slurm-conf", str(conf)]))


def test_plan_defrag_help_says_what_each_exit_code_means(capsys):
    from gpuwarden.agent.cli.main import main
    from gpuwarden.agent.fleet.plan import defrag as defrag_mod

    with pytest.raises(SystemExit):
        main(["plan", "defrag", "--help"])
    shown = capsys.readouterr().out
    assert "exit codes:" in shown
    for code, meaning in defrag_mod.EXIT_CODES:
        assert f"  {code}  {meaning}" in shown
    assert (defrag_mod.EXIT_PLAN, defrag_mod.EXIT_NO_PLAN, defrag_mod.EXIT_INPUT) == tuple(
        int(code) for code, _ in defrag_mod.EXIT_CODES)

"""`gpuwarden sweep`, the real command, on a real Slurm cluster (slurmctld and six slurmd on 127.0.0.1, two NVLink
domains published through the Slurm adapter), launching its collectives with srun in a low-priority preemptible
partition. The collective is a stand-in for all_reduce_perf (tests/standin_all_reduce_perf.py) that prints
nccl-tests' output with figures a scenario bends: a slow node, a bad link, wrong values, a hang. Each test asserts
what the sweep names, where its collectives ran (the stand-in's log), the verdict files it writes, and that no job
or process of it is left behind."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from gpuwarden.agent.act.adapters.slurm import SlurmAdapter
from slurm_cluster import SlurmCluster, poll

LIVE = ("n1", "n2", "n3", "n4", "n5", "n6")
DOMAINS = {"n1": "rackA", "n2": "rackA", "n3": "rackA", "n4": "rackB", "n5": "rackB", "n6": "rackB"}
STANDIN = ROOT / "tests" / "standin_all_reduce_perf.py"
CLI = [sys.executable, "-m", "gpuwarden.agent.cli"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Partition "all" (default, PriorityTier 10) and "sweep" (PriorityTier 1) over the same nodes; a job of "all"
    preempts (cancels) a sweep job on its nodes."""
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), live=LIVE, dead=("n7",),
                     settings={"PreemptType": "preempt/partition_prio", "PreemptMode": "CANCEL"},
                     all_options="PriorityTier=10",
                     partitions=("PartitionName=sweep Nodes=" + ",".join(LIVE + ("n7",))
                                 + " MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL",))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def fresh(cluster):
    cluster.reset(deadline_s=120.0)
    adapter = SlurmAdapter(slurm_conf=str(cluster.conf))
    for node, domain in DOMAINS.items():
        adapter.publish_domain(node, domain)
    return cluster


class Sweeper:
    def __init__(self, cluster: SlurmCluster, work: Path):
        self.cluster, self.work = cluster, work
        self.results = work / "results"
        self.log = work / "standin.log"

    def config(self, timeout_s: float = 20.0) -> Path:
        command = [sys.executable, str(STANDIN), "-b", "8", "-e", "2G", "-f", "2", "-g", "1", "-N", "5"]
        path = self.work / "gpuwarden.toml"
        path.write_text(f"""
[remediation]
adapter = "slurm"
[remediation.slurm]
slurm_conf = "{self.cluster.conf}"
[sweep]
command = {json.dumps(command)}
ranks_per_node = 1
group_nodes = 3
partition = "sweep"
timeout_s = {timeout_s}
start_timeout_s = 5.0
results_dir = "{self.results}"
[sweep.baselines]
"any/2" = {{ latency_p95_us = 65.0, busbw_gbps = 460.0 }}
"any/3" = {{ latency_p95_us = 65.0, busbw_gbps = 460.0 }}
""")
        return path

    def env(self, scenario: dict) -> dict:
        path = self.work / "scenario.json"
        path.write_text(json.dumps(scenario))
        return {**self.cluster.env, "GW_SWEEP_SCENARIO": str(path), "GW_SWEEP_STANDIN_LOG": str(self.log),
                "GW_STANDIN_DIR": str(self.work / "rendezvous")}

    def run(self, scenario: dict, *args: str, timeout_s: float = 20.0) -> tuple[int, dict]:
        proc = subprocess.run([*CLI, "sweep", "--config", str(self.config(timeout_s)), "--json", *args],
                              env=self.env(scenario), capture_output=True, text=True, timeout=300)
        assert proc.stdout.strip(), f"rc {proc.returncode}, no report\n{proc.stderr[-3000:]}"
        return proc.returncode, json.loads(proc.stdout)

    def start(self, scenario: dict, *args: str, timeout_s: float = 120.0) -> subprocess.Popen:
        return subprocess.Popen([*CLI, "sweep", "--config", str(self.config(timeout_s)), "--json", *args],
                                env=self.env(scenario), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def groups_run(self) -> list[tuple[str, ...]]:
        """The node lists the stand-in ran on, as it logged them when each collective started."""
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("event") == "start":
                out.append(tuple(sorted(entry["nodes"])))
        return out

    def verdict(self, node: str) -> dict:
        return json.loads((self.results / "nodes" / f"{node}.json").read_text())


def sweep_jobs(cluster: SlurmCluster) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j %T %N"], env=cluster.env, capture_output=True, text=True,
                         timeout=30).stdout
    return [line for line in out.splitlines() if line.startswith("gpuwarden-sweep")]


def standins_left() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(STANDIN).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def user_job(cluster: SlurmCluster, node: str, seconds: int = 300) -> str:
    out = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "-p", "all", "-w", node, "-J", "user-work",
                          "--wrap", f"sleep {seconds}"], env=cluster.env, capture_output=True, text=True, timeout=30,
                         check=True)
    return out.stdout.strip().split(";")[0]


def job_state(cluster: SlurmCluster, job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=cluster.env, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_sweep_runs_only_on_idle_nodes_and_a_healthy_cluster_passes(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    busy = user_job(fresh, "n2")
    poll(lambda: job_state(fresh, busy) == "RUNNING", "the user's job on n2 to run")
    SlurmAdapter(slurm_conf=str(fresh.conf)).return_to_pool("n6", "rackB")  # a spare: drained, never swept
    code, report = s.run({})
    assert code == 0, report
    ran = s.groups_run()
    assert ran and all("n2" not in g and "n6" not in g for g in ran)  # the busy node and the spare never swept ...
    assert job_state(fresh, busy) == "RUNNING"  # ... and the work on n2 is untouched
    assert {t["phase"] for t in report["tests"]} == {"domain", "fabric"}
    domain = [tuple(t["nodes"]) for t in report["tests"] if t["phase"] == "domain"]
    assert all(len({DOMAINS[n] for n in g}) == 1 for g in domain)  # within one NVLink domain
    fabric = [tuple(t["nodes"]) for t in report["tests"] if t["phase"] == "fabric"]
    assert all(len({DOMAINS[n] for n in g}) == 2 for g in fabric)  # across the fabric
    assert sorted(report["passed"]) == ["n1", "n3", "n4", "n5"]
    for node in report["passed"]:
        assert s.verdict(node)["findings"] == []
    assert not (s.results / "nodes" / "n2.json").exists() and not (s.results / "nodes" / "n6.json").exists()
    assert not sweep_jobs(fresh)


def test_sweep_names_a_slow_node_and_a_bad_link(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    code, report = s.run({"slow_nodes": ["n5"], "bad_links": [["n1", "n4"]], "seed": 3})
    assert code == 1, report
    # the runs of n5's groups with the rest: once (in a full suite) n5 was judged sweep-failed, not sweep-slow
    assert report["culprit_nodes"] == {"n5": "sweep-slow"}, [t for t in report["tests"] if "n5" in t["nodes"]]
    assert report["culprit_links"] == [["n1", "n4"]]
    (slow,) = s.verdict("n5")["findings"]
    assert slow["code"] == "sweep-slow" and slow["action"] == "DRAIN" and "n5" in slow["message"]
    for me, peer in (("n1", "n4"), ("n4", "n1")):
        (link,) = s.verdict(me)["findings"]
        assert link["code"] == "sweep-bad-link" and link["evidence"]["peer"] == peer
    for node in ("n2", "n3", "n6"):
        assert s.verdict(node)["findings"] == []
    # The slow node, once found within its domain, is not tested again across the fabric.
    assert all("n5" not in t["nodes"] for t in report["tests"] if t["phase"] == "fabric")
    assert not sweep_jobs(fresh)


def test_sweep_names_a_node_returning_wrong_values(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    code, report = s.run({"wrong_nodes": ["n3"]})
    assert code == 1, report
    assert report["culprit_nodes"] == {"n3": "sweep-wrong-results"} and report["culprit_links"] == []
    (f,) = s.verdict("n3")["findings"]
    assert f["code"] == "sweep-wrong-results" and "wrong values" in f["message"]


def test_sweep_kills_a_hung_collective_and_names_the_node(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    # Four nodes: every hung collective waits out its limit, so the fewer it takes to corner n6, the shorter the test.
    code, report = s.run({"hang_nodes": ["n6"]}, "--nodes", "n1,n2,n4,n6", timeout_s=8.0)
    assert code == 1, report
    assert report["culprit_nodes"] == {"n6": "sweep-hang"}
    hung = [t for t in report["tests"] if t["outcome"] == "hung"]
    assert hung and all("n6" in t["nodes"] and t["ended"] == "timeout" for t in hung)
    assert not sweep_jobs(fresh)  # every hung job was cancelled ...
    poll(lambda: not standins_left(), "the hung stand-ins to be gone", timeout_s=60)  # ... and its ranks ended


def test_sweep_gives_way_to_real_work_and_records_a_partial_result(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    proc = s.start({"duration_s": 120.0}, "--nodes", "n1,n2,n3")  # one domain: one group, one round
    try:
        poll(lambda: len(s.groups_run()) >= 1, "the sweep's collective to start")
        job = user_job(fresh, "n1", seconds=60)
        poll(lambda: job_state(fresh, job) == "RUNNING", "the user's job to preempt the sweep on n1")
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads(out)
    assert proc.returncode == 2, err[-2000:]
    (preempted,) = report["tests"]
    assert preempted["outcome"] == "preempted" and preempted["nodes"] == ["n1", "n2", "n3"]
    assert "PREEMPTION" in preempted["reasons"][0] or preempted["ended"] == "preempted"
    assert not report["culprit_nodes"] and not report["culprit_links"]
    assert not list((s.results / "nodes").glob("*.json"))  # a preempted collective decides nothing
    assert (s.results / "reports" / f"{report['sweep_id']}.json").exists()
    assert job_state(fresh, job) == "RUNNING"


def test_sweep_stopped_by_sigterm_ends_its_jobs_and_writes_a_partial_report(fresh, tmp_path):
    s = Sweeper(fresh, tmp_path)
    proc = s.start({"duration_s": 120.0})
    try:
        poll(lambda: len(sweep_jobs(fresh)) >= 2, "the sweep's jobs to run")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    report = json.loads(out)
    assert report["partial"] == "interrupted by SIGTERM"
    assert (s.results / "reports" / f"{report['sweep_id']}.json").exists()
    poll(lambda: not sweep_jobs(fresh), "no sweep job left", timeout_s=60)
    poll(lambda: not standins_left(), "no stand-in left", timeout_s=60)
    time.sleep(0)  # nothing else to wait for: the jobs and processes are gone

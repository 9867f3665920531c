"""The job response end to end on a real Slurm cluster (tests/slurm_cluster.py: a real slurmctld and real slurmds n1..n6
on 127.0.0.1): real batch jobs run on n1 and n2, and the real agent (`gpuwarden run`, act mode, the Slurm adapter)
speaks for each node on its own copy of a recorded GB200 tray whose GPUs run that job (fixtures/nodes/gb200-nvl72-job,
the job's id written into its processes' cgroups and environments). Faults are injected into the tray: an XID appended
to its kernel log, an IB port written down, a throttle in its NVML. What happened is read from Slurm itself (`scontrol
show job`: the job's state, its Restarts count, its AdminComment; sinfo), from the job's own output (its USR1 handler
writes a line), and from the agents' journals and /metrics. Deadlines are generous; nothing is a measurement."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NODES, ROOT, edit_nvml
from slurm_cluster import poll, slurm_cluster  # noqa: F401  (the fixture)
from test_slurm_e2e import DEADLINE_S, XID79, Agent, sinfo

QUARANTINE79 = "gpuwarden: quarantine: xid 79 GPU0 0008:01:00.0"
JOB_SCENARIO = NODES / "gb200-nvl72-job"
SCENARIO_JOB = "4242"  # the job id the recorded tray's processes carry
PORT = "sys/class/infiniband/mlx5_1/ports/1/state"  # one of the four rails the recorded job may use (NCCL_IB_HCA=mlx5)
# The job script: a USR1 handler that says so in the job's output, then the "training" (sleeps, so the handler runs).
SCRIPT = "trap 'echo usr1 $(date +%s.%N)' USR1; echo start $SLURM_RESTART_COUNT; while true; do sleep 0.2; done"


@pytest.fixture
def cluster(slurm_cluster):  # noqa: F811
    slurm_cluster.reset(deadline_s=DEADLINE_S)
    yield slurm_cluster
    slurm_cluster.reset(deadline_s=DEADLINE_S)


def submit(cluster, base: Path, nodes: str = "n1,n2", requeue: bool = True) -> tuple[str, Path]:
    """A batch job on `nodes`, running: (its id, its output file)."""
    out = base / "job-%j.out"
    proc = subprocess.run(["sbatch", "--parsable", f"--nodes={len(nodes.split(','))}", f"--nodelist={nodes}",
                           "--requeue" if requeue else "--no-requeue", f"--output={out}", "--wrap", SCRIPT],
                          env=cluster.env, capture_output=True, text=True, timeout=60, cwd=base)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    poll(lambda: job_info(cluster, job).get("JobState") == "RUNNING", f"job {job} running")
    return job, Path(str(out).replace("%j", job))


def job_info(cluster, job: str) -> dict[str, str]:
    """`scontrol show job -o` as key=value (AdminComment may hold spaces: read to the next key)."""
    text = cluster.scontrol("show", "job", "-o", job, check=False).stdout.strip()
    keys = list(re.finditer(r"(?:^| )([A-Za-z/:]+)=", text))
    return {m.group(1): text[m.end():keys[i + 1].start() if i + 1 < len(keys) else len(text)].strip()
            for i, m in enumerate(keys)}


def usr1_lines(out: Path) -> list[str]:
    return [line for line in out.read_text(errors="replace").splitlines() if line.startswith("usr1 ")] \
        if out.exists() else []


class JobAgent(Agent):
    """The agent of one Slurm node whose recorded tray runs the real job `job` on its four GPUs (ranks 0-3 of a
    two-node job), with [jobs] set as given and, optionally, the job's NCCL_IB_TIMEOUT."""

    def __init__(self, base: Path, cluster, node: str, job: str, on_doomed: str = "requeue",
                 signal_before_s: float = 0.0, ib_timeout: int | None = None, extra: str = "", **kw):
        super().__init__(base, cluster, node, **kw)
        shutil.rmtree(self.root)
        shutil.copytree(JOB_SCENARIO, self.root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
        for proc in (self.root / "proc").iterdir():
            if not proc.name.isdigit():
                continue
            cgroup = proc / "cgroup"
            cgroup.write_text(cgroup.read_text().replace(f"job_{SCENARIO_JOB}/", f"job_{job}/"))
            env = (proc / "environ").read_bytes().replace(f"SLURM_JOB_ID={SCENARIO_JOB}\0".encode(),
                                                          f"SLURM_JOB_ID={job}\0".encode())
            if ib_timeout is not None:
                env += f"NCCL_IB_TIMEOUT={ib_timeout}\0".encode()
            (proc / "environ").write_bytes(env)
        self.job = job
        self.cfg.write_text(self.cfg.read_text() + f"""
[jobs]
on_doomed = "{on_doomed}"
signal_before_s = {signal_before_s}
{extra}""")

    def job_intents(self) -> list[dict]:
        return [i for i in self.intents() if i["action"] == "job"]

    def knows_job(self) -> bool:
        jobs = self.status().get("jobs", [])
        return any(j["job"] == f"slurm:{self.job}.0" and j["on_node"] for j in jobs)


@pytest.fixture
def job_agents(cluster, tmp_path):
    """job_agents(job, node, ...) starts the agent of each node and waits until it has published its domain and
    seen the job on its GPUs; every agent started is stopped at the end."""
    started: list[JobAgent] = []

    def start(job: str, *nodes: str, **kw) -> list[JobAgent]:
        new = [JobAgent(tmp_path, cluster, n, job, **kw).start() for n in nodes]
        started.extend(new)
        for a in new:
            poll(lambda a=a: (a.published(cluster) and a.knows_job()) or a.proc.poll() is not None,
                 f"{a.node}'s agent to publish its domain and see job {job}")
            assert a.proc.poll() is None, a.log.read_text()[-3000:]
        return new

    yield start
    for a in started:
        a.stop()


# -- XID 79 on a GPU of the job: requeued at once, its node quarantined, its other node untouched ------------------
def test_job_slurm_xid79_requeues_the_job_with_our_reason_and_drains_only_its_node(cluster, job_agents, tmp_path):
    job, _ = submit(cluster, tmp_path)
    a1, a2 = job_agents(job, "n1", "n2")
    a1.inject(XID79)
    poll(lambda: job_info(cluster, job).get("Restarts") == "1", f"job {job} requeued")
    poll(lambda: a1.done("cordon", "drain", "job"), "n1's intents carried out")
    # Back in the queue once its tasks are ended (COMPLETING a moment), started again once eligible.
    def queued() -> dict | None:
        info = job_info(cluster, job)
        return info if info.get("JobState") in ("PENDING", "RUNNING") else None

    info = poll(queued, f"job {job} back in the queue")
    assert info["AdminComment"].startswith("gpuwarden: requeued on n1: xid 79 GPU0 0008:01:00.0 (its GPU 0) [run 0]")
    # The node first, then the job: the cordon (through the breaker) carried out before the job's requeue, then the
    # quarantine.
    journal = [i for i in a1.intents() if i["action"] != "publish_domain"]
    assert [i["action"] for i in journal][:3] == ["cordon", "job", "drain"], journal
    (job_intent,) = a1.job_intents()
    assert job_intent["outcome"] == f"done: requeued Slurm job {job}"
    states = sinfo(cluster)
    assert states["n1"]["reason"] == QUARANTINE79 and states["n1"]["state"] == "drained"
    assert states["n2"]["reason"] == "" and states["n2"]["state"] in ("idle", "mixed", "allocated"), states["n2"]
    assert not a2.job_intents() and [i["action"] for i in a2.intents()] == ["publish_domain"]
    # Made by the observation that read the XID (the transition's), carried out within seconds of the kernel line:
    # the figure is the agent's own, from the fault's first sign to the requeue.
    status = a1.status()
    (t,) = status["transitions"]
    assert job_intent["key"].startswith(f"job:slurm:{job}.0:xid:") and t["to"] == "quarantined"
    (seen,) = [j for j in status["jobs"] if j["job"] == f"slurm:{job}.0"]
    assert seen["actions"][0]["created"] == t["at"] and seen["actions"][0]["outcome"] == job_intent["outcome"]
    m = a1.metrics()
    assert m['gpuwarden_job_actions_total{action="requeue",reason="xid"}'] == 1.0
    assert 0.0 <= m['gpuwarden_job_fault_to_action_seconds{action="requeue"}'] < 10.0
    assert m['gpuwarden_job_gpu_seconds_saved_estimate_total{action="requeue"}'] > 0.0


def test_job_slurm_signal_first_then_requeue_after_signal_before_s(cluster, job_agents, tmp_path):
    job, out = submit(cluster, tmp_path)
    (a,) = job_agents(job, "n1", signal_before_s=3.0)
    a.inject(XID79)
    poll(lambda: usr1_lines(out), "the job's USR1 handler to run")
    signalled = time.time()
    assert job_info(cluster, job)["Restarts"] == "0"  # signalled, not requeued yet: it has its time to checkpoint
    assert job_info(cluster, job)["AdminComment"].startswith("gpuwarden: signalled USR1, requeue in 3 s on n1:")
    poll(lambda: job_info(cluster, job).get("Restarts") == "1", f"job {job} requeued after the signal")
    assert time.time() - signalled >= 2.0  # not before its wait (measured from after the handler ran: a lower bound)
    poll(lambda: a.done("job"), "the job intent ended")
    (intent,) = a.job_intents()
    assert intent["outcome"] == f"done: requeued Slurm job {job} 3 s after USR1"
    assert len(usr1_lines(out)) == 1


def test_job_slurm_a_job_that_is_not_requeueable_is_signalled_never_cancelled(cluster, job_agents, tmp_path):
    job, out = submit(cluster, tmp_path, requeue=False)
    (a,) = job_agents(job, "n1")  # on_doomed = "requeue": the scheduler will not, so the job is signalled
    a.inject(XID79)
    poll(lambda: a.done("job"), "the job intent ended")
    poll(lambda: usr1_lines(out), "the job's USR1 handler to run")
    (intent,) = a.job_intents()
    assert intent["outcome"] == (f"done: signalled Slurm job {job} with USR1 (it is not requeueable: signalled, "
                                 "never cancelled)")
    time.sleep(2.0)  # the job goes on (its handler returned): still running, never cancelled
    info = job_info(cluster, job)
    assert info["JobState"] == "RUNNING" and info["Restarts"] == "0" and info["Requeue"] == "0", info
    assert info["AdminComment"].startswith("gpuwarden: signalled USR1 (not requeueable) on n1:")


# -- an IB port of the job: down longer than its NCCL IB timeout ends it, shorter does not -------------------------
def test_job_slurm_ib_port_down_past_the_job_timeout_requeues_it_shorter_leaves_it_running(cluster, job_agents,
                                                                                          tmp_path):
    job, _ = submit(cluster, tmp_path)
    # NCCL_IB_TIMEOUT=18 with 7 retries: 4.096 us x 2^18 x 7 = 7.5 s before NCCL fails the collective.
    (a,) = job_agents(job, "n1", ib_timeout=18)
    (seen,) = [j for j in a.status()["jobs"] if j["job"] == f"slurm:{job}.0"]
    assert 7.4 < seen["effective_ib_timeout_s"] < 7.6 and "mlx5_1/1" in seen["ports"]
    port = a.root / PORT
    port.write_text("1: DOWN\n")  # 4 s: long enough for the port's FAIL (2 s), shorter than the job's 7.5 s
    poll(lambda: any('code="ib-port-down"' in k and 'entity="mlx5_1/1"' in k for k in a.metrics()),
         "the port's outage judged a fault")
    time.sleep(2.0)
    port.write_text("4: ACTIVE\n")
    poll(lambda: a.metrics().get('gpuwarden_ib_port_up{port="mlx5_1/1"}') == 1.0, "the port seen up again")
    time.sleep(3.0)
    assert not a.job_intents() and job_info(cluster, job)["Restarts"] == "0"  # the collectives rode it out
    assert job_info(cluster, job)["JobState"] == "RUNNING"
    port.write_text("1: DOWN\n")  # now for good: past 7.5 s the job's collectives have failed
    poll(lambda: job_info(cluster, job).get("Restarts") == "1", f"job {job} requeued", timeout_s=DEADLINE_S)
    poll(lambda: a.done("job"), "the job intent ended")
    (intent,) = a.job_intents()
    assert intent["outcome"] == f"done: requeued Slurm job {job}"
    assert job_info(cluster, job)["AdminComment"].startswith(
        "gpuwarden: requeued on n1: ib_port ib-port-down ib_port mlx5_1/1 (its port mlx5_1/1)")
    assert sinfo(cluster)["n1"]["reason"].startswith("gpuwarden: quarantine: ib_port ib-port-down")


def test_job_slurm_a_throttle_finding_leaves_the_job_alone(cluster, job_agents, tmp_path):
    job, out = submit(cluster, tmp_path)
    (a,) = job_agents(job, "n1", extra="[checks.clock_events]\nmin_window_s = 1.0\nwindow_s = 30.0\n")
    edit_nvml(a.root, lambda s: s["gpus"][0].update(clocks_event_reasons=0x88))  # HW slowdown + power brake
    poll(lambda: any(k.startswith('gpuwarden_finding{action="DRAIN",check="clock_events"') for k in a.metrics()),
         "the throttle judged a fault", timeout_s=DEADLINE_S)
    poll(lambda: a.done("cordon"), "the node cordoned")
    time.sleep(3.0)
    assert not a.job_intents()  # a throttled GPU slows the job; it does not end its collectives
    info = job_info(cluster, job)
    assert info["JobState"] == "RUNNING" and info["Restarts"] == "0" and not info.get("AdminComment"), info
    assert not usr1_lines(out)


# -- one fault seen by two nodes of the job: one requeue ---------------------------------------------------------
def test_job_slurm_two_nodes_of_one_job_seeing_one_fault_requeue_it_once(cluster, job_agents, tmp_path):
    job, _ = submit(cluster, tmp_path)
    # NCCL_IB_TIMEOUT=16: 4.096 us x 2^16 x 7 = 1.9 s, under the port check's own 2 s: doomed at the port's FAIL.
    agents = job_agents(job, "n1", "n2", ib_timeout=16)
    for a in agents:  # one leaf switch: a rail of each node goes down at the same moment
        (a.root / PORT).write_text("1: DOWN\n")
    poll(lambda: all(a.done("job") for a in agents), "both job intents ended", timeout_s=DEADLINE_S)
    outcomes = sorted(a.job_intents()[0]["outcome"] for a in agents)
    done = [o for o in outcomes if o == f"done: requeued Slurm job {job}"]
    already = [o for o in outcomes if o.startswith("already so at the scheduler")]
    assert len(done) == 1 and len(already) == 1, outcomes
    assert job_info(cluster, job)["Restarts"] == "1"  # Slurm's own count: requeued once


# -- kill -9 between the intent and the action: exactly one action after the restart --------------------------------
def test_job_slurm_kill_9_between_the_intent_and_the_action_acts_exactly_once(cluster, tmp_path):
    job, _ = submit(cluster, tmp_path)
    a = JobAgent(tmp_path, cluster, "n1", job)
    # Only the job's own calls held back 30 s: the reads and the node's cordon and quarantine go as usual.
    slow = [sys.executable, str(ROOT / "tests" / "kill9_agent.py"), "30", "--only",
            "mark_job,signal_job,requeue_job,cancel_job", "--"]
    args = ["run", "--root", str(a.root), "--state-dir", str(a.state), "--listen", f"127.0.0.1:{a.port}", "--config",
            str(a.cfg), "--log-format", "json"]
    with open(a.log, "ab") as log:
        proc = subprocess.Popen([*slow, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    try:
        poll(lambda: a.published(cluster) and a.knows_job(), "the slowed agent to see the job")
        a.inject(XID79)
        poll(lambda: a.job_intents() and all(i["done"] for i in a.intents() if i["action"] == "cordon"),
             "the job intent journalled, the node cordoned")
        assert a.job_intents()[0]["done"] is None  # its action is under way (held back 30 s): kill it there
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert job_info(cluster, job)["Restarts"] == "0" and not job_info(cluster, job).get("AdminComment")
    a.start()  # the real agent again, on the same state
    try:
        poll(lambda: a.done("job"), "the job intent carried out after the restart")
        poll(lambda: job_info(cluster, job).get("Restarts") == "1", f"job {job} requeued")
        (intent,) = a.job_intents()
        assert intent["outcome"] == f"done: requeued Slurm job {job}"
        time.sleep(3.0)  # nothing more comes: one journal entry, one requeue
        assert job_info(cluster, job)["Restarts"] == "1" and len(a.job_intents()) == 1
    finally:
        a.stop()

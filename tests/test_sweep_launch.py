"""The sweep's launchers on a real Slurm cluster (tests/slurm_cluster.py: n1..n4, a normal partition "all" and a
low-priority preemptible partition "sweep" over the same nodes) running the stand-in all_reduce_perf
(tests/standin_all_reduce_perf.py), and on a real Open MPI (several "nodes" on this host through an rsh agent that
names the node). Where a collective ran is read from the stand-in's log and from the device lines of its output,
never from timings."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gpuwarden.agent.fleet.sweep.launch_mpirun import MpirunLauncher
from gpuwarden.agent.fleet.sweep.launch_srun import SrunLauncher, classify_srun
from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, NOT_STARTED, PREEMPTED, TIMEOUT
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests
from slurm_cluster import SlurmCluster, poll

STANDIN = Path(__file__).resolve().parent / "standin_all_reduce_perf.py"
SIZES = ["-b", "8", "-e", "128M", "-f", "4", "-g", "1"]


@pytest.fixture(scope="module")
def sweep_cluster(tmp_path_factory):
    """n1..n4; jobs of partition "sweep" (PriorityTier=1) are cancelled when a job of "all" (PriorityTier=10)
    needs their nodes."""
    cluster = SlurmCluster(
        tmp_path_factory.mktemp("slurm"), live=("n1", "n2", "n3", "n4"), dead=(),
        settings={"PreemptType": "preempt/partition_prio", "PreemptMode": "CANCEL"},
        all_options="PriorityTier=10 PreemptMode=OFF",
        partitions=("PartitionName=sweep Nodes=n1,n2,n3,n4 MaxTime=INFINITE State=UP PriorityTier=1 "
                    "PreemptMode=CANCEL",))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(sweep_cluster):
    yield sweep_cluster
    sweep_cluster.reset(deadline_s=60)


class Standin:
    """A scenario for the stand-in, its log, and a launcher whose environment points at both."""

    def __init__(self, cluster: SlurmCluster, tmp_path: Path, scenario: dict, **launcher) -> None:
        self.cluster, self.log, self.scenario = cluster, tmp_path / "standin.log", tmp_path / "scenario.json"
        self.scenario.write_text(json.dumps(scenario))
        self.launcher = SrunLauncher(partition="sweep", env=self.env(), **{"start_timeout_s": 10, **launcher})

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.cluster.conf), "GW_SWEEP_SCENARIO": str(self.scenario),
                "GW_SWEEP_STANDIN_LOG": str(self.log)}

    def events(self, event: str | None = None) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [e for e in map(json.loads, lines) if event is None or e["event"] == event]

    def processes(self) -> list[int]:
        return processes_of(self.scenario)

    def in_background(self, groups, timeout_s: float, argv=None):
        """run_groups in a thread; returns (thread, results list filled when it ends)."""
        results: list = []
        thread = threading.Thread(target=lambda: results.extend(
            self.launcher.run_groups(groups, argv or [sys.executable, str(STANDIN), *SIZES], timeout_s)))
        thread.start()
        return thread, results


def processes_of(scenario: Path) -> list[int]:
    """Processes of a test's runs still alive (srun or mpirun, its daemons, the ranks): they carry the test's
    scenario in their environment."""
    mark, found = f"GW_SWEEP_SCENARIO={scenario}".encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def sbatch(cluster: SlurmCluster, *args: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", *args], env=cluster.env, capture_output=True,
                          text=True, timeout=30, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_state(cluster: SlurmCluster, job: str) -> str:
    out = cluster.scontrol("show", "job", "-o", job, check=False).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "")


def test_sweep_srun_argv_is_a_users_job_in_the_sweep_partition():
    launcher = SrunLauncher(partition="sweep", qos="scavenger", ranks_per_node=8, start_timeout_s=30,
                            extra_args=["--mpi=pmix"])
    assert launcher.argv(["n1", "n2"], "gpuwarden-sweep-x-1.0", ["all_reduce_perf", "-b", "8"]) == [
        "srun", "--job-name=gpuwarden-sweep-x-1.0", "--nodes=2", "--nodelist=n1,n2", "--ntasks-per-node=8",
        "--partition=sweep", "--qos=scavenger", "--immediate=30", "--kill-on-bad-exit=1", "--label", "--mpi=pmix",
        "all_reduce_perf", "-b", "8"]


def test_sweep_srun_endings_from_slurm_2205_messages():
    """What srun and slurmstepd of Slurm 22.05 print (recorded on the test cluster) and how each run ended; srun
    exits 143 in the preempted, cancelled and failed-rank cases alike."""
    preempted = ["0: slurmstepd-n1: error: *** STEP 2.0 ON n1 CANCELLED AT 2026-12-01T02:21:46 DUE TO PREEMPTION ***",
                 "srun: Job step aborted: Waiting up to 4 seconds for job step to finish.",
                 "srun: error: n1: task 0: Terminated", "srun: launch/slurm: _step_signal: Terminating StepId=2.0",
                 "srun: error: n2: task 1: Terminated"]
    cancelled = ["0: slurmstepd-n1: error: *** STEP 4.0 ON n1 CANCELLED AT 2026-12-01T02:21:56 ***",
                 "srun: Job step aborted: Waiting up to 4 seconds for job step to finish.",
                 "srun: error: n2: task 1: Terminated", "srun: error: n1: task 0: Terminated"]
    rank_failed = ["srun: error: n2: task 1: Exited with exit code 1",
                   "srun: launch/slurm: _step_signal: Terminating StepId=8.0",
                   "0: slurmstepd-n1: error: *** STEP 8.0 ON n1 CANCELLED AT 2026-12-01T02:22:19 ***",
                   "srun: error: n1: task 0: Terminated", "srun: Force Terminated StepId=8.0"]
    busy = ["srun: Required node not available (down, drained or reserved)",
            "srun: job 9 queued and waiting for resources",
            "srun: error: Unable to allocate resources: Requested nodes are busy"]
    label = [line.split(": ", 1)[1] if line.startswith("0: ") else line for line in preempted]
    assert classify_srun(143, label) == (PREEMPTED, label[0])
    label = [line.split(": ", 1)[1] if line.startswith("0: ") else line for line in cancelled]
    assert classify_srun(143, label) == (PREEMPTED, label[0])
    assert classify_srun(143, [line.removeprefix("0: ") for line in rank_failed]) == (EXITED, "")
    assert classify_srun(1, busy) == (NOT_STARTED, busy[-1])
    bad = ["srun: error: Unable to allocate resources: Invalid node name specified"]
    assert classify_srun(1, bad) == (LAUNCH_ERROR, bad[0])
    assert classify_srun(0, []) == (EXITED, "")


def test_sweep_srun_groups_run_at_once_on_exactly_their_nodes(cluster, tmp_path, monkeypatch):
    for name, value in (("SLURM_JOB_ID", "424242"), ("SLURM_JOBID", "424242"), ("SLURM_NTASKS", "1"),
                        ("SLURM_NODELIST", "n9")):
        monkeypatch.setenv(name, value)  # started inside a job: each group is still a job of its own
    # Each group's rank 0 waits until both groups have started: both "start" lines come before either "end" only
    # if the two jobs ran at the same time (the wait gives up after a minute and logs it).
    s = Standin(cluster, tmp_path, {"barrier_groups": 2, "seed": 7})
    runs = s.launcher.run_groups([["n1", "n3"], ["n2", "n4"]], [sys.executable, str(STANDIN), *SIZES, "-N", "3"],
                                 timeout_s=60)
    assert [(r.nodes, r.ended, r.returncode) for r in runs] == [(("n1", "n3"), EXITED, 0), (("n2", "n4"), EXITED, 0)]
    events = s.events()
    assert not [e for e in events if e["event"] == "barrier-timeout"], events
    assert [e["event"] for e in events] == ["start", "start", "end", "end"]
    assert sorted(tuple(e["nodes"]) for e in s.events("start")) == [("n1", "n3"), ("n2", "n4")]
    for run in runs:
        parsed = parse_nccl_tests(run.output, "srun")
        assert parsed.hosts == sorted(run.nodes) and parsed.complete and parsed.out_of_bounds == 0
        assert [d.rank for d in parsed.devices] == [0, 1]
        sizes = sorted({row.size_bytes for row in parsed.rows})
        assert len(parsed.rows) == 3 * len(sizes)  # -N 3: every size once per cycle
        small = [row.out_of_place.time_us for row in parsed.rows if row.size_bytes == 8]
        assert len(set(small)) > 1  # cycles differ: a p95 over them means something
    assert not cluster.jobs()


def test_sweep_srun_slow_link_and_wrong_values_show_in_the_output(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"bad_links": [["n1", "n2"]], "wrong_nodes": ["n4"], "slow_factor": 0.4})
    argv = [sys.executable, str(STANDIN), *SIZES]
    slow, wrong = s.launcher.run_groups([["n1", "n2"], ["n3", "n4"]], argv, timeout_s=60)
    (healthy,) = s.launcher.run_groups([["n1", "n3"]], argv, timeout_s=60)  # n1 and n3: no bad link between them
    assert (slow.ended, slow.returncode, healthy.returncode) == (EXITED, 0, 0)
    p_slow, p_ok = parse_nccl_tests(slow.output, "slow"), parse_nccl_tests(healthy.output, "healthy")

    def at(parsed, size):
        return next(row for row in parsed.rows if row.size_bytes == size)

    assert at(p_slow, 8).out_of_place.time_us > 1.8 * at(p_ok, 8).out_of_place.time_us
    assert at(p_slow, 128 << 20).busbw_gbps < 0.6 * at(p_ok, 128 << 20).busbw_gbps
    # Rank 0 exits 1; srun's status is 1 or 143 as --kill-on-bad-exit's SIGTERM reaches the other rank first or not
    assert wrong.ended == EXITED and wrong.returncode not in (0, None)
    p_wrong = parse_nccl_tests(wrong.output, "wrong")
    assert p_wrong.out_of_bounds > 0 and any(row.wrong for row in p_wrong.rows)
    assert "Out of bounds values" in wrong.output and "FAILED" in wrong.output


def test_sweep_srun_a_crashed_rank_is_an_nccl_error_not_a_preemption(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"crash_nodes": ["n2"]})
    (run,) = s.launcher.run_groups([["n1", "n2"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=60)
    assert (run.ended, run.returncode != 0) == (EXITED, True), run
    errors = parse_nccl_tests(run.output + run.stderr, "crash").errors
    assert any("Test NCCL failure" in e.text and "remote process exited or there was a network error" in e.text
               for e in errors)


def test_sweep_srun_a_hung_collective_is_cancelled_and_ended_timeout(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"hang_nodes": ["n3"]})
    runs = s.launcher.run_groups([["n1", "n2"], ["n3", "n4"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=7)
    assert [(r.ended, r.returncode) for r in runs] == [(EXITED, 0), (TIMEOUT, None)]
    hung = runs[1]
    assert hung.job_id and "time limit" in hung.detail
    parsed = parse_nccl_tests(hung.output, "hung")
    assert parsed.rows and not parsed.complete  # the rows before the hang came back
    assert [e["event"] for e in s.events() if e["nodes"] == ["n3", "n4"]] == ["start"]
    poll(lambda: not cluster.jobs(), "no job left in the queue", timeout_s=60)
    poll(lambda: not s.processes(), "no srun or rank of the test left", timeout_s=60)


def test_sweep_srun_a_users_job_preempts_the_sweep(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"duration_s": 600})
    thread, results = s.in_background([["n1", "n2"]], timeout_s=300)
    try:
        poll(lambda: s.events("start"), "the group running")
        marker = tmp_path / "user-job-ran"
        user = sbatch(cluster, "--partition=all", "-w", "n1", f"--output={tmp_path / 'user.out'}",
                      f"--wrap=touch {marker}")
        thread.join(120)
        assert not thread.is_alive()
    finally:
        s.launcher.cancel_all()
        thread.join(60)
    (preempted,) = results
    assert (preempted.ended, preempted.returncode is not None) == (PREEMPTED, True)
    assert "DUE TO PREEMPTION" in preempted.detail and preempted.job_id
    poll(marker.exists, "the user's job to run on n1")
    # it ends as it should (then leaves the controller once MinJobAge passed)
    poll(lambda: job_state(cluster, user) in ("COMPLETED", ""), "the user's job completed")


def test_sweep_srun_a_job_cancelled_by_someone_else_is_preempted(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"duration_s": 600})
    thread, results = s.in_background([["n1", "n2"]], timeout_s=300)
    try:
        poll(lambda: s.events("start"), "the group running")
        job = s.events("start")[0]["job"]
        subprocess.run(["scancel", job], env=cluster.env, check=True, timeout=30)
        thread.join(120)
    finally:
        s.launcher.cancel_all()
        thread.join(60)
    (run,) = results
    assert run.ended == PREEMPTED and "CANCELLED AT" in run.detail and run.job_id == job


def test_sweep_srun_busy_nodes_are_not_started_and_the_users_job_goes_on(cluster, tmp_path):
    user = sbatch(cluster, "--partition=all", "-w", "n2", "--output=/dev/null", "--wrap=sleep 300")
    poll(lambda: job_state(cluster, user) == "RUNNING", "the user's job running on n2")
    # A job pending for its nodes holds the jobs that reach the controller after it in the same partition until the
    # next scheduling pass (about 2 s on 22.05 here): the start timeout covers that, so the free group still runs.
    s = Standin(cluster, tmp_path, {}, start_timeout_s=6)
    runs = s.launcher.run_groups([["n1", "n2"], ["n3", "n4"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=60)
    assert [(r.ended, r.returncode != 0) for r in runs] == [(NOT_STARTED, True), (EXITED, False)], runs
    assert "Requested nodes are busy" in runs[0].detail and runs[0].job_id
    assert job_state(cluster, user) == "RUNNING"
    assert cluster.jobs().split() == [user]
    assert [tuple(e["nodes"]) for e in s.events("start")] == [("n3", "n4")]


def test_sweep_srun_cancel_all_ends_every_job_it_started(cluster, tmp_path):
    s = Standin(cluster, tmp_path, {"duration_s": 600})
    thread, results = s.in_background([["n1", "n2"], ["n3"], ["n4"]], timeout_s=300)
    try:
        poll(lambda: len(s.events("start")) == 3, "every group running")
    finally:
        s.launcher.cancel_all()
        thread.join(120)
    assert not thread.is_alive()
    assert [(r.ended, r.returncode) for r in results] == [(PREEMPTED, None)] * 3
    assert all(r.job_id for r in results)
    poll(lambda: not cluster.jobs(), "no job left in the queue", timeout_s=60)
    poll(lambda: not s.processes(), "no srun or rank of the test left", timeout_s=60)
    (after,) = s.launcher.run_groups([["n1"]], ["true"], timeout_s=10)  # a stopped sweep starts nothing more
    assert after.ended == PREEMPTED and not cluster.jobs()


def test_sweep_srun_a_controller_that_stops_answering_is_no_verdict(cluster, tmp_path):
    """srun waits for an allocation the controller never answers: past the time limit the run ends with no verdict
    on its nodes (not a hang of theirs), and srun is ended."""
    s = Standin(cluster, tmp_path, {})
    cluster.hang_ctld()
    try:
        (run,) = s.launcher.run_groups([["n1", "n2"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=3)
    finally:
        cluster.wake_ctld()
    # srun gives up by itself after MessageTimeout ("Unable to allocate resources: Socket timed out on send/recv
    # operation"), or the sweep ends it first when squeue cannot say the job ran: no verdict either way
    assert (run.ended, run.output) == (LAUNCH_ERROR, ""), run
    assert "Socket timed out" in run.detail or "squeue did not answer" in run.detail
    poll(lambda: not s.processes(), "srun ended", timeout_s=60)


# -- mpirun: Open MPI (Debian openmpi-bin) on this host; each "node" is a name the rsh agent exports ----------------
RSH_AGENT = """#!/bin/sh
# Open MPI's rsh agent: "run this command on host $1"; here every host is this one, named by GW_STANDIN_NODE, and
# each has a session folder of its own (the orteds of one job on one host would race to create the same one).
host=$1; shift
export GW_STANDIN_NODE="$host"
mkdir -p "$GW_RSH_TMP/$host"
export OMPI_MCA_orte_tmpdir_base="$GW_RSH_TMP/$host"
exec /bin/sh -c "$*"
"""


def open_mpi_hosts(tmp_path: Path) -> dict[str, str]:
    """The environment under which mpirun runs its "hosts" on this machine, each named by the rsh agent."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not installed (Debian package: openmpi-bin)", pytrace=False)
    agent = tmp_path / "rsh-agent"
    agent.write_text(RSH_AGENT)
    agent.chmod(0o755)
    # Several orteds on one host (each "node" here) race to share hwloc's topology in the same shared memory and one
    # may crash (Open MPI 4.1.4): no sharing, as on separate hosts.
    return {"OMPI_MCA_plm_rsh_agent": str(agent), "OMPI_MCA_rtc_hwloc_vmhole": "none",
            "GW_RSH_TMP": str(tmp_path / "hosts")}


@pytest.fixture
def mpirun_launcher(tmp_path):
    hosts = open_mpi_hosts(tmp_path)

    def make(scenario: dict) -> tuple[MpirunLauncher, Path]:
        (tmp_path / "scenario.json").write_text(json.dumps(scenario))
        log = tmp_path / "standin.log"
        env = {"GW_SWEEP_SCENARIO": str(tmp_path / "scenario.json"), "GW_SWEEP_STANDIN_LOG": str(log), **hosts}
        return MpirunLauncher(workdir=tmp_path / "hostfiles", env=env), log

    return make


def test_sweep_mpirun_groups_run_at_once_and_a_hang_is_ended(mpirun_launcher, tmp_path):
    launcher, log = mpirun_launcher({"barrier_groups": 2, "hang_nodes": ["hc"], "slow_nodes": ["ha"]})
    runs = launcher.run_groups([["ha", "hb"], ["hc", "hd"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=8)
    assert [(r.ended, r.returncode) for r in runs] == [(EXITED, 0), (TIMEOUT, None)], runs
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert not [e for e in events if e["event"] == "barrier-timeout"], events
    assert sorted(tuple(e["nodes"]) for e in events if e["event"] == "start") == [("ha", "hb"), ("hc", "hd")]
    parsed = parse_nccl_tests(runs[0].output, "mpirun")
    assert parsed.complete and parsed.hosts == ["ha", "hb"]
    assert runs[0].output.startswith("[1,0]<stdout>:")  # --tag-output labels
    assert not list((tmp_path / "hostfiles").iterdir())  # the hostfiles are removed
    poll(lambda: not processes_of(tmp_path / "scenario.json"), "no mpirun, orted or rank of the test left",
         timeout_s=30)


def test_sweep_mpirun_a_program_it_cannot_start_is_a_launch_error(mpirun_launcher, tmp_path):
    launcher, log = mpirun_launcher({})
    (run,) = launcher.run_groups([["ha", "hb"]], [str(tmp_path / "no-such-all_reduce_perf")], timeout_s=30)
    assert run.ended == LAUNCH_ERROR and run.returncode not in (0, None), run
    assert "unable to launch the specified application" in run.detail  # mpirun's own words, not a rank's
    assert not log.exists()


def test_sweep_mpirun_cancel_all_ends_every_group(mpirun_launcher, tmp_path):
    launcher, log = mpirun_launcher({"duration_s": 600})
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(launcher.run_groups(
        [["ha", "hb"], ["hc"]], [sys.executable, str(STANDIN), *SIZES], timeout_s=300)))
    thread.start()
    try:
        poll(lambda: log.exists() and len(log.read_text().splitlines()) == 2, "both groups running")
    finally:
        launcher.cancel_all()
        thread.join(60)
    assert not thread.is_alive()
    assert [(r.ended, r.returncode) for r in results] == [(PREEMPTED, None)] * 2
    assert all("sweep was stopped" in r.detail for r in results)
    poll(lambda: not processes_of(tmp_path / "scenario.json"), "no mpirun, orted or rank of the test left",
         timeout_s=30)

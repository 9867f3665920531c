"""Which job uses what (checks/job_discovery.py), read by the real code from a recorded node: the bundled tray running
Slurm job 4242 (fixtures/nodes/gb200-nvl72-job, a capture of real processes), and copies of it edited the way other
nodes differ (cgroup layouts, a job without a Slurm cgroup, NCCL found other ways, what the agent may not read)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, record_tool
from gpuwarden.agent.node.host import Node
from gpuwarden.checks import job_discovery as discover
from gpuwarden.checks import job_process

PIDS = (12596, 12597, 12598, 12599)
BANNER = ROOT / "fixtures" / "jobs" / "libnccl.so.2-2.32.3-banner.bin"
BANNER_AT = 3521059  # where the excerpt starts in the real library (its .source.txt)
SITE = "usr/local/lib/python3.11/dist-packages"
LIB = f"/{SITE}/nvidia/nccl/lib/libnccl.so.2"


@pytest.fixture(autouse=True)
def fresh():
    job_process.forget()  # the cache is by pid and start time: tests rewrite the same recorded pids
    yield
    job_process.forget()


def look(root: Path, ports=(("mlx5_0/1", True), ("mlx5_1/1", True), ("mlx5_2/1", True), ("mlx5_3/1", True))):
    return discover.discover(Node.recorded_at(root), list(ports), 100.0)


def set_env(root: Path, pid: int, **values: str | None) -> None:
    path = root / "proc" / str(pid) / "environ"
    env = dict(item.split("=", 1) for item in path.read_text().split("\0") if "=" in item)
    for k, v in values.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    path.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def test_the_bundled_tray_runs_ranks_0_to_3_of_a_two_node_slurm_job(scenario_copy):
    found = look(scenario_copy("gb200-nvl72-job"))
    (job,) = found.jobs
    assert (job.job.scheduler, job.job.id, job.job.run) == ("slurm", "4242", 0)
    assert job.job.source.startswith("cgroup of pid 12596 (0::/system.slice/slurmstepd.scope/job_4242/step_0")
    assert job.gpu_indices == (0, 1, 2, 3) and job.pids == PIDS and job.ranks == (0, 1, 2, 3)
    assert job.gpus[0].uuid == "GPU-f1f125ab-e3b5-c66a-ab3f-9862557b394e" and job.gpus[0].pci == "0008:01:00.0"
    assert job.ports == ("mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1")
    assert job.ports_source == "NCCL_IB_HCA=mlx5 (environment of pid 12596)"
    assert job.nodes.value == 2 and job.multi_node is True and job.gpus_total.value == 8
    assert job.nccl_version.value == "2.32.3" and "nvidia_nccl_cu12-2.32.3.dist-info" in job.nccl_version.source
    assert (job.ib_timeout.value, job.ib_retry_cnt.value) == (20, 7)
    assert job.effective_ib_timeout_s.value == pytest.approx(30.06, abs=0.01)
    assert job.watchdog_s.value == 600.0 and "PyTorch 2.13.0+cpu" in job.watchdog_s.source
    assert job.async_error_handling.value == "3" and not found.unreadable and not found.problems


@pytest.mark.parametrize("line, want", [
    ("0::/system.slice/slurmstepd.scope/job_1392969/step_0/user/task_0", ("slurm", "1392969")),  # cgroup v2
    ("0::/system.slice/n1_slurmstepd.scope/job_77/step_batch/user/task_special", ("slurm", "77")),  # NodeName in it
    ("10:devices:/slurm/uid_2101171/job_280678/step_interactive/task_0", ("slurm", "280678")),  # cgroup v1
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f3e8e2b_9a1c_4d2e_8f6a_2b7c9d1e5f40.slice/"
     "cri-containerd-3c9d.scope", ("kubernetes", "0f3e8e2b-9a1c-4d2e-8f6a-2b7c9d1e5f40")),  # systemd cgroup driver
    ("11:memory:/kubepods/burstable/pod0f3e8e2b-9a1c-4d2e-8f6a-2b7c9d1e5f40/3c9d",
     ("kubernetes", "0f3e8e2b-9a1c-4d2e-8f6a-2b7c9d1e5f40")),  # cgroupfs driver
    ("0::/user.slice/user-1000.slice/session-3.scope", None),
    ("0::/", None),
])
def test_the_job_of_a_cgroup(line, want):
    assert job_process.job_from_cgroup(line + "\n") == want


def test_a_process_whose_cgroup_says_nothing_asks_scontrol_pidinfo_then_its_environment(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    for pid in PIDS:
        (root / "proc" / str(pid) / "cgroup").write_text("0::/\n")  # proctrack/pgid: no job cgroup
    # scontrol pidinfo's answer (src/scontrol/info_job.c scontrol_pid_info: "Slurm job id %u ends at %s").
    record_tool(root, "scontrol-pidinfo-12596", "Slurm job id 4242 ends at Fri Dec 04 23:59:59 2026\n"
                "slurm_get_rem_time is 9999\n", rc=0)
    for pid in PIDS[1:]:
        record_tool(root, f"scontrol-pidinfo-{pid}", "Failed to locate job for requested pid\n", rc=1)
    jobs = {j.job.key: j for j in look(root).jobs}
    assert list(jobs) == ["slurm:4242.0"]  # all four ranks are one job, however each was found
    infos = (job_process.read_process(Node.recorded_at(root), p) for p in PIDS)
    sources = {info.pid: info.job.source for info in infos}
    assert sources[12596] == "scontrol pidinfo 12596"
    assert sources[12597].startswith("SLURM_JOB_ID in the environment of pid 12597")


def test_a_process_of_no_job_is_listed_as_such_and_its_restart_count_is_the_run(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    (root / "proc" / "12599" / "cgroup").write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    set_env(root, 12599, SLURM_JOB_ID=None)
    set_env(root, 12596, SLURM_RESTART_COUNT="2")
    for pid in PIDS[1:3]:
        set_env(root, pid, SLURM_RESTART_COUNT="2")
    jobs = {j.job.key: j for j in look(root).jobs}
    assert sorted(jobs) == ["slurm:4242.2", "unknown:pid-12599"]
    assert jobs["slurm:4242.2"].gpu_indices == (0, 1, 2) and jobs["slurm:4242.2"].job.run == 2
    assert "no job in its cgroup" in jobs["unknown:pid-12599"].job.source


def test_the_environment_decides_the_figures_and_only_its_job_variables_are_read(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    for pid in PIDS:
        set_env(root, pid, NCCL_IB_TIMEOUT="18", NCCL_IB_RETRY_CNT="5", TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="900",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1", WORLD_SIZE="16", AWS_SECRET_ACCESS_KEY="hunter2")
    (job,) = look(root).jobs
    assert job.effective_ib_timeout_s.value == pytest.approx(4.096e-6 * 2**18 * 5)
    assert job.ib_timeout.source == "NCCL_IB_TIMEOUT=18 (environment of pid 12596)"
    assert job.heartbeat_s.value == 900.0 and job.async_error_handling.value == "1" and job.gpus_total.value == 16
    info = job_process.read_process(Node.recorded_at(root), 12596)
    assert "AWS_SECRET_ACCESS_KEY" not in info.env and info.env["NCCL_IB_TIMEOUT"] == "18"


def test_nccls_config_files_as_the_process_sees_them(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    etc = root / "proc" / "12596" / "root" / "etc"
    etc.mkdir(parents=True)
    (etc / "nccl.conf").write_text("NCCL_IB_TIMEOUT=22\nNCCL_IB_HCA==mlx5_0,mlx5_1\n")
    home = root / "proc" / "12596" / "root" / "root"
    home.mkdir()
    (home / ".nccl.conf").write_text("NCCL_IB_TIMEOUT=19\n")  # the user's file wins over /etc's
    (job,) = look(root).jobs
    assert job.ib_timeout.value == 19 and job.ib_timeout.source == "NCCL_IB_TIMEOUT=19 (/root/.nccl.conf of pid 12596)"
    # NCCL_IB_HCA of the environment (mlx5) wins over the file's.
    assert job.ports == ("mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1")


def test_nccl_disabled_uses_no_port_and_a_job_of_unknown_span_no_network(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    for pid in PIDS:
        set_env(root, pid, NCCL_IB_DISABLE="1", SLURM_NNODES=None, SLURM_JOB_NUM_NODES=None)
    (job,) = look(root).jobs
    assert job.ib_disabled and job.ports == () and "NCCL_IB_DISABLE=1" in job.ports_source
    assert job.nodes.value is None and job.multi_node is None


def _library(root: Path, name: str) -> None:
    """The scenario's processes map `name` instead of the wheel's libnccl.so.2, and the wheel's dist-info is gone."""
    for pid in PIDS:
        maps = root / "proc" / str(pid) / "maps"
        maps.write_text(maps.read_text().replace(LIB, name))
        shutil.rmtree(root / "proc" / str(pid) / "root" / SITE / "nvidia_nccl_cu12-2.32.3.dist-info")


def test_the_nccl_release_from_the_library_file_name(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    _library(root, "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5")  # the resolved name of a distribution's package
    (job,) = look(root).jobs
    assert job.nccl_version.value == "2.21.5" and job.ib_timeout.value == 18
    assert job.effective_ib_timeout_s.value == pytest.approx(7.52, abs=0.01)


def test_the_nccl_release_from_the_banner_inside_the_library(scenario_copy):
    # A library whose name and folder say nothing (a container's own build): NCCL's banner, as the real library holds
    # it, in place in an otherwise empty file (how `gpuwarden record` keeps a library).
    root = scenario_copy("gb200-nvl72-job")
    _library(root, "/opt/nccl/lib/libnccl.so.2")
    for pid in PIDS:
        lib = root / "proc" / str(pid) / "root" / "opt/nccl/lib/libnccl.so.2"
        lib.parent.mkdir(parents=True)
        with open(lib, "wb") as f:
            f.seek(BANNER_AT)
            f.write(BANNER.read_bytes())
    (job,) = look(root).jobs
    assert job.nccl_version.value == "2.32.3" and job.nccl_version.source.startswith("the banner in the library")


def test_a_library_that_names_no_version_assumes_the_longest_wait(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    _library(root, "/opt/nccl/lib/libnccl.so.2")  # not readable under the process's root
    (job,) = look(root).jobs
    assert job.nccl_version.value is None and "names no version" in job.nccl_version.source
    assert job.ib_timeout.value == 20 and "not known" in job.ib_timeout.source


def test_what_the_agent_may_not_read_is_said_never_guessed(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    for pid in PIDS:  # hidepid, or another PID namespace: the processes NVML lists are not in this /proc
        shutil.rmtree(root / "proc" / str(pid))
    found = look(root)
    assert sorted(j.job.key for j in found.jobs) == [f"unknown:pid-{p}" for p in PIDS]
    assert any("cannot read" in p and "environ" in p for p in found.problems)
    assert [j.gpu_indices for j in found.jobs] == [(0,), (1,), (2,), (3,)]  # each still named with its GPU


def test_a_gpu_whose_processes_nvml_cannot_list_is_unreadable_not_empty(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    data = json.loads((root / "nvml.json").read_text())
    data["gpus"][2]["errors"] = {"*": "GPU_IS_LOST"}
    data["gpus"][3].setdefault("errors", {})["nvmlDeviceGetComputeRunningProcesses"] = "NO_PERMISSION"
    (root / "nvml.json").write_text(json.dumps(data))
    found = look(root)
    (job,) = found.jobs
    assert job.gpu_indices == (0, 1) and sorted(found.unreadable) == [2, 3]
    assert "GPU_IS_LOST" in found.unreadable[2] and "NO_PERMISSION" in found.unreadable[3]


def test_a_pid_the_kernel_gave_to_another_process_is_read_again(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    node = Node.recorded_at(root)
    assert job_process.read_process(node, 12596).job.id == "4242"
    (root / "proc" / "12596" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_5150/step_0/user/task_0\n")
    assert job_process.read_process(node, 12596).job.id == "4242"  # the same process: read once
    stat = root / "proc" / "12596" / "stat"
    fields = stat.read_text().split(" ")
    fields[21] = str(int(fields[21]) + 1000)  # another start time: another process with the same pid
    stat.write_text(" ".join(fields))
    assert job_process.read_process(node, 12596).job.id == "5150"


# -- the jobs check keeps a job on a GPU that can no longer be read ---------------------------------------------------
def _judged(root: Path, state: dict, now: float):
    from gpuwarden.checks import jobs as check

    cfg = {"state_dir": ""}
    return check.judge(state, check.sample(Node.recorded_at(root), cfg, state), cfg, now)


def _lose(root: Path, *gpus: int) -> None:
    data = json.loads((root / "nvml.json").read_text())
    for g in gpus:
        data["gpus"][g]["errors"] = {"*": "GPU_IS_LOST"}
    (root / "nvml.json").write_text(json.dumps(data))


def test_a_gpu_that_fell_off_the_bus_keeps_its_job(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    first = _judged(root, {}, 1000.0)
    _lose(root, 2)  # a lost GPU lists no processes
    after = _judged(root, first.state, 1010.0)
    (job,) = after.state["jobs"].values()
    assert [g["index"] for g in job["gpus"]] == [0, 1, 2, 3] and job["seen_at"] == 1000.0
    assert [(f.code, f.entity.index) for f in after.findings] == [("gpu-lost", 2)]


def test_a_job_whose_every_gpu_is_lost_stays_while_its_processes_live(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")
    first = _judged(root, {}, 1000.0)
    _lose(root, 0, 1, 2, 3)
    later = _judged(root, first.state, 1000.0 + 3000.0)  # within the hour since it was last listed
    assert list(later.state["jobs"]) == ["slurm:4242.0"] and later.state["listed_at"] == {"slurm:4242.0": 1000.0}
    assert _judged(root, later.state, 1000.0 + 3700.0).state["jobs"] == {}  # an hour past: its processes may hang
    for pid in PIDS:
        (root / "proc" / str(pid) / "stat").unlink()  # the processes are gone
    assert _judged(root, first.state, 1010.0).state["jobs"] == {}


def test_a_recording_replays_the_jobs_the_node_showed(scenario_copy, tmp_path):
    from gpuwarden.agent.node.record import record

    root = scenario_copy("gb200-nvl72-job")
    (root / "proc" / "12596" / "cgroup").write_text("0::/\n")  # this one named by scontrol pidinfo alone
    set_env(root, 12596, SLURM_JOB_ID=None)
    record_tool(root, "scontrol-pidinfo-12596", "Slurm job id 4242 ends at Fri Dec 04 23:59:59 2026\n", rc=0)
    set_env(root, 12597, AWS_SECRET_ACCESS_KEY="hunter2")  # a process's environment holds secrets: never recorded
    out = tmp_path / "recorded"
    assert record(Node.recorded_at(root), out) == []
    assert (out / "tools" / "scontrol-pidinfo-12596.out").read_text().startswith("Slurm job id 4242")
    job_process.forget()
    before = look(root)
    job_process.forget()
    after = look(out)
    assert [j.to_dict() for j in after.jobs] == [j.to_dict() for j in before.jobs]
    (job,) = after.jobs
    assert job.gpu_indices == (0, 1, 2, 3) and job.nccl_version.value == "2.32.3"
    assert "hunter2" not in (out / "proc" / "12597" / "environ").read_text()
    assert job.job.source == "scontrol pidinfo 12596"  # the lead rank, named by its replayed answer

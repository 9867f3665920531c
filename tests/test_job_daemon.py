"""The job response in the real daemon, on the recorded tray that runs Slurm job 4242 (fixtures/nodes/gb200-nvl72-job),
with the local adapter's real SQLite scheduler: a fault on a GPU of the job ends it right after the node's cordon, in
the same observation that read the fault; a dry run ends nothing; a restart acts on no job twice; the NCCL settings
warning comes from the daemon's own port history; `gpuwarden status` shows the jobs and what was done to them."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import ROOT, append_kmsg, edit_nvml, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.remediation import Settings
from gpuwarden.agent.core import config
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs, job_process

XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
JOB = JobRef("slurm", "4242", 0)


@pytest.fixture
def start(scenario_copy, tmp_path):
    """start(mode=..., on_doomed=..., root=...) runs the daemon on a copy of the job's tray; all are stopped at the
    end."""
    made = []
    root = scenario_copy("gb200-nvl72-job")
    job_process.forget()

    def run(mode: str = "act", on_doomed: str = "requeue", intervals: dict | None = None, **cfg_checks):
        state = tmp_path / "state"
        cfg = config.defaults(all_specs())
        cfg.jobs["on_doomed"] = on_doomed
        cfg.agent["state_dir"] = str(state)
        for check, values in cfg_checks.items():
            cfg.checks[check].update(values)
        store = Store(state / "state.db")
        adapter = LocalAdapter(state / "actions.jsonl", node_name="n1")
        d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store, adapter,
                   DaemonCollector(), DaemonOptions(
                       kmsg_tick_s=0.01, idle_tick_s=0.05, policy=dict(DEFAULT_POLICY),
                       intervals={"jobs": 0.2, **(intervals or {})},
                       remediation=Settings(mode=mode, node_name="n1", actions_path=state / "actions.jsonl")))
        d.start()
        made.append((d, store))
        wait_for(lambda: (r := d.results().get("jobs")) is not None and r.state.get("jobs"), what="the job seen")
        return d, store, adapter

    run.root, run.state = root, tmp_path / "state"
    yield run
    for d, store in made:
        d.stop()
        store.close()


def journal(store) -> list[dict]:
    return store.intents()


def test_an_xid_on_a_gpu_of_the_job_requeues_it_right_after_the_cordon(start):
    d, store, adapter = start()
    append_kmsg(start.root, XID79)
    wait_for(lambda: any(i["action"] == "job" and i["done"] for i in journal(store)), what="the job intent done")
    wait_for(lambda: all(i["done"] for i in journal(store)), what="every intent done")
    intents = journal(store)
    assert [i["action"] for i in intents] == ["cordon", "job", "drain"]
    job = intents[1]
    assert job["outcome"] == "done: requeued Slurm job 4242" and job["detail"]["rule"] == "xid"
    # Made by the observation that read the XID: the node's transition's own time.
    assert job["created"] == intents[0]["created"] == store.transitions(1)[0].at
    assert d.record.state is NodeState.QUARANTINED
    view = adapter.job(JOB)
    assert (view.state, view.run) == ("pending", 1) and view.mark.startswith("gpuwarden: requeued on n1: xid 79")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in d.engine.samples()}
    assert samples[("gpuwarden_job_actions", (("action", "requeue"), ("reason", "xid")))] == 1.0


def test_in_dry_run_the_job_is_logged_and_left_running(start):
    d, store, adapter = start(mode="dry-run")
    append_kmsg(start.root, XID79)
    wait_for(lambda: any(i["action"] == "job" and i["done"] for i in journal(store)), what="the job intent ended")
    (job,) = [i for i in journal(store) if i["action"] == "job"]
    assert job["outcome"] == "dry-run: logged, not carried out" and adapter.job(JOB).state == "running"
    logged = [json.loads(line) for line in (start.state / "actions.jsonl").read_text().splitlines()]
    assert [a["policy"] for a in logged if a["action"] == "job"] == ["requeue"]


def test_a_restart_acts_on_the_job_once(start):
    d, store, adapter = start()
    append_kmsg(start.root, XID79)
    wait_for(lambda: any(i["action"] == "job" and i["done"] for i in journal(store)), what="the job intent done")
    d.stop()
    store.close()
    d2, store2, _ = start()  # the same state: the fault and the job still there
    time.sleep(1.0)
    assert [i["action"] for i in journal(store2)].count("job") == 1
    assert adapter.job(JOB).run == 1  # requeued once


def test_a_throttled_gpu_leaves_the_job_alone(start):
    d, store, adapter = start(intervals={"clock_events": 0.1}, clock_events={"min_window_s": 0.3, "window_s": 5.0})
    edit_nvml(start.root, lambda s: s["gpus"][0].update(clocks_event_reasons=0x88))
    # the check's first result comes after its first interval: until then the daemon has none for it
    wait_for(lambda: any(f.status.value == "fail" for f in getattr(d.results().get("clock_events"), "findings", ())),
             what="the throttle judged a fault")
    wait_for(lambda: any(i["action"] == "cordon" and i["done"] for i in journal(store)), what="the cordon")
    time.sleep(0.5)
    assert "job" not in [i["action"] for i in journal(store)] and adapter.job(JOB).state == "running"


def test_a_port_down_past_the_jobs_timeout_ends_it_shorter_does_not(start):
    for proc in (start.root / "proc").glob("1259?"):  # NCCL_IB_TIMEOUT=17: 4.096 us x 2^17 x 7 = 3.76 s
        (proc / "environ").write_bytes((proc / "environ").read_bytes() + b"NCCL_IB_TIMEOUT=17\0")
    d, store, adapter = start(ib_port={"down_fail_s": 1.0})
    port = start.root / "sys/class/infiniband/mlx5_1/ports/1/state"
    port.write_text("1: DOWN\n")
    wait_for(lambda: (r := d.results().get("ib_port")) and any(f.code == "ib-port-down" for f in r.findings),
             what="the port's FAIL")
    port.write_text("4: ACTIVE\n")  # back well before 3.76 s: the collectives rode it out
    wait_for(lambda: not d.results()["ib_port"].findings, what="the port up again")
    assert "job" not in [i["action"] for i in journal(store)]
    port.write_text("1: DOWN\n")
    wait_for(lambda: any(i["action"] == "job" and i["done"] for i in journal(store)), timeout_s=30,
             what="the job intent done")
    (job,) = [i for i in journal(store) if i["action"] == "job"]
    assert job["detail"]["rule"] == "ib-port-down" and job["outcome"] == "done: requeued Slurm job 4242"
    assert job["detail"]["fault_at"] == pytest.approx(float(job["key"].rsplit(":", 1)[1]) + 3.758, abs=0.01)


def test_the_nccl_settings_warning_comes_from_the_daemons_port_history(start):
    d, store, adapter = start()
    # No outage in the daemon's port history: nothing to say of the job's 30 s IB timeout ...
    wait_for(lambda: store.check("ib_port") is not None, what="the port history written")
    rec = store.check("ib_port")
    assert not d.results()["jobs"].findings
    # ... then the history as the ib_port check keeps it in its store (its state's intervals: start, end, seconds,
    # flaps), with a 40 s outage of mlx5_2/1 an hour ago (the check writes its record only when it changes: while
    # every port stays up, this one stands).
    ports = dict(rec.state["ports"])
    ports["mlx5_2/1"] = {**ports["mlx5_2/1"], "intervals": [[time.time() - 100, time.time() - 60, 40.0, 1]]}
    store.commit(checks=[type(rec)(rec.name, {**rec.state, "ports": ports}, rec.status, rec.error, rec.findings,
                                   rec.updated, rec.duration_s)])
    # 40 s is longer than the job's 30 s: the next look warns, naming the outage and the setting that rides it out.
    wait_for(lambda: d.results()["jobs"].findings, what="the settings warning")
    (f,) = d.results()["jobs"].findings
    assert f.code == "nccl-ib-timeout-short" and f.status.value == "warn" and f.entity.id == "slurm:4242.0"
    assert "mlx5_2/1 40.0 s" in f.message and "NCCL_IB_TIMEOUT=21" in f.message and f.evidence["riding_out"] == 21


def test_status_shows_the_jobs_on_the_node_and_what_was_done(start):
    d, store, adapter = start()
    append_kmsg(start.root, XID79)
    wait_for(lambda: any(i["action"] == "job" and i["done"] for i in journal(store)), what="the job intent done")
    d.flush()
    out = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(start.state)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "slurm:4242.0: GPUs 0,1,2,3, ranks 0,1,2,3" in out.stdout
    assert "doomed by xid 79 GPU0 0008:01:00.0 (its GPU 0): requeue -> done: requeued Slurm job 4242" in out.stdout
    js = json.loads(subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir",
                                    str(start.state), "--json"], capture_output=True, text=True, timeout=60,
                                   cwd=ROOT).stdout)
    (job,) = js["jobs"]
    assert job["job"] == "slurm:4242.0" and job["on_node"] and job["actions"][0]["rule"] == "xid"


def test_gpuwarden_jobs_json_on_the_bundled_tray():
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "jobs", "--root",
                           "fixtures/nodes/gb200-nvl72-job", "--json", "--state-dir", "/nonexistent"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (job,) = out["jobs"]
    assert job["job"]["id"] == "4242" and job["ranks"] == [0, 1, 2, 3] and [g["index"] for g in job["gpus"]] == \
        [0, 1, 2, 3]
    assert job["effective_ib_timeout_s"]["value"] == pytest.approx(30.06, abs=0.01)
    assert "NCCL 2.32.3" in job["ib_timeout"]["source"] and job["watchdog_s"]["value"] == 600.0
    assert out["findings"] == [] and "no daemon state here" in out["port_history"]

"""The fleet simulator: seeded and reproducible, node-hours conserved, and every failure decided by the real state
machine, remediation engine, circuit breaker and spare swap against the local adapter on a simulated clock."""
from __future__ import annotations

import argparse
import json

import pytest
from gpuwarden.agent.cli import plan as plan_cli
from gpuwarden.agent.cli.flags import options
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.scheduler import Service
from gpuwarden.agent.fleet.plan import simulate as plan_simulate
from gpuwarden.agent.fleet.plan.sim_config import HOUR, Burst, Policy, SimConfig
from gpuwarden.agent.fleet.plan.sim_fleet import Fleet, simulate
from gpuwarden.agent.state.transitions import NodeState

# Small fleets, short node MTBI: many failures in a fraction of a second.
BUSY = SimConfig(racks=4, nodes_per_rack=18, days=30, mtbi_days=60, seed=7)
# No random failure (a node MTBI of 270 years) and fixed repairs: only what a test forces happens.
QUIET = dict(mtbi_days=100_000, repair_median_h=10, repair_sigma=0.0, days=2)


def _args(*argv: str) -> plan_simulate.Options:
    p = argparse.ArgumentParser()
    plan_cli.part_arguments(p, "simulate")
    return options(p.parse_args(list(argv)), plan_simulate.Options)


def test_the_same_seed_gives_the_same_report():
    a = simulate(BUSY, Policy(2, 16)).to_dict()
    b = simulate(BUSY, Policy(2, 16)).to_dict()
    assert a["failures"] > 5 and a["jobs"]["interrupted"] > 5
    assert a == b  # the job figures with the rest


def test_another_seed_gives_another_report():
    a = simulate(BUSY, Policy(2, 16)).to_dict()
    b = simulate(SimConfig(**{**BUSY.__dict__, "seed": 8}), Policy(2, 16)).to_dict()
    assert a != b
    assert a["series"] != b["series"]


def test_two_policies_see_the_same_failures():
    a = simulate(BUSY, Policy(2, 16))
    b = simulate(BUSY, Policy(0, 18))
    assert a.failures == b.failures and a.repairs == b.repairs


@pytest.mark.parametrize("policy", [Policy(2, 16), Policy(0, 18), Policy(1, 8)])
def test_node_hours_add_up(policy):
    r = simulate(BUSY, policy)
    assert r.total_node_hours == pytest.approx(4 * 18 * 30 * 24)
    assert sum(r.node_hours.values()) == pytest.approx(r.total_node_hours)
    assert 0 < r.usable_node_hours <= r.total_node_hours
    assert r.usable_node_hours == pytest.approx(r.node_hours["working"])
    # Never more than the policy keeps in service, and the hourly series stays within the fleet.
    in_service = 4 * ((18 - policy.spares) // policy.slice) * policy.slice
    assert r.usable_node_hours <= in_service * 30 * 24 + 1e-6
    assert all(0 <= n <= in_service for _, n in r.series)
    assert len(r.series) == 30 * 24 + 1


def test_a_failed_node_goes_through_the_state_machine_and_back(tmp_path):
    config = SimConfig(racks=2, nodes_per_rack=18, bursts=(Burst(1, 1, 5.0),), **QUIET)
    fleet = Fleet(config, Policy(2, 16), workdir=tmp_path)
    report = fleet.run()
    name = fleet.names[18]
    mine = [t for n, t in fleet.transitions if n == name]
    steps = [(t.frm, t.to, t.actions) for t in mine]
    assert steps == [
        (NodeState.HEALTHY, NodeState.QUARANTINED, ("cordon", "drain")),
        (NodeState.QUARANTINED, NodeState.QUARANTINED, ("ticket",)),
        (NodeState.QUARANTINED, NodeState.HEALTHY, ("resume",)),
    ]
    assert mine[0].at == 5 * HOUR
    assert mine[1].at == 5 * HOUR + 60  # the ladder's first step waits step_after_s after the quarantine
    assert mine[2].at > 15 * HOUR  # after the repair (10 h) and the retest
    done = [("job" if k.startswith("job:") else k.rsplit(":", 1)[1], outcome)
            for n, k, outcome, _ in fleet.intents if n == name]
    # The slice's doomed job is ended after the node is out: the engine ends a job only where it took the node out.
    assert [a for a, _ in done] == ["cordon", "drain", "take_spare", "job", "ticket", "resume"]
    assert dict(done)["ticket"] == "done: simulated ticket"
    assert dict(done)["job"] == "done: requeued Slurm job 2"
    assert report.failures == report.repairs == 1
    assert report.interruptions == 1 and report.waits == 0
    assert fleet.scheduler.mirror_matches()


def test_a_spare_comes_from_the_same_rack_and_the_repaired_node_refills_the_pool(tmp_path):
    config = SimConfig(racks=3, nodes_per_rack=18, bursts=(Burst(1, 1, 5.0),), **QUIET)
    fleet = Fleet(config, Policy(2, 16), workdir=tmp_path)
    report = fleet.run()
    failed = fleet.names[18]
    outcomes = dict((k.rsplit(":", 1)[1], o) for n, k, o, _ in fleet.intents if n == failed)
    assert outcomes["take_spare"] == "done: spare r0001n016 of rack0001 taken into service"
    assert outcomes["resume"] == "done: returned to the spare pool of rack0001"
    assert report.spares_consumed == 1 and report.slice_must_move == 0
    views = {v.name: v for v in fleet.scheduler.real.nodes()}
    assert views["r0001n016"].service is Service.IN_SERVICE and not views["r0001n016"].spare
    assert views[failed].spare and views[failed].domain == "rack0001"
    # Every other rack's pool is untouched.
    for r in (0, 2):
        assert [v.name for v in views.values() if v.spare and v.domain == f"rack{r:04d}"] == \
            [f"r{r:04d}n016", f"r{r:04d}n017"]
    # The slice came back on its rack at once, with the spare, and worked after its restart.
    assert report.waits == 0 and report.interruptions == 1
    assert report.node_hours["restarting"] == pytest.approx(16 * 10 / 60)


def test_without_spares_a_failure_interrupts_and_the_slice_waits_for_the_repair():
    config = SimConfig(racks=2, nodes_per_rack=18, bursts=(Burst(1, 1, 5.0),), **QUIET)
    r = simulate(config, Policy(0, 18))
    assert r.interruptions == 1 and r.spares_consumed == 0 and r.slice_must_move == 1
    assert r.waits == 1
    # Repaired 10 h after the failure, then a minute clear and the retest (10 min) before it is back in service.
    assert r.wait_slice_hours == pytest.approx(10 + 1 / 60 + 10 / 60, abs=0.05)
    assert r.node_hours["idle"] == pytest.approx(17 * r.wait_slice_hours, rel=1e-6)


def test_the_breaker_trips_when_a_rack_fails_at_once_and_acts_after_the_reset():
    config = SimConfig(racks=10, nodes_per_rack=18, bursts=(Burst(3, 6, 5.0),), **QUIET)
    fleet = Fleet(config, Policy(2, 16))
    r = fleet.run()
    # A quarter of an 18-node rack (4 nodes) may be drained within the window; the fifth and sixth are held.
    assert r.breaker_trips == 2
    cordons = {n: at for n, k, o, at in fleet.intents if k.endswith(":cordon") and o == "done"}
    burst = [fleet.names[3 * 18 + k] for k in range(6)]
    assert all(cordons[n] == 5 * HOUR for n in burst[:4])
    assert all(cordons[n] == 5 * HOUR + 2 * HOUR for n in burst[4:])  # after the operator's reset


def test_intents_the_breaker_held_are_superseded_when_the_node_recovered_before_the_reset():
    # The burst's fifth and sixth nodes are held by the breaker; repaired (10 h) and retested before the operator's
    # reset (20 h), they are healthy again: their held cordon, quarantine, swap and ticket are superseded, never
    # carried out on a healthy node (the simulator found them carried out after the reset).
    config = SimConfig(racks=10, nodes_per_rack=18, bursts=(Burst(3, 6, 5.0),), breaker_reset_h=20.0, **QUIET)
    fleet = Fleet(config, Policy(2, 16))
    r = fleet.run()
    assert r.breaker_trips == 2
    held = [fleet.names[3 * 18 + k] for k in (4, 5)]
    for node in held:
        outcomes = [(k.rsplit(":", 1)[1], o) for n, k, o, _ in fleet.intents if n == node]
        acted = [a for a, o in outcomes if a in ("cordon", "quarantine", "drain", "take_spare", "ticket")
                 and not o.startswith("superseded")]
        assert not acted, outcomes
        assert any(o.startswith("superseded") for _, o in outcomes), outcomes
    assert all(fleet.scheduler.node(n).service.value == "in_service" for n in held)


def test_no_breaker_trip_for_independent_failures():
    assert simulate(BUSY, Policy(2, 16)).breaker_trips == 0


def test_run_prints_json_and_draws_the_plot(tmp_path, capsys):
    out = tmp_path / "sim.png"
    args = _args("--racks", "3", "--days", "5", "--mtbi-days", "30", "--policy", "spares=2,slice=16",
                 "--policy", "spares=0,slice=18", "--json", "--plot", str(out))
    assert plan_simulate.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["spares=2,slice=16", "spares=0,slice=18"]
    assert doc["config"]["racks"] == 3 and doc["policies"][0]["nodes"] == 54
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_prints_a_table(capsys):
    assert plan_simulate.run(_args("--racks", "2", "--days", "3", "--burst", "0:1@1")) == 0
    text = capsys.readouterr().out
    assert "spares=2,slice=16" in text and "spares=0,slice=18" in text
    assert "slice interruptions" in text and "breaker trips" in text
    rows = {line[:40].strip(): line[40:].split() for line in text.splitlines()}
    # One failure at 1 h into a 64-GPU (and a 72-GPU) job that checkpoints hourly: nothing since its checkpoint.
    assert rows["GPU-hours lost: job waits for watchdog"] == ["10.7", "12.0"]
    assert rows["GPU-hours lost: gpuwarden ends it"] == ["0.0", "0.0"]
    assert rows["GPU-hours saved by ending it"] == ["10.6", "12.0"]


@pytest.mark.parametrize("argv", [
    ("--racks", "inf"), ("--racks", "nan"), ("--racks", "-1"), ("--racks", "0"), ("--racks", "9" * 5000),
    ("--racks", "1e3"), ("--nodes-per-rack", "2000"), ("--racks", "10000", "--nodes-per-rack", "18"),
    ("--days", "inf"), ("--days", "nan"), ("--days", "-1"), ("--days", "0"), ("--days", "1e309"),
    ("--mtbi-days", "0"), ("--mtbi-days", "nan"), ("--racks", "5000", "--days", "3650"),
    ("--repair-hours", "inf"), ("--repair-hours", "-2"), ("--repair-sigma", "nan"), ("--repair-sigma", "99"),
    ("--restart-minutes", "-1"), ("--breaker-reset-hours", "inf"), ("--seed", "-1"), ("--seed", "1" * 40),
    ("--policy", "spares=2"), ("--policy", "slice=16"), ("--policy", "spares=2,slice=17"),
    ("--policy", "spares=18,slice=1"), ("--policy", "spares=2,slice=16,slice=8"), ("--policy", "x" * 10_000),
    ("--policy", "spares=nan,slice=16"),
    ("--burst", "0:1"), ("--burst", "128:1@1"), ("--burst", "0:19@1"), ("--burst", "0:1@inf"),
    ("--burst", "0:1@-1"), ("--burst", "0:1@99999"),
    ("--gpus-per-node", "0"), ("--gpus-per-node", "65"), ("--gpus-per-node", "4.5"), ("--gpus-per-node", "nan"),
    ("--checkpoint-minutes", "0"), ("--checkpoint-minutes", "-30"), ("--checkpoint-minutes", "inf"),
    ("--checkpoint-minutes", "99999"), ("--watchdog-minutes", "-1"), ("--watchdog-minutes", "nan"),
    ("--watchdog-minutes", "1441"), ("--abort-seconds", "-0.5"), ("--abort-seconds", "1e9"),
    ("--abort-seconds", "inf"), ("--job-response", "never"), ("--job-response", "x" * 10_000),
])
def test_hostile_flags_are_config_errors(argv):
    with pytest.raises(ConfigError) as err:
        plan_simulate.parse(_args(*argv))
    assert err.value.args[0].startswith("--")


def test_too_many_policies_or_bursts_are_config_errors():
    with pytest.raises(ConfigError, match="--policy"):
        plan_simulate.parse(_args(*["--policy", "spares=0,slice=1"] * 9))
    with pytest.raises(ConfigError, match="--burst"):
        plan_simulate.parse(_args(*["--burst", "0:1@1"] * 65))


def test_a_breaker_never_reset_holds_its_cordons_to_the_end():
    config = SimConfig(racks=10, nodes_per_rack=18, bursts=(Burst(3, 6, 5.0),), **{**QUIET, "breaker_reset_h": 0.0})
    fleet = Fleet(config, Policy(2, 16))
    r = fleet.run()
    assert r.breaker_trips == 2
    held = [fleet.names[3 * 18 + k] for k in (4, 5)]
    # Never carried out: held until the node recovered (repaired and retested), then superseded by the recovery.
    cordons = [o for n, k, o, _ in fleet.intents if n in held and k.endswith(":cordon")]
    assert cordons and all(o.startswith("superseded") for o in cordons)
    assert all(fleet.engines[fleet.index[n]].breaker_open for n in held)



def test_a_spare_that_fails_in_the_pool_takes_no_other_spare(tmp_path):
    # r0000n017 is a spare in rack0000's pool when it fails: the agent quarantines it, and the engine, which saw it
    # held in the pool at the quarantine, takes no spare in its place (it served no slice). The simulator found the
    # engine taking the rack's other spare here; the count of such swaps stays in the report, now zero.
    config = SimConfig(racks=2, nodes_per_rack=18, bursts=(Burst(0, 1, 5.0, first=17),), **QUIET)
    fleet = Fleet(config, Policy(2, 16), workdir=tmp_path)
    r = fleet.run()
    assert [(t.frm, t.to) for n, t in fleet.transitions if n == "r0000n017"][0] == \
        (NodeState.HEALTHY, NodeState.QUARANTINED)
    outcomes = dict((k.rsplit(":", 1)[1], o) for n, k, o, _ in fleet.intents if n == "r0000n017")
    assert outcomes["take_spare"] == "done: no spare taken: r0000n017 was a spare of rack0000 held in the pool " \
                                     "(no slice ran on it)"
    assert r.spares_consumed == r.spares_for_spares == 0
    assert r.interruptions == 0 and r.node_hours["idle"] == 0.0  # no spare sits in service with nothing to run


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import sys
    report = simulate(SimConfig(racks=1, days=1, mtbi_days=100_000), Policy(2, 16))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: the import raises ImportError
    with pytest.raises(ConfigError, match=r"`plot` extra"):
        plan_simulate.plot([report], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# -- the jobs on the slices: GPU-hours lost waiting for the watchdog against gpuwarden ending the job -----------------
def _lost(report):
    return report.jobs.gpu_hours_lost_watchdog, report.jobs.gpu_hours_lost_fast_abort


def test_json_carries_both_job_figures_and_the_settings(capsys):
    args = _args("--racks", "4", "--days", "30", "--mtbi-days", "60", "--seed", "7", "--gpus-per-node", "8",
                 "--checkpoint-minutes", "30", "--watchdog-minutes", "20", "--abort-seconds", "3", "--json")
    assert plan_simulate.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == plan_simulate.JSON_VERSION
    assert doc["config"] | {"gpus_per_node": 8, "checkpoint_min": 30.0, "watchdog_min": 20.0, "abort_s": 3.0,
                            "job_response": "fast-abort"} == doc["config"]
    for p, gpus in zip(doc["policies"], (128, 144), strict=True):
        jobs = p["jobs"]
        assert jobs["settings"] == {"job_nodes": gpus // 8, "gpus_per_node": 8, "job_gpus": gpus,
                                    "checkpoint_min": 30.0, "watchdog_min": 20.0, "abort_s": 3.0}
        assert jobs["interrupted"] > 5 and jobs["response"] == "fast-abort"
        assert 0 < jobs["gpu_hours_lost_fast_abort"] < jobs["gpu_hours_lost_watchdog"]
        assert jobs["gpu_hours_saved"] == pytest.approx(jobs["gpu_hours_lost_watchdog"]
                                                        - jobs["gpu_hours_lost_fast_abort"], abs=0.002)
        # Nothing held a requeue here: each job idled 3 s, not 20 min.
        assert jobs["ended_by_gpuwarden"] == jobs["interrupted"] and jobs["ended_by_watchdog"] == 0
        assert jobs["idle_gpu_hours_watchdog"] == pytest.approx(jobs["interrupted"] * gpus * 20 / 60, abs=0.002)
        assert jobs["idle_gpu_hours_fast_abort"] == pytest.approx(jobs["interrupted"] * gpus * 3 / 3600, abs=0.002)


@pytest.mark.parametrize("policy", [Policy(2, 16), Policy(0, 18), Policy(1, 8)])
def test_gpuwarden_ending_a_doomed_job_loses_less_than_waiting_for_its_watchdog(policy):
    r = simulate(BUSY, policy)
    watchdog, fast = _lost(r)
    assert r.jobs.interrupted > 5
    assert fast < watchdog
    # The same work since the checkpoint on both sides, at most one interval per doomed job.
    assert 0 < r.jobs.checkpoint_gpu_hours <= r.jobs.interrupted * r.jobs.job_gpus * BUSY.checkpoint_min / 60
    assert watchdog - r.jobs.checkpoint_gpu_hours == pytest.approx(r.jobs.idle_gpu_hours_watchdog)
    assert fast - r.jobs.checkpoint_gpu_hours == pytest.approx(r.jobs.idle_gpu_hours_fast_abort)


def test_no_failures_lose_no_job_time():
    r = simulate(SimConfig(racks=3, nodes_per_rack=18, **QUIET), Policy(2, 16))
    assert r.failures == 0 and r.jobs.interrupted == 0
    assert _lost(r) == (0.0, 0.0) and r.jobs.gpu_hours_saved == 0.0
    assert r.node_hours["hung"] == 0.0


def test_a_watchdog_of_zero_minutes_makes_the_idle_parts_equal():
    r = simulate(SimConfig(**{**BUSY.__dict__, "watchdog_min": 0.0}), Policy(2, 16))
    assert r.jobs.interrupted > 5
    assert r.jobs.idle_gpu_hours_watchdog == r.jobs.idle_gpu_hours_fast_abort == 0.0
    watchdog, fast = _lost(r)
    assert watchdog == fast == r.jobs.checkpoint_gpu_hours > 0 and r.jobs.gpu_hours_saved == 0.0


def test_the_same_seed_gives_the_same_job_figures_and_another_seed_others():
    a = simulate(BUSY, Policy(0, 18)).jobs.to_dict()
    assert a == simulate(BUSY, Policy(0, 18)).jobs.to_dict()
    assert a != simulate(SimConfig(**{**BUSY.__dict__, "seed": 8}), Policy(0, 18)).jobs.to_dict()


def test_a_doomed_job_loses_the_work_since_its_checkpoint_and_a_restarting_one_nothing(tmp_path):
    # Node 0 of rack 1's 16-node slice (64 GPUs, working since 0) fails 5.5 h in: half an hour since its checkpoint.
    # The job ends 2 s later and is placed again with the spare; node 1 fails while it restarts: no job time.
    config = SimConfig(racks=2, nodes_per_rack=18, bursts=(Burst(1, 1, 5.5), Burst(1, 1, 5.6, first=1)), **QUIET)
    fleet = Fleet(config, Policy(2, 16), workdir=tmp_path)
    r = fleet.run()
    assert r.interruptions == 2 and r.jobs.interrupted == 1
    assert r.jobs.checkpoint_gpu_hours == pytest.approx(64 * 0.5)
    assert r.jobs.idle_gpu_hours_watchdog == pytest.approx(64 * 10 / 60)
    assert r.jobs.idle_gpu_hours_fast_abort == pytest.approx(64 * 2 / 3600)
    assert r.node_hours["hung"] == pytest.approx(15 * 2 / 3600)  # the 15 healthy nodes, 2 s; the failed one is out
    # The slice's job at the scheduler: requeued by gpuwarden, then by the scheduler when its start-up failed.
    view = fleet.scheduler.job(JobRef("slurm", "2"))
    assert (view.state, view.run) == ("running", 2)


def test_one_fault_on_several_nodes_of_a_job_ends_it_once(tmp_path):
    # Six nodes of one 16-node slice fail at once: each one's engine is given the job; the first requeues it, the
    # others find it requeued at the scheduler (the breaker held two of them, whose turn came after its reset).
    config = SimConfig(racks=10, nodes_per_rack=18, bursts=(Burst(3, 6, 5.0),), **QUIET)
    fleet = Fleet(config, Policy(2, 16), workdir=tmp_path)
    r = fleet.run()
    jobs = [(n, o) for n, k, o, _ in fleet.intents if k.startswith("job:slurm:4.0:")]
    assert [n for n, _ in jobs] == [fleet.names[3 * 18 + k] for k in range(6)]
    assert jobs[0][1] == "done: requeued Slurm job 4"
    assert all(o == "already so at the scheduler (Slurm job 4 is pending (requeued since))" for _, o in jobs[1:])
    assert r.jobs.interrupted == r.jobs.ended_by_gpuwarden == 1
    view = fleet.scheduler.job(JobRef("slurm", "4"))
    assert view.run == 1 and view.mark.startswith("gpuwarden: requeued on r0003n000: ")
    requeues = [a for a in fleet.scheduler.real.actions() if a["action"] == "requeue_job"]
    assert [a["job"] for a in requeues] == ["slurm:4"]


def test_a_job_whose_failed_nodes_the_breaker_holds_waits_for_its_watchdog():
    # 4-node slices: the burst's first four nodes are one job, ended by gpuwarden; its fifth and sixth the next job,
    # whose nodes' intents (the job's with them) the breaker holds until its reset 2 h later: that job waits for its
    # watchdog.
    config = SimConfig(racks=10, nodes_per_rack=18, bursts=(Burst(3, 6, 5.0),), **QUIET)
    r = simulate(config, Policy(2, 4))
    assert r.breaker_trips == 2
    assert r.jobs.interrupted == 2 and r.jobs.ended_by_gpuwarden == 1 and r.jobs.ended_by_watchdog == 1
    assert r.jobs.idle_gpu_hours_fast_abort == pytest.approx(16 * (2 / 3600 + 10 / 60))
    assert r.jobs.idle_gpu_hours_watchdog == pytest.approx(2 * 16 * 10 / 60)


def test_waiting_for_the_watchdog_holds_the_slice_and_costs_what_the_fast_run_charges():
    fast = simulate(BUSY, Policy(2, 16))
    slow = simulate(SimConfig(**{**BUSY.__dict__, "job_response": False}), Policy(2, 16))
    assert slow.failures == fast.failures and slow.jobs.response == "watchdog"
    assert slow.jobs.ended_by_gpuwarden == 0 and slow.jobs.interrupted == fast.jobs.interrupted
    # Each doomed job's 15 healthy nodes hung for the watchdog, not for 2 s; the fleet worked that much less.
    assert slow.node_hours["hung"] == pytest.approx(slow.jobs.interrupted * 15 * 10 / 60, rel=0.05)
    lost = slow.usable_node_hours - fast.usable_node_hours
    assert lost == pytest.approx(-slow.jobs.interrupted * 16 * 10 / 60, rel=0.15)
    # What the fast run charges the watchdog for is what waiting for it cost (the checkpoint part moves by chance).
    assert slow.jobs.gpu_hours_lost_watchdog == pytest.approx(fast.jobs.gpu_hours_lost_watchdog, rel=0.05)
    assert slow.jobs.idle_gpu_hours_watchdog == fast.jobs.idle_gpu_hours_watchdog


@pytest.mark.parametrize("argv", [("--watchdog-minutes", "-1"), ("--checkpoint-minutes", "0"),
                                  ("--gpus-per-node", "0"), ("--abort-seconds", "nan"), ("--job-response", "wait")])
def test_bad_job_flags_exit_2_naming_the_flag(argv, capsys):
    from gpuwarden.agent.cli import main as cli

    assert cli.main(["plan", "simulate", "--racks", "1", "--days", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {argv[0]} " in err

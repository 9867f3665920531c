"""The fleet simulator: seeded and reproducible, node-hours conserved, and every failure decided by the real state
machine, remediation engine, circuit breaker and spare swap against the local adapter on a simulated clock."""
from __future__ import annotations

import argparse
import json

import pytest

from gpuwarden.agent import plan_simulate
from gpuwarden.agent.adapters.base import Service
from gpuwarden.agent.errors import ConfigError
from gpuwarden.agent.sim_fleet import HOUR, Burst, Fleet, Policy, SimConfig, simulate
from gpuwarden.agent.state import NodeState

# Small fleets, short node MTBI: many failures in a fraction of a second.
BUSY = SimConfig(racks=4, nodes_per_rack=18, days=30, mtbi_days=60, seed=7)
# No random failure (a node MTBI of 270 years) and fixed repairs: only what a test forces happens.
QUIET = dict(mtbi_days=100_000, repair_median_h=10, repair_sigma=0.0, days=2)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    plan_simulate.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_same_seed_gives_the_same_report():
    a = simulate(BUSY, Policy(2, 16)).to_dict()
    b = simulate(BUSY, Policy(2, 16)).to_dict()
    assert a["failures"] > 5
    assert a == b


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
    done = [(k.rsplit(":", 1)[1], outcome) for n, k, outcome, _ in fleet.intents if n == name]
    assert [a for a, _ in done] == ["cordon", "drain", "take_spare", "ticket", "resume"]
    assert dict(done)["ticket"] == "done: simulated ticket"
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

"""The sweep's localisation (agent/fleet/sweep/localise.py): which node or link made a group fail, by further
collectives on disjoint sets of nodes, every round checked disjoint (padding included); and the bench's rounds criterion
for fleets up to 144 nodes (bench/localise.py)."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
from conftest import ROOT
from gpuwarden.agent.fleet.sweep.localise import Culprits, Localiser
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GOOD = ("good-a", "good-b")


def outcome(test, bad, links) -> bool:
    s = set(test)
    return bool(s & set(bad)) or any(set(link) <= s for link in links)


def drive(loc: Localiser, failing, good, bad=(), links=(), answer=None) -> list[list[tuple[str, ...]]]:
    """Run the search against an oracle; every round is checked: tests of >= 2 nodes, disjoint (padding
    included), nodes only from the failing groups and the good ones, and a good node only as the padding of one
    suspect. `answer(test, outcome)` may replace an outcome (None: no verdict)."""
    failing_nodes = {n for g in failing for n in g}
    good = set(good) - failing_nodes
    rounds = []
    while tests := loc.next_round():
        used: set[str] = set()
        for t in tests:
            assert len(t) >= 2, t
            assert not used & set(t), f"round {len(rounds) + 1} not disjoint: {tests}"
            used.update(t)
            assert set(t) <= failing_nodes | good, t
            pads = [n for n in t if n in good]
            assert not pads or (len(pads) == 1 and len(t) == 2), f"padding beside more than one suspect: {t}"
            # every test stays inside one failing group (plus padding)
            assert sum(1 for g in failing if set(t) & set(g)) == 1, t
        rounds.append(tests)
        for t in tests:
            result = outcome(t, bad, links)
            loc.record(t, answer(t, result) if answer else result)
    return rounds


def nodes(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(n)]


def test_sweep_localise_one_bad_node():
    g = nodes("n", 16)
    loc = Localiser([g], GOOD)
    rounds = drive(loc, [g], GOOD, bad={"n05"})
    assert loc.result() == Culprits(frozenset({"n05"}), frozenset(), frozenset(), frozenset({0}))
    # both halves of each failing set in the same round: 8+8, 4+4, 2+2, then n04 and n05 each beside a node from
    # outside; n05 fails, so the group less n05 is tested beside n05's second look, with the other outside node
    assert rounds == [
        [tuple(g[:8]), tuple(g[8:])],
        [tuple(g[:4]), tuple(g[4:8])],
        [("n04", "n05"), ("n06", "n07")],
        [("n04", "good-a"), ("n05", "good-b")],
        [tuple(n for n in g if n != "n05"), ("n05", "good-a")],
    ]
    assert loc.rounds_run == 5 and loc.tests_run == 10


def test_sweep_localise_rounds_do_not_grow_with_bad_nodes():
    # four bad nodes in four quarters of 64: all found in the same rounds as one
    g = nodes("n", 64)
    one = Localiser([g], GOOD)
    drive(one, [g], GOOD, bad={"n03"})
    four = Localiser([g], GOOD)
    drive(four, [g], GOOD, bad={"n03", "n21", "n40", "n60"})
    assert four.result().nodes == {"n03", "n21", "n40", "n60"} and not four.result().unresolved
    assert one.rounds_run == 7  # six levels of halving, then the group less n03
    # more singles than the two outside nodes: the rest are padded with nodes of the group that passed, and a
    # suspect that fails so is tested again beside an outside node before it is blamed
    assert four.rounds_run <= one.rounds_run + 2
    assert four.tests_run > 3 * one.tests_run


def test_sweep_localise_padding_from_the_group_is_proven_with_an_outside_node():
    # one outside node: in round 2, n02 gets it and n03 is padded with n00, which passed in round 1. n03 fails
    # beside n00 (a link, not a bad node): beside the outside node it passes (round 3, beside the rest's test),
    # so the link is blamed, not n03; then n03 is tested with the rest, which finds its link to n02
    g = nodes("n", 4)
    links = [frozenset({"n00", "n03"}), frozenset({"n02", "n03"})]
    loc = Localiser([g], ["ok"])
    rounds = drive(loc, [g], ["ok"], links=links)
    assert rounds[:3] == [[("n00", "n01"), ("n02", "n03")], [("n02", "ok"), ("n03", "n00")],
                          [("n00", "n01", "n02"), ("n03", "ok")]]
    res = loc.result()
    assert res.nodes == frozenset() and res.links == set(links) and not res.unresolved
    # the same with n03 bad: blamed only once it failed beside the outside node too
    loc = Localiser([g], ["ok"])
    rounds = drive(loc, [g], ["ok"], bad={"n03"})
    assert rounds[2] == [("n00", "n01", "n02"), ("n03", "ok")] and len(rounds) == 3
    assert loc.result().nodes == {"n03"} and not loc.result().links


def test_sweep_localise_link_to_a_padding_node_is_not_a_bad_node():
    # a link between a failing group's node and a node of a group that passed (n4 of one rack, n1 of the other):
    # n4 fails beside n1, passes beside n2; the link is named, not n4, and n5 is a bad node (it failed beside
    # two different padding nodes)
    good = ["n1", "n2", "n3"]
    g = ["n4", "n5", "n6"]
    loc = Localiser([g], good)
    drive(loc, [g], good, bad={"n5"}, links=[frozenset({"n1", "n4"})])
    res = loc.result()
    assert res.nodes == {"n5"} and res.links == {frozenset({"n1", "n4"})} and not res.unresolved


def test_sweep_localise_bad_link_is_not_a_bad_node():
    g = nodes("n", 16)
    link = frozenset({"n03", "n11"})
    loc = Localiser([g], GOOD)
    drive(loc, [g], GOOD, links=[link])
    res = loc.result()
    assert res.nodes == frozenset() and res.links == {link} and not res.unresolved


def test_sweep_localise_several_defects_in_one_group_unknown_count():
    g = nodes("n", 24)
    bad = {"n02", "n17"}
    links = [frozenset({"n05", "n20"})]
    loc = Localiser([g], GOOD)  # how many there are is not said
    drive(loc, [g], GOOD, bad=bad, links=links)
    res = loc.result()
    assert res.nodes == bad and res.links == set(links) and not res.unresolved


def test_sweep_localise_groups_share_rounds():
    groups = [nodes("a", 8), nodes("b", 8), nodes("c", 8)]
    bad = {"a01", "c06"}
    links = [frozenset({"b02", "b05"})]
    loc = Localiser(groups, ["ok1", "ok2", "ok3"])
    rounds = drive(loc, groups, ["ok1", "ok2", "ok3"], bad=bad, links=links)
    res = loc.result()
    assert res.nodes == bad and res.links == set(links) and not res.unresolved
    assert res.finished == {0, 1, 2}
    # each alone, in turn, would take the sum of their rounds; together they overlap
    alone = 0
    for g in groups:
        one = Localiser([g], ["ok1", "ok2", "ok3"])
        alone += len(drive(one, [g], ["ok1", "ok2", "ok3"], bad=bad, links=links))
    assert len(rounds) < alone
    assert any(len({t[0][0] for t in r}) > 1 for r in rounds), "no round held tests of two groups"


def test_sweep_localise_padding_is_shared_out_by_rounds():
    # one good node, three groups that each end on a single suspect: never two tests padded with it at once
    groups = [nodes("a", 4), nodes("b", 4), nodes("c", 4)]
    loc = Localiser(groups, ["ok"])
    drive(loc, groups, ["ok"], bad={"a03", "b00", "c02"})
    assert loc.result().nodes == {"a03", "b00", "c02"}


def test_sweep_localise_no_good_node_blames_nothing():
    # every group of the first round failed: a fleet-wide signal is no node's fault
    groups = [nodes("a", 4), nodes("b", 4)]
    loc = Localiser(groups, [])
    assert loc.next_round() == []
    res = loc.result()
    assert res.nodes == frozenset() and res.links == frozenset()
    assert res.unresolved == set(groups[0]) | set(groups[1])
    # "good" nodes that are in a failing group are not good
    loc = Localiser(groups, ["a00"])
    assert loc.next_round() == [] and loc.result().unresolved == set(groups[0]) | set(groups[1])


def test_sweep_localise_preempted_test_ends_unresolved_never_blamed():
    g = nodes("n", 16)
    bad = {"n09"}
    full = Localiser([g], GOOD)
    total = len(drive(full, [g], GOOD, bad=bad))
    for stop_round in range(1, total + 1):
        loc = Localiser([g], GOOD)

        def answer(t, result, stop_round=stop_round, loc=loc):
            return None if loc.rounds_run == stop_round else result

        drive(loc, [g], GOOD, bad=bad, answer=answer)
        res = loc.result()
        assert res.links == frozenset()
        assert res.nodes <= bad, f"blamed a good node when round {stop_round} was preempted"
        assert not res.finished, f"round {stop_round} preempted, yet the group counts as cleared"
        assert res.unresolved == set(g) - res.nodes
        assert loc.rounds_run == stop_round, "rounds ran after the preempted one"


def test_sweep_localise_preemption_keeps_other_groups_going():
    groups = [nodes("a", 8), nodes("b", 8)]
    bad = {"a02", "b07"}

    def answer(t, result):
        return None if t[0].startswith("a") else result

    loc = Localiser(groups, GOOD)
    drive(loc, groups, GOOD, bad=bad, answer=answer)
    res = loc.result()
    assert res.nodes == {"b07"} and res.finished == {1}
    assert res.unresolved == set(groups[0])


def test_sweep_localise_max_tests_stops_without_guessing():
    g = nodes("n", 64)
    bad = {"n10", "n40"}
    for budget in range(0, 12):
        loc = Localiser([g], GOOD, max_tests=budget)
        drive(loc, [g], GOOD, bad=bad)
        assert loc.tests_run <= budget
        res = loc.result()
        assert res.nodes <= bad and not res.links
        assert res.unresolved == set(g) - res.nodes
    loc = Localiser([g], GOOD, max_tests=100)
    drive(loc, [g], GOOD, bad=bad)
    assert loc.result().nodes == bad and not loc.result().unresolved


def test_sweep_localise_flaky_first_failure_blames_nothing():
    # the group failed in the first round, but no test fails again: both halves pass (a link across them?), then
    # neither diagonal of their halves' unions fails: nothing to blame
    g = nodes("n", 12)
    loc = Localiser([g], GOOD)
    rounds = drive(loc, [g], GOOD)
    res = loc.result()
    assert res.nodes == frozenset() and res.links == frozenset()
    assert res.unresolved == set(g) and not res.finished
    assert rounds == [
        [tuple(g[:6]), tuple(g[6:])],
        [tuple(g[:3] + g[6:9]), tuple(g[3:6] + g[9:])],
        [tuple(g[:3] + g[9:]), tuple(g[3:6] + g[6:9])],
    ]


def test_sweep_localise_contradicting_outcomes_end():
    # outcomes that fit no defect (each test fails at random) still end, within a bounded number of tests
    import random
    g = nodes("n", 20)
    for seed in range(30):
        rng = random.Random(seed)
        loc = Localiser([g], GOOD)
        drive(loc, [g], GOOD, answer=lambda t, r, rng=rng: rng.random() < 0.5)
        assert loc.tests_run < 40 * len(g)


def test_sweep_localise_is_deterministic():
    groups = [nodes("a", 12), nodes("b", 9)]
    bad = {"a04", "a07", "b01"}
    links = [frozenset({"b03", "b08"})]
    runs = []
    for _ in range(2):
        loc = Localiser(groups, GOOD)
        runs.append((drive(loc, groups, GOOD, bad=bad, links=links), loc.result()))
    assert runs[0] == runs[1]


def test_sweep_localise_refuses_bad_input():
    with pytest.raises(ValueError, match="shares nodes"):
        Localiser([["a", "b"], ["b", "c"]], GOOD)
    with pytest.raises(ValueError, match="max_tests"):
        Localiser([["a", "b"]], GOOD, max_tests=-1)
    loc = Localiser([["a", "b"]], GOOD)
    tests = loc.next_round()
    with pytest.raises(KeyError):
        loc.record(("x", "y"), True)
    with pytest.raises(RuntimeError, match="not recorded"):
        loc.next_round()
    loc.record(tests[0], True)
    with pytest.raises(KeyError):
        loc.record(tests[0], True)


@st.composite
def fleets(draw):
    """Small fleets: groups of 1..9 nodes, some bad nodes and bad links inside groups (a link never touches a
    bad node: such a link changes no outcome), the groups with a defect failing, the others good."""
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    groups = [[f"g{i}n{j}" for j in range(s)] for i, s in enumerate(sizes)]
    bad: set[str] = set()
    links: set[frozenset[str]] = set()
    for g in groups:
        bad |= set(draw(st.lists(st.sampled_from(g), max_size=3)))
        if len(g) >= 2:
            pairs = [frozenset((a, b)) for i, a in enumerate(g) for b in g[i + 1:]]
            links |= set(draw(st.lists(st.sampled_from(pairs), max_size=3)))
    links = {x for x in links if not x & bad}
    extra_good = draw(st.integers(1, 2))
    return groups, bad, links, extra_good


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_sweep_localise_finds_every_defect_when_every_test_is_decided(fleet):
    groups, bad, links, extra_good = fleet
    failing = [g for g in groups if outcome(g, bad, links)]
    good = [n for g in groups if g not in failing for n in g] + [f"spare{i}" for i in range(extra_good)]
    loc = Localiser(failing, good)
    drive(loc, failing, good, bad=bad, links=links)
    res = loc.result()
    assert res.nodes == bad
    assert res.links == links
    assert res.unresolved == frozenset()
    assert res.finished == set(range(len(failing)))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_localise", ROOT / "bench" / "localise.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_sweep_localise_bench_rounds_within_the_allowance():
    """The bench's check for fleets up to 144 nodes, every seed it runs: each run names exactly the bad nodes (the
    bench stops otherwise), and the worst case of each row takes no more rounds than 1.2 x ceil(log2 C(N, k)) + k.
    """
    bench = load_bench()
    rows = bench.check((16, 17, 33, 72, 100, 144), (1, 2, 3, 4), seeds=200)
    assert len(rows) == 24
    for row in rows:
        assert max(row.rounds) <= bench.allowance(row.n, row.k), (row.n, row.k, max(row.rounds))
        assert not row.over
    # one bad node: one level of halving a round, then the group less it
    assert max(next(r for r in rows if (r.n, r.k) == (144, 1)).rounds) == math.ceil(math.log2(144)) + 1
    link_row = bench.measure(72, 1, seeds=10, links=True)
    assert max(link_row.rounds) < 71 and max(link_row.tests) < math.comb(72, 2)

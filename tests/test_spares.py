"""Spare hot-swap planning over a fleet view: same-domain spares in order, or where the slice must move."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from gpuwarden.agent.act.spares import (
    SparePolicy,
    healthy_spares,
    name_order,
    plan_swap,
    slice_size,
    wants_back_in_pool,
)
from gpuwarden.agent.core.scheduler import SPARE_REASON, NodeView, Service
from hypothesis import given, settings
from hypothesis import strategies as st

POLICY = SparePolicy()
PROPS = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def rack(domain: str, nodes: int = 18, spares: int = 2, jobs: int | None = 1) -> list[NodeView]:
    views = [NodeView(f"{domain}-n{i}", Service.IN_SERVICE, domain=domain, jobs=jobs) for i in range(nodes - spares)]
    views += [NodeView(f"{domain}-s{i}", Service.DRAINED, SPARE_REASON, 0.0, ours=True, domain=domain, spare=True,
                       jobs=0) for i in range(spares)]
    return views


def edit(fleet: list[NodeView], name: str, **changes) -> list[NodeView]:
    assert any(v.name == name for v in fleet), name
    return [replace(v, **changes) if v.name == name else v for v in fleet]


def quarantine(fleet, name):
    return edit(fleet, name, service=Service.DRAINED, reason="gpuwarden: xid 79", ours=True, quarantined=True)


def test_a_spare_of_the_same_rack_replaces_the_failed_node():
    fleet = quarantine(rack("r0", spares=3) + rack("r1"), "r0-n4")
    plan = plan_swap(fleet, "r0-n4", POLICY)
    assert plan.domain == "r0" and plan.candidates == ("r0-s0", "r0-s1", "r0-s2") and not plan.slice_must_move
    assert plan.hosts == () and plan.reason == "3 healthy spare(s) of r0 for r0-n4, first r0-s0"


def test_spares_are_tried_in_name_order_with_numbers_as_numbers():
    fleet = [NodeView(n, Service.DRAINED, SPARE_REASON, ours=True, domain="r", spare=True)
             for n in ("gpu10", "gpu9", "gpu100", "gpu2")] + [NodeView("gpu1", Service.CORDONED, domain="r")]
    assert plan_swap(fleet, "gpu1", POLICY).candidates == ("gpu2", "gpu9", "gpu10", "gpu100")
    assert sorted(["n", "n10", "n01", "n1", "a2b"], key=name_order) == ["a2b", "n", "n01", "n1", "n10"]
    long = "n" + "9" * 100_000  # no int conversion: a hostile name costs its length, nothing more
    assert sorted([long, "n2"], key=name_order) == ["n2", long]


@pytest.mark.parametrize("change", [dict(service=Service.DOWN), dict(service=Service.UNKNOWN),
                                    dict(quarantined=True), dict(spare=False)])
def test_a_spare_that_is_down_unknown_or_quarantined_is_never_a_candidate(change):
    fleet = quarantine(edit(rack("r0"), "r0-s0", **change), "r0-n1")
    assert plan_swap(fleet, "r0-n1", POLICY).candidates == ("r0-s1",)
    assert healthy_spares(fleet, "r0") == ("r0-s1",)


def test_spares_of_another_rack_are_never_candidates_and_the_slice_must_move():
    # r0 has used its spares; r1 keeps 2 spares and 14 idle nodes (16 free: fits a 16-node slice), r2 has 15 free
    # (one node's work unknown: not counted as idle), r3 is empty (18 free), r4 is busy.
    fleet = rack("r0", spares=0) + edit(edit(rack("r1", jobs=0), "r1-n0", jobs=1), "r1-n1", jobs=2)
    fleet += edit(edit(edit(rack("r2", jobs=0), "r2-n0", jobs=1), "r2-n1", jobs=1), "r2-n3", jobs=None)
    fleet += rack("r3", spares=0, jobs=0) + rack("r4")
    fleet = quarantine(fleet, "r0-n7")
    plan = plan_swap(fleet, "r0-n7", POLICY)
    assert plan.candidates == () and plan.slice_must_move and plan.domain == "r0"
    assert plan.hosts == ("r1", "r3")  # best fit first: the fullest domain that still fits
    assert plan.reason == ("no healthy spare left in r0: the slice of r0-n7 (16 nodes) must move; domains that "
                           "could host it: r1, r3")


def test_the_slice_has_nowhere_to_go():
    fleet = quarantine(rack("r0", spares=0) + rack("r1"), "r0-n0")
    plan = plan_swap(fleet, "r0-n0", POLICY)
    assert plan.slice_must_move and plan.hosts == () and plan.reason.endswith("no domain has that many free nodes")


def test_quarantined_down_and_unpublished_nodes_never_make_a_domain_free():
    fleet = rack("r0", spares=0) + rack("r1", spares=0, jobs=0)
    for name in ("r1-n0", "r1-n1"):
        fleet = quarantine(fleet, name)
    fleet = edit(fleet, "r1-n2", service=Service.DOWN)
    fleet += [NodeView(f"x{i}", Service.IN_SERVICE, jobs=0) for i in range(20)]  # no domain published
    assert plan_swap(fleet, "r0-n0", POLICY).hosts == ()
    assert plan_swap(fleet, "r0-n0", SparePolicy(per_domain=3)).hosts == ("r1",)  # a 15-node slice fits r1's 15


def test_the_slice_size_is_the_domain_less_its_spares():
    assert slice_size(rack("r0"), "r0", POLICY) == 16
    assert slice_size(rack("r0"), "r0", SparePolicy(per_domain=0)) == 18
    assert slice_size(rack("r0", nodes=2, spares=1), "r0", SparePolicy(per_domain=4)) == 1


def test_a_node_with_no_domain_or_not_listed_gets_no_plan():
    fleet = rack("r0") + [NodeView("loner", Service.CORDONED, "gpuwarden: xid 79", ours=True)]
    for name in ("loner", "ghost"):
        plan = plan_swap(fleet, name, POLICY)
        assert plan.domain is None and plan.candidates == () and not plan.slice_must_move and plan.hosts == ()
    assert "no published NVLink domain" in plan_swap(fleet, "loner", POLICY).reason
    assert "not in the scheduler's view" in plan_swap(fleet, "ghost", POLICY).reason


def test_a_failed_spare_is_not_replaced():
    fleet = quarantine(rack("r0"), "r0-s1")
    fleet = edit(fleet, "r0-s1", spare=True)
    plan = plan_swap(fleet, "r0-s1", POLICY)
    assert plan.candidates == () and not plan.slice_must_move
    assert plan.reason == "r0-s1 is a spare of r0: nothing to replace; 1 healthy spare(s) left there"


def test_a_repaired_node_refills_its_pool_only_while_the_pool_is_short():
    fleet = quarantine(rack("r0", spares=1) + rack("r1"), "r0-n3")
    assert wants_back_in_pool(fleet, "r0-n3", POLICY)  # 1 of 2
    assert not wants_back_in_pool(fleet, "r0-n3", SparePolicy(per_domain=1))
    assert not wants_back_in_pool(fleet, "r0-n3", SparePolicy(per_domain=0))
    full = quarantine(rack("r0"), "r0-n3")
    assert not wants_back_in_pool(full, "r0-n3", POLICY)
    # A pool spare that cannot be reached does not count as one: the pool is short.
    assert wants_back_in_pool(edit(full, "r0-s0", service=Service.DOWN), "r0-n3", POLICY)
    # The node itself is not counted when it is already held as a spare.
    assert wants_back_in_pool(full, "r0-s0", SparePolicy(per_domain=2))
    # Unknown domain, or a node the scheduler does not list: straight back to service.
    assert not wants_back_in_pool([NodeView("loner", Service.DRAINED)], "loner", POLICY)
    assert not wants_back_in_pool(full, "ghost", POLICY)


@pytest.mark.parametrize("bad", [-1, 1025, 1.0, True, "2", None])
def test_a_spare_policy_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="per_domain"):
        SparePolicy(per_domain=bad)


# -- properties ---------------------------------------------------------------------------------------------------
@st.composite
def fleets(draw):
    views = []
    for i in range(draw(st.integers(1, 50))):
        views.append(NodeView(
            f"n{i}", draw(st.sampled_from(list(Service))), domain=draw(st.sampled_from(["a", "b", "c", None])),
            quarantined=draw(st.booleans()), spare=draw(st.booleans()), jobs=draw(st.sampled_from([None, 0, 1]))))
    return views


@PROPS
@given(fleet=fleets(), per_domain=st.integers(0, 4), data=st.data(), seed=st.integers(0, 2**32))
def test_a_plan_only_offers_healthy_spares_of_the_failed_domain_and_moves_only_when_there_are_none(
        fleet, per_domain, data, seed):
    policy = SparePolicy(per_domain)
    failed = data.draw(st.sampled_from(fleet)).name
    plan = plan_swap(fleet, failed, policy)
    me = next(v for v in fleet if v.name == failed)
    byname = {v.name: v for v in fleet}
    for name in plan.candidates:
        v = byname[name]
        assert name != failed and v.domain == me.domain and v.spare and not v.quarantined
        assert v.service not in (Service.DOWN, Service.UNKNOWN)
    assert plan.slice_must_move == (me.domain is not None and not me.spare and not plan.candidates)
    assert me.domain not in plan.hosts and (plan.hosts == () or plan.slice_must_move)
    shuffled = list(fleet)
    random.Random(seed).shuffle(shuffled)
    assert plan_swap(shuffled, failed, policy) == plan
    assert wants_back_in_pool(shuffled, failed, policy) == wants_back_in_pool(fleet, failed, policy)

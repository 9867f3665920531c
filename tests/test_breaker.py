"""The circuit breaker's verdict over a fleet view: per cluster and per NVLink domain, within a window."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from gpuwarden.agent.act.breaker import BreakerPolicy, judge, limit
from gpuwarden.agent.core.scheduler import SPARE_REASON, NodeView, Service
from hypothesis import given, settings
from hypothesis import strategies as st

NOW = 1_700_000_000.0
POLICY = BreakerPolicy()
PROPS = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def rack(domain: str, nodes: int = 18, spares: int = 2) -> list[NodeView]:
    """One NVL72 rack as the scheduler lists it: in-service nodes, then its spares (drained with our spare reason)."""
    views = [NodeView(f"{domain}-n{i:02d}", Service.IN_SERVICE, domain=domain, jobs=1) for i in range(nodes - spares)]
    views += [NodeView(f"{domain}-s{i}", Service.DRAINED, SPARE_REASON, NOW - 86400, ours=True, domain=domain,
                       spare=True, jobs=0) for i in range(spares)]
    return views


def drain_ours(fleet: list[NodeView], names: list[str], at: float | None = NOW - 60) -> list[NodeView]:
    names = set(names)
    return [replace(v, service=Service.DRAINED, reason="gpuwarden: xid 79 GPU3 0000:1b:00.0", reason_since=at,
                    ours=True, spare=False) if v.name in names else v for v in fleet]


def test_a_first_fault_in_a_healthy_fleet_is_allowed():
    fleet = rack("r0") + rack("r1")
    v = judge(fleet, "r0-n03", "r0", NOW, POLICY)
    assert v.allow and v.cluster == (1, 36) and v.domain == (1, 18)
    assert v.reason.startswith("breaker closed: cluster 1 of 36 (limit 3), NVLink domain r0 1 of 18 (limit 4)")


def test_a_fifth_node_of_one_rack_is_a_rack_event():
    fleet = rack("r0") + rack("r1") + rack("r2") + rack("r3") + rack("r4") + rack("r5")  # 108 nodes, limit 10
    fleet = drain_ours(fleet, ["r0-n00", "r0-n01", "r0-n02", "r0-n03"])
    v = judge(fleet, "r0-n04", "r0", NOW, POLICY)
    assert not v.allow and v.domain == (5, 18) and v.cluster == (5, 108)
    assert "NVLink domain r0 5 of 18 (limit 4)" in v.reason and "cluster" not in v.reason.split(":")[1]
    assert "gpuwarden breaker reset" in v.reason
    # Another rack is not held by r0's trouble.
    assert judge(fleet, "r1-n00", "r1", NOW, POLICY).allow


def test_the_cluster_share_holds_across_racks():
    fleet = [v for i in range(4) for v in rack(f"r{i}")]  # 72 nodes: limit 7
    fleet = drain_ours(fleet, [f"r{i}-n0{j}" for i in range(4) for j in range(2)][:7])  # at most 2 per rack
    v = judge(fleet, "r3-n05", "r3", NOW, POLICY)
    assert not v.allow and v.cluster == (8, 72) and v.domain == (2, 18)
    assert v.reason.startswith("breaker open: cluster 8 of 72 (limit 7) drained")


def test_drains_by_others_spares_and_old_drains_do_not_count():
    fleet = rack("r0") + rack("r1")
    fleet = [replace(v, service=Service.DRAINED, reason="admin: PSU swap", reason_since=NOW - 30, ours=False)
             if v.name in {"r0-n00", "r0-n01", "r0-n02", "r0-n03", "r0-n04"} else v for v in fleet]
    fleet = drain_ours(fleet, ["r0-n05", "r0-n06", "r0-n07", "r0-n08"], at=NOW - 601)  # before the window
    v = judge(fleet, "r0-n09", "r0", NOW, POLICY)
    assert v.allow and v.domain == (1, 18) and v.cluster == (1, 36)


def test_a_drain_of_ours_without_a_start_counts_as_recent():
    fleet = drain_ours(rack("r0"), ["r0-n00", "r0-n01", "r0-n02", "r0-n03"], at=None)
    v = judge(fleet, "r0-n04", "r0", NOW, POLICY)
    assert not v.allow and v.domain == (5, 18)
    fleet = drain_ours(rack("r0"), ["r0-n00", "r0-n01", "r0-n02", "r0-n03"], at=math.nan)
    assert not judge(fleet, "r0-n04", "r0", NOW, POLICY).allow


def test_the_window_passing_and_a_reset_close_the_breaker():
    fleet = drain_ours(rack("r0"), ["r0-n00", "r0-n01", "r0-n02", "r0-n03"], at=NOW - 60)
    assert not judge(fleet, "r0-n04", "r0", NOW, POLICY).allow
    assert judge(fleet, "r0-n04", "r0", NOW + 541, POLICY).allow  # the four began 601 s ago
    # A reset forgets every drain that began before it, in the window or not.
    assert judge(fleet, "r0-n04", "r0", NOW, POLICY, reset_at=NOW - 59).allow
    assert not judge(fleet, "r0-n04", "r0", NOW, POLICY, reset_at=NOW - 61).allow
    # Drains after the reset count again.
    later = drain_ours(fleet, ["r0-n05", "r0-n06", "r0-n07", "r0-n08"], at=NOW + 10)
    assert not judge(later, "r0-n09", "r0", NOW + 20, POLICY, reset_at=NOW).allow


@pytest.mark.parametrize("size", [1, 2, 3])
def test_tiny_clusters_act_on_one_node_at_a_time(size):
    fleet = [NodeView(f"n{i}", Service.IN_SERVICE) for i in range(size)]
    v = judge(fleet, "n0", None, NOW, POLICY)
    assert v.allow and v.cluster == (1, size) and v.domain is None
    if size > 1:
        held = judge(drain_ours(fleet, ["n0"]), "n1", None, NOW, POLICY)
        assert not held.allow and held.cluster == (2, size)
    # min_nodes = 0 lets a site refuse every cordon a share does not allow.
    assert not judge(fleet, "n0", None, NOW, BreakerPolicy(min_nodes=0)).allow
    assert judge(fleet, "n0", None, NOW, BreakerPolicy(min_nodes=2)).allow


def test_a_node_with_no_domain_is_judged_on_the_cluster_alone():
    fleet = rack("r0") + [NodeView(f"x{i}", Service.IN_SERVICE) for i in range(4)]
    fleet = drain_ours(fleet, ["r0-n00", "r0-n01", "r0-n02", "r0-n03", "x0"])
    v = judge(fleet, "x1", None, NOW, POLICY)
    assert v.domain is None and v.cluster == (6, 22) and not v.allow  # limit 2 on 22 nodes
    assert "NVLink domain unknown" in judge(rack("r0"), "x9", None, NOW, POLICY).reason
    # Nodes without a published domain never count in a domain's share.
    v = judge(fleet, "r0-n04", "r0", NOW, BreakerPolicy(cluster_share=1.0))
    assert v.domain == (5, 18) and not v.allow


def test_a_node_the_scheduler_does_not_list_yet_counts_as_one_more():
    v = judge(rack("r0"), "new", "r0", NOW, POLICY)
    assert v.allow and v.cluster == (1, 19) and v.domain == (1, 19)


def test_agents_that_acted_at_once_let_exactly_the_limit_go_on():
    # Six nodes of one rack cordoned in the same instant, each on a view without the others: every agent now
    # reads the same view and the first four by (time, name) go on to the drain, the other two stop.
    names = [f"r0-n{i:02d}" for i in range(6)]
    fleet = drain_ours(rack("r0") + rack("r1") + rack("r2") + rack("r3") + rack("r4") + rack("r5"), names, at=NOW - 1)
    verdicts = {n: judge(fleet, n, "r0", NOW, POLICY) for n in names}
    assert [n for n in names if verdicts[n].allow] == names[:4]
    assert "this node drained 5th" in verdicts["r0-n04"].reason
    # Earlier drains rank first whatever their name.
    fleet = drain_ours(fleet, ["r0-n05"], at=NOW - 5)
    assert judge(fleet, "r0-n05", "r0", NOW, POLICY).allow and not judge(fleet, "r0-n03", "r0", NOW, POLICY).allow


@pytest.mark.parametrize("bad", [dict(cluster_share=1.5), dict(domain_share=-0.1), dict(cluster_share=math.nan),
                                 dict(window_s=0), dict(window_s=math.inf), dict(min_nodes=-1), dict(min_nodes=True),
                                 dict(min_nodes=1.5), dict(domain_share="0.2")])
def test_a_policy_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="breaker"):
        BreakerPolicy(**bad)


def test_a_time_that_is_not_finite_is_refused():
    with pytest.raises(ValueError, match="finite"):
        judge(rack("r0"), "r0-n00", "r0", math.nan, POLICY)


# -- properties ---------------------------------------------------------------------------------------------------
DOMAINS = ["a", "b", "c", None]


@st.composite
def fleets(draw):
    n = draw(st.integers(1, 60))
    views = []
    for i in range(n):
        domain = draw(st.sampled_from(DOMAINS))
        kind = draw(st.sampled_from(["in", "ours", "ours", "admin", "spare", "old"]))
        since = NOW - draw(st.floats(0, 599, allow_nan=False))
        if kind == "in":
            views.append(NodeView(f"n{i}", Service.IN_SERVICE, domain=domain))
        elif kind == "ours":
            views.append(NodeView(f"n{i}", Service.DRAINED, "gpuwarden: x", since, ours=True, domain=domain))
        elif kind == "admin":
            views.append(NodeView(f"n{i}", Service.DRAINED, "admin", since, domain=domain))
        elif kind == "spare":
            views.append(NodeView(f"n{i}", Service.DRAINED, SPARE_REASON, since, ours=True, domain=domain, spare=True))
        else:
            views.append(NodeView(f"n{i}", Service.DRAINED, "gpuwarden: x", NOW - 700, ours=True, domain=domain))
    return views


policies = st.builds(BreakerPolicy, cluster_share=st.floats(0, 1), domain_share=st.floats(0, 1),
                     window_s=st.just(600.0), min_nodes=st.integers(0, 4))


def recent_ours(fleet, domain=None):
    return [v for v in fleet if v.ours and not v.spare and v.reason_since >= NOW - 600
            and (domain is None or v.domain == domain)]


@PROPS
@given(fleet=fleets(), policy=policies, domain=st.sampled_from(DOMAINS))
def test_a_new_node_is_never_allowed_past_either_share(fleet, policy, domain):
    v = judge(fleet, "new", domain, NOW, policy)
    count = len(recent_ours(fleet)) + 1
    assert v.cluster == (count, len(fleet) + 1)
    assert v.allow == (count <= max(policy.min_nodes, math.floor(policy.cluster_share * (len(fleet) + 1) + 1e-9))
                       and (domain is None or v.domain[0] <= limit(policy.domain_share, v.domain[1], policy)))
    if v.allow:
        assert count <= max(policy.min_nodes, policy.cluster_share * (len(fleet) + 1) + 1e-9)
    if domain is not None:
        size = sum(1 for x in fleet if x.domain == domain) + 1
        assert v.domain == (len(recent_ours(fleet, domain)) + 1, size)
        if v.allow:
            assert v.domain[0] <= max(policy.min_nodes, policy.domain_share * size + 1e-9)


@PROPS
@given(fleet=fleets(), policy=policies, domain=st.sampled_from(DOMAINS), data=st.data())
def test_more_drained_never_turns_a_refusal_into_an_allow(fleet, policy, domain, data):
    node = data.draw(st.sampled_from([v.name for v in fleet] + ["new"]))
    before = judge(fleet, node, domain, NOW, policy)
    others = [v for v in fleet if v.name != node and not (v.ours and not v.spare and v.reason_since >= NOW - 600)]
    if not others:
        return
    victim = data.draw(st.sampled_from(others)).name
    after = judge(drain_ours(fleet, [victim], at=NOW - data.draw(st.floats(0, 599))), node, domain, NOW, policy)
    assert after.cluster[0] == before.cluster[0] + 1
    assert not (after.allow and not before.allow)


@PROPS
@given(fleet=fleets(), policy=policies, domain=st.sampled_from(DOMAINS), seed=st.integers(0, 2**32))
def test_the_verdict_does_not_depend_on_the_order_the_scheduler_lists_nodes(fleet, policy, domain, seed):
    shuffled = list(fleet)
    random.Random(seed).shuffle(shuffled)
    for node in ("new", fleet[0].name):
        assert judge(fleet, node, domain, NOW, policy) == judge(shuffled, node, domain, NOW, policy)


@PROPS
@given(fleet=fleets(), policy=policies)
def test_of_the_nodes_already_drained_no_more_than_the_limit_go_on(fleet, policy):
    drained = recent_ours(fleet)
    allowed = [v for v in drained if judge(fleet, v.name, None, NOW, policy).allow]
    assert len(allowed) == min(len(drained), limit(policy.cluster_share, len(fleet), policy))

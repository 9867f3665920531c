"""The node state machine, driven through time as a pure function."""
from gpuwarden.agent.model import Action, Entity, Finding, Status
from gpuwarden.agent.state import DEFAULT_POLICY, NodeRecord, NodeState, next_state, wants_retest

GPU = Entity("gpu", "GPU-1", 1, "0009:01:00.0")
FAIL_DRAIN = Finding("ib_port", "ib-port-down", Entity("ib_port", "mlx5_2/1"), Status.FAIL, "down", Action.DRAIN)
FAIL_RESET = Finding("ecc", "row-remap-pending", GPU, Status.FAIL, "pending", Action.RESET_GPU)
WARN = Finding("thermal", "hbm-gradient", GPU, Status.WARN, "warm", Action.MONITOR)
P = DEFAULT_POLICY


def drive(rec, steps):
    """steps: (now, findings, unknown, retest) -> list of (state, actions) after each step."""
    out = []
    for now, findings, unknown, retest in steps:
        rec, t = next_state(rec, findings, unknown, now, P, retest)
        out.append((rec.state, t.actions if t else ()))
    return rec, out


def test_drain_class_fault_cordons_then_quarantines_after_grace():
    rec, out = drive(NodeRecord(since=0), [
        (10, [FAIL_DRAIN], [], None),
        (100, [FAIL_DRAIN], [], None),
        (10 + P["quarantine_after_s"], [FAIL_DRAIN], [], None),
    ])
    assert out == [(NodeState.CORDONED, ("cordon",)), (NodeState.CORDONED, ()), (NodeState.QUARANTINED, ("drain",))]


def test_reset_class_fault_quarantines_at_the_first_observation():
    # One observation moves the state to a fixpoint: cordon and drain together, as one transition.
    rec, out = drive(NodeRecord(), [(1, [FAIL_RESET], [], None), (2, [FAIL_RESET], [], None)])
    assert out == [(NodeState.QUARANTINED, ("cordon", "drain")), (NodeState.QUARANTINED, ())]
    _, t = next_state(NodeRecord(), [FAIL_RESET], [], 1, P)
    assert (t.frm, t.to, t.reason) == (NodeState.HEALTHY, NodeState.QUARANTINED, rec.reason)
    assert rec.since == 1


def test_a_fixpoint_never_loops():
    # A retest that passes returns the node to HEALTHY; the same observation's fault must not be replayed in a loop.
    rec = NodeRecord(NodeState.QUARANTINED, since=0, clear_since=0)
    rec, t = next_state(rec, [], [], 100, P, retest=True)
    assert (rec.state, t.actions) == (NodeState.HEALTHY, ("resume",))


def test_transient_fault_uncordons_without_quarantine():
    _, out = drive(NodeRecord(), [(0, [FAIL_DRAIN], [], None), (5, [], [], None),
                                  (5 + P["cordon_clear_s"], [], [], None)])
    assert out[-1] == (NodeState.HEALTHY, ("uncordon",))


def test_warn_is_suspect_and_clears_later():
    clear = 10 + P["suspect_clear_s"]
    _, out = drive(NodeRecord(), [(0, [WARN], [], None), (10, [], [], None), (clear - 1, [], [], None),
                                  (clear, [], [], None)])
    assert [s for s, _ in out] == [NodeState.SUSPECT, NodeState.SUSPECT, NodeState.SUSPECT, NodeState.HEALTHY]
    assert all(actions == () for _, actions in out)  # suspicion alone never acts on the scheduler


def test_unknown_is_suspect_after_grace_and_never_cordons():
    _, out = drive(NodeRecord(), [(0, [], ["ib_port"], None), (P["unknown_grace_s"], [], ["ib_port"], None),
                                  (10_000, [], ["ib_port", "thermal"], None)])
    assert [s for s, _ in out] == [NodeState.HEALTHY, NodeState.SUSPECT, NodeState.SUSPECT]


def test_quarantine_retest_pass_returns_to_service_and_failures_retire():
    rec, _ = drive(NodeRecord(), [(0, [FAIL_RESET], [], None), (1, [FAIL_RESET], [], None)])
    rec, out = drive(rec, [(100, [], [], None)])
    assert not wants_retest(rec, 100) and wants_retest(rec, 100 + P["retest_after_s"])
    passed, out = drive(rec, [(200, [], [], True)])
    assert out == [(NodeState.HEALTHY, ("resume",))] and passed.retests == 0
    rec, out = drive(rec, [(200, [], [], False), (300, [], [], False)])
    assert out == [(NodeState.QUARANTINED, ()), (NodeState.RETIRED, ("retire",))]
    assert next_state(rec, [], [], 400, P)[1] is None  # retired stays retired


def test_record_round_trips():
    rec = NodeRecord(NodeState.QUARANTINED, 12.5, "why", 1, 3.0, None)
    assert NodeRecord.from_dict(rec.to_dict()) == rec

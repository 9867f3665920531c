"""The node state machine, driven through time as a pure function."""
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeRecord, NodeState, next_state, wants_retest

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


def test_a_drain_class_fault_that_dooms_a_job_quarantines_at_once():
    # Without the grace a DRAIN-class fault gets: the job is ended only on a node out of service (agent/jobs/).
    rec, t = next_state(NodeRecord(since=0), [FAIL_DRAIN], [], 10, P, doomed=True)
    assert (rec.state, t.frm, t.to, t.actions) == (NodeState.QUARANTINED, NodeState.HEALTHY, NodeState.QUARANTINED,
                                                   ("cordon", "drain"))
    assert rec.reason == t.reason and rec.since == 10
    # A node cordoned earlier for the fault is quarantined by the observation at which it dooms a job.
    rec, _ = next_state(NodeRecord(since=0), [FAIL_DRAIN], [], 10, P)
    assert rec.state is NodeState.CORDONED
    rec, t = next_state(rec, [FAIL_DRAIN], [], 11, P, doomed=True)
    assert (rec.state, t.actions) == (NodeState.QUARANTINED, ("drain",))
    # A job doomed with no DRAIN-class fault on the node (a WARN) does not take the node out.
    rec, t = next_state(NodeRecord(since=0), [WARN], [], 10, P, doomed=True)
    assert rec.state is NodeState.SUSPECT and t.actions == ()


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


# -- the recovery ladder of a quarantined node -------------------------------------------------------------------------
FAIL_REBOOT = Finding("xid", "79", GPU, Status.FAIL, "fallen off the bus", Action.REBOOT)
FAIL_SERVICE = Finding("ecc", "row-remap-failure", GPU, Status.FAIL, "no spare rows", Action.SERVICE)


def ladder(rec, steps):
    """steps: (now, findings, held) -> the recovery actions each observation emitted."""
    out = []
    for now, findings, held in steps:
        rec, t = next_state(rec, findings, [], now, P, None, held)
        out.append(t.actions if t else ())
    return rec, out


def test_ladder_reset_then_reboot_then_ticket_each_after_its_settle_time():
    rec, out = ladder(NodeRecord(), [(0, [FAIL_RESET], None)])
    assert rec.state is NodeState.QUARANTINED and out == [("cordon", "drain")]  # the drain goes first
    first = P["step_after_s"]
    reboot_at = first + P["reset_settle_s"]
    ticket_at = reboot_at + P["reboot_settle_s"]
    rec, out = ladder(rec, [
        (first - 1, [FAIL_RESET], False),  # too soon after the quarantine
        (first, [FAIL_RESET], False),  # no process holds the GPU: reset
        (reboot_at - 1, [FAIL_RESET], False),  # the reset still settling
        (reboot_at, [FAIL_RESET], None),  # the fault outlived the reset: reboot
        (ticket_at - 1, [FAIL_RESET], None),
        (ticket_at, [FAIL_RESET], None),  # and the reboot: a service ticket
        (ticket_at + 10**6, [FAIL_RESET], None),  # then it waits for the repair, for as long as it takes
    ])
    assert out == [(), ("reset_gpu",), (), ("reboot",), (), ("ticket",), ()]
    assert (rec.state, rec.step, rec.step_since) == (NodeState.QUARANTINED, "ticket", ticket_at)
    assert NodeRecord.from_dict(rec.to_dict()) == rec


def test_ladder_skips_the_reset_while_a_process_holds_the_gpu():
    rec, _ = ladder(NodeRecord(), [(0, [FAIL_RESET], None)])
    rec, out = ladder(rec, [(P["step_after_s"], [FAIL_RESET], True),
                            (P["holders_wait_s"] - 1, [FAIL_RESET], True),
                            (P["holders_wait_s"], [FAIL_RESET], True)])
    assert out == [(), (), ("reboot",)]  # never a reset of a GPU in use


def test_ladder_reboot_class_starts_at_the_reboot_and_service_class_at_the_ticket():
    rec, _ = ladder(NodeRecord(), [(0, [FAIL_REBOOT], False)])
    _, out = ladder(rec, [(P["step_after_s"], [FAIL_REBOOT], False),
                          (P["step_after_s"] + P["reboot_settle_s"], [FAIL_REBOOT], False)])
    assert out == [("reboot",), ("ticket",)]
    rec, _ = ladder(NodeRecord(), [(0, [FAIL_SERVICE], False)])
    _, out = ladder(rec, [(P["step_after_s"], [FAIL_SERVICE], False)])
    assert out == [("ticket",)]


def test_ladder_stops_when_the_fault_clears_and_the_retest_returns_the_node():
    rec, _ = ladder(NodeRecord(), [(0, [FAIL_RESET], None)])
    rec, out = ladder(rec, [(P["step_after_s"], [FAIL_RESET], False), (P["step_after_s"] + 5, [], False),
                            (P["step_after_s"] + P["reset_settle_s"] + 5, [], False)])
    assert out == [("reset_gpu",), (), ()]  # cleared after the reset: no reboot
    rec, t = next_state(rec, [], [], 10**4, P, retest=True)
    assert (rec.state, rec.step, t.actions) == (NodeState.HEALTHY, "", ("resume",))


def test_ladder_is_off_where_the_operator_turned_steps_off():
    policy = dict(P, reset_gpu=False, reboot=False)
    rec, _ = next_state(NodeRecord(), [FAIL_RESET], [], 0, policy)
    _, t = next_state(rec, [FAIL_RESET], [], P["step_after_s"], policy, held=False)
    assert t.actions == ("ticket",)

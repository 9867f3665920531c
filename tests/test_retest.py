"""The retest of a quarantined node, driven through time on a recorded node with the daemon's real retest (the quick
preflight on the kernel log after the recovery, agent/node/retest.py): a reset-class XID quarantines the node at its
first observation, a recovery lets the retest pass and the node return, and an XID that comes back after the
recovery fails the retest."""
from __future__ import annotations

import pytest
from conftest import append_kmsg, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.retest import run_retest
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs

GPU1 = "0009:01:00"  # GPU 1 of the GB200 tray
XID48 = f"3,{{seq}},{{usec}},-;NVRM: Xid (PCI:{GPU1}): 48, pid=77, name=python3, An uncorrectable double bit error"
RESET = (f"4,{{seq}},{{usec}},-;NVRM: Xid (PCI:{GPU1}): 154, GPU recovery action changed from 0x1 (GPU Reset "
         "Required) to 0x0 (None)")


@pytest.fixture
def node_daemon(scenario_copy, tmp_path):
    made = []

    def make(**xid_cfg):
        root = scenario_copy("gb200-nvl72-healthy")
        node = Node.recorded_at(root)
        cfg = config.defaults(all_specs())
        cfg.checks["xid"].update(xid_cfg)
        store = Store(tmp_path / "state" / "state.db")
        policy = dict(DEFAULT_POLICY, retest_after_s=0.3)
        d = Daemon(node, list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store,
                   LocalAdapter(tmp_path / "state" / "actions.jsonl"), DaemonCollector(),
                   DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, policy=policy,
                                 # what `gpuwarden run` gives the daemon (agent/cli/run.py)
                                 retest=lambda since: run_retest(node, d.config, since)[0]))
        d.start()
        made.append((d, store))
        return d, root, node

    yield make
    for d, store in made:
        d.stop()
        store.close()


def actions(d: Daemon) -> list[str]:
    return [a["action"] for a in d.adapter.actions()]


def test_xid48_quarantines_then_a_reset_lets_the_retest_pass_and_a_second_xid48_fails_it(node_daemon):
    d, root, node = node_daemon()
    wait_for(lambda: "xid" in d.results(), what="the first kernel-log tick")
    append_kmsg(root, XID48)
    # One observation moves the node as far as the rules allow: cordoned and quarantined at once.
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine at the XID 48")
    (t,) = d.store.transitions(5) or wait_for(lambda: d.store.transitions(5), what="the transition written")
    assert (t.frm, t.to, t.actions) == (NodeState.HEALTHY, NodeState.QUARANTINED, ("cordon", "drain"))

    append_kmsg(root, RESET)  # the driver reports the GPU recovered (after nvidia-smi -r)
    wait_for(lambda: d.record.state is NodeState.HEALTHY, what="the retest passing after the reset")
    assert d.record.reason == "retest passed"
    wait_for(lambda: actions(d) == ["cordon", "drain", "resume"], what="the resume applied")

    append_kmsg(root, XID48)  # the fault comes back after the recovery
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine at the second XID 48")
    passed, results = run_retest(node, d.config, d.recovery_cursor())
    assert passed is False
    (xid,) = [r for r in results if r.check == "xid"]
    assert [(f.code, f.status.value) for f in xid.findings if f.status.value == "fail"] == [("48", "fail")]
    assert d.record.state is NodeState.QUARANTINED  # never healthy while the fault stands


def test_a_fault_cleared_without_a_reboot_is_not_held_against_the_retest(node_daemon):
    """An XID 48 that clears by time (hold_s) with no recovery line: judging the whole boot, every retest would fail
    on it until a reboot (and the node would be retired); judging from the recovery, the retest passes."""
    d, root, node = node_daemon(hold_s=1.0)
    wait_for(lambda: "xid" in d.results(), what="the first kernel-log tick")
    append_kmsg(root, XID48)
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="quarantine at the XID 48")
    wait_for(lambda: d.record.state is NodeState.HEALTHY, timeout_s=30, what="the retest passing once the XID aged out")
    assert d.record.reason == "retest passed" and d.record.retests == 0
    since = d.recovery_cursor()
    assert since is not None and since.seq >= int((root / "kmsg").read_text().splitlines()[-1].split(",")[1])
    # The same preflight over the whole boot still sees the XID 48 as logged just now: the bug the window fixes.
    assert run_retest(node, d.config, None)[0] is False
    assert run_retest(node, d.config, since)[0] is True

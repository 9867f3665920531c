"""The Slurm adapter against a real slurmctld with real slurmds on 127.0.0.1 (tests/slurm_cluster.py: n1..n6 answer,
n7 and n8 never do), and its parser on recorded `sinfo --json` output of Slurm 22.05."""
from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import ROOT, wait_for
from gpuwarden.agent.act.adapters.slurm import SlurmAdapter, reason_text
from gpuwarden.agent.act.adapters.slurm_json import MAX_EXTRA, extra_domain, extra_with_domain, parse_sinfo_json
from gpuwarden.agent.act.adapters.slurm_spares import CLAIM_PREFIX, claim_name
from gpuwarden.agent.act.adapters.slurm_tools import MAX_REASON, _classify
from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, Refused, Service, Transient
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

RECORDED = ROOT / "fixtures" / "slurm"
LIVE = ("n1", "n2", "n3", "n4", "n5", "n6")
XID79 = "gpuwarden: xid 79 GPU3 0000:1b:00.0"


@pytest.fixture
def slurm(slurm_cluster):  # noqa: F811
    """An adapter on the cluster, and the cluster put back as it started after the test: every live node idle, no
    reason, no comment, no Extra, its slurm.conf features only, no reservation, no job."""
    yield SlurmAdapter(timeout_s=15, slurm_conf=str(slurm_cluster.conf))
    slurm_cluster.reset(deadline_s=60)


def answering(adapter, node):
    """Waits out slurmctld's ping after a RESUME (22.05 marks the node NOT_RESPONDING until it answers)."""
    wait_for(lambda: adapter.node(node).service is not Service.DOWN, timeout_s=60, what=f"{node} answering")


def pool(adapter, domain, spares):
    wait_for(lambda: adapter.spares(domain) == spares, timeout_s=60, what=f"spares {spares} in {domain}")


# -- on the real cluster ---------------------------------------------------------------------------------------
def test_slurm_cordon_drain_quarantine_set_our_reason_and_state(slurm):
    slurm.cordon("n1", XID79)
    slurm.drain("n2", "gpuwarden: ib port mlx5_0/1 down 12s")
    slurm.quarantine("n3", XID79)
    n1, n2, n3 = (slurm.node(n) for n in ("n1", "n2", "n3"))
    assert (n1.service, n1.reason, n1.ours, n1.quarantined) == (Service.DRAINED, XID79, True, False)
    assert n1.reason_since is not None and n1.jobs == 0
    assert (n2.service, n2.reason, n2.ours) == (Service.DRAINED, "gpuwarden: ib port mlx5_0/1 down 12s", True)
    assert (n3.service, n3.reason, n3.ours, n3.quarantined) == (
        Service.DRAINED, "gpuwarden: quarantine: xid 79 GPU3 0000:1b:00.0", True, True)
    # Twice is the same: the reason and its time are left alone (the breaker's window reads that time).
    slurm.cordon("n1", XID79)
    slurm.quarantine("n3", XID79)
    assert slurm.node("n1") == n1 and slurm.node("n3") == n3
    # Quarantine after a cordon replaces our own reason; a late cordon does not undo the quarantine.
    slurm.quarantine("n1", XID79)
    slurm.cordon("n1", XID79)
    assert slurm.node("n1").quarantined


def test_slurm_cordon_with_a_running_job_is_cordoned_and_the_job_goes_on(slurm, slurm_cluster):  # noqa: F811
    job = subprocess.run(["sbatch", "--parsable", "-w", "n4", "-o", "/dev/null", "--wrap", "sleep 300"],
                         env=slurm_cluster.env, capture_output=True, text=True, timeout=30, cwd="/tmp")
    assert job.returncode == 0, job.stderr
    wait_for(lambda: slurm.node("n4").jobs == 1, timeout_s=60, what="the job running on n4")
    slurm.cordon("n4", XID79)
    n4 = slurm.node("n4")
    assert (n4.service, n4.jobs, n4.reason) == (Service.CORDONED, 1, XID79)


def test_slurm_resume_undoes_ours_but_never_an_admin_or_nhc_drain(slurm, slurm_cluster):  # noqa: F811
    slurm.drain("n1", XID79)
    slurm.resume("n1")
    assert slurm.node("n1").reason is None and slurm.node("n1").service in (Service.IN_SERVICE, Service.DOWN)
    wait_for(lambda: slurm.node("n1").service is Service.IN_SERVICE, what="n1 in service after the resume")
    for node, reason in (("n2", "admin: bad fan"), ("n3", "NHC: check_fs_mount: /scratch not mounted")):
        slurm_cluster.scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
        with pytest.raises(Refused, match="someone else"):
            slurm.resume(node)
        slurm.cordon(node, XID79)  # out of service already: left as it is, the reason kept
        with pytest.raises(Refused):
            slurm.quarantine(node, XID79)
        with pytest.raises(Refused):
            slurm.return_to_pool(node, "rackA")
        after = slurm.node(node)
        assert (after.service, after.reason, after.ours) == (Service.DRAINED, reason, False)


def test_slurm_every_call_twice_is_the_same(slurm):
    slurm.resume("n1")  # in service: nothing to do
    slurm.resume("n1")
    assert slurm.node("n1").service is Service.IN_SERVICE
    slurm.drain("n1", XID79)
    slurm.resume("n1")
    slurm.resume("n1")  # right after a RESUME slurmctld marks it NOT_RESPONDING until it answers: still a no-op
    assert slurm.node("n1").reason is None
    for _ in range(2):
        slurm.publish_domain("n2", "rackA")
        slurm.publish_domain("n3", "rackA")
    assert slurm.node("n2").domain == "rackA"
    for _ in range(2):
        slurm.return_to_pool("n3", "rackA")
    since = slurm.node("n3").reason_since
    assert slurm.spares("rackA") == ["n3"] and since is not None
    # n2 in service: a take for it is not recorded as a swap to come back to
    assert slurm.take_spare("rackA", "n2") == "n3"
    answering(slurm, "n3")
    slurm.return_to_pool("n3", "rackA")
    slurm.drain("n2", XID79)
    answering(slurm, "n3")
    assert slurm.take_spare("rackA", "n2") == "n3"
    assert slurm.take_spare("rackA", "n2") == "n3"  # a retried take returns the spare already taken
    assert slurm.spares("rackA") == []
    slurm.resume("n2")  # n2 repaired: the record of the swap goes
    slurm.publish_domain("n4", "rackA")
    slurm.return_to_pool("n4", "rackA")
    slurm.drain("n2", XID79)
    assert slurm.take_spare("rackA", "n2") == "n4", slurm.nodes()  # a new failure of n2 takes a new spare


def test_slurm_node_that_never_answers_is_down_and_unknown_names_are_refused(slurm):
    nodes = {v.name: v for v in slurm.nodes()}
    assert set(nodes) == set(LIVE) | {"n7", "n8"}
    assert nodes["n7"].service is Service.DOWN and nodes["n8"].service is Service.DOWN
    assert all(nodes[n].service is Service.IN_SERVICE for n in LIVE)
    with pytest.raises(Refused, match="does not know"):
        slurm.node("n99")
    with pytest.raises(Refused, match="does not know"):
        slurm.cordon("n99", XID79)
    for many in ("n[1-6]", "n1,n2", "n1 n2", "ALL", ""):  # a hostlist would drain many nodes: never passed on
        with pytest.raises(Refused):
            slurm.cordon(many, XID79)
    assert all(v.reason is None for v in slurm.nodes() if v.name in LIVE)


def test_slurm_domains_and_spares_known_at_once_after_a_slurmctld_restart(slurm, slurm_cluster):  # noqa: F811
    c = slurm_cluster
    c.scontrol("update", "NodeName=n2", "Extra=rack 12 slot 3")  # an operator's own Extra: kept after ours
    c.scontrol("update", "NodeName=n5", 'Extra={"rack": 12}')  # Slurm 23.02's extra constraints want JSON there
    for node in LIVE:
        slurm.publish_domain(node, "rackA" if node <= "n3" else "rackB")
    slurm.drain("n1", XID79)
    slurm.return_to_pool("n3", "rackA")
    slurm.return_to_pool("n6", "rackB")
    assert show_field(c, "n2", "Extra") == "gpuwarden_domain=rackA; rack 12 slot 3"
    assert json.loads(show_field(c, "n5", "Extra")) == {"rack": 12, "gpuwarden_domain": "rackB"}
    c.restart_ctld()
    # The drains, reasons and Extra are slurmctld's saved state; the features set by scontrol are gone ...
    assert show_field(c, "n3", "AvailableFeatures") == "gb200"
    after = {v.name: v for v in slurm.nodes()}
    assert after["n1"].reason == XID79 and after["n1"].ours and after["n3"].spare and after["n6"].spare
    # ... and the domains and the spare pools are known at once, from Extra, before any agent publishes again.
    assert [after[n].domain for n in LIVE] == ["rackA"] * 3 + ["rackB"] * 3
    assert slurm.spares("rackA") == ["n3"] and slurm.spares("rackB") == ["n6"]
    assert slurm.take_spare("rackA", "n1") == "n3"
    # The next publish puts the features back (users select them with --constraint), next to slurm.conf's own, and
    # leaves Extra as it is.
    for node in LIVE:
        slurm.publish_domain(node, "rackA" if node <= "n3" else "rackB")
    for node in LIVE:
        features = show_field(c, node, "AvailableFeatures").split(",")
        assert sorted(features) == ["gb200", f"gpuwarden_domain_{'rackA' if node <= 'n3' else 'rackB'}"], node
    assert show_field(c, "n2", "Extra") == "gpuwarden_domain=rackA; rack 12 slot 3"
    assert json.loads(show_field(c, "n5", "Extra")) == {"rack": 12, "gpuwarden_domain": "rackB"}
    # A node moved to another domain: the feature and Extra follow, the operator's text stays.
    slurm.publish_domain("n2", "rackB")
    assert slurm.node("n2").domain == "rackB"
    assert show_field(c, "n2", "Extra") == "gpuwarden_domain=rackB; rack 12 slot 3"
    assert "gpuwarden_domain_rackA" not in show_field(c, "n2", "AvailableFeatures")


def show_field(cluster, node: str, key: str) -> str:
    """One field of `scontrol show node` (its own line in the long form: Extra and Comment may hold spaces)."""
    for line in cluster.scontrol("show", "node", node).stdout.splitlines():
        if line.strip().startswith(f"{key}="):
            return line.strip()[len(key) + 1:]
    raise AssertionError(f"{node}: no {key} in scontrol show node")


def _race(adapters, domain, failed):
    """Each adapter takes a spare of `domain` for its failed node, all released at once; {failed: spare}."""
    barrier = threading.Barrier(len(adapters))
    got: dict[str, object] = {}

    def take(adapter, node):
        barrier.wait()
        try:
            got[node] = adapter.take_spare(domain, node)
        except Exception as exc:  # noqa: BLE001  (reported below)
            got[node] = exc

    threads = [threading.Thread(target=take, args=(a, f)) for a, f in zip(adapters, failed, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_slurm_two_agents_racing_never_take_the_same_spare(slurm, slurm_cluster):  # noqa: F811
    agents = [SlurmAdapter(timeout_s=15, slurm_conf=str(slurm_cluster.conf)) for _ in range(2)]
    for node in ("n1", "n2", "n3", "n4"):
        slurm.publish_domain(node, "rackA")
    for round_ in range(2):
        slurm.drain("n1", XID79)
        slurm.drain("n2", XID79)
        slurm.return_to_pool("n3", "rackA")  # one spare, two failed nodes
        pool(slurm, "rackA", ["n3"])
        got = _race(agents, "rackA", ("n1", "n2"))
        assert sorted(map(str, got.values())) == ["None", "n3"], (round_, got)
        slurm.resume("n1")
        slurm.resume("n2")
    # Two spares: each agent gets its own.
    slurm.drain("n1", XID79)
    slurm.drain("n2", XID79)
    slurm.return_to_pool("n3", "rackA")
    slurm.return_to_pool("n4", "rackA")
    pool(slurm, "rackA", ["n3", "n4"])
    got = _race(agents, "rackA", ("n1", "n2"))
    assert sorted(map(str, got.values())) == ["n3", "n4"], got
    assert slurm.spares("rackA") == []
    assert "No reservations" in slurm_cluster.scontrol("show", "reservation").stdout  # every claim released


def test_slurm_a_spare_claimed_by_another_agent_is_passed_over(slurm, slurm_cluster):  # noqa: F811
    for node in ("n1", "n2", "n3", "n4"):
        slurm.publish_domain(node, "rackA")
    slurm.return_to_pool("n3", "rackA")
    slurm.return_to_pool("n4", "rackA")
    pool(slurm, "rackA", ["n3", "n4"])
    slurm.drain("n1", XID79)
    slurm_cluster.scontrol("create", "reservation", f"ReservationName={CLAIM_PREFIX}n3", "Nodes=n3", "Users=root",
                           "StartTime=now", "Duration=5", "Flags=IGNORE_JOBS")
    assert slurm.take_spare("rackA", "n1") == "n4"
    assert slurm.take_spare("rackB", "n2") is None  # a domain with no spare
    assert slurm.spares("rackA") == ["n3"]
    # An agent that died after recording n3 for n2 and before resuming it: the retry waits for the claim to end,
    # then finishes that take; n3 is not offered to anyone else meanwhile.
    slurm.drain("n2", XID79)
    slurm_cluster.scontrol("update", "NodeName=n3", "Comment=gpuwarden: spare for n2; rack 12 slot 3")
    assert slurm.spares("rackA") == []
    with pytest.raises(Transient, match="claimed"):
        slurm.take_spare("rackA", "n2")
    slurm_cluster.scontrol("delete", f"ReservationName={CLAIM_PREFIX}n3")
    assert slurm.take_spare("rackA", "n2") == "n3"
    slurm.resume("n2")  # n2 back: the record goes, the operator's comment stays
    assert show_field(slurm_cluster, "n3", "Comment") == "rack 12 slot 3"


def claim_as_the_adapter_does(cluster, spare: str, for_node: str, end: str = "Duration=2") -> None:
    """The reservation take_spare creates first (its claim), left behind: the agent died before it went on."""
    cluster.scontrol("create", "reservation", f"ReservationName={claim_name(spare, for_node)}", f"Nodes={spare}",
                     "Users=root", "StartTime=now", end, "Flags=IGNORE_JOBS")


def reservations(cluster) -> list[str]:
    out = cluster.scontrol("show", "reservation", "-o").stdout
    return [line.split()[0].partition("=")[2] for line in out.splitlines() if line.startswith("ReservationName=")]


def test_slurm_a_claim_left_by_a_dead_agent_is_carried_on_by_its_retry_and_no_one_else(slurm, slurm_cluster):  # noqa: F811,E501
    c = slurm_cluster
    for node in ("n1", "n2", "n3", "n4"):
        slurm.publish_domain(node, "rackA")
    slurm.return_to_pool("n3", "rackA")
    slurm.drain("n1", XID79)
    slurm.drain("n2", XID79)
    pool(slurm, "rackA", ["n3"])
    # n1's agent claimed n3 and died before it recorded the swap: n3 has no Comment, only the claim says whose it is.
    claim_as_the_adapter_does(c, "n3", "n1")
    assert slurm.take_spare("rackA", "n2") is None  # another node's take does not get it, and does not wait for it
    assert reservations(c) == [claim_name("n3", "n1")]
    assert slurm.take_spare("rackA", "n1") == "n3"  # the retried take carries on with its own claim
    assert reservations(c) == []  # and releases it
    assert show_field(c, "n3", "Comment") == "gpuwarden: spare for n1"
    assert slurm.take_spare("rackA", "n1") == "n3"  # retried once more: the same spare
    answering(slurm, "n3")
    slurm.resume("n1")
    # Two spares, and n1's claim left on the second one: the retry takes the spare it claimed, not the first free
    # one, so no spare stays blocked by a claim nobody will finish.
    slurm.return_to_pool("n3", "rackA")
    slurm.return_to_pool("n4", "rackA")
    pool(slurm, "rackA", ["n3", "n4"])
    slurm.drain("n1", XID79)
    claim_as_the_adapter_does(c, "n4", "n1")
    c.scontrol("update", "NodeName=n4", f"Comment={REASON_PREFIX} spare for n1")  # died after the record, too
    assert slurm.take_spare("rackA", "n1") == "n4"
    assert reservations(c) == [] and slurm.spares("rackA") == ["n3"]
    # A claim of an agent that died for good is not renewed by anyone: it ends, and the spare is free again.
    claim_as_the_adapter_does(c, "n3", "n1", end="EndTime=now+2")
    wait_for(lambda: slurm.take_spare("rackA", "n2") == "n3", timeout_s=90, what="n3 free once n1's claim ended")
    assert show_field(c, "n3", "Comment") == "gpuwarden: spare for n2"


def test_slurm_hung_slurmctld_is_transient_then_works(slurm, slurm_cluster):  # noqa: F811
    quick = SlurmAdapter(timeout_s=3, slurm_conf=str(slurm_cluster.conf))
    slurm_cluster.hang_ctld()
    try:
        with pytest.raises(Transient):
            quick.nodes()
        with pytest.raises(Transient):
            quick.cordon("n1", XID79)
    finally:
        slurm_cluster.wake_ctld()
    wait_for(lambda: _answers(quick), timeout_s=60, what="slurmctld answering after SIGCONT")
    quick.cordon("n1", XID79)
    assert quick.node("n1").reason == XID79


def test_slurm_slurmctld_down_is_transient_not_an_empty_cluster(slurm, slurm_cluster):  # noqa: F811
    slurm_cluster.stop_ctld()
    with pytest.raises(Transient, match="slurmctld not reached"):  # sinfo --json exits 0 with no nodes here
        slurm.cordon("n1", XID79)
    slurm_cluster.start_ctld()
    slurm.cordon("n1", XID79)
    assert slurm.node("n1").reason == XID79


def _answers(adapter) -> bool:
    try:
        adapter.nodes()
    except Transient:
        return False
    return True


# -- recorded output and what the adapter writes ------------------------------------------------------------------
def test_reasons_are_prefixed_clean_and_bounded():
    assert reason_text(XID79) == XID79
    assert reason_text("xid 79 GPU3") == "gpuwarden: xid 79 GPU3"
    assert reason_text(XID79, quarantine=True) == "gpuwarden: quarantine: xid 79 GPU3 0000:1b:00.0"
    assert reason_text(reason_text(XID79, quarantine=True), quarantine=True) == reason_text(XID79, quarantine=True)
    hostile = 'gpuwarden: a\nb\t"c" \'d\' \\e `f` ünï \x00' + "x" * 10_000
    text = reason_text(hostile)
    assert text.startswith(REASON_PREFIX) and len(text) <= MAX_REASON
    assert all("!" <= c <= "~" or c == " " for c in text) and not set(text) & set("\"'\\`\n\t")
    assert text.startswith("gpuwarden: a b c d e f")


def test_recorded_sinfo_json_of_22_05_reads_every_state():
    nodes = {n.view.name: n.view for n in parse_sinfo_json((RECORDED / "sinfo-22.05.json").read_text())}
    assert nodes["n1"].service is Service.DRAINED and nodes["n1"].ours and nodes["n1"].domain == "rackA"
    assert nodes["n2"].service is Service.DRAINED and not nodes["n2"].ours and nodes["n2"].reason == "admin: bad fan"
    assert nodes["n3"].spare and nodes["n3"].reason == SPARE_REASON
    assert nodes["n4"].service is Service.CORDONED and nodes["n4"].jobs is None
    assert nodes["n5"].quarantined
    assert nodes["n6"].service is Service.IN_SERVICE and nodes["n6"].jobs == 0
    assert nodes["n7"].service is Service.DOWN


def test_the_domain_in_extra_keeps_the_operators_text_and_survives_hostile_input():
    assert extra_with_domain("", "rackA") == "gpuwarden_domain=rackA"
    assert extra_with_domain("rack 12; slot 3", "rackA") == "gpuwarden_domain=rackA; rack 12; slot 3"
    assert extra_with_domain("gpuwarden_domain=rackA; rack 12; slot 3", "rackB") == \
        "gpuwarden_domain=rackB; rack 12; slot 3"
    assert extra_domain("gpuwarden_domain=rackB; rack 12; slot 3") == ("rackB", "rack 12; slot 3")
    assert extra_domain("rack 12 gpuwarden_domain=rackB") == (None, "rack 12 gpuwarden_domain=rackB")  # not ours
    assert json.loads(extra_with_domain('{"rack": 12}', "rackA")) == {"rack": 12, "gpuwarden_domain": "rackA"}
    assert extra_domain('{"rack": 12, "gpuwarden_domain": "rackA"}') == ("rackA", '{"rack": 12}')
    for bad in ("gpuwarden_domain=n[1-3]", "gpuwarden_domain=", "gpuwarden_domain=a b", '{"gpuwarden_domain": 5}',
                "gpuwarden_domain=" + "x" * 1000, "{" * 100_000, '{"a": ' + "[" * 50_000):
        assert extra_domain(bad)[0] is None, bad[:40]
    huge = "gpuwarden_domain=rackA; " + "x" * (4 * MAX_EXTRA)
    node = {"name": "n1", "state": "idle", "extra": huge, "features": "gb200"}
    (n,) = parse_sinfo_json(json.dumps({"errors": [], "nodes": [node]}))
    assert n.view.domain is None and n.extra is None  # too long to be ours: not read, and never written over
    # The feature names the domain; Extra only when the feature is gone (after a slurmctld restart).
    nodes = [{"name": "a", "state": "idle", "extra": "gpuwarden_domain=rackB", "features": "gb200"},
             {"name": "b", "state": "idle", "extra": "gpuwarden_domain=rackB",
              "features": "gb200,gpuwarden_domain_rackA"}]
    views = {n.view.name: n.view for n in parse_sinfo_json(json.dumps({"errors": [], "nodes": nodes}))}
    assert views["a"].domain == "rackB" and views["b"].domain == "rackA"
    assert claim_name("n3", "n1") == f"{CLAIM_PREFIX}n3_for_n1"


def test_sinfo_json_with_errors_or_garbage_is_transient():
    down = (RECORDED / "sinfo-22.05-slurmctld-down.json").read_text()
    assert json.loads(down)["nodes"] == []
    with pytest.raises(Transient, match="not reached"):
        parse_sinfo_json(down)
    for bad in ("", "[]", "{", '{"nodes": 5}', "[" * 100_000, "nan"):
        with pytest.raises(Transient):
            parse_sinfo_json(bad)
    odd = {"errors": [], "nodes": [
        {"name": "n[1-3]", "state": "idle"}, {"name": 7}, "x",
        {"name": "ok1", "state": ["IDLE", "DRAIN"], "reason": "gpuwarden: x",
         "reason_changed_at": {"set": True, "infinite": False, "number": 1700000000}, "features": ["a"]},
        {"name": "ok2", "state": "idle", "reason": "gpuwarden: y", "reason_changed_at": float("inf")}]}
    views = {n.view.name: n.view for n in parse_sinfo_json(json.dumps(odd))}
    assert set(views) == {"ok1", "ok2"}  # a hostlist is not a node
    assert views["ok1"].service is Service.DRAINED and views["ok1"].reason_since == 1700000000
    assert views["ok2"].reason_since is None


def test_scontrol_messages_are_typed():
    # stderr of scontrol 22.05 as recorded on the test cluster
    for text in ("slurm_update error: Unable to contact slurm controller (connect failure)",
                 "slurm_load_node error: Socket timed out on send/recv operation"):
        assert isinstance(_classify("scontrol update", text), Transient)
    for text in ("slurm_update error: Invalid node name specified", "slurm_update error: Invalid node state specified",
                 "Error creating the reservation: Duplicate reservation name",
                 "slurm_update error: Access/permission denied"):
        assert type(_classify("scontrol update", text)) is Refused
    assert isinstance(_classify("scontrol update", "something new"), Transient)  # unknown: retried, never dropped


def test_bad_timeout_is_refused_at_construction(tmp_path: Path):
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            SlurmAdapter(timeout_s=bad)


# -- a job, as squeue --json gives it (the job response) --------------------------------------------------------------
def test_squeue_json_gives_the_jobs_state_nodes_run_and_requeue_flag():
    from gpuwarden.agent.act.adapters.slurm_json import parse_squeue_job

    text = (ROOT / "fixtures" / "slurm" / "squeue-22.05-defrag.json").read_text()
    view = parse_squeue_job(text, "7")  # running across both racks: n[2,4]
    assert (view.id, view.state, view.nodes, view.run, view.requeueable) == ("7", "running", ("n2", "n4"), 0, True)
    assert parse_squeue_job(text, "10").state == "pending" and parse_squeue_job(text, "10").nodes == ()
    assert parse_squeue_job(text, "99999") is None  # slurmctld answered: no such job (any more)


def test_squeue_json_that_could_not_ask_slurmctld_is_transient_never_a_job_gone():
    from gpuwarden.agent.act.adapters.slurm_json import parse_squeue_job

    # 22.05 exits 0 with an empty job list and an "errors" entry: read as "no such job", the intent would end undone.
    text = (ROOT / "fixtures" / "slurm" / "squeue-22.05-slurmctld-down.json").read_text()
    with pytest.raises(Transient, match="squeue --json: slurmctld not reached"):
        parse_squeue_job(text, "5")

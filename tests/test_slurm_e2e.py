"""End to end on a real Slurm cluster (tests/slurm_cluster.py: a real slurmctld, six real slurmds n1..n6, and n7, n8
that never answer) with the real agent: one `gpuwarden run` process per Slurm node it speaks for, each on its own
copy of a recorded GB200 tray (fixtures/nodes/gb200-nvl72-healthy), in act mode through the Slurm adapter, its
NVLink domain published as a node feature (n1..n3 in rackA, n4..n6 in rackB). Faults are injected by appending to
the tray's recorded kernel log. Every scenario is judged from the scheduler's own state (sinfo, scontrol, and
slurmctld's log of each update it made) and from the agent's journal (`gpuwarden status --json`, its state.db),
/metrics and log; deadlines are generous and nothing is timed."""
from __future__ import annotations

import json
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import NODES, ROOT, append_kmsg
from gpuwarden.agent.act.adapters.slurm import SlurmAdapter
from slurm_cluster import free_port, poll, slurm_cluster  # noqa: F401  (the fixture)

LIVE = ("n1", "n2", "n3", "n4", "n5", "n6")
RACK = {"n1": "rackA", "n2": "rackA", "n3": "rackA", "n4": "rackB", "n5": "rackB", "n6": "rackB"}
XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID48 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 48, pid=1, name=p, An uncorrectable double bit error"
XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
QUIET = "6,{seq},{usec},-;systemd[1]: Started Session {seq} of user root."
REASON79 = "gpuwarden: xid 79 GPU0 0008:01:00.0"  # the recorded tray's GPU 0 is at 0008:01:00.0
QUARANTINE79 = "gpuwarden: quarantine: xid 79 GPU0 0008:01:00.0"
DEADLINE_S = 120.0  # two loaded cores, several agents and slurmctld: generous, and never a measurement


# -- the scheduler's side ------------------------------------------------------------------------------------------
def sinfo(cluster) -> dict[str, dict[str, str]]:
    """node -> {state, reason, features} as sinfo prints them (state `drained`, `idle`, `idle*` ...)."""
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%T|%f|%E"], env=cluster.env, capture_output=True,
                          text=True, timeout=30)
    out = {}
    for line in proc.stdout.splitlines():
        name, state, features, reason = (line.split("|", 3) + ["", "", ""])[:4]
        out[name] = {"state": state, "features": features, "reason": "" if reason == "none" else reason}
    return out


def show(cluster, node: str) -> dict[str, str]:
    """`scontrol show node -o` as key=value (Reason and Comment may hold spaces: they are read to the next key)."""
    text = cluster.scontrol("show", "node", node, "-o").stdout.strip()
    keys = list(re.finditer(r"(?:^| )([A-Za-z]+)=", text))
    return {m.group(1): text[m.end():keys[i + 1].start() if i + 1 < len(keys) else len(text)].strip()
            for i, m in enumerate(keys)}


def ctld_log(cluster, since: int) -> str:
    """What slurmctld logged since byte `since`: each update_node and reservation it carried out, its own record."""
    with open(cluster.base / "log" / "slurmctld.log", "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace")


def ctld_log_size(cluster) -> int:
    path = cluster.base / "log" / "slurmctld.log"
    return path.stat().st_size if path.exists() else 0


def reasons_set(log: str, node: str, reason: str) -> int:
    """How many times slurmctld set `reason` on `node` (its log line per update)."""
    return log.count(f"update_node: node {node} reason set to: {reason}\n")


def in_service(cluster, *nodes: str) -> bool:
    states = sinfo(cluster)
    return all(states[n]["state"] in ("idle", "mixed", "allocated") for n in nodes)


@pytest.fixture
def cluster(slurm_cluster):  # noqa: F811
    """The module's cluster, put back as it started before and after each test: slurmctld up and awake, every live
    node in service with no reason, no comment, no Extra, its slurm.conf features only, and no reservation."""
    slurm_cluster.reset(deadline_s=DEADLINE_S)
    yield slurm_cluster
    slurm_cluster.reset(deadline_s=DEADLINE_S)


# -- the agents ------------------------------------------------------------------------------------------------------
class Agent:
    """`gpuwarden run` speaking for one Slurm node, on its own copy of the recorded tray."""

    def __init__(self, base: Path, cluster, node: str, *, breaker: tuple[float, float] = (1.0, 1.0),
                 hold_s: float = 3600.0, retry_s: tuple[float, float] = (0.2, 1.0), publish_every_s: float = 600.0,
                 timeout_s: float = 5.0):
        self.node, self.domain = node, RACK[node]
        self.dir = base / node
        self.root, self.state, self.cfg, self.log = (self.dir / "root", self.dir / "state", self.dir / "gw.toml",
                                                    self.dir / "agent.log")
        shutil.copytree(NODES / "gb200-nvl72-healthy", self.root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
        # The ladder's reboot never runs (turned off, and its command harmless); no step is due within a test.
        self.cfg.write_text(f"""
[checks.xid]
hold_s = {hold_s}
[remediation]
mode = "act"
adapter = "slurm"
node_name = "{node}"
retry_min_s = {retry_s[0]}
retry_max_s = {retry_s[1]}
publish_every_s = {publish_every_s}
[remediation.slurm]
slurm_conf = "{cluster.conf}"
timeout_s = {timeout_s}
claim_ttl_s = 60
[remediation.breaker]
cluster_share = {breaker[0]}
domain_share = {breaker[1]}
[remediation.ladder]
reset_gpu = false
reboot = false
reboot_command = ["true"]
step_after_s = 3600.0
retest_after_s = 0.5
[topology]
domain = "{self.domain}"
""")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Agent":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(self.root), "--state-dir",
                 str(self.state), "--listen", f"127.0.0.1:{self.port}", "--config", str(self.cfg), "--log-format",
                 "json"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def inject(self, template: str, n: int = 1) -> None:
        append_kmsg(self.root, template, n)

    # what the agent says
    def intents(self) -> list[dict]:
        """The journal, oldest first: action, done (None while pending), outcome."""
        try:
            with sqlite3.connect(f"{(self.state / 'state.db').absolute().as_uri()}?mode=ro", uri=True,
                                 timeout=10) as conn:
                rows = conn.execute("SELECT key, action, done, outcome FROM intents ORDER BY created, rowid").fetchall()
        except sqlite3.Error:
            return []
        return [{"key": k, "action": a, "done": d, "outcome": o} for k, a, d, o in rows]

    def done(self, *actions: str) -> bool:
        """Every intent journalled is done, and `actions` are among them."""
        journal = self.intents()
        return bool(journal) and all(i["done"] is not None for i in journal) and \
            set(actions) <= {i["action"] for i in journal}

    def outcome(self, action: str) -> str | None:
        (found,) = [i for i in self.intents() if i["action"] == action]
        return found["outcome"]

    def status(self) -> dict:
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(self.state),
                               "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=20).read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def events(self, event: str) -> list[dict]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == event:
                found.append(entry)
        return found

    def published(self, cluster) -> bool:
        return self.done("publish_domain") and f"gpuwarden_domain_{self.domain}" in sinfo(cluster)[self.node][
            "features"]


@pytest.fixture
def agents(cluster, tmp_path):
    """agents(node, ...) starts the real agent for a Slurm node and waits until it has published its NVLink domain;
    every agent started is stopped at the end."""
    started: list[Agent] = []

    def start(*nodes: str, **kw) -> list[Agent]:
        new = [Agent(tmp_path, cluster, n, **kw).start() for n in nodes]
        started.extend(new)
        for a in new:
            poll(lambda a=a: a.published(cluster) or a.proc.poll() is not None, f"{a.node}'s agent to publish "
                 f"its domain")
            assert a.proc.poll() is None, a.log.read_text()[-3000:]
        return new

    yield start
    for a in started:
        a.stop()


def pool(cluster, **spares: str) -> None:
    """Spares held out of service in their domain's pool, as the adapter keeps them (docs/slurm.md)."""
    adapter = SlurmAdapter(timeout_s=30, slurm_conf=str(cluster.conf))
    for node, domain in spares.items():
        adapter.return_to_pool(node, domain)


# -- 1. XID 79 -> drained with our reason, at the observation that read it ----------------------------------------
def test_slurm_xid79_drains_the_node_with_our_reason_within_one_poll(cluster, agents):
    (a,) = agents("n1")
    mark = ctld_log_size(cluster)
    a.inject(XID79)
    poll(lambda: sinfo(cluster)["n1"]["reason"] == QUARANTINE79, "n1 drained with our reason")
    poll(lambda: a.done("cordon", "drain", "take_spare"), "the intents carried out")
    assert sinfo(cluster)["n1"]["state"] == "drained" and show(cluster, "n1")["Reason"].startswith(QUARANTINE79)
    journal = a.intents()
    assert [i["action"] for i in journal] == ["publish_domain", "cordon", "drain", "take_spare"]
    assert a.outcome("cordon") == "done" and a.outcome("drain") == "done"
    # Within one poll: the transition was made by the very observation that read the XID from the kernel log (its
    # time is the xid check's), and its intents carry that time: no other check's poll or timer came in between.
    status = a.status()
    (t,) = status["transitions"]
    xid = {c["check"]: c for c in status["checks"]}["xid"]
    assert t["to"] == "quarantined" and t["at"] == xid["updated"] and t["reason"].startswith("xid/79 on GPU 0")
    assert all(i["key"].startswith(f"{t['at']:.6f}:") for i in journal[1:])
    # slurmctld's own record: the cordon's reason, then the quarantine's, each set once.
    log = ctld_log(cluster, mark)
    assert reasons_set(log, "n1", REASON79) == 1 and reasons_set(log, "n1", QUARANTINE79) == 1
    m = a.metrics()
    assert m['gpuwarden_node_state{state="quarantined"}'] == 1.0
    assert m['gpuwarden_xid_events{pci="0008:01:00.0",xid="79"}'] == 1.0
    assert m["gpuwarden_actions_pending"] == 0.0 and m["gpuwarden_scheduler_reachable"] == 1.0


# -- 2. an administrator's drain is never undone ----------------------------------------------------------------
def test_slurm_an_admin_drained_node_is_never_resumed_by_the_agent(cluster, agents):
    cluster.scontrol("update", "NodeName=n2", "State=DRAIN", "Reason=admin: bad fan")
    mark = ctld_log_size(cluster)
    (a,) = agents("n2", hold_s=1.0)  # the XID 48 stands 1 s, then the node is retested
    assert [i["action"] for i in a.intents()] == ["publish_domain"]  # healthy: nothing to resume, nothing asked
    a.inject(XID48)  # RESET_GPU class: quarantined at once
    poll(lambda: a.done("cordon", "drain"), "the fault's intents carried out")
    # The cordon found the node out of service already; the quarantine is refused (not ours to take over).
    assert a.outcome("cordon").startswith("already so at the scheduler (drained")
    assert a.outcome("drain").startswith("refused:") and "admin: bad fan" in a.outcome("drain")

    def resumed_by_retest() -> bool:
        a.inject(QUIET)  # kernel-log lines move the XID's hold and the retest's wait along (no 30 s idle tick)
        return a.done("resume")

    poll(resumed_by_retest, "the fault to clear, the retest to pass and the resume intent to end", every_s=1.0)
    assert a.outcome("resume").startswith("refused:") and "admin: bad fan" in a.outcome("resume")
    status = a.status()
    assert status["transitions"][0]["reason"] == "retest passed" and status["node"]["state"] == "healthy"
    node = show(cluster, "n2")
    assert node["Reason"].startswith("admin: bad fan") and "DRAIN" in node["State"]
    log = ctld_log(cluster, mark)
    assert "node n2 state set to IDLE" not in log and "update_node: node n2 reason set to" not in log
    assert all(not i["outcome"].startswith("done") for i in a.intents() if i["action"] in ("drain", "resume"))


# -- 3. a spare of the same rack, not of the other ---------------------------------------------------------------
def test_slurm_a_spare_of_the_same_rack_goes_into_service_not_one_of_the_other_rack(cluster, agents):
    pool(cluster, n3="rackA", n6="rackB")  # n3 comes first by name: the rack decides, not the name
    (a,) = agents("n4")  # rackB
    mark = ctld_log_size(cluster)
    a.inject(XID79)
    poll(lambda: a.done("take_spare"), "the spare's swap carried out")
    assert a.outcome("take_spare") == "done: spare n6 of rackB taken into service"
    poll(lambda: in_service(cluster, "n6"), "n6 answering in service")
    states = sinfo(cluster)
    assert states["n4"]["reason"] == QUARANTINE79 and states["n4"]["state"] == "drained"
    assert states["n3"]["reason"] == "gpuwarden: spare" and states["n3"]["state"] == "drained"  # the other rack's
    assert show(cluster, "n6")["Comment"] == "gpuwarden: spare for n4"
    assert a.status()["remediation"]["swap"]["spare"] == "n6"
    assert a.metrics()["gpuwarden_slice_must_move"] == 0.0
    log = ctld_log(cluster, mark)
    assert log.count("reservation=gpuwarden_spare_n6") >= 1 and "gpuwarden_spare_n3" not in log  # only n6 claimed
    assert cluster.scontrol("show", "reservation", check=False).stdout.strip().startswith("No reservations")


def test_slurm_two_agents_of_one_rack_racing_for_its_last_spare_never_both_get_it(cluster, agents):
    """Two nodes of rackA fail at the same moment and rackA has one spare: slurmctld is the arbiter (the claim
    reservation), so exactly one agent takes n3 into service and the other says the slice must move."""
    pool(cluster, n3="rackA")
    racers = agents("n1", "n2")  # the breaker lets both through (shares of 1.0): only the spare is contended
    for a in racers:
        a.inject(XID79)
    poll(lambda: all(a.done("take_spare") for a in racers), "both swaps carried out")
    outcomes = {a.node: a.outcome("take_spare") for a in racers}
    winners = [n for n, o in outcomes.items() if o == "done: spare n3 of rackA taken into service"]
    losers = [n for n, o in outcomes.items() if "the slice must move" in (o or "")]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    (winner,), (loser,) = winners, losers
    poll(lambda: in_service(cluster, "n3"), "n3 answering in service")
    assert show(cluster, "n3")["Comment"] == f"gpuwarden: spare for {winner}"
    by_node = {a.node: a for a in racers}
    assert by_node[loser].metrics()["gpuwarden_slice_must_move"] == 1.0
    assert by_node[winner].metrics()["gpuwarden_slice_must_move"] == 0.0
    states = sinfo(cluster)
    assert states["n1"]["state"] == states["n2"]["state"] == "drained"
    assert cluster.scontrol("show", "reservation", check=False).stdout.strip().startswith("No reservations")


# -- 4. the circuit breaker --------------------------------------------------------------------------------------
def _burst(cluster, group: list[Agent]) -> tuple[list[Agent], list[Agent]]:
    """XID 79 on every agent of `group` at the same moment; returns (drained, held) once each has settled: drained by
    us (cordon and drain done), or held by its breaker (open on /metrics) and back in service."""
    for a in group:
        a.inject(XID79)

    def settled(a: Agent) -> bool:
        return a.done("cordon", "drain") or (a.metrics().get("gpuwarden_breaker_open") == 1.0
                                             and in_service(cluster, a.node))

    poll(lambda: all(settled(a) for a in group), "every agent drained or held by its breaker")
    drained = [a for a in group if a.done("cordon", "drain")]
    held = [a for a in group if a not in drained]
    states = sinfo(cluster)
    for a in drained:
        assert states[a.node]["reason"] == QUARANTINE79 and a.metrics()["gpuwarden_breaker_open"] == 0.0
    for a in held:
        assert states[a.node]["state"] == "idle" and states[a.node]["reason"] == "", states[a.node]
        assert a.events("circuit breaker open: cordons held until `gpuwarden breaker reset`"), a.node
        assert {i["action"] for i in a.intents() if i["done"] is None} >= {"cordon", "drain"}  # waiting, not lost
        assert a.status()["remediation"]["breaker"]["open"] is True
    return drained, held


def test_slurm_breaker_holds_when_half_the_nodes_report_at_once(cluster, agents):
    # 4 of the 8 nodes fail at once; at most a quarter of the cluster (2 nodes) may be drained within the window.
    group = agents("n1", "n2", "n4", "n5", breaker=(0.25, 1.0))
    drained, held = _burst(cluster, group)
    assert len(drained) <= 2 and len(held) >= 2, ([a.node for a in drained], [a.node for a in held])
    ours = [n for n, s in sinfo(cluster).items() if s["reason"].startswith("gpuwarden:")]
    assert sorted(ours) == sorted(a.node for a in drained)


def test_slurm_breaker_holds_per_nvlink_domain_when_one_rack_reports(cluster, agents):
    # rackA's three nodes fail at once: at most one of them (a third of the rack) may be drained; the cluster's own
    # share is not the limit. A node of rackB is then drained all the same: the brake is per domain.
    rack_a = agents("n1", "n2", "n3", breaker=(1.0, 0.34))
    (b,) = agents("n4", breaker=(1.0, 0.34))
    drained, held = _burst(cluster, rack_a)
    assert len(drained) <= 1 and len(held) >= 2, ([a.node for a in drained], [a.node for a in held])
    assert "NVLink domain rackA" in held[0].status()["remediation"]["breaker"]["reason"]
    b.inject(XID79)
    poll(lambda: b.done("cordon", "drain"), "rackB's node drained")
    assert sinfo(cluster)["n4"]["reason"] == QUARANTINE79 and b.metrics()["gpuwarden_breaker_open"] == 0.0


# -- 5. slurmctld restarted mid-remediation ----------------------------------------------------------------------
def test_slurm_ctld_restarted_mid_remediation_every_intent_done_exactly_once(cluster, agents):
    pool(cluster, n3="rackA", n6="rackB")
    # The spares run their agents too: slurmctld forgets scontrol-set features when it restarts, and each agent
    # re-asserts its own node's domain (often here, so the spares are found again before the failed nodes ask).
    agents("n3", "n6", publish_every_s=0.5, retry_s=(0.2, 0.5))
    failed = n1, n4 = agents("n1", "n4", publish_every_s=0.5, retry_s=(2.0, 2.0))
    mark = ctld_log_size(cluster)
    # slurmctld goes down while n1's remediation is under way (its cordon done, the rest being carried out or
    # pending), and n4's fault comes while it is down (all of n4's intents pending); then it starts again.
    n1.inject(XID79)
    poll(lambda: any(i["action"] == "cordon" and i["done"] for i in n1.intents()), "n1's cordon carried out",
         every_s=0.05)
    cluster.stop_ctld()
    n4.inject(XID79)
    poll(lambda: n4.metrics().get("gpuwarden_scheduler_reachable") == 0.0
         and n4.metrics().get('gpuwarden_node_state{state="quarantined"}') == 1.0,
         "n4 quarantined, its intents waiting")
    assert {i["action"] for i in n4.intents() if i["done"] is None} == {"cordon", "drain", "take_spare"}
    cluster.start_ctld()
    for a in failed:
        poll(lambda a=a: a.done("cordon", "drain", "take_spare"), f"{a.node}'s intents carried out", timeout_s=240)
    spare = {"n1": "n3", "n4": "n6"}
    for a in failed:
        journal = a.intents()
        actions = [i["action"] for i in journal if i["action"] != "publish_domain"]
        assert actions == ["cordon", "drain", "take_spare"], journal  # one intent each
        assert all(not i["outcome"].startswith(("refused", "failed")) for i in journal), journal
        assert a.outcome("take_spare") == f"done: spare {spare[a.node]} of {a.domain} taken into service"
        assert a.metrics()["gpuwarden_actions_pending"] == 0.0
    poll(lambda: in_service(cluster, "n3", "n6"), "both spares answering in service")
    states = sinfo(cluster)
    assert states["n1"]["reason"] == QUARANTINE79 and states["n4"]["reason"] == QUARANTINE79
    assert show(cluster, "n3")["Comment"] == "gpuwarden: spare for n1"
    assert show(cluster, "n6")["Comment"] == "gpuwarden: spare for n4"
    log = ctld_log(cluster, mark)
    for node in ("n1", "n4"):  # slurmctld's own record: each change made once, the restart notwithstanding
        assert reasons_set(log, node, QUARANTINE79) == 1, log
        assert reasons_set(log, node, REASON79) <= 1, log  # a cordon the quarantine overtook is never sent twice
    for spare_node in ("n3", "n6"):  # each spare resumed once: no second take, no spare taken for two
        assert log.count(f"update_node: node {spare_node} state set to IDLE") <= 1, log
    assert cluster.scontrol("show", "reservation", check=False).stdout.strip().startswith("No reservations")
    assert n4.events("intent not carried out yet; retrying")  # the outage was seen, and waited out


# -- 6. a hung slurmctld delays actions, never detection ---------------------------------------------------------
def test_slurm_a_hung_ctld_delays_actions_but_not_detection(cluster, agents):
    (a,) = agents("n5", timeout_s=2.0, retry_s=(0.5, 2.0))
    cluster.hang_ctld()  # SIGSTOP: connections accepted, never answered
    try:
        a.inject(XID79)

        def detected_while_hung() -> dict | None:
            m = a.metrics()
            waiting = m.get("gpuwarden_scheduler_reachable") == 0.0 or m.get("gpuwarden_actions_pending", 0) > 0
            return m if m.get('gpuwarden_node_state{state="quarantined"}') == 1.0 and waiting else None

        m = poll(detected_while_hung, "the quarantine on /metrics while slurmctld hangs")
        assert m['gpuwarden_xid_events{pci="0008:01:00.0",xid="79"}'] == 1.0
        a.inject(XID13)  # detection goes on: the next XID is counted while the drain still waits
        poll(lambda: a.metrics().get('gpuwarden_xid_events{pci="0009:01:00.0",xid="13"}') == 1.0,
             "an XID 13 counted while slurmctld hangs")
        # The engine journals a transition's intents after its own call to the hung slurmctld has timed out: on a
        # busy machine that can come after the XID 13 above. They stay pending while slurmctld hangs.
        poll(lambda: {i["action"] for i in a.intents() if i["done"] is None} >= {"cordon", "drain"},
             "the cordon and the drain journaled, waiting on slurmctld")
        poll(lambda: a.metrics().get("gpuwarden_scheduler_reachable") == 0.0, "the scheduler reported unreachable")
    finally:
        cluster.wake_ctld()
    poll(lambda: a.done("cordon", "drain", "take_spare"), "the intents carried out once slurmctld answers")
    assert sinfo(cluster)["n5"]["reason"] == QUARANTINE79
    assert [i["action"] for i in a.intents()] == ["publish_domain", "cordon", "drain", "take_spare"]
    poll(lambda: a.metrics().get("gpuwarden_scheduler_reachable") == 1.0, "the scheduler reachable again")

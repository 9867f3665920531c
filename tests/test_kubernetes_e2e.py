"""The real agent acting through the Kubernetes adapter: `gpuwarden run` (mode = act, adapter = kubernetes) on
copies of a recorded GB200 tray, faults injected through the tray's kernel log, against the fake API server of
tests/fake_kube_api.py (kube-apiserver's HTTP/JSON, the eviction subresource with PodDisruptionBudgets, 409s on
stale writes). Each test reads the outcome from the API server's objects (the Node's spec.unschedulable, the
agent's taint and GpuwardenHealthy condition, Events, the pods evicted) and from the agent's own `status` and
/metrics. The scenarios are the ones the Slurm cluster runs: XID 79 cordons and drains, a budget holds the drain
without losing it, an administrator's cordon is never undone, a spare of the same NVLink domain goes into service,
the circuit breaker holds, and an API server that restarts or hangs delays actions, never detection, and gets
every intent once."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, append_kmsg, end_processes, wait_for
from fake_kube_api import FakeKubeApi
from gpuwarden.agent.act.adapters import kubernetes as k8s

HOST = "gb200-rack07-tray03"  # gb200-nvl72-healthy's hostname: the agent's node at the API server
DOMAIN = "62c4efc6-d460-488d-b7d7-69de49edd641.32766"  # the recorded tray's NVML fabric clusterUuid.cliqueId
OTHER = "8d1b7a3e-0c5f-4e2a-9b6d-3f4e5a6b7c8d.1"  # another rack's clique
XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID48 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 48, pid=1, name=p, An uncorrectable double bit error"
XID13 = "3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1"
WAIT_S = 90.0  # two loaded cores and several agents: generous, and never a timing assertion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml(table: dict, prefix: str = "") -> str:
    """A config file from nested dicts of strings, numbers, booleans and lists of strings."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))

    plain = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = ([f"[{prefix}]"] if prefix and plain else []) + plain
    for k, v in table.items():
        if isinstance(v, dict):
            out.append(toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


class Agent:
    """One `gpuwarden run` on its own copy of the recorded tray, acting on `node` through the fake API server."""

    def __init__(self, base: Path, api: FakeKubeApi, node: str, extra: dict | None = None):
        import shutil

        self.node, self.dir = node, base / node
        self.root, self.state = self.dir / "root", self.dir / "state"
        shutil.copytree(ROOT / "fixtures" / "nodes" / "gb200-nvl72-healthy", self.root,
                        ignore=shutil.ignore_patterns("tools"))
        kubeconfig = api.write_kubeconfig(self.dir / "kubeconfig")
        cfg = merged({"remediation": {
            "mode": "act", "adapter": "kubernetes", "node_name": node, "retry_min_s": 0.1, "retry_max_s": 1.0,
            "kubernetes": {"kubeconfig": str(kubeconfig), "timeout_s": 3},
            "breaker": {"cluster_share": 1.0, "domain_share": 1.0},
            "ladder": {"reboot": False, "reset_gpu": False}}}, extra or {})
        self.config = self.dir / "gpuwarden.toml"
        self.config.write_text(toml(cfg) + "\n")
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> Agent:
        self.port = free_port()
        self.log = open(self.dir / "agent.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden.agent.cli", "run", "--root", str(self.root), "--state-dir",
             str(self.state), "--listen", f"127.0.0.1:{self.port}", "--config", str(self.config),
             "--log-format", "json"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log)
        wait_for(lambda: self.intents() and self.metrics(), timeout_s=WAIT_S, what=f"the agent on {self.node} up")
        return self

    def stop(self) -> None:
        end_processes(self.proc, grace_s=30)
        if self.proc is not None:
            self.log.close()
        self.proc = None

    def inject(self, template: str) -> None:
        append_kmsg(self.root, template)

    def status(self) -> dict:
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(self.state),
                               "--json"], capture_output=True, text=True, timeout=60)
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}

    def intents(self) -> list[dict]:
        return self.status().get("intents") or []

    def done(self, action: str) -> list[str]:
        """The outcomes of this action's intents carried out so far."""
        return [i["outcome"] for i in self.intents() if i["action"] == action and i.get("done") is not None]

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
                return r.read().decode()
        except OSError:
            return ""

    def metric(self, sample: str) -> float | None:
        """The value of one sample line (`name{labels}` exactly as exposed), None when absent."""
        for line in self.metrics().splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return None


@pytest.fixture
def agents(tmp_path, api):
    """Makes agents (started by the test); every one is stopped at the end, also when the test failed."""
    made: list[Agent] = []

    def make(node: str = HOST, extra: dict | None = None) -> Agent:
        agent = Agent(tmp_path, api, node, extra)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop()


@pytest.fixture
def admin(api, tmp_path):
    """The test's own client on the API server, as an operator's tools would use it (spares put in the pool)."""
    adapter = k8s.KubernetesAdapter(kubeconfig=str(api.write_kubeconfig(tmp_path / "admin.kubeconfig")),
                                    host="operator", timeout_s=10.0)
    yield adapter
    adapter.close()


# -- reading the API server's objects ----------------------------------------------------------------------------
def taint(api: FakeKubeApi, node: str, key: str = k8s.TAINT) -> dict | None:
    return next((t for t in api.node_obj(node)["spec"].get("taints", []) if t["key"] == key), None)


def level(api: FakeKubeApi, node: str) -> str | None:
    return (taint(api, node) or {}).get("value")


def condition(api: FakeKubeApi, node: str) -> dict | None:
    return next((c for c in api.node_obj(node)["status"]["conditions"] if c["type"] == k8s.CONDITION), None)


def events(api: FakeKubeApi, node: str, reason: str | None = None) -> list[dict]:
    return [e for e in list(api.events) if e["involvedObject"]["name"] == node
            and (reason is None or e["reason"] == reason)]


def evictions(api: FakeKubeApi, code: int | None = 201) -> list[str]:
    return [r["path"].split("/")[-2] for r in list(api.requests) if r["path"].endswith("/eviction")
            and (code is None or r["code"] == code)]


def untouched(api: FakeKubeApi, node: str) -> bool:
    """Nothing of the agent's on the node: schedulable, no taint, no condition saying unhealthy."""
    obj = api.node_obj(node)
    return (not obj["spec"].get("unschedulable") and not taint(api, node)
            and (condition(api, node) or {}).get("status") != "False")


def nodes(api: FakeKubeApi, names, domain: str = DOMAIN, **kw) -> None:
    for name in names:
        api.add_node(name, labels={k8s.CLIQUE_LABEL: domain}, **kw)


def job(api: FakeKubeApi, node: str, n: int = 2, app: str = "train") -> list[str]:
    names = [f"{app}-{node[-6:]}-{i}" for i in range(n)]
    for name in names:
        api.add_pod("team-a", name, node, labels={"app": app}, owner="ReplicaSet")
    return names


def all_done(agent: Agent, *actions: str) -> bool:
    intents = agent.intents()
    return all(any(i["action"] == a for i in intents) for a in actions) and all(
        i.get("done") is not None for i in intents)


# -- (a) XID 79: cordoned, drained through evictions, quarantined --------------------------------------------------
def test_kubernetes_xid79_cordons_and_drains_through_evictions_with_our_reason(api, agents):
    nodes(api, [HOST, "gb200-rack07-tray04"])
    pods = job(api, HOST)
    api.add_pod("kube-system", "nvidia-dcgm-exporter-x", HOST, owner="DaemonSet")
    agent = agents().start()
    assert agent.metric("gpuwarden_remediation_acting") == 1.0
    assert untouched(api, HOST) and api.pods_on(HOST) == sorted(
        [f"team-a/{p}" for p in pods] + ["kube-system/nvidia-dcgm-exporter-x"])

    agent.inject(XID79)
    # The taint, the condition and its Event are three writes (the node, its status subresource, then the Event):
    # wait for all three.
    wait_for(lambda: level(api, HOST) == "quarantined" and (condition(api, HOST) or {}).get("reason") == "Quarantined"
             and "GpuwardenQuarantined" in [e["reason"] for e in events(api, HOST)],
             timeout_s=WAIT_S, what="the node quarantined")
    obj = api.node_obj(HOST)
    assert obj["spec"]["unschedulable"] is True
    assert obj["metadata"]["annotations"][k8s.OURS_UNSCHEDULABLE] == "true"
    cond = condition(api, HOST)
    assert (cond["status"], cond["reason"]) == ("False", "Quarantined")
    reason = cond["message"]
    assert reason == "gpuwarden: xid 79 GPU0 0008:01:00.0"  # check, code, GPU index and PCI address
    # drained through the eviction API, the DaemonSet's pod left, no pod deleted
    assert sorted(evictions(api)) == sorted(pods)
    assert api.pods_on(HOST) == ["kube-system/nvidia-dcgm-exporter-x"]
    assert not [r for r in api.requests if r["method"] == "DELETE"]
    # an Event for each step, each with the agent's reason
    steps = [e["reason"] for e in events(api, HOST)]
    assert steps == ["GpuwardenCordoned", "GpuwardenDraining", "GpuwardenDrained", "GpuwardenQuarantined"]
    assert {e["message"] for e in events(api, HOST)} == {reason}
    assert untouched(api, "gb200-rack07-tray04")  # the other tray of the rack is left alone

    wait_for(lambda: all_done(agent, "cordon", "drain", "take_spare"), timeout_s=WAIT_S, what="every intent done")
    assert agent.done("cordon") == ["done"] and agent.done("drain") == ["done"]
    st = agent.status()
    assert st["node"]["state"] == "quarantined" and st["remediation"]["adapter"] == "kubernetes"
    assert agent.metric('gpuwarden_node_state{state="quarantined"}') == 1.0
    assert agent.metric("gpuwarden_scheduler_reachable") == 1.0
    assert agent.metric("gpuwarden_actions_pending") == 0.0


# -- (b) a PodDisruptionBudget holds the drain: retried, nothing deleted, then through -----------------------------
def test_kubernetes_pdb_holds_the_drain_until_the_budget_allows(api, agents):
    nodes(api, [HOST, "gb200-rack07-tray04"])
    pods = job(api, HOST, 2)
    api.add_pdb("team-a", "train", {"app": "train"}, min_available=2)  # no disruption left
    agent = agents().start()
    agent.inject(XID79)

    wait_for(lambda: events(api, HOST, "GpuwardenDrainBlocked"), timeout_s=WAIT_S, what="the drain held by the PDB")
    # Retried (more than one refused eviction per pod), the pods kept, the node cordoned and not drained.
    wait_for(lambda: len(evictions(api, 429)) >= 2 * len(pods) + 2, timeout_s=WAIT_S, what="the drain retried")
    assert evictions(api, 201) == [] and not [r for r in api.requests if r["method"] == "DELETE"]
    assert api.pods_on(HOST) == sorted(f"team-a/{p}" for p in pods)
    assert level(api, HOST) == "draining" and api.node_obj(HOST)["spec"]["unschedulable"] is True
    assert len(events(api, HOST, "GpuwardenDrainBlocked")) == 1  # reported once, not at every retry
    wait_for(lambda: "PodDisruptionBudget" in str(agent.status()["remediation"].get("scheduler_waiting")),
             timeout_s=WAIT_S, what="status naming the budget")
    assert agent.done("cordon") == ["done"] and agent.done("drain") == []  # the drain waits, not lost, not done
    # The API server answered (429 for the budget): reachable, and nothing said about it being unreachable.
    assert agent.metric("gpuwarden_scheduler_reachable") == 1.0
    assert agent.status()["remediation"].get("scheduler_error") is None
    assert agent.metric("gpuwarden_actions_pending") >= 1.0

    # The workload's controller brings up replicas elsewhere: the budget has room, the drain goes through.
    job(api, "gb200-rack07-tray04", 2)
    wait_for(lambda: level(api, HOST) == "quarantined", timeout_s=WAIT_S, what="the drain through")
    assert sorted(evictions(api, 201)) == sorted(pods)  # each pod evicted once
    assert api.pods_on(HOST) == []
    wait_for(lambda: all_done(agent, "cordon", "drain", "take_spare"), timeout_s=WAIT_S, what="every intent done")
    assert agent.done("drain") == ["done"]
    wait_for(lambda: agent.metric("gpuwarden_scheduler_reachable") == 1.0, timeout_s=WAIT_S, what="reachable again")


# -- (c) an administrator's cordon is never undone -----------------------------------------------------------------
def test_kubernetes_admin_cordon_is_never_undone(api, agents):
    nodes(api, ["gb200-rack07-tray04"])
    nodes(api, [HOST], unschedulable=True)  # `kubectl cordon` by an administrator, before any fault
    # A RESET_GPU-class XID that clears: quarantined, then the retest passes and the node would go back to service.
    # (The state machine runs the retest once all has looked clear for retest_after_s: half a second here.)
    agent = agents(extra={"checks": {"xid": {"hold_s": 0.5}}, "remediation": {
        "spares": {"swap": False}, "ladder": {"retest_after_s": 0.5}}}).start()
    agent.inject(XID48)
    # The quarantine lasts only until the retest passes (about a second here): on a loaded machine a poll of the
    # taint can miss it, so its drain carried out counts as well.
    wait_for(lambda: level(api, HOST) == "quarantined" or agent.done("drain"), timeout_s=WAIT_S,
             what="the node quarantined")
    assert agent.done("drain") == ["done"] or level(api, HOST) == "quarantined"
    assert k8s.OURS_UNSCHEDULABLE not in api.node_obj(HOST)["metadata"]["annotations"]  # the cordon is not ours
    wait_for(lambda: agent.done("resume"), timeout_s=WAIT_S, what="the retest passed and the resume tried")

    (outcome,) = agent.done("resume")
    assert outcome.startswith("refused:") and "set by someone else" in outcome, outcome
    obj = api.node_obj(HOST)
    assert obj["spec"]["unschedulable"] is True  # still cordoned, as the administrator left it
    assert taint(api, HOST) is None  # the agent's own marks are gone
    assert condition(api, HOST)["status"] == "True"
    assert agent.status()["node"]["state"] == "healthy"
    # never written: no request of the agent ever cleared spec.unschedulable (the node was unschedulable throughout)
    assert agent.done("cordon") and agent.done("cordon")[0].startswith("already so at the scheduler")
    assert agent.metric('gpuwarden_intents_carried_out_total{outcome="refused"}') == 1.0


# -- (d) a spare of the same NVLink domain goes into service, not one of another -----------------------------------
def test_kubernetes_spare_of_the_same_clique_goes_into_service(api, agents, admin):
    nodes(api, [HOST, "gb200-rack07-tray04", "gb200-rack07-spare1"])
    nodes(api, ["gb200-rack06-tray01", "gb200-rack06-spare1"], domain=OTHER)  # sorts first: never to be taken
    admin.return_to_pool("gb200-rack07-spare1", DOMAIN)
    admin.return_to_pool("gb200-rack06-spare1", OTHER)
    assert admin.spares(DOMAIN) == ["gb200-rack07-spare1"] and admin.spares(OTHER) == ["gb200-rack06-spare1"]
    job(api, HOST, 1)
    agent = agents().start()
    agent.inject(XID79)

    wait_for(lambda: agent.done("take_spare"), timeout_s=WAIT_S, what="the spare swap")
    (outcome,) = agent.done("take_spare")
    assert outcome == f"done: spare gb200-rack07-spare1 of {DOMAIN} taken into service", outcome
    spare = api.node_obj("gb200-rack07-spare1")
    assert not spare["spec"].get("unschedulable") and taint(api, "gb200-rack07-spare1", k8s.SPARE_TAINT) is None
    assert k8s.SPARE_LABEL not in spare["metadata"]["labels"]
    assert spare["metadata"]["annotations"][k8s.TAKEN_FOR] == HOST
    assert (condition(api, "gb200-rack07-spare1") or {}).get("reason") == "InService"
    assert events(api, "gb200-rack07-spare1", "GpuwardenSpareTaken")
    # the other rack's spare stays in its pool
    assert admin.spares(OTHER) == ["gb200-rack06-spare1"] and admin.spares(DOMAIN) == []
    assert level(api, HOST) == "quarantined"
    swap = agent.status()["remediation"]["swap"]
    assert (swap["spare"], swap["domain"], swap["slice_must_move"]) == ("gb200-rack07-spare1", DOMAIN, False)
    assert agent.metric("gpuwarden_slice_must_move") == 0.0


# -- (e) the breaker holds when half the nodes report ---------------------------------------------------------------
def test_kubernetes_breaker_holds_when_half_the_nodes_report(api, agents, tmp_path):
    """8 nodes of one rack; cordons limited to a quarter of the cluster (2). Agents on half of them report an XID 79:
    the first two are drained, the other two are held (the breaker latches, their nodes stay in service) until
    `gpuwarden breaker reset`. The two waves are injected one after the other: agents that read the fleet in the
    same instant each count only themselves and all pass (docs/kubernetes.md, Testing)."""
    names = [f"gb200-rack07-tray{i:02d}" for i in range(1, 9)]
    nodes(api, names)
    extra = {"remediation": {"breaker": {"cluster_share": 0.25, "domain_share": 1.0}}}
    first, held = [agents(n, extra).start() for n in names[:2]], [agents(n, extra).start() for n in names[2:4]]

    for agent in first:  # two at once
        agent.inject(XID79)
    wait_for(lambda: all(level(api, a.node) == "quarantined" for a in first), timeout_s=WAIT_S,
             what="the first two drained")
    for agent in held:  # two more at once: half the cluster has reported
        agent.inject(XID79)
    for agent in held:
        wait_for(lambda a=agent: a.metric("gpuwarden_breaker_open") == 1.0, timeout_s=WAIT_S,
                 what=f"the breaker open on {agent.node}")
        breaker = agent.status()["remediation"]["breaker"]
        assert breaker["open"] and breaker["cluster"] == [3, 8], breaker
        assert agent.status()["node"]["state"] == "quarantined"  # detection went on: the node knows it is bad
        assert agent.done("cordon") == [] and agent.metric("gpuwarden_actions_pending") >= 1.0
    assert [n for n in names if not untouched(api, n)] == names[:2]  # the fleet was not drained
    assert all(a.metric("gpuwarden_breaker_open") == 0.0 for a in first)

    # The operator looked, and resets one node's breaker: that one is cordoned, the other stays held.
    reset = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "breaker", "reset", "--state-dir",
                            str(held[0].state)], capture_output=True, text=True, timeout=60)
    assert reset.returncode == 0, reset.stderr
    wait_for(lambda: level(api, held[0].node) == "quarantined", timeout_s=WAIT_S, what="the reset node drained")
    assert untouched(api, held[1].node) and held[1].metric("gpuwarden_breaker_open") == 1.0


# -- (f) the API server hangs, or restarts, mid-remediation ---------------------------------------------------------
def test_kubernetes_api_server_hanging_delays_actions_not_detection(api, agents):
    nodes(api, [HOST, "gb200-rack07-tray04"])
    pods = job(api, HOST, 2)
    api.linger_evictions = True  # evicted pods take time to terminate: the drain is in progress
    agent = agents().start()
    agent.inject(XID79)
    wait_for(lambda: level(api, HOST) == "draining" and len(evictions(api)) == 2, timeout_s=WAIT_S,
             what="the drain under way")

    api.hang()  # every request from now on is held without an answer
    try:
        agent.inject(XID13)  # detection and /metrics go on while the scheduler hangs
        wait_for(lambda: agent.metric('gpuwarden_xid_events{pci="0009:01:00.0",xid="13"}') == 1.0,
                 timeout_s=WAIT_S, what="the XID 13 on /metrics while the API server hangs")
        wait_for(lambda: "no answer from the API server" in str(agent.status()["remediation"]["scheduler_error"]),
                 timeout_s=WAIT_S, what="the hang seen as the scheduler's error")
        assert agent.metric("gpuwarden_scheduler_reachable") == 0.0
        assert agent.metric('gpuwarden_node_state{state="quarantined"}') == 1.0
        assert agent.metric("gpuwarden_actions_pending") >= 1.0
        api.finish_terminations()  # the kubelet finished the pods meanwhile
    finally:
        api.unhang()
    wait_for(lambda: level(api, HOST) == "quarantined", timeout_s=WAIT_S, what="the drain through after the hang")
    wait_for(lambda: all_done(agent, "cordon", "drain", "take_spare"), timeout_s=WAIT_S, what="every intent done")
    assert_once(api, agent, pods)
    wait_for(lambda: agent.metric("gpuwarden_scheduler_reachable") == 1.0, timeout_s=WAIT_S, what="reachable again")


def test_kubernetes_api_server_restarted_mid_remediation_does_each_intent_once(api, agents):
    nodes(api, [HOST, "gb200-rack07-tray04"])
    pods = job(api, HOST, 2)
    api.linger_evictions = True
    agent = agents().start()
    port = int(api.url.rsplit(":", 1)[1])
    agent.inject(XID79)
    wait_for(lambda: level(api, HOST) == "draining" and len(evictions(api)) == 2, timeout_s=WAIT_S,
             what="the drain under way")

    api.stop()  # down: connections refused; its objects are kept (etcd)
    try:
        wait_for(lambda: "could not reach the API server" in str(agent.status()["remediation"]["scheduler_error"]),
                 timeout_s=WAIT_S, what="the outage seen as the scheduler's error")
        assert agent.metric("gpuwarden_scheduler_reachable") == 0.0
        agent.inject(XID13)
        wait_for(lambda: agent.metric('gpuwarden_xid_events{pci="0009:01:00.0",xid="13"}') == 1.0,
                 timeout_s=WAIT_S, what="detection going on while the API server is down")
        api.finish_terminations()
        assert agent.done("drain") == []
    finally:
        api.start(port)  # back on the same address, with the same objects
    wait_for(lambda: level(api, HOST) == "quarantined", timeout_s=WAIT_S, what="the drain through after the restart")
    wait_for(lambda: all_done(agent, "cordon", "drain", "take_spare"), timeout_s=WAIT_S, what="every intent done")
    assert_once(api, agent, pods)


def assert_once(api: FakeKubeApi, agent: Agent, pods: list[str]) -> None:
    """Every intent carried out exactly once: one intent each, marked done; each pod evicted once; each step's
    Event at most once (an Event is best effort: one whose request was lost in the outage is not sent again)."""
    intents = agent.intents()
    for action in ("cordon", "drain", "take_spare"):
        assert [i["action"] for i in intents].count(action) == 1, intents
    assert all(i.get("done") is not None and not i["outcome"].startswith(("refused", "failed")) for i in intents), \
        intents
    assert sorted(evictions(api, 201)) == sorted(pods)
    for reason in ("GpuwardenCordoned", "GpuwardenDrained", "GpuwardenQuarantined"):
        assert len(events(api, HOST, reason)) <= 1, [e["reason"] for e in events(api, HOST)]
    assert events(api, HOST, "GpuwardenQuarantined")  # the last step, made after the outage
    assert level(api, HOST) == "quarantined" and api.pods_on(HOST) == []
    assert agent.status()["pending_intents"] == []

"""The Kubernetes adapter against a fake API server that speaks the real HTTP/JSON (tests/fake_kube_api.py): the
adapter's own client code (lightkube) builds every request, the fake answers as kube-apiserver does for those
requests, and each test reads the outcome back from the server's objects and request log."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from conftest import ROOT
from fake_kube_api import FakeKubeApi
from gpuwarden.agent.act.adapters import kubernetes as k8s  # the client comes with the [test] extra: never skipped
from gpuwarden.agent.act.adapters import kubernetes_api
from gpuwarden.agent.core.scheduler import SPARE_REASON, Busy, Refused, Service, Transient
from gpuwarden.agent.node.topology import DOMAIN_LABEL

REASON = "gpuwarden: xid 79 GPU3 0000:1b:00.0"
DOMAIN = "c9d0e4f2-1a2b-4c3d-8e9f-001122334455.7"


@pytest.fixture
def make(api, tmp_path):
    """Adapters on the fake server, each with its own client; all closed at the end."""
    made = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    def build(**kw) -> k8s.KubernetesAdapter:
        kw.setdefault("timeout_s", 10.0)
        adapter = k8s.KubernetesAdapter(kubeconfig=str(kubeconfig), host="agent-test", **kw)
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


def cond(api: FakeKubeApi, node: str) -> dict | None:
    return next((c for c in api.node_obj(node)["status"]["conditions"] if c["type"] == k8s.CONDITION), None)


def our_taint(api: FakeKubeApi, node: str, key: str = k8s.TAINT) -> dict | None:
    return next((t for t in api.node_obj(node)["spec"].get("taints", []) if t["key"] == key), None)


def writes(api: FakeKubeApi) -> list[dict]:
    return [r for r in api.requests if r["method"] in ("PATCH", "PUT", "POST", "DELETE")]


def events(api: FakeKubeApi, reason: str) -> list[dict]:
    return [e for e in api.events if e["reason"] == reason]


def job_pods(api: FakeKubeApi, node: str, n: int = 2) -> None:
    for i in range(n):
        api.add_pod("team-a", f"train-{node}-{i}", node, labels={"app": "train"}, owner="ReplicaSet")


# -- cordon / drain / quarantine / resume ------------------------------------------------------------------------
def test_kubernetes_cordon_sets_unschedulable_our_taint_condition_and_event(api, make):
    api.add_node("gpu-1", labels={CLIQUE: DOMAIN})
    job_pods(api, "gpu-1")
    adapter = make()
    adapter.cordon("gpu-1", REASON)

    node = api.node_obj("gpu-1")
    assert node["spec"]["unschedulable"] is True
    assert our_taint(api, "gpu-1") == {"key": k8s.TAINT, "value": "cordoned", "effect": "NoSchedule"}
    assert node["metadata"]["annotations"][k8s.OURS_UNSCHEDULABLE] == "true"
    c = cond(api, "gpu-1")
    assert (c["status"], c["reason"], c["message"]) == ("False", "Cordoned", REASON)
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready", k8s.CONDITION]  # kubelet's kept
    (event,) = events(api, "GpuwardenCordoned")
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "uid-node-gpu-1"}
    assert (event["type"], event["message"], event["source"]["component"]) == ("Warning", REASON, "gpuwarden")
    assert event["metadata"]["namespace"] == "default"
    assert api.pods_on("gpu-1") == ["team-a/train-gpu-1-0", "team-a/train-gpu-1-1"]  # running work goes on

    v = adapter.node("gpu-1")
    assert (v.service, v.reason, v.ours, v.domain, v.jobs) == (Service.CORDONED, REASON, True, DOMAIN, 2)
    assert v.reason_since is not None
    # the patch went as a JSON merge patch, the condition through nodes/status as a strategic merge patch
    kinds = {(r["path"], r["content_type"]) for r in writes(api) if r["method"] == "PATCH"}
    assert kinds == {("/api/v1/nodes/gpu-1", "application/merge-patch+json"),
                     ("/api/v1/nodes/gpu-1/status", "application/strategic-merge-patch+json")}


CLIQUE = k8s.CLIQUE_LABEL


def test_kubernetes_drain_evicts_through_the_eviction_api_and_leaves_daemonset_and_mirror_pods(api, make):
    api.add_node("gpu-1")
    job_pods(api, "gpu-1")
    api.add_pod("kube-system", "nvidia-dcgm-exporter-x", "gpu-1", owner="DaemonSet")
    api.add_pod("kube-system", "etcd-gpu-1", "gpu-1", mirror=True)
    api.add_pod("team-a", "finished", "gpu-1", phase="Succeeded")
    adapter = make()
    adapter.drain("gpu-1", REASON)

    assert api.pods_on("gpu-1") == ["kube-system/etcd-gpu-1", "kube-system/nvidia-dcgm-exporter-x",
                                    "team-a/finished"]
    evictions = sorted(r["path"] for r in api.requests if r["path"].endswith("/eviction"))
    assert evictions == ["/api/v1/namespaces/team-a/pods/train-gpu-1-0/eviction",
                         "/api/v1/namespaces/team-a/pods/train-gpu-1-1/eviction"]
    assert not [r for r in api.requests if r["method"] == "DELETE"]
    assert our_taint(api, "gpu-1")["value"] == "drained"
    assert cond(api, "gpu-1")["reason"] == "Drained"
    v = adapter.node("gpu-1")
    assert (v.service, v.jobs, v.ours, v.reason) == (Service.DRAINED, 0, True, REASON)
    assert events(api, "GpuwardenDraining") and events(api, "GpuwardenDrained")


def test_kubernetes_drain_waits_for_terminating_pods(api, make):
    api.add_node("gpu-1")
    job_pods(api, "gpu-1", 1)
    api.linger_evictions = True
    adapter = make()
    with pytest.raises(Busy, match="still terminating"):
        adapter.drain("gpu-1", REASON)
    assert our_taint(api, "gpu-1")["value"] == "draining"
    assert adapter.node("gpu-1").service is Service.CORDONED
    api.finish_terminations()
    adapter.drain("gpu-1", REASON)
    assert our_taint(api, "gpu-1")["value"] == "drained"
    assert len([r for r in api.requests if r["path"].endswith("/eviction")]) == 1  # not evicted twice


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_kubernetes_quarantine_drains_then_holds_the_node(api, make, effect):
    api.add_node("gpu-1")
    job_pods(api, "gpu-1")
    adapter = make(quarantine_effect=effect)
    adapter.quarantine("gpu-1", REASON)
    assert api.pods_on("gpu-1") == []
    assert our_taint(api, "gpu-1") == {"key": k8s.TAINT, "value": "quarantined", "effect": effect}
    assert cond(api, "gpu-1")["reason"] == "Quarantined"
    v = adapter.node("gpu-1")
    assert (v.service, v.quarantined, v.ours) == (Service.DRAINED, True, True)
    # a later cordon or drain does not bring it back down the ladder
    adapter.cordon("gpu-1", REASON)
    adapter.drain("gpu-1", REASON)
    assert our_taint(api, "gpu-1")["value"] == "quarantined"


def test_kubernetes_resume_undoes_only_our_marks(api, make):
    other = {"key": "example.com/maintenance", "value": "disk", "effect": "PreferNoSchedule"}
    api.add_node("gpu-1", labels={"team": "a"}, taints=[other], annotations={"owner": "infra"})
    adapter = make()
    adapter.quarantine("gpu-1", REASON)
    adapter.resume("gpu-1")

    node = api.node_obj("gpu-1")
    assert node["spec"].get("taints") == [other]
    assert not node["spec"].get("unschedulable")
    assert node["metadata"]["labels"]["team"] == "a"
    assert node["metadata"]["annotations"] == {"owner": "infra"}
    c = cond(api, "gpu-1")
    assert (c["status"], c["reason"]) == ("True", "InService")
    assert adapter.node("gpu-1").service is Service.IN_SERVICE
    (event,) = events(api, "GpuwardenResume")
    assert event["type"] == "Normal"


def test_kubernetes_an_admin_cordon_is_never_undone(api, make):
    api.add_node("gpu-admin", unschedulable=True)  # kubectl cordon: no taint of ours, no condition of ours
    adapter = make()
    v = adapter.node("gpu-admin")
    assert (v.service, v.ours, v.reason) == (Service.DRAINED, False, None)
    before = api.node_obj("gpu-admin")
    with pytest.raises(Refused, match="not by gpuwarden"):
        adapter.resume("gpu-admin")
    assert api.node_obj("gpu-admin") == before
    with pytest.raises(Refused):
        adapter.return_to_pool("gpu-admin", DOMAIN)
    assert api.node_obj("gpu-admin") == before

    # the admin's cordon came first, ours on top: resume takes ours off and leaves the admin's in place
    adapter.cordon("gpu-admin", REASON)
    assert k8s.OURS_UNSCHEDULABLE not in api.node_obj("gpu-admin")["metadata"].get("annotations", {})
    with pytest.raises(Refused, match="someone else"):
        adapter.resume("gpu-admin")
    node = api.node_obj("gpu-admin")
    assert node["spec"]["unschedulable"] is True and not node["spec"].get("taints")
    with pytest.raises(Refused):
        adapter.resume("gpu-admin")
    assert api.node_obj("gpu-admin")["spec"]["unschedulable"] is True


# -- PodDisruptionBudgets ----------------------------------------------------------------------------------------
def test_kubernetes_pdb_refusal_is_transient_and_no_pod_is_deleted_until_the_budget_allows(api, make):
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        api.add_node(name)
    api.add_pod("db", "db-0", "gpu-1", labels={"app": "db"}, owner="StatefulSet")
    api.add_pod("db", "db-1", "gpu-2", labels={"app": "db"}, owner="StatefulSet")
    api.add_pdb("db", "db-pdb", {"app": "db"}, min_available=2)
    job_pods(api, "gpu-1", 1)
    adapter = make()

    for _ in range(2):  # the engine's retries: each is refused while the budget has no room
        with pytest.raises(Busy, match="PodDisruptionBudget"):
            adapter.drain("gpu-1", REASON)
    assert "db/db-0" in api.pods_on("gpu-1")
    assert api.pdb_status("db", "db-pdb")["disruptionsAllowed"] == 0
    assert [r["code"] for r in api.requests if r["path"].endswith("/db-0/eviction")] == [429, 429]
    assert not [r for r in api.requests if r["method"] == "DELETE"]
    assert our_taint(api, "gpu-1")["value"] == "draining"  # cordoned meanwhile, never past it
    assert adapter.node("gpu-1").service is Service.CORDONED
    assert len(events(api, "GpuwardenDrainBlocked")) == 1  # said once, not at every retry

    # the StatefulSet's third replica comes up elsewhere: the budget has room, the drain finishes
    api.add_pod("db", "db-2", "gpu-3", labels={"app": "db"}, owner="StatefulSet")
    adapter.drain("gpu-1", REASON)
    assert api.pods_on("gpu-1") == []
    assert api.pods_on("gpu-3") == ["db/db-2"]
    assert our_taint(api, "gpu-1")["value"] == "drained"


def test_kubernetes_pdb_max_unavailable_and_two_budgets(api, make):
    api.add_node("gpu-1")
    api.add_pod("web", "w-0", "gpu-1", labels={"app": "web"}, owner="ReplicaSet")
    api.add_pod("web", "w-1", "gpu-1", labels={"app": "web"}, owner="ReplicaSet")
    api.add_pdb("web", "web-pdb", {"app": "web"}, max_unavailable="50%", expected_pods=2)
    adapter = make()
    with pytest.raises(Busy, match="PodDisruptionBudget"):  # one of the two may go, not both
        adapter.drain("gpu-1", REASON)
    assert len(api.pods_on("gpu-1")) == 1

    api.add_node("gpu-2")
    api.add_pod("svc", "s-0", "gpu-2", labels={"app": "svc", "tier": "x"}, owner="ReplicaSet")
    api.add_pdb("svc", "one", {"app": "svc"}, max_unavailable=1)
    api.add_pdb("svc", "two", {"tier": "x"}, max_unavailable=1)
    with pytest.raises(Transient, match="500"):  # the API server does not evict under two budgets
        adapter.drain("gpu-2", REASON)
    assert api.pods_on("gpu-2") == ["svc/s-0"]


# -- conflicts and the spare race --------------------------------------------------------------------------------
def test_kubernetes_a_409_conflict_is_read_again_and_retried(api, make):
    api.add_node("gpu-1")

    def other_writer(node: dict) -> None:
        node["metadata"]["labels"]["example.com/seen"] = "yes"

    api.interfere("gpu-1", other_writer, count=2)
    make().cordon("gpu-1", REASON)
    node = api.node_obj("gpu-1")
    assert node["metadata"]["labels"]["example.com/seen"] == "yes"  # the other writer's change is kept
    assert our_taint(api, "gpu-1")["value"] == "cordoned"
    codes = [r["code"] for r in api.requests if r["path"] == "/api/v1/nodes/gpu-1" and r["method"] == "PATCH"]
    assert codes == [409, 409, 200]


def test_kubernetes_conflicts_past_the_retries_are_transient(api, make):
    api.add_node("gpu-1")
    api.interfere("gpu-1", lambda node: node["metadata"]["labels"].update(x="y"), count=10)
    with pytest.raises(Transient, match="kept changing"):
        make(conflict_retries=2).cordon("gpu-1", REASON)
    assert our_taint(api, "gpu-1") is None


def spare_pool(api: FakeKubeApi, adapter: k8s.KubernetesAdapter, names: list[str]) -> None:
    for name in names:
        api.add_node(name, labels={CLIQUE: DOMAIN})
        adapter.return_to_pool(name, DOMAIN)


@pytest.mark.parametrize("n_spares", [2, 1])
def test_kubernetes_two_agents_racing_take_spare_never_get_the_same_one(api, make, n_spares):
    spare_pool(api, make(), [f"spare-{i}" for i in range(n_spares)])
    a, b = make(), make()
    api.gate_writes(2)  # both have read the same pool before either writes
    got: dict[str, str | None] = {}

    def take(adapter: k8s.KubernetesAdapter, failed: str) -> None:
        got[failed] = adapter.take_spare(DOMAIN, failed)

    threads = [threading.Thread(target=take, args=(a, "gpu-1")), threading.Thread(target=take, args=(b, "gpu-2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(got) == {"gpu-1", "gpu-2"}
    taken = [v for v in got.values() if v is not None]
    assert len(taken) == len(set(taken)) == n_spares
    assert 409 in [r["code"] for r in api.requests if r["method"] == "PATCH"]  # the API server arbitrated
    for failed, spare in got.items():
        if spare is not None:
            node = api.node_obj(spare)
            assert node["metadata"]["annotations"][k8s.TAKEN_FOR] == failed
            assert k8s.SPARE_LABEL not in node["metadata"]["labels"] and not node["spec"].get("unschedulable")
    assert make().spares(DOMAIN) == []


def test_kubernetes_spare_pool_return_take_and_retry(api, make):
    adapter = make()
    api.add_node("gpu-1", labels={CLIQUE: DOMAIN})
    api.add_node("gpu-other", labels={CLIQUE: "other.1"})
    spare_pool(api, adapter, ["spare-b", "spare-a"])
    adapter.return_to_pool("gpu-other", "other.1")
    assert adapter.spares(DOMAIN) == ["spare-a", "spare-b"]
    v = adapter.node("spare-a")
    assert (v.spare, v.ours, v.reason, v.domain, v.service) == (True, True, SPARE_REASON, DOMAIN, Service.DRAINED)
    assert our_taint(api, "spare-a", k8s.SPARE_TAINT) == {"key": k8s.SPARE_TAINT, "value": "true",
                                                          "effect": "NoSchedule"}
    assert (cond(api, "spare-a")["status"], cond(api, "spare-a")["reason"]) == ("True", "Spare")

    assert adapter.take_spare(DOMAIN, "gpu-1") == "spare-a"
    n = len(writes(api))
    assert adapter.take_spare(DOMAIN, "gpu-1") == "spare-a"  # a retried intent: the same spare, nothing written
    assert len(writes(api)) == n
    assert adapter.spares(DOMAIN) == ["spare-b"]
    assert adapter.node("spare-a").service is Service.IN_SERVICE
    assert events(api, "GpuwardenSpareTaken")

    adapter.quarantine("gpu-1", REASON)  # repaired later, it goes back to the pool
    adapter.return_to_pool("gpu-1", DOMAIN)
    assert our_taint(api, "gpu-1") is None
    assert adapter.spares(DOMAIN) == ["gpu-1", "spare-b"]
    assert adapter.take_spare(DOMAIN, "gpu-9") == "gpu-1"
    assert adapter.take_spare(DOMAIN, "gpu-10") == "spare-b"
    assert adapter.take_spare(DOMAIN, "gpu-11") is None

    # a spare that goes bad leaves the pool
    adapter.return_to_pool("spare-b", DOMAIN)
    adapter.cordon("spare-b", REASON)
    assert adapter.spares(DOMAIN) == []
    assert k8s.SPARE_LABEL not in api.node_obj("spare-b")["metadata"]["labels"]


def test_kubernetes_a_spare_without_domain_labels_is_still_found_again_once_taken(api, make):
    api.add_node("spare-x")  # no clique label: the pool's domain becomes its domain
    adapter = make()
    adapter.return_to_pool("spare-x", DOMAIN)
    assert adapter.node("spare-x").domain == DOMAIN
    assert adapter.take_spare(DOMAIN, "gpu-1") == "spare-x"
    assert adapter.take_spare(DOMAIN, "gpu-1") == "spare-x"


def test_kubernetes_domain_from_the_clique_label_and_publish_domain(api, make):
    api.add_node("gpu-gfd", labels={CLIQUE: DOMAIN})
    api.add_node("gpu-bare")
    adapter = make()
    assert {v.name: v.domain for v in adapter.nodes()} == {"gpu-gfd": DOMAIN, "gpu-bare": None}
    adapter.publish_domain("gpu-bare", "rack-7.0")  # a domain from config: gpuwarden's labels only
    assert CLIQUE not in api.node_obj("gpu-bare")["metadata"]["labels"]
    assert api.node_obj("gpu-bare")["metadata"]["labels"][DOMAIN_LABEL] == "rack-7.0"
    api.add_node("gpu-nogfd")
    adapter.publish_domain("gpu-nogfd", DOMAIN)  # read from NVML, no GPU feature discovery: its label too
    assert api.node_obj("gpu-nogfd")["metadata"]["labels"][CLIQUE] == DOMAIN
    adapter.publish_domain("gpu-gfd", "rack-8.0")  # GPU feature discovery's label stays its own
    assert api.node_obj("gpu-gfd")["metadata"]["labels"][CLIQUE] == DOMAIN
    assert api.node_obj("gpu-gfd")["metadata"]["labels"][DOMAIN_LABEL] == "rack-8.0"
    assert adapter.node("gpu-bare").domain == "rack-7.0"
    with pytest.raises(Refused, match="label value"):
        adapter.publish_domain("gpu-bare", "not a label/value")


def test_kubernetes_not_ready_is_down(api, make):
    api.add_node("gpu-lost", ready=False)
    assert make().node("gpu-lost").service is Service.DOWN


def test_kubernetes_lists_are_read_page_by_page(api, make, monkeypatch):
    monkeypatch.setattr(kubernetes_api, "LIST_PAGE", 2)
    for i in range(5):
        api.add_node(f"gpu-{i}")
    assert [v.name for v in make().nodes()] == [f"gpu-{i}" for i in range(5)]
    pages = [r["query"] for r in api.requests if r["path"] == "/api/v1/nodes"]
    assert [q.get("continue") for q in pages] == [None, "2", "4"]


# -- the condition ------------------------------------------------------------------------------------------------
def test_kubernetes_condition_transition_time_moves_only_when_its_status_does(api, make):
    api.add_node("gpu-1")
    adapter = make()
    adapter.resume("gpu-1")  # in service already: a no-op, nothing written
    assert cond(api, "gpu-1") is None and not writes(api)

    old = "2020-01-01T00:00:00Z"
    api.nodes["gpu-1"]["status"]["conditions"].append(
        {"type": k8s.CONDITION, "status": "True", "reason": "InService", "message": "gpuwarden: in service",
         "lastHeartbeatTime": old, "lastTransitionTime": old})
    adapter.cordon("gpu-1", REASON)
    moved = cond(api, "gpu-1")["lastTransitionTime"]
    assert moved != old

    earlier = "2021-06-01T00:00:00Z"  # as if the cordon had been a while ago
    api.nodes["gpu-1"]["status"]["conditions"][-1]["lastTransitionTime"] = earlier
    adapter.drain("gpu-1", REASON)
    c = cond(api, "gpu-1")
    assert (c["status"], c["reason"], c["lastTransitionTime"]) == ("False", "Drained", earlier)
    assert adapter.node("gpu-1").reason_since == 1622505600.0  # our drain began then
    adapter.resume("gpu-1")
    c = cond(api, "gpu-1")
    assert c["status"] == "True" and c["lastTransitionTime"] != earlier


# -- idempotency ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["cordon", "drain", "quarantine", "resume", "publish_domain", "return_to_pool",
                                  "take_spare"])
def test_kubernetes_every_call_is_idempotent(api, make, call):
    api.add_node("gpu-1", labels={CLIQUE: DOMAIN})
    job_pods(api, "gpu-1")
    adapter = make()
    if call == "resume":
        adapter.quarantine("gpu-1", REASON)
    if call == "take_spare":
        spare_pool(api, adapter, ["spare-1"])
    act = {"cordon": lambda: adapter.cordon("gpu-1", REASON), "drain": lambda: adapter.drain("gpu-1", REASON),
           "quarantine": lambda: adapter.quarantine("gpu-1", REASON), "resume": lambda: adapter.resume("gpu-1"),
           "publish_domain": lambda: adapter.publish_domain("gpu-1", DOMAIN),
           "return_to_pool": lambda: adapter.return_to_pool("gpu-1", DOMAIN),
           "take_spare": lambda: adapter.take_spare(DOMAIN, "gpu-1")}[call]
    first = act()
    state, n_events, n_writes = api.node_obj("gpu-1"), len(api.events), len(writes(api))
    assert act() == first
    assert api.node_obj("gpu-1") == state
    assert (len(api.events), len(writes(api))) == (n_events, n_writes)  # the repeat wrote nothing


# -- the API server failing ----------------------------------------------------------------------------------------
def test_kubernetes_a_hanging_api_server_is_transient_within_the_timeout(api, make):
    api.add_node("gpu-1")
    adapter = make(timeout_s=1.0)
    api.hang()
    with pytest.raises(Transient, match="no answer|time ran out"):
        adapter.cordon("gpu-1", REASON)
    with pytest.raises(Transient):
        adapter.nodes()
    api.unhang()
    adapter.cordon("gpu-1", REASON)  # once it answers again, the call goes through
    assert our_taint(api, "gpu-1")["value"] == "cordoned"


def test_kubernetes_a_crawling_api_server_is_transient_within_the_timeout(api, make):
    api.add_node("gpu-1")
    adapter = make(timeout_s=1.0)
    api.trickle_s = 0.05  # every byte comes in time for a read timeout, the whole answer never in time
    with pytest.raises(Transient, match="time ran out"):
        adapter.node("gpu-1")
    api.trickle_s = 0.0
    assert adapter.node("gpu-1").name == "gpu-1"


@pytest.mark.parametrize("code", [500, 503, 429])
def test_kubernetes_server_errors_are_transient(api, make, code):
    api.add_node("gpu-1")
    adapter = make()
    api.fail(code)
    with pytest.raises(Transient, match=str(code)) as err:
        adapter.cordon("gpu-1", REASON)
    assert not isinstance(err.value, Busy)  # an API server in trouble is not one that asks to come back later
    adapter.cordon("gpu-1", REASON)
    assert our_taint(api, "gpu-1") is not None


def test_kubernetes_no_api_server_is_transient(api, make):
    adapter = make(timeout_s=2.0)
    api.stop()
    with pytest.raises(Transient, match="could not reach"):
        adapter.nodes()


@pytest.mark.parametrize("code", [400, 401, 403, 404, 422])
def test_kubernetes_refusals_are_refused(api, make, code):
    api.add_node("gpu-1")
    adapter = make()
    api.fail(code)
    with pytest.raises(Refused, match=str(code)):
        adapter.cordon("gpu-1", REASON)


def test_kubernetes_unknown_node_and_rbac_refusals(api, make):
    api.add_node("gpu-1")
    adapter = make()
    with pytest.raises(Refused, match="404"):
        adapter.node("gpu-missing")
    with pytest.raises(Refused, match="404"):
        adapter.cordon("gpu-missing", REASON)
    with pytest.raises(Refused, match="not a Kubernetes node name"):
        adapter.cordon("../../namespaces/x", REASON)
    with pytest.raises(Refused, match="starts with"):
        adapter.cordon("gpu-1", "xid 79")
    api.forbidden.add(("create", "pods/eviction"))
    job_pods(api, "gpu-1", 1)
    with pytest.raises(Refused, match="403"):
        adapter.drain("gpu-1", REASON)
    assert api.pods_on("gpu-1") == ["team-a/train-gpu-1-0"]
    api.forbidden.add(("create", "events"))  # events are best effort: the cordon itself stands
    adapter.resume("gpu-1")
    assert our_taint(api, "gpu-1") is None


# -- without the client ----------------------------------------------------------------------------------------------
def test_kubernetes_adapter_without_the_client_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['lightkube'] = None\n"  # as if it were not installed
        "import gpuwarden.agent.cli.main, gpuwarden.agent.act.adapters.kubernetes as k\n"
        "try:\n"
        "    k.KubernetesAdapter(timeout_s=1)\n"
        "except ImportError as e:\n"
        "    assert isinstance(e, k.Refused)\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "pip install 'gpuwarden[kubernetes]'" in out.stdout
    plain = subprocess.run([sys.executable, "-c", "import sys, gpuwarden.agent.cli.main, gpuwarden.agent.daemon.loop; "
                            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightkube', 'httpx2')))"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "[]"


# -- the fake server's own semantics (what the adapter's tests rest on) -------------------------------------------
def test_kubernetes_fake_api_patch_semantics():
    from fake_kube_api import ApiStatus, json_patch, merge_patch, strategic_merge_patch

    node = {"metadata": {"labels": {"a": "1", "b": "2"}},
            "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Old", "status": "False"}]}}
    out = strategic_merge_patch(node, {"metadata": {"labels": {"a": None, "c": "3"}},
                                       "spec": {"taints": [{"key": "y", "effect": "NoExecute"}]},
                                       "status": {"conditions": [{"type": "Ready", "status": "False"},
                                                                 {"type": "Old", "$patch": "delete"},
                                                                 {"type": "New", "status": "True"}]}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["taints"] == [{"key": "y", "effect": "NoExecute"}]  # no merge key: replaced
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "False"}, {"type": "New", "status": "True"}]
    merged = merge_patch(node, {"status": {"conditions": [{"type": "Only", "status": "True"}]}})
    assert merged["status"]["conditions"] == [{"type": "Only", "status": "True"}]  # RFC 7386: lists replace
    patched = json_patch(node, [{"op": "test", "path": "/metadata/labels/a", "value": "1"},
                                {"op": "add", "path": "/spec/taints/-", "value": {"key": "z", "effect": "NoSchedule"}},
                                {"op": "remove", "path": "/metadata/labels/b"}])
    assert [t["key"] for t in patched["spec"]["taints"]] == ["x", "z"] and patched["metadata"]["labels"] == {"a": "1"}
    with pytest.raises(ApiStatus):
        json_patch(node, [{"op": "test", "path": "/metadata/labels/a", "value": "2"}])


def test_kubernetes_fake_api_json_patch_and_put_with_resource_version(api):
    import json
    import urllib.error
    import urllib.request

    api.add_node("gpu-1")

    def send(method: str, path: str, body: object, ctype: str) -> tuple[int, dict]:
        req = urllib.request.Request(api.url + path, data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": ctype, "Authorization": "Bearer fake-token"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    code, node = send("PATCH", "/api/v1/nodes/gpu-1", [{"op": "add", "path": "/spec/unschedulable", "value": True}],
                      "application/json-patch+json")
    assert code == 200 and node["spec"]["unschedulable"] is True
    stale = dict(node, metadata=dict(node["metadata"], resourceVersion="1"))
    code, status = send("PUT", "/api/v1/nodes/gpu-1", stale, "application/json")
    assert (code, status["reason"]) == (409, "Conflict")
    code, _ = send("PUT", "/api/v1/nodes/gpu-1", node, "application/json")
    assert code == 200
    code, status = send("PATCH", "/api/v1/nodes/gpu-1", {}, "application/apply-patch+yaml")
    assert code == 415
    code, status = send("PATCH", "/api/v1/nodes/nope", {}, "application/merge-patch+json")
    assert (code, status["reason"]) == (404, "NotFound")
    code, status = send("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [{"key": "k", "effect": "Bad"}]}},
                        "application/merge-patch+json")
    assert code == 422


def rbac_of(request: dict) -> tuple[str, str]:
    """(verb, resource) as the API server's authorizer sees a request."""
    parts = request["path"].strip("/").split("/")[2:]  # after api/v1
    if parts[0] == "namespaces":
        parts = parts[2:]
    resource = "/".join(parts[::2][:1] + parts[2:3])  # nodes, nodes/status, pods/eviction, events
    verb = {"GET": "get" if len(parts) > 1 else "list", "PATCH": "patch", "POST": "create", "PUT": "update",
            "DELETE": "delete"}[request["method"]]
    return verb, resource


def test_shipped_rbac_grants_what_the_adapter_asks_for(api, make):
    import yaml
    from gpuwarden.agent.core.job import JobRef

    # the roles of packaging/kubernetes/ (tests/test_k8s_manifests.py checks scopes)
    docs = yaml.safe_load_all((ROOT / "packaging" / "kubernetes" / "10-rbac.yaml").read_text())
    granted = {(verb, res) for d in docs if d["kind"] in ("ClusterRole", "Role") for rule in d["rules"]
               for res in rule["resources"] for verb in rule["verbs"]}

    api.add_node("gpu-1", labels={CLIQUE: DOMAIN})
    job_pods(api, "gpu-1")
    adapter = make()
    spare_pool(api, adapter, ["spare-1"])
    adapter.nodes()
    adapter.node("gpu-1")
    adapter.publish_domain("gpu-1", DOMAIN)
    doomed = JobRef("kubernetes", api.add_pod("team-a", "gang-0", "gpu-1", owner="Job", gpus=4)["metadata"]["uid"])
    adapter.job(doomed)
    adapter.mark_job(doomed, REASON)  # agent/jobs/respond.py: the reason, then the pod deleted
    adapter.requeue_job(doomed)
    api.finish_terminations()
    adapter.quarantine("gpu-1", REASON)
    adapter.take_spare(DOMAIN, "gpu-1")
    adapter.spares(DOMAIN)
    adapter.resume("gpu-1")
    used = {rbac_of(r) for r in api.requests}
    assert used == granted  # all it needs, and nothing more

"""The job response on Kubernetes: agent/jobs/respond.py's `carry_out` through the real Kubernetes adapter against the
fake API server (tests/fake_kube_api.py). A doomed job is the pod whose UID its processes' cgroup names; each policy
is read back from the server's objects and request log: the condition GpuwardenJobDoomed and the Event on the pod, the
pod deleted with its own grace period (signal, requeue) or at once (cancel), never evicted (a PodDisruptionBudget over
a gang would refuse it), and every request allowed by packaging/kubernetes' RBAC. Last, the remediation engine
carrying a job intent after its own cordon and quarantine."""
from __future__ import annotations

import time

import pytest
from fake_kube_api import FakeKubeApi
from gpuwarden.agent.act.adapters import kubernetes as k8s
from gpuwarden.agent.act.adapters import kubernetes_pods
from gpuwarden.agent.act.adapters.kubernetes_objects import JOB_CONDITION
from gpuwarden.agent.act.remediation import Engine, Hooks, Settings
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.core.scheduler import Refused, Transient
from gpuwarden.agent.jobs.respond import carry_out

REASON = "xid 79 GPU2 0018:01:00.0 (its GPU 2)"


@pytest.fixture
def make(api, tmp_path):
    """Adapters on the fake server, speaking for node n1 unless told otherwise; all closed at the end."""
    made = []
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    def build(**kw) -> k8s.KubernetesAdapter:
        kw.setdefault("timeout_s", 10.0)
        kw.setdefault("node_name", "n1")
        adapter = k8s.KubernetesAdapter(kubeconfig=str(kubeconfig), host="agent-test", **kw)
        made.append(adapter)
        return adapter

    yield build
    for adapter in made:
        adapter.close()


def gang(api: FakeKubeApi, n: int = 2, grace_s: int = 120) -> list[dict]:
    """A gang-scheduled training job: worker i on node n<i+1>, four GPUs each, made by a Job."""
    for i in range(1, n + 1):
        api.add_node(f"n{i}")
    return [api.add_pod("team-a", f"train-worker-{i}", f"n{i + 1}", labels={"job": "train"}, owner="Job", gpus=4,
                        grace_s=grace_s) for i in range(n)]


def detail(pod: dict, policy: str, **kw) -> dict:
    return {"job": {"scheduler": "kubernetes", "id": pod["metadata"]["uid"], "run": None, "source": "cgroup"},
            "policy": policy, "signal": "USR1", "signal_before_s": 0.0, "reason": REASON, **kw}


def ref(pod: dict) -> JobRef:
    return JobRef("kubernetes", pod["metadata"]["uid"], None, "cgroup")


def condition(pod: dict | None) -> dict | None:
    return next((c for c in ((pod or {}).get("status") or {}).get("conditions", [])
                 if c["type"] == JOB_CONDITION), None)


def pod_events(api: FakeKubeApi, name: str) -> list[dict]:
    return [e for e in api.events if e["involvedObject"]["kind"] == "Pod" and e["involvedObject"]["name"] == name]


def writes(api: FakeKubeApi) -> list[dict]:
    return [r for r in api.requests if r["method"] in ("PATCH", "PUT", "POST", "DELETE")]


def deletes(api: FakeKubeApi) -> list[dict]:
    return [r for r in api.requests if r["method"] == "DELETE"]


# -- the pod, found by its UID ----------------------------------------------------------------------------------
def test_job_kubernetes_the_pod_is_found_by_its_uid_among_the_nodes_pods(api, make):
    worker, other = gang(api)
    adapter = make()
    view = adapter.job(ref(worker))
    assert (view.id, view.state, view.nodes, view.run, view.requeueable, view.mark) == (
        "team-a/train-worker-0", "running", ("n1",), None, None, None)
    # the API server has no field selector on metadata.uid: the node's pods are listed and the UID matched
    (listed,) = [r for r in api.requests if r["path"] == "/api/v1/pods"]
    assert listed["query"]["fieldSelector"] == "spec.nodeName=n1"
    assert adapter.job(ref(other)) is None  # a UID not on this node's pods: not this node's job (a pod never moves)
    assert adapter.job(JobRef("kubernetes", "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b")) is None


def test_job_kubernetes_without_a_node_name_the_whole_cluster_is_searched_page_by_page(api, make, monkeypatch):
    pods = gang(api, n=3)
    monkeypatch.setattr(kubernetes_pods, "LIST_PAGE", 2)
    adapter = make(node_name=None)
    assert adapter.job(ref(pods[2])).nodes == ("n3",)
    listed = [r for r in api.requests if r["path"] == "/api/v1/pods"]
    assert len(listed) == 2 and all("fieldSelector" not in r["query"] for r in listed)


def test_job_kubernetes_the_api_server_refuses_a_uid_field_selector(api):
    """Why the adapter lists: kube-apiserver answers 400 to fieldSelector=metadata.uid for pods (so does the fake)."""
    import json
    import urllib.error
    import urllib.request

    from fake_kube_api import TOKEN

    req = urllib.request.Request(f"{api.url}/api/v1/pods?fieldSelector=metadata.uid%3Dx",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "metadata.uid" in json.loads(err.value.read())["message"]


@pytest.mark.parametrize(("phase", "deleting", "state"), [
    ("Running", False, "running"), ("Running", True, "ending"), ("Pending", False, "pending"),
    ("Pending", True, "ending"), ("Succeeded", False, "ended"), ("Failed", True, "ended"),
    ("Unknown", False, "unknown")])
def test_job_kubernetes_state_from_the_pods_phase(api, make, phase, deleting, state):
    api.add_node("n1")
    pod = api.add_pod("team-a", "p", "n1", phase=phase, gpus=1)
    if deleting:
        api.pods[("team-a", "p")]["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert make().job(ref(pod)).state == state


def test_job_kubernetes_refuses_what_is_not_a_pod_uid_or_not_our_reason(api, make):
    (worker,) = gang(api, n=1)
    adapter = make()
    for bad in (JobRef("slurm", "4242", 0), JobRef("kubernetes", "not-a-uid"), JobRef("kubernetes", "X" * 36)):
        with pytest.raises(Refused, match="not a Kubernetes pod UID"):
            adapter.job(bad)
    with pytest.raises(Refused, match="starts with 'gpuwarden:'"):
        adapter.mark_job(ref(worker), "doomed")
    assert not writes(api)


# -- each policy --------------------------------------------------------------------------------------------------
def test_job_kubernetes_notify_writes_the_condition_and_an_event_and_the_pod_stays(api, make):
    worker, _ = gang(api)
    outcome = carry_out(make(), detail(worker, "notify"), "n1", time.time())
    assert outcome == f"done: notified: the reason is on pod {worker['metadata']['uid']}"
    pod = api.pod_obj("team-a", "train-worker-0")
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")
    c = condition(pod)
    assert (c["status"], c["reason"], c["message"]) == ("True", JOB_CONDITION,
                                                        f"gpuwarden: doomed, notified on n1: {REASON}")
    assert c["lastTransitionTime"]
    assert [x["type"] for x in pod["status"]["conditions"]] == ["Ready", JOB_CONDITION]  # the kubelet's kept
    (event,) = pod_events(api, "train-worker-0")
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train-worker-0",
                                       "namespace": "team-a", "uid": worker["metadata"]["uid"]}
    assert (event["metadata"]["namespace"], event["type"], event["reason"], event["message"]) == (
        "team-a", "Warning", JOB_CONDITION, c["message"])
    (patch,) = [r for r in writes(api) if r["method"] == "PATCH"]
    assert (patch["path"], patch["content_type"]) == ("/api/v1/namespaces/team-a/pods/train-worker-0/status",
                                                      "application/strategic-merge-patch+json")
    assert not deletes(api)
    assert make().job(ref(worker)).mark == c["message"]


@pytest.mark.parametrize("policy", ["signal", "requeue"])
def test_job_kubernetes_signal_and_requeue_delete_the_pod_with_its_own_grace_period(api, make, policy):
    worker, other = gang(api, grace_s=120)
    adapter = make()
    outcome = carry_out(adapter, detail(worker, policy), "n1", time.time())
    label = f"pod {worker['metadata']['uid']}"
    assert outcome == {"signal": f"done: signalled {label} with USR1", "requeue": f"done: requeued {label}"}[policy]
    (delete,) = deletes(api)
    assert delete["path"] == "/api/v1/namespaces/team-a/pods/train-worker-0"
    assert "gracePeriodSeconds" not in delete["query"]  # the pod's own terminationGracePeriodSeconds
    pod = api.pod_obj("team-a", "train-worker-0")
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 120
    verb = {"signal": "signalled USR1", "requeue": "requeued"}[policy]
    assert condition(pod)["message"] == f"gpuwarden: {verb} on n1: {REASON}"
    assert len(pod_events(api, "train-worker-0")) == 1
    assert adapter.job(ref(worker)).state == "ending"
    assert api.pod_obj("team-a", "train-worker-1") == other  # the other node's worker is its own agent's business
    assert not [r for r in api.requests if r["path"].endswith("/eviction")]
    api.finish_terminations()  # the kubelet ended it within its grace period
    assert adapter.job(ref(worker)) is None


def test_job_kubernetes_cancel_deletes_the_pod_at_once(api, make):
    worker, _ = gang(api)
    outcome = carry_out(make(), detail(worker, "cancel"), "n1", time.time())
    assert outcome == f"done: cancelled pod {worker['metadata']['uid']}"
    (delete,) = deletes(api)
    assert delete["query"]["gracePeriodSeconds"] == "0"
    assert api.pod_obj("team-a", "train-worker-0") is None
    (event,) = pod_events(api, "train-worker-0")  # the reason went first, while the pod was there
    assert event["message"] == f"gpuwarden: cancelled on n1: {REASON}"
    assert [r["method"] for r in writes(api)] == ["PATCH", "POST", "DELETE"]


def test_job_kubernetes_a_budget_with_min_available_all_does_not_hold_it(api, make):
    worker, _ = gang(api)
    api.add_pdb("team-a", "train", {"job": "train"}, min_available=2)
    assert api.pdb_status("team-a", "train")["disruptionsAllowed"] == 0  # an eviction would be refused (429)
    carry_out(make(), detail(worker, "requeue"), "n1", time.time())
    assert api.pod_obj("team-a", "train-worker-0")["metadata"]["deletionTimestamp"]
    assert not [r for r in api.requests if r["path"].endswith("/eviction")]
    assert all(r["code"] in (200, 201) for r in api.requests)


# -- idempotent -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["notify", "signal", "requeue", "cancel"])
def test_job_kubernetes_a_second_intent_is_already_so(api, make, policy):
    worker, _ = gang(api)
    adapter = make()
    carry_out(adapter, detail(worker, policy), "n1", time.time())
    before = len(writes(api))
    # this agent after a restart, or another node's agent that saw the same fabric fault
    again = carry_out(make(), detail(worker, policy), "n1", time.time())
    assert again.startswith("already so at the scheduler (")
    assert {"notify": "already has gpuwarden's answer", "signal": "is ending", "requeue": "is ending",
            "cancel": "is no longer known"}[policy] in again
    assert len(writes(api)) == before


def test_job_kubernetes_a_pod_that_is_gone_is_already_so(api, make):
    worker, _ = gang(api)
    api.pods.pop(("team-a", "train-worker-0"))  # ended and removed before the intent's turn
    adapter = make()
    outcome = carry_out(adapter, detail(worker, "cancel"), "n1", time.time())
    assert outcome == f"already so at the scheduler (pod {worker['metadata']['uid']} is no longer known to the " \
                      "scheduler)"
    for call in (adapter.requeue_job, adapter.cancel_job, lambda r: adapter.signal_job(r, "USR1"),
                 lambda r: adapter.mark_job(r, "gpuwarden: x")):
        call(ref(worker))  # each a no-op that succeeds
    assert not writes(api)


def test_job_kubernetes_a_pod_gone_between_the_lookup_and_the_delete_is_done(api, make):
    worker, _ = gang(api)

    def kubelet_was_quicker(a: dict) -> bool:
        if a["verb"] == "delete":
            with api.lock:
                api.pods.pop(("team-a", "train-worker-0"), None)
        return True

    api.authorizer = kubelet_was_quicker
    make().cancel_job(ref(worker))
    assert [r["code"] for r in deletes(api)] == [404]


def test_job_kubernetes_a_same_named_pod_made_since_is_never_marked(api, make):
    """The status patch carries the UID: a StatefulSet's new pod of the same name, made between the lookup and the
    patch, is refused as another object (422), and the mark goes nowhere."""
    worker, _ = gang(api)

    def replaced_meanwhile(a: dict) -> bool:
        if a["subresource"] == "status" and a["name"] == "train-worker-0" and not replaced:
            replaced.append(api.add_pod("team-a", "train-worker-0", "n2", labels={"job": "train"}, owner="Job"))
        return True

    replaced: list[dict] = []
    api.authorizer = replaced_meanwhile
    make().mark_job(ref(worker), f"gpuwarden: requeued on n1: {REASON}")
    new = api.pod_obj("team-a", "train-worker-0")
    assert new["metadata"]["uid"] == replaced[0]["metadata"]["uid"] != worker["metadata"]["uid"]
    assert condition(new) is None and not pod_events(api, "train-worker-0")
    assert [r["code"] for r in api.requests if r["method"] == "PATCH"] == [422]


def test_job_kubernetes_the_mark_is_written_once_and_keeps_its_transition_time(api, make):
    worker, _ = gang(api)
    adapter = make()
    first = "gpuwarden: signalled USR1, requeue in 30 s on n1: xid 79"
    adapter.mark_job(ref(worker), first)
    adapter.mark_job(ref(worker), first)
    assert len([r for r in writes(api) if r["method"] == "PATCH"]) == 1 and len(pod_events(api, "train-worker-0")) == 1
    since = condition(api.pod_obj("team-a", "train-worker-0"))["lastTransitionTime"]
    api.pods[("team-a", "train-worker-0")]["status"]["conditions"][-1]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    adapter.mark_job(ref(worker), "gpuwarden: requeued 30 s after USR1 on n1: xid 79")
    c = condition(api.pod_obj("team-a", "train-worker-0"))
    assert c["message"].startswith("gpuwarden: requeued") and c["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    assert since and len(pod_events(api, "train-worker-0")) == 2


def test_job_kubernetes_errors_are_typed(api, make):
    worker, _ = gang(api)
    adapter = make()
    api.forbidden = {("delete", "pods")}
    with pytest.raises(Refused, match="403"):
        adapter.requeue_job(ref(worker))
    api.forbidden = set()
    api.fail(503)
    with pytest.raises(Transient):
        adapter.job(ref(worker))
    api.forbidden = {("create", "events")}  # the Event is best effort: the condition is the mark read back
    adapter.mark_job(ref(worker), f"gpuwarden: doomed on n1: {REASON}")
    assert condition(api.pod_obj("team-a", "train-worker-0"))
    assert api.pod_obj("team-a", "train-worker-0")["metadata"].get("deletionTimestamp") is None


# -- RBAC --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("node_name", ["n1", None])
def test_job_kubernetes_the_shipped_rbac_allows_every_request_of_every_policy(api, make, node_name):
    from fake_kube_api import request_attributes
    from test_k8s_manifests import authorizer, grants_for, load_all, service_account

    manifests = load_all()
    allowed = authorizer(grants_for(manifests, *service_account(manifests)))
    api.authorizer = allowed
    api.add_node("n1")
    api.add_node("n2")
    adapter = make(node_name=node_name)
    for policy in ("notify", "signal", "requeue", "cancel"):
        pod = api.add_pod(f"team-{policy}", "worker-0", "n1", owner="Job", gpus=8)
        assert carry_out(adapter, detail(pod, policy), "n1", time.time()).startswith("done: ")
    assert api.requests and all(r["code"] != 403 for r in api.requests)
    assert all(allowed(request_attributes(r["method"], r["path"], r["query"])) for r in api.requests)
    # a pod's Events in its own namespace, whichever it is
    assert {e["metadata"]["namespace"] for e in api.events} == {f"team-{p}" for p in ("notify", "signal", "requeue",
                                                                                       "cancel")}


# -- through the remediation engine ------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def engine(adapter: k8s.KubernetesAdapter, clock: Clock, done: list) -> Engine:
    settings = Settings(mode="act", adapter="kubernetes", node_name="n1", retry_min_s=1.0, retry_max_s=4.0,
                        breaker={"cluster_share": 1.0, "domain_share": 1.0})
    hooks = Hooks(done=lambda key, at, outcome: done.append((key, outcome)), set_meta=lambda key, value: None)
    return Engine(adapter, settings, hooks, clock=clock)


def run(e: Engine, clock: Clock, until, turns: int = 40) -> None:
    for _ in range(turns):
        if until():
            return
        wait = e.step()
        clock.t += min(wait, 60.0)
    raise AssertionError(f"not done after {turns} turns: {e.pending()}")


def intent(action: str, at: float) -> tuple[str, str, dict]:
    return f"{at:.6f}:healthy->quarantined:{action}", action, {"at": at, "to": "quarantined", "reason": REASON}


def test_job_kubernetes_the_engine_requeues_the_job_after_its_own_cordon_and_then_quarantines(api, make):
    """As the daemon queues them for XID 79: the cordon, the doomed job, the quarantine. The job's pod is deleted past
    its gang's budget, and the quarantine's drain then waits for it to terminate."""
    worker, _ = gang(api)
    api.add_pod("kube-system", "nvidia-dcgm-exporter-n1", "n1", owner="DaemonSet")
    api.add_pdb("team-a", "train", {"job": "train"}, min_available=2)
    clock, done = Clock(), []
    e = engine(make(), clock, done)
    job_key = f"job:kubernetes:{worker['metadata']['uid']}:xid:xid:79:gpu-2:boot"
    e.enqueue([intent("cordon", clock.t), (job_key, "job", detail(worker, "requeue")), intent("quarantine", clock.t)])
    run(e, clock, until=lambda: len(done) == 2)
    assert done[0][1] == "done"
    assert done[1] == (job_key, f"done: requeued pod {worker['metadata']['uid']}")
    assert api.node_obj("n1")["spec"]["unschedulable"] is True  # cordoned before the job was ended
    pod = api.pod_obj("team-a", "train-worker-0")
    assert pod["metadata"]["deletionTimestamp"] and condition(pod)["message"] == f"gpuwarden: requeued on n1: {REASON}"
    assert not [r for r in api.requests if r["path"].endswith("/eviction")]
    api.finish_terminations()
    run(e, clock, until=lambda: len(done) == 3)
    assert done[2][1] == "done" and api.pods_on("n1") == ["kube-system/nvidia-dcgm-exporter-n1"]
    assert k8s.view(api.node_obj("n1")).quarantined


def test_job_kubernetes_the_engine_finds_a_pod_its_quarantine_evicted_already_so(api, make):
    """A job intent behind the quarantine: the drain's eviction has ended the pod already, and the job intent says so
    rather than act again."""
    worker, _ = gang(api)
    clock, done = Clock(), []
    e = engine(make(), clock, done)
    job_key = f"job:kubernetes:{worker['metadata']['uid']}:xid:xid:79:gpu-2:boot"
    e.enqueue([intent("cordon", clock.t), intent("quarantine", clock.t), (job_key, "job", detail(worker, "cancel"))])
    run(e, clock, until=lambda: len(done) == 3)
    assert [o for _, o in done[:2]] == ["done", "done"]
    assert done[2] == (job_key, f"already so at the scheduler (pod {worker['metadata']['uid']} is no longer known to "
                                "the scheduler)")
    assert not deletes(api)


def test_job_kubernetes_the_engine_ends_no_job_on_a_node_still_in_service(api, make):
    worker, _ = gang(api)
    clock, done = Clock(), []
    e = engine(make(), clock, done)
    job_key = f"job:kubernetes:{worker['metadata']['uid']}:xid:xid:79:gpu-2:boot"
    e.enqueue([(job_key, "job", detail(worker, "requeue"))])
    run(e, clock, until=lambda: len(done) == 1)
    assert done[0][1].startswith("refused: n1 is in service at the scheduler")
    assert api.pod_obj("team-a", "train-worker-0") == worker and not writes(api)

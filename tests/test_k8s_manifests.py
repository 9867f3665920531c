"""The Kubernetes manifests (packaging/kubernetes/) and the container image (packaging/container/) hold together with
the code they deploy:
- every manifest parses, names a current apiVersion and kind, and has no field the API's schema lacks (a round trip
  through lightkube's models, generated from Kubernetes' OpenAPI);
- the RBAC rules are exactly what the Kubernetes adapter uses: the real adapter runs every operation the
  remediation engine performs against the fake API server, which authorizes each request by the manifests' rules
  (the attributes derived from method and path as kube-apiserver does); every request is allowed and every rule is
  used;
- the DaemonSet's args parse with the real command-line parser, the ConfigMap loads with the real config loader and
  builds the real adapter, the entrypoint adds the downward API's node name, the tolerations cover the taints the
  adapter really writes, the probes and monitors reach the port the agent listens on.
Nothing here runs a real kube-apiserver, kubelet or image build.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, end_processes, wait_for
from fake_kube_api import FakeKubeApi, request_attributes

pytest.importorskip("lightkube")

from gpuwarden.agent.act.adapters import build as build_adapter  # noqa: E402
from gpuwarden.agent.act.adapters import kubernetes as k8s  # noqa: E402
from gpuwarden.agent.cli import main as cli
from gpuwarden.agent.core import config  # noqa: E402
from gpuwarden.agent.core.errors import ConfigError  # noqa: E402
from gpuwarden.agent.core.scheduler import REASON_PREFIX, SchedulerAdapter  # noqa: E402
from gpuwarden.checks import all_specs  # noqa: E402

KUBE = ROOT / "packaging" / "kubernetes"
CONTAINER = ROOT / "packaging" / "container"
ENTRYPOINT = CONTAINER / "entrypoint.sh"
CORE_FILES = sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
# apiVersion -> the module of lightkube's resources for it; anything else must be one of CRD_KINDS
LIGHTKUBE_MODULES = {"v1": "core_v1", "apps/v1": "apps_v1", "rbac.authorization.k8s.io/v1": "rbac_authorization_v1"}
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}
DOMAIN = "62c4efc6-d460-488d-b7d7-69de49edd641.32766"
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def load_all() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(KUBE.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path}: a document that is not a mapping"
            out.append((str(path.relative_to(KUBE)), doc))
    return out


@pytest.fixture(scope="module")
def manifests() -> list[tuple[str, dict]]:
    return load_all()


def one(manifests, kind: str, name: str | None = None) -> dict:
    found = [d for _, d in manifests if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(manifests) -> dict:
    (c,) = one(manifests, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return c


def configmap_toml(manifests) -> str:
    return one(manifests, "ConfigMap", "gpuwarden")["data"]["gpuwarden.toml"]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def pruned(value):
    """A document without empty values: what a round trip through the models must give back."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


# -- every manifest parses, with current kinds and fields the schema has -----------------------------------------
def test_every_manifest_is_a_current_kind_with_known_fields(manifests):
    kinds = set()
    for path, doc in manifests:
        api, kind = doc.get("apiVersion"), doc.get("kind")
        kinds.add(kind)
        assert doc.get("metadata", {}).get("name"), f"{path}: {kind} without a name"
        if (api, kind) in CRD_KINDS:
            continue
        assert api in LIGHTKUBE_MODULES, f"{path}: {kind} uses apiVersion {api}, not one of {list(LIGHTKUBE_MODULES)}"
        cls = getattr(importlib.import_module(f"lightkube.resources.{LIGHTKUBE_MODULES[api]}"), kind, None)
        assert cls is not None, f"{path}: {api} has no kind {kind} in the API's current schema"
        # lightkube's models drop any field the schema does not have: a round trip shows a misspelt or misplaced one
        assert pruned(cls.from_dict(doc).to_dict()) == pruned(doc), f"{path}: {kind} has fields the API does not"
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Service",
            "ServiceMonitor", "PodMonitor"} <= kinds


def test_namespaced_objects_live_in_the_agents_namespace(manifests):
    namespaced = {"ServiceAccount", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor", "PodMonitor"}
    for path, doc in manifests:
        if doc["kind"] in namespaced:
            assert doc["metadata"].get("namespace") == "gpuwarden", f"{path}: {doc['kind']} outside gpuwarden"
    ns = one(manifests, "Namespace")
    # the pod needs host namespaces and a privileged container: Pod Security Admission must let it in
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_kustomization_applies_the_core_manifests_in_order():
    kust = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kust["resources"] == CORE_FILES  # 00-namespace first, then RBAC, config, DaemonSet, Service
    (image,) = kust["images"]
    assert image["newTag"] == project_version()


# -- RBAC: exactly what the adapter uses --------------------------------------------------------------------------
def grants_for(manifests, namespace: str, name: str) -> list[tuple[str | None, dict]]:
    """(namespace the rule applies in, None for everywhere; the rule) for the service account namespace/name."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules", [])
             for _, d in manifests if d["kind"] in ("ClusterRole", "Role")}
    out = []
    for _, b in manifests:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == name and s.get("namespace") == namespace
                   for s in b["subjects"]):
            continue
        ref, where = b["roleRef"], b["metadata"].get("namespace")
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        if b["kind"] == "ClusterRoleBinding":
            assert ref["kind"] == "ClusterRole", "a ClusterRoleBinding can only bind a ClusterRole"
            rules, scope = roles[("ClusterRole", None, ref["name"])], None
        else:
            key = ("Role", where, ref["name"]) if ref["kind"] == "Role" else ("ClusterRole", None, ref["name"])
            rules, scope = roles[key], where
        out += [(scope, rule) for rule in rules]
    return out


def rule_allows(rule: dict, a: dict) -> bool:
    """RBAC's rule matching (k8s.io/kubernetes/plugin/pkg/auth/authorizer/rbac: RuleAllows)."""
    if not a["resource_request"]:
        return a["verb"] in rule.get("verbs", []) and a["path"] in rule.get("nonResourceURLs", [])
    resource = f"{a['resource']}/{a['subresource']}" if a["subresource"] else a["resource"]
    return (any(v in ("*", a["verb"]) for v in rule.get("verbs", []))
            and any(g in ("*", a["api_group"]) for g in rule.get("apiGroups", []))
            and any(r in ("*", resource) for r in rule.get("resources", []))
            and (not rule.get("resourceNames") or a["name"] in rule["resourceNames"]))


def authorizer(grants):
    def allowed(a: dict) -> bool:
        return any(rule_allows(rule, a) and (scope is None or a["namespace"] == scope) for scope, rule in grants)
    return allowed


def granted(grants) -> set[tuple[str | None, str, str, str]]:
    """(namespace or None, API group, resource[/subresource], verb) every grant names."""
    return {(scope, g, r, v) for scope, rule in grants for g in rule.get("apiGroups", [])
            for r in rule.get("resources", []) for v in rule.get("verbs", [])}


def service_account(manifests) -> tuple[str, str]:
    ds = one(manifests, "DaemonSet")
    return ds["metadata"]["namespace"], ds["spec"]["template"]["spec"]["serviceAccountName"]


def adapter_table(manifests) -> dict:
    return tomllib.loads(configmap_toml(manifests))["remediation"]["kubernetes"]


OPERATIONS = ("publish_domain", "return_to_pool", "spares", "nodes", "node", "cordon", "drain", "quarantine",
              "take_spare", "resume", "job", "mark_job", "signal_job", "requeue_job", "cancel_job")


def run_every_operation(api: FakeKubeApi, tmp_path: Path, table: dict) -> dict[str, list[dict]]:
    """Every SchedulerAdapter operation through the real adapter, as the engine calls them for one node that goes
    bad (its domain published, a spare put in the pool and taken in its place, cordon, the doomed jobs' pods marked
    and ended, drain, quarantine, resume); one write meets a conflict and is read again. Returns the taints each node
    carried along the way."""
    from gpuwarden.agent.core.job import JobRef

    for name in ("gpu-a", "gpu-s1", "gpu-s2"):
        api.add_node(name, labels={"nvidia.com/gpu.clique": DOMAIN})
    api.add_pod("jobs", "train-0", "gpu-a", labels={"app": "train"}, owner="ReplicaSet")
    api.add_pod("gpuwarden", "gpuwarden-x1", "gpu-a", owner="DaemonSet")
    doomed = [JobRef("kubernetes", api.add_pod("jobs", f"gang-{i}", "gpu-a", owner="Job", gpus=4)["metadata"]["uid"],
                     None, "cgroup") for i in range(3)]
    kwargs = {**table, "kubeconfig": str(api.write_kubeconfig(tmp_path / "kubeconfig")), "host": "gpu-a",
              "quarantine_effect": "NoExecute"}  # the stronger effect: the one the tolerations must cover
    adapter = build_adapter("kubernetes", kwargs, tmp_path)
    seen: dict[str, list[dict]] = {}

    def taints() -> None:
        for name in api.nodes:
            for t in api.node_obj(name)["spec"].get("taints") or []:
                if t not in seen.setdefault(name, []):
                    seen[name].append(t)

    reason = f"{REASON_PREFIX} XID 79 on GPU 0008:01:00.0"
    try:
        adapter.publish_domain("gpu-a", DOMAIN)
        adapter.return_to_pool("gpu-s1", DOMAIN)
        adapter.return_to_pool("gpu-s2", DOMAIN)
        taints()
        assert adapter.spares(DOMAIN) == ["gpu-s1", "gpu-s2"]
        assert {v.name for v in adapter.nodes()} == {"gpu-a", "gpu-s1", "gpu-s2"}
        assert adapter.node("gpu-a").jobs == 4  # the job and the three doomed gang pods, not the DaemonSet's
        api.interfere("gpu-a", lambda n: n["metadata"]["labels"].update({"other-writer": "x"}))
        adapter.cordon("gpu-a", reason)
        assert adapter.job(doomed[0]).state == "running"
        for ref in doomed:
            adapter.mark_job(ref, reason)
        adapter.signal_job(doomed[0], "USR1")
        adapter.requeue_job(doomed[1])
        adapter.cancel_job(doomed[2])
        api.finish_terminations()  # the kubelet ended the two deleted with their grace period
        assert all(adapter.job(ref) is None for ref in doomed)
        adapter.drain("gpu-a", reason)
        adapter.quarantine("gpu-a", reason)
        taints()
        assert adapter.take_spare(DOMAIN, "gpu-a") == "gpu-s1"
        adapter.resume("gpu-a")
        taints()
    finally:
        adapter.close()
    assert api.pods_on("gpu-a") == ["gpuwarden/gpuwarden-x1"]  # the job evicted, the DaemonSet's pod left
    assert len(api.events) >= 5  # every step's Event went through
    return seen


@pytest.fixture(scope="module")
def adapter_run(manifests, tmp_path_factory):
    """The adapter's every operation against a fake API server that authorizes by the manifests' RBAC."""
    grants = grants_for(manifests, *service_account(manifests))
    api = FakeKubeApi()
    api.authorizer = authorizer(grants)
    api.start()
    try:
        seen = run_every_operation(api, tmp_path_factory.mktemp("rbac"), adapter_table(manifests))
    finally:
        api.stop()
    return grants, list(api.requests), seen


def test_the_operations_exercised_are_every_one_the_engine_calls():
    protocol = {n for n, _ in inspect.getmembers(SchedulerAdapter, inspect.isfunction) if not n.startswith("_")}
    assert protocol == set(OPERATIONS), "an adapter operation was added or removed: exercise it here, and review RBAC"


def test_every_request_the_adapter_makes_is_allowed(adapter_run):
    grants, requests, _ = adapter_run
    allowed = authorizer(grants)
    assert requests
    for r in requests:
        a = request_attributes(r["method"], r["path"], r["query"])
        assert a["resource_request"], f"a non-resource request: {r['method']} {r['path']}"
        assert r["code"] != 403 and allowed(a), f"refused by RBAC: {r['method']} {r['path']} ({a})"


def test_the_rbac_grants_exactly_what_the_adapter_uses(adapter_run, manifests):
    grants, requests, _ = adapter_run
    used = set()
    for r in requests:
        a = request_attributes(r["method"], r["path"], r["query"])
        resource = f"{a['resource']}/{a['subresource']}" if a["subresource"] else a["resource"]
        used.add((a["namespace"] or None, a["api_group"], resource, a["verb"]))
    # each grant matched by some request, each request by some grant: least privilege
    unused = {g for g in granted(grants) if not any(g[1:] == u[1:] and g[0] in (None, u[0]) for u in used)}
    assert not unused, f"RBAC grants what the adapter never uses: {sorted(unused, key=str)}"
    cluster = {(g, r, v) for scope, g, r, v in granted(grants) if scope is None}
    assert cluster == {("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "patch"),
                       ("", "nodes/status", "patch"), ("", "pods", "list"), ("", "pods", "delete"),
                       ("", "pods/status", "patch"), ("", "pods/eviction", "create"), ("", "events", "create")}
    # Events cluster-wide: a node's go to event_namespace, a pod's must be in the pod's namespace, which can be any
    assert {(u[0], u[2]) for u in used if u[2] == "events"} == {(adapter_table(manifests)["event_namespace"], "events"),
                                                                ("jobs", "events")}
    assert not {g for g in granted(grants) if g[0] is not None}
    assert {(u[2], u[3]) for u in used} == {(r, v) for _, _, r, v in granted(grants)}


def test_the_authorizer_refuses_what_the_rules_leave_out(manifests, tmp_path):
    """The check above has teeth: without the eviction rule the same drain is refused with the API's 403."""
    grants = [(s, r) for s, r in grants_for(manifests, *service_account(manifests))
              if "pods/eviction" not in r.get("resources", [])]
    api = FakeKubeApi()
    api.authorizer = authorizer(grants)
    api.start()
    try:
        api.add_node("gpu-a")
        api.add_pod("jobs", "train-0", "gpu-a", owner="ReplicaSet")
        adapter = k8s.KubernetesAdapter(kubeconfig=str(api.write_kubeconfig(tmp_path / "kubeconfig")), timeout_s=10)
        try:
            with pytest.raises(k8s.Refused, match="403"):
                adapter.drain("gpu-a", f"{REASON_PREFIX} test")
        finally:
            adapter.close()
        assert api.pods_on("gpu-a") == ["jobs/train-0"]
        assert any(r["code"] == 403 and r["path"].endswith("/eviction") for r in api.requests)
    finally:
        api.stop()


def test_request_attributes_follow_kube_apiserver():
    cases = {
        ("GET", "/api/v1/nodes/n1", ""): ("get", "", "nodes", "", "", "n1"),
        ("GET", "/api/v1/nodes", ""): ("list", "", "nodes", "", "", ""),
        ("GET", "/api/v1/nodes", "watch=true"): ("watch", "", "nodes", "", "", ""),
        ("PATCH", "/api/v1/nodes/n1/status", ""): ("patch", "", "nodes", "status", "", "n1"),
        ("PUT", "/api/v1/nodes/n1", ""): ("update", "", "nodes", "", "", "n1"),
        ("GET", "/api/v1/pods", ""): ("list", "", "pods", "", "", ""),
        ("POST", "/api/v1/namespaces/ns/pods/p/eviction", ""): ("create", "", "pods", "eviction", "ns", "p"),
        ("POST", "/api/v1/namespaces/default/events", ""): ("create", "", "events", "", "default", ""),
        ("DELETE", "/api/v1/namespaces/ns/pods", ""): ("deletecollection", "", "pods", "", "ns", ""),
        ("GET", "/apis/policy/v1/namespaces/ns/poddisruptionbudgets", ""):
            ("list", "policy", "poddisruptionbudgets", "", "ns", ""),
        ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", ""):
            ("get", "coordination.k8s.io", "leases", "", "ns", "l"),
        ("GET", "/api/v1/namespaces/ns", ""): ("get", "", "namespaces", "", "ns", "ns"),
    }
    for (method, path, query), want in cases.items():
        q = dict(p.split("=", 1) for p in query.split("&") if p)
        a = request_attributes(method, path, q)
        got = (a["verb"], a["api_group"], a["resource"], a["subresource"], a["namespace"], a["name"])
        assert got == want, f"{method} {path}?{query}"
    assert not request_attributes("GET", "/api")["resource_request"]
    assert not request_attributes("GET", "/healthz")["resource_request"]


# -- tolerations: the agent stays on a node it tainted ------------------------------------------------------------
def tolerates(toleration: dict, taint: dict) -> bool:
    """k8s.io/api/core/v1 Toleration.ToleratesTaint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return toleration.get("value", "") == taint.get("value", "")


def test_the_daemonset_tolerates_every_taint_the_adapter_writes(manifests, adapter_run):
    _, _, seen = adapter_run
    tolerations = one(manifests, "DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    written = [t for taints in seen.values() for t in taints]
    assert {t["key"] for t in written} == {k8s.TAINT, k8s.SPARE_TAINT}
    assert any(t["effect"] == "NoExecute" for t in written)  # the quarantine's, with quarantine_effect NoExecute
    for taint in written:
        assert any(tolerates(tol, taint) for tol in tolerations), f"the agent would be evicted by {taint}"
    for key in (k8s.TAINT, k8s.SPARE_TAINT):  # whatever value or effect a later version writes
        for effect in EFFECTS:
            assert any(tolerates(tol, {"key": key, "value": "anything", "effect": effect}) for tol in tolerations)
    assert any(tolerates(tol, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
               for tol in tolerations)  # cordoned


# -- the DaemonSet, the ConfigMap and the entrypoint ---------------------------------------------------------------
def gpuwarden_bin() -> Path:
    """The gpuwarden command installed beside this interpreter (the project under test)."""
    beside = Path(sys.executable).parent / "gpuwarden"
    return beside if beside.exists() else Path(shutil.which("gpuwarden") or "gpuwarden")


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def parsed_args(manifests):
    c = container(manifests)
    assert "command" not in c, "the image's entrypoint (node_name from NODE_NAME) must not be overridden"
    return cli._parser().parse_args(c["args"])  # argparse exits on a flag `gpuwarden run` does not take


def test_the_container_args_are_flags_gpuwarden_run_takes(manifests):
    args = parsed_args(manifests)
    assert args.command == "run"
    help_text = subprocess.run([str(gpuwarden_bin()), "run", "--help"], capture_output=True,
                               text=True, timeout=60, cwd=ROOT)
    assert help_text.returncode == 0
    for arg in container(manifests)["args"][1:]:
        assert arg.split("=", 1)[0] in help_text.stdout


def test_the_configmap_loads_with_the_real_loader_and_builds_the_adapter(manifests, tmp_path):
    path = tmp_path / "gpuwarden.toml"
    path.write_text(configmap_toml(manifests))
    cfg = config.load(all_specs(), path, explicit=True)
    assert cfg.remediation["adapter"] == "kubernetes"
    assert cfg.remediation["node_name"] == ""  # the entrypoint adds it; set here it would be there twice
    assert cfg.agent["log_format"] == "json"
    adapter = build_adapter("kubernetes", cfg.remediation["kubernetes"], tmp_path)  # the adapter takes every key
    try:
        assert adapter.event_namespace == "default"
    finally:
        adapter.close()
    # the reboot step's command is one the image has (util-linux's nsenter), into PID 1's namespaces
    assert cfg.remediation["ladder"]["reboot_command"][:3] == ["nsenter", "--target", "1"]


def run_entrypoint(tmp_path: Path, config_text: str, node_name: str | None, *args: str):
    conf = tmp_path / "etc" / "gpuwarden.toml"
    conf.parent.mkdir(exist_ok=True)
    conf.write_text(config_text)
    bindir = gpuwarden_bin().parent
    environment = {"PATH": f"{bindir}:/usr/bin:/bin", "GPUWARDEN_CONFIG": str(conf),
                   "GPUWARDEN_RUNTIME_DIR": str(tmp_path / "run")}
    if node_name is not None:
        environment["NODE_NAME"] = node_name
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=60,
                          env=environment, cwd=tmp_path)


def test_the_entrypoint_gives_the_agent_the_downward_apis_node_name(manifests, tmp_path):
    c = container(manifests)
    field = env(c)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "spec.nodeName"
    # the real entrypoint and the real gpuwarden: `run --help` renders the config, then exits without starting
    out = run_entrypoint(tmp_path, configmap_toml(manifests), "gpu-node-07.rack3", *c["args"], "--help")
    assert out.returncode == 0, out.stderr
    assert "--state-dir" in out.stdout
    rendered = tmp_path / "run" / "gpuwarden.toml"
    cfg = config.load(all_specs(), rendered, explicit=True)
    assert cfg.remediation["node_name"] == "gpu-node-07.rack3"
    assert cfg.remediation["adapter"] == "kubernetes"
    assert tomllib.loads(rendered.read_text())["remediation"]["kubernetes"] == adapter_table(manifests)


def test_the_entrypoint_refuses_what_is_not_a_node_name(manifests, tmp_path):
    for bad in ('x" \nmode = "act', "UPPER", "-lead", "trail.", "a/b"):
        out = run_entrypoint(tmp_path, configmap_toml(manifests), bad, "run", "--help")
        assert out.returncode == 2 and "not a Kubernetes node name" in out.stderr, bad
        assert not (tmp_path / "run" / "gpuwarden.toml").exists()


def test_the_entrypoint_adds_a_remediation_table_where_there_is_none_and_never_hides_a_second_name(tmp_path):
    out = run_entrypoint(tmp_path, '[agent]\nlog_format = "json"', "n1", "run", "--help")
    assert out.returncode == 0, out.stderr
    rendered = tmp_path / "run" / "gpuwarden.toml"
    assert config.load(all_specs(), rendered, explicit=True).remediation["node_name"] == "n1"
    out = run_entrypoint(tmp_path, '[remediation]\nnode_name = "other"\n', "n1", "run", "--help")
    assert out.returncode == 0, out.stderr
    with pytest.raises(ConfigError):  # the key twice: the agent refuses the file rather than pick one
        config.load(all_specs(), rendered, explicit=True)
    # no NODE_NAME, or another command: gpuwarden as it is
    out = run_entrypoint(tmp_path, "", None, "--version")
    assert out.returncode == 0 and out.stdout.startswith("gpuwarden ")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_agent_started_as_the_daemonset_starts_it_acts_on_the_downward_apis_node(manifests, tmp_path):
    """The image's entrypoint with the DaemonSet's args and env and the ConfigMap's configuration (mode "act"; the
    listen address and state folder moved under the test's own), on the recorded GB200 tray whose hostname is not
    the node's name: the real agent publishes its NVLink domain on the node named by NODE_NAME, through the API
    server the client finds (here $KUBECONFIG, the fallback of the in-cluster account), and serves the probes'
    path."""
    import urllib.request

    c = container(manifests)
    api = FakeKubeApi()
    api.authorizer = authorizer(grants_for(manifests, *service_account(manifests)))
    api.start()
    proc = None
    try:
        api.add_node("k8s-node-17")
        root = tmp_path / "root"
        shutil.copytree(ROOT / "fixtures" / "nodes" / "gb200-nvl72-healthy", root,
                        ignore=shutil.ignore_patterns("tools"))
        conf = tmp_path / "etc" / "gpuwarden.toml"
        conf.parent.mkdir()
        text = configmap_toml(manifests)
        assert 'mode = "dry-run"' in text  # shipped in dry-run; the operator turns it on
        conf.write_text(text.replace('mode = "dry-run"', 'mode = "act"'))
        port = free_port()
        args = [a for a in c["args"] if not a.startswith(("--listen", "--state-dir"))]
        args += [f"--listen=127.0.0.1:{port}", f"--state-dir={tmp_path / 'state'}", "--root", str(root)]
        environment = {"PATH": f"{gpuwarden_bin().parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                       "NODE_NAME": "k8s-node-17", "GPUWARDEN_CONFIG": str(conf),
                       "GPUWARDEN_RUNTIME_DIR": str(tmp_path / "run"),
                       "KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig"))}
        assert {e["name"] for e in c["env"]} >= {"NODE_NAME", "GPUWARDEN_CONFIG"}
        with open(tmp_path / "agent.log", "wb") as log:
            proc = subprocess.Popen(["sh", str(ENTRYPOINT), *args], env=environment, cwd=tmp_path,
                                    stdout=subprocess.DEVNULL, stderr=log)
            wait_for(lambda: proc.poll() is not None or api.node_obj("k8s-node-17")["metadata"]["labels"].get(
                "gpuwarden.io/nvlink-domain"), timeout_s=90, what="the domain published on k8s-node-17")
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
            probe = c["livenessProbe"]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=30) as answer:
                assert answer.status == 200 and b"gpuwarden_" in answer.read()
    finally:
        end_processes(proc, grace_s=30)
        api.stop()
    assert api.node_obj("k8s-node-17")["metadata"]["labels"]["gpuwarden.io/nvlink-domain"] == DOMAIN
    assert all(r["code"] != 403 for r in api.requests)
    assert any(e["involvedObject"]["name"] == "k8s-node-17" for e in api.events)

def test_the_daemonset_runs_where_and_how_the_agent_needs(manifests):
    ds = one(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(manifests)
    args = parsed_args(manifests)
    assert pod["hostPID"] is True  # Fabric Manager's process in the driver container: checks/fabric_manager.py
    assert pod["hostNetwork"] is True  # the kernel's uevents for the host's netdevs: agent/sources/udev.py
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "gpuwarden"
    assert pod["runtimeClassName"] == "nvidia"
    assert env(c)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # GPUs are the workloads', not requested
    sec = c["securityContext"]
    assert sec["privileged"] is True and sec["readOnlyRootFilesystem"] is True
    # every path the agent writes is a mount (the root file system is read-only), every path it reads is there
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert str(args.state_dir) == "/var/lib/gpuwarden" and not mounts["/var/lib/gpuwarden"].get("readOnly")
    assert volumes[mounts["/var/lib/gpuwarden"]["name"]]["hostPath"]["path"] == "/var/lib/gpuwarden"
    assert volumes[mounts["/dev/kmsg"]["name"]]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert mounts["/dev/kmsg"]["readOnly"] and mounts["/sys"]["readOnly"]
    assert volumes[mounts["/sys"]["name"]]["hostPath"]["path"] == "/sys"
    assert Path(env(c)["GPUWARDEN_CONFIG"]["value"]).parent == Path("/etc/gpuwarden")
    assert volumes[mounts["/etc/gpuwarden"]["name"]]["configMap"]["name"] == "gpuwarden"
    runtime_dir = re.search(r"runtime_dir=\$\{GPUWARDEN_RUNTIME_DIR:-([^}]+)\}", ENTRYPOINT.read_text()).group(1)
    assert runtime_dir in mounts and "emptyDir" in volumes[mounts[runtime_dir]["name"]]
    assert "/tmp" in mounts
    # the image is this version's
    assert c["image"].rsplit(":", 1)[1] == project_version()
    # memory sized from measured use: the request above the resident size (about 50 MB with the Kubernetes client)
    assert c["resources"]["requests"]["memory"] == "96Mi" and "cpu" not in c["resources"]["limits"]


def test_the_probes_and_monitors_reach_the_port_the_agent_listens_on(manifests):
    c = container(manifests)
    args = parsed_args(manifests)
    listen_port = int(args.listen.rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": listen_port} and listen_port == 9456
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/metrics" and ports[get["port"]] == listen_port, probe
    pod_labels = one(manifests, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    ds_selector = one(manifests, "DaemonSet")["spec"]["selector"]["matchLabels"]
    assert ds_selector.items() <= pod_labels.items()
    svc = one(manifests, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == listen_port and svc_port["port"] == listen_port
    sm = one(manifests, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [svc_port["name"]]
    pm = one(manifests, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [one(manifests, "DaemonSet")["metadata"]["namespace"]]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for endpoint in sm["spec"]["endpoints"] + pm["spec"]["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics"


# -- the container image's build file ------------------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            current = ""
    return out


def test_the_containerfile_builds_what_the_manifests_run():
    steps = instructions((CONTAINER / "Containerfile").read_text())
    ignore = [line for line in (CONTAINER / "Containerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*"
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the source tree"
                assert src.rstrip("/") in allowed, f"COPY {src}: kept out of the context by the .dockerignore"
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = re.findall(r"pip install '\.\[([a-z,]+)\]'", runs)
    assert installed == ["kubernetes"] and "kubernetes" in extras
    entry = dict(steps)["ENTRYPOINT"]
    assert yaml.safe_load(entry) == ["/usr/local/bin/gpuwarden-entrypoint"]
    assert "packaging/container/entrypoint.sh /usr/local/bin/gpuwarden-entrypoint" in " ".join(
        rest for word, rest in steps if word == "COPY")
    assert yaml.safe_load(dict(steps)["CMD"]) == ["run"]
    assert dict(steps)["EXPOSE"] == "9456"
    assert dict(steps)["USER"].split(":")[0] == "0"
    base = dict(steps)["ARG"]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert base.startswith("PYTHON_IMAGE=python:3.11") and requires == ">=3.11"
    assert os.access(ENTRYPOINT, os.X_OK)


def test_the_rbac_table_in_the_docs_is_the_manifests(manifests):
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    section = text[text.index("\n## RBAC\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("verb", "---"):
            scope = None if cells[2] == "cluster" else cells[2].removeprefix("namespace ").strip("`")
            rows.add((scope, "", cells[1], cells[0]))
    assert rows == granted(grants_for(manifests, *service_account(manifests)))

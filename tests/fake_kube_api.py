"""A small stand-in for kube-apiserver that speaks its HTTP/JSON for what the Kubernetes adapter uses, so the
adapter's real client code runs against real request and response shapes:

- core/v1 nodes: GET, LIST (labelSelector: `k=v`, `k!=v`, `k`, `!k`), PATCH of the object and of its `status`
  subresource as strategic merge patch, JSON merge patch (RFC 7386) or JSON patch (RFC 6902), PUT; a
  `metadata.resourceVersion` in a PATCH or PUT body is a precondition (409 Conflict when stale), as the real server
  does. Strategic merge knows the merge keys of the fields the adapter touches (node `status.conditions` and
  `status.addresses` by `type`, `metadata.ownerReferences` by `uid`); `spec.taints` has no merge key in the Node
  schema, so a patch replaces the whole list there too. Status writes keep the spec, spec writes keep the status.
- core/v1 pods: LIST across namespaces with `fieldSelector=spec.nodeName=NAME`, LIST in a namespace, GET; PATCH of
  the `status` subresource (strategic merge, conditions by `type`; JSON merge patch; JSON patch), where a
  `metadata.uid` other than the pod's is refused as immutable (422) and a `metadata.resourceVersion` is a
  precondition (409); DELETE, graceful as the pod strategy makes it: the grace period is the request's
  (`gracePeriodSeconds` in a DeleteOptions body, else in the query), else the pod's
  `spec.terminationGracePeriodSeconds`; 0, an unscheduled pod or a finished one goes at once, any other pod gets
  `metadata.deletionTimestamp` (now + grace) and `deletionGracePeriodSeconds` and goes when
  `finish_terminations()` runs (its kubelet finished it); a repeat may only shorten the grace period; DeleteOptions
  `preconditions` (uid, resourceVersion) are checked (409). Pod UIDs are UUIDs, new for every pod made.
- pods/eviction (policy/v1 Eviction): 201 and the pod goes (or starts terminating, see `linger_evictions`); 429
  when a PodDisruptionBudget over the pod has no disruption left; 500 when more than one budget selects it; 404 for
  an unknown pod. Budgets carry a label selector and `minAvailable` or `maxUnavailable` (integer or percentage);
  their status (`expectedPods`, `currentHealthy`, `desiredHealthy`, `disruptionsAllowed`) is computed as the
  disruption controller does, with `expectedPods` the replica count the budget was given (the controller's scale).
- events: POST core/v1 `events` and events.k8s.io/v1 `events`; an Event about a namespaced object (a Pod) must be in
  that object's namespace, one about a cluster-scoped object (a Node) in "default" (422 otherwise).
- 401 without the bearer token, 403 for a (verb, resource) pair made forbidden, 404 for unknown objects, 415 for an
  unknown patch type, 422 for invalid labels, taints or conditions.
- an optional `authorizer`: called with each request's RBAC attributes (`request_attributes`: verb, API group,
  resource, subresource, namespace, name, derived from the method and path as kube-apiserver does) before anything
  else is looked at; False is a 403, as RBAC answers a request no rule allows.

Knobs for failures: `fail(status, count)` answers the next requests with a 5xx (or any status), `hang()` holds
every request without an answer until `unhang()` or `stop()`, `trickle_s` sends answers a byte at a time,
`interfere(node, fn)` lets another writer change a node just before the next write to it (a real 409 for the
writer that read first), `gate_writes(n)` holds node writes until `n` of them have arrived (two writers racing on
one object), `stop()` then `start(port)` is a restart on the same address with the same objects (connections
open before the stop are closed, not served).

Not modelled: watch, server-side apply, admission, field managers, finalizers, graceful deletion timers (a
terminating pod stays until `finish_terminations`), namespaces as objects, field selectors other than spec.nodeName.
"""
from __future__ import annotations

import copy
import json
import math
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "fake-token"
MAX_BODY = 1 << 20
HANG_LIMIT_S = 300.0  # a held request is let go after this, whatever the test does

STRATEGIC_MERGE_KEYS = {  # path (dotted, lists as the field name) -> merge key, for the fields node/pod writes touch
    "status.conditions": "type",
    "status.addresses": "type",
    "metadata.ownerReferences": "uid",
}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
CONDITION_STATUSES = {"True", "False", "Unknown"}


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiStatus(Exception):
    """An answer other than success, carried as a metav1.Status body."""

    REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
               409: "Conflict", 413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 422: "Invalid",
               429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.reason = reason or self.REASONS.get(code, "Unknown")
        self.details = details or {}

    def body(self) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": self.details, "code": self.code}


# -- patch semantics ---------------------------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """Kubernetes strategic merge patch for the fields in STRATEGIC_MERGE_KEYS: lists with a merge key merge element
    by element (`$patch: delete` in an element removes it); other lists replace; maps merge as in a merge patch;
    `$patch: replace` on a map replaces it; `$setElementOrder/...` and `$retainKeys` directives are accepted."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        sub = f"{path}.{key}" if path else key
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and sub in STRATEGIC_MERGE_KEYS:
            out[key] = merge_list(out.get(key) or [], value, STRATEGIC_MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            out[key] = strategic_merge_patch(out.get(key), value, sub)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_list(current: list, patch: list, key: str, path: str) -> list:
    out = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiStatus(422, f"{path}: every element of a strategic merge list needs the merge key {key!r}")
        at = next((i for i, old in enumerate(out) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(strategic_merge_patch({}, item, path))
        else:
            out[at] = strategic_merge_patch(out[at], item, path)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiStatus(422, f"JSON patch path {path!r} does not start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    return _get(doc, parts[:-1]), parts[-1]


def _get(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, dict) and p in doc:
            doc = doc[p]
        elif isinstance(doc, list) and p.isdigit() and int(p) < len(doc):
            doc = doc[int(p)]
        else:
            raise ApiStatus(422, f"JSON patch: no such path element {p!r}")
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> None:
    parent, last = _parent(doc, parts)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list) and (last == "-" or (last.isdigit() and int(last) <= len(parent))):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        raise ApiStatus(422, f"JSON patch: cannot add at {last!r}")


def _remove(doc: Any, parts: list[str]) -> Any:
    parent, last = _parent(doc, parts)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise ApiStatus(422, f"JSON patch: nothing to remove at {last!r}")


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test, applied in order, all or nothing."""
    if not isinstance(ops, list):
        raise ApiStatus(400, "a JSON patch is a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiStatus(400, f"JSON patch operation without op or path: {op!r}")
        kind, parts = op["op"], _pointer(op["path"])
        if kind == "add":
            _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            _get(doc, parts)
            parent, last = _parent(doc, parts)
            parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op.get("value"))
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = _remove(doc, src) if kind == "move" else copy.deepcopy(_get(doc, src))
            _add(doc, parts, value)
        elif kind == "test":
            if _get(doc, parts) != op.get("value"):
                raise ApiStatus(422, f"JSON patch test failed at {op['path']!r}")
        else:
            raise ApiStatus(400, f"unknown JSON patch operation {kind!r}")
    return doc


# -- validation (the parts the adapter could get wrong) ----------------------------------------------------------
def _is_label_value(v: Any) -> bool:
    if not isinstance(v, str) or len(v) > 63:
        return False
    if v == "":
        return True
    return v[0].isascii() and v[0].isalnum() and v[-1].isascii() and v[-1].isalnum() and all(
        c.isascii() and (c.isalnum() or c in "-_.") for c in v)


def _is_qualified_name(k: Any) -> bool:
    if not isinstance(k, str) or not k:
        return False
    prefix, _, name = k.rpartition("/")
    if prefix and (len(prefix) > 253 or not all(c.isascii() and (c.isalnum() or c in "-.") for c in prefix)):
        return False
    return 0 < len(name) <= 63 and _is_label_value(name)


def validate_node(node: dict) -> None:
    meta = node.get("metadata") or {}
    for k, v in (meta.get("labels") or {}).items():
        if not _is_qualified_name(k) or not _is_label_value(v):
            raise ApiStatus(422, f"metadata.labels: Invalid value: {k!r}: {v!r}: a label is a qualified name and a "
                                 "value of at most 63 characters [A-Za-z0-9_.-], starting and ending alphanumeric")
    for k, v in (meta.get("annotations") or {}).items():
        if not _is_qualified_name(k) or not isinstance(v, str):
            raise ApiStatus(422, f"metadata.annotations: Invalid value: {k!r}")
    seen = set()
    for t in (node.get("spec") or {}).get("taints") or []:
        if not isinstance(t, dict) or not _is_qualified_name(t.get("key")) or t.get("effect") not in TAINT_EFFECTS \
                or not _is_label_value(t.get("value", "")):
            raise ApiStatus(422, f"spec.taints: Invalid value: {t!r}")
        if (t["key"], t["effect"]) in seen:
            raise ApiStatus(422, f"spec.taints: Duplicate value: {t['key']}:{t['effect']}")
        seen.add((t["key"], t["effect"]))
    types = set()
    for c in (node.get("status") or {}).get("conditions") or []:
        if not isinstance(c, dict) or not c.get("type") or c.get("status") not in CONDITION_STATUSES:
            raise ApiStatus(422, f"status.conditions: Invalid value: {c!r}")
        if c["type"] in types:
            raise ApiStatus(422, f"status.conditions: Duplicate value: {c['type']}")
        types.add(c["type"])


def validate_pod(pod: dict) -> None:
    """A pod's status conditions as the API server validates them: a type (a qualified name for types outside the
    kubelet's), a status True/False/Unknown, each type once."""
    types = set()
    for c in (pod.get("status") or {}).get("conditions") or []:
        if not isinstance(c, dict) or not _is_qualified_name(c.get("type")) \
                or c.get("status") not in CONDITION_STATUSES:
            raise ApiStatus(422, f"status.conditions: Invalid value: {c!r}")
        if c["type"] in types:
            raise ApiStatus(422, f"status.conditions: Duplicate value: {c['type']}")
        types.add(c["type"])


# -- label selectors ---------------------------------------------------------------------------------------------
def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, joined by commas."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def request_attributes(method: str, path: str, query: dict[str, str] | None = None) -> dict[str, Any]:
    """The attributes RBAC authorizes a request by, derived as kube-apiserver's RequestInfoFactory does
    (k8s.io/apiserver/pkg/endpoints/request/requestinfo.go): /api/v1/... is the core group "", /apis/GROUP/VERSION/...
    a named one; then an optional namespaces/NS/, the resource, the object's name and a subresource. The verb is the
    method's (POST create, GET get, PUT update, PATCH patch, DELETE delete), except that a GET of a collection is
    list (watch with ?watch=true) and a DELETE of one is deletecollection. Any other path is a non-resource URL."""
    query = query or {}
    parts = [unquote(p) for p in path.strip("/").split("/") if p]
    verb = VERBS.get(method.upper(), method.lower())
    out: dict[str, Any] = {"verb": verb, "resource_request": False, "path": path, "api_group": None,
                           "resource": "", "subresource": "", "namespace": "", "name": ""}
    if len(parts) >= 3 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return out  # /api, /apis, /version, /healthz ...: a non-resource URL
    if rest[0] == "namespaces" and len(rest) >= 3:  # namespaces/NS/RESOURCE...; namespaces/NS alone is the namespace
        out["namespace"], rest = rest[1], rest[2:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        out["namespace"] = rest[1]
    out.update(resource_request=True, api_group=group, resource=rest[0],
               name=rest[1] if len(rest) >= 2 else "", subresource=rest[2] if len(rest) >= 3 else "")
    if not out["name"]:
        if verb == "get":
            out["verb"] = "watch" if query.get("watch") in ("1", "true") else "list"
        elif verb == "delete":
            out["verb"] = "deletecollection"
    return out


def _scaled(value: int | str, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = total * int(value[:-1]) / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


# -- the server --------------------------------------------------------------------------------------------------
class FakeKubeApi:
    """One fake API server on 127.0.0.1 (a free port). Objects are plain dicts in the real API's shapes."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rv = 100
        self.nodes: dict[str, dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.pdbs: dict[tuple[str, str], dict] = {}
        self.events: list[dict] = []
        self.requests: list[dict] = []  # method, path, query, content_type, code of every request answered
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource) pairs RBAC would refuse
        # request_attributes(...) -> allowed: a whole RBAC policy (None: every authenticated request is allowed)
        self.authorizer: Callable[[dict[str, Any]], bool] | None = None
        self.linger_evictions = False  # an evicted pod starts terminating (deletionTimestamp) instead of going
        self.trickle_s = 0.0  # > 0: answers are sent one byte at a time, this long apart (a server that crawls)
        self._fail: list[int] = []
        self._hang = threading.Event()
        self._stopping = threading.Event()
        self._interfere: dict[str, list[Callable[[dict], None]]] = {}
        self._gate: threading.Barrier | None = None
        self._gate_left = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._generation = 0  # each start; a connection kept alive from before a stop is closed, not served

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Serves on 127.0.0.1:`port` (0: a free one). After `stop`, starting again on the same port serves the same
        objects: an API server restarted on its saved state (etcd)."""
        api = self

        self._generation += 1

        class Handler(_Handler):
            server_api = api
            generation = api._generation

        self._stopping.clear()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-kube-api", daemon=True)
        self._thread.start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._stopping.set()
        self._hang.clear()
        if self._gate is not None:
            self._gate.abort()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=30)
            self._server = None

    def write_kubeconfig(self, path: Path, token: str = TOKEN) -> Path:
        """A kubeconfig with one context that points at this server."""
        path.write_text(json.dumps({  # JSON is YAML: the client's loader reads it as is
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "agent", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
        }))
        return path

    # -- knobs -----------------------------------------------------------------------------------------------
    def fail(self, code: int = 500, count: int = 1) -> None:
        """The next `count` requests are answered with `code` (a Status body) and change nothing."""
        with self.lock:
            self._fail.extend([code] * count)

    def hang(self) -> None:
        """Every request from now on is held without an answer (until `unhang` or `stop`)."""
        self._hang.set()

    def unhang(self) -> None:
        self._hang.clear()

    def interfere(self, node: str, change: Callable[[dict], None], count: int = 1) -> None:
        """Another writer changes `node` (a new resourceVersion) just before each of the next `count` writes to
        it: a writer that carries the resourceVersion it read gets a 409 Conflict."""
        with self.lock:
            self._interfere.setdefault(node, []).extend([change] * count)

    def gate_writes(self, n: int) -> None:
        """The next `n` node writes wait until all `n` have arrived, then go on one at a time."""
        self._gate, self._gate_left = threading.Barrier(n, timeout=60), n

    # -- objects ---------------------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def add_node(self, name: str, labels: dict | None = None, unschedulable: bool = False, ready: bool = True,
                 taints: list[dict] | None = None, annotations: dict | None = None) -> dict:
        with self.lock:
            node = {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {"name": name, "uid": f"uid-node-{name}", "resourceVersion": self._next_rv(),
                             "creationTimestamp": now_rfc3339(),
                             "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                             "annotations": dict(annotations or {})},
                "spec": {"providerID": f"fake://{name}"},
                "status": {
                    "conditions": [{"type": "Ready", "status": "True" if ready else "Unknown",
                                    "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                                    "message": "kubelet is posting ready status" if ready
                                    else "Kubelet stopped posting node status.",
                                    "lastHeartbeatTime": now_rfc3339(), "lastTransitionTime": now_rfc3339()}],
                    "addresses": [{"type": "Hostname", "address": name}],
                    "capacity": {"nvidia.com/gpu": "4"}, "allocatable": {"nvidia.com/gpu": "4"}},
            }
            if unschedulable:
                node["spec"]["unschedulable"] = True
            if taints:
                node["spec"]["taints"] = copy.deepcopy(taints)
            validate_node(node)
            self.nodes[name] = node
            return copy.deepcopy(node)

    def add_pod(self, namespace: str, name: str, node: str, labels: dict | None = None, owner: str | None = None,
                mirror: bool = False, phase: str = "Running", gpus: int = 0, grace_s: int = 30) -> dict:
        """A pod bound to `node` (none for ""); `owner` is its controller's kind (ReplicaSet, DaemonSet, ...); `gpus`
        the nvidia.com/gpu its container asks for; `grace_s` its terminationGracePeriodSeconds (the API server's
        default is 30)."""
        with self.lock:
            rv = self._next_rv()
            meta: dict[str, Any] = {"name": name, "namespace": namespace,
                                    "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"fake-kube-api/pods/{namespace}/{name}/"
                                                                              f"{rv}")),
                                    "resourceVersion": rv, "creationTimestamp": now_rfc3339(),
                                    "labels": dict(labels or {})}
            if owner:
                meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner, "name": f"{name}-owner",
                                            "uid": f"uid-owner-{name}", "controller": True,
                                            "blockOwnerDeletion": True}]
            if mirror:
                meta["annotations"] = {"kubernetes.io/config.mirror": "0123456789abcdef"}
            main: dict[str, Any] = {"name": "main", "image": "registry.invalid/job:1"}
            if gpus:
                main["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}
            spec: dict[str, Any] = {"containers": [main], "terminationGracePeriodSeconds": grace_s}
            if node:
                spec["nodeName"] = node
            pod = {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec,
                   "status": {"phase": phase, "conditions": [
                       {"type": "Ready", "status": "True" if phase == "Running" else "False"}]}}
            self.pods[(namespace, name)] = pod
            return copy.deepcopy(pod)

    def add_pdb(self, namespace: str, name: str, match_labels: dict, min_available: int | str | None = None,
                max_unavailable: int | str | None = None, expected_pods: int | None = None) -> None:
        """A policy/v1 PodDisruptionBudget; `expected_pods` is the scale of the pods' controller (default: the
        number of pods the selector matches now)."""
        with self.lock:
            spec: dict[str, Any] = {"selector": {"matchLabels": dict(match_labels)}}
            if min_available is not None:
                spec["minAvailable"] = min_available
            if max_unavailable is not None:
                spec["maxUnavailable"] = max_unavailable
            pdb = {"kind": "PodDisruptionBudget", "apiVersion": "policy/v1",
                   "metadata": {"name": name, "namespace": namespace, "resourceVersion": self._next_rv(),
                                "generation": 1},
                   "spec": spec, "status": {}}
            expected = expected_pods if expected_pods is not None else len(self._pdb_pods(pdb))
            pdb["status"]["expectedPods"] = expected
            self.pdbs[(namespace, name)] = pdb
            self._pdb_status(pdb)

    def node_obj(self, name: str) -> dict:
        with self.lock:
            return copy.deepcopy(self.nodes[name])

    def pods_on(self, node: str) -> list[str]:
        with self.lock:
            return sorted(f"{ns}/{n}" for (ns, n), p in self.pods.items() if p["spec"].get("nodeName") == node)

    def pod_obj(self, namespace: str, name: str) -> dict | None:
        with self.lock:
            pod = self.pods.get((namespace, name))
            return copy.deepcopy(pod) if pod is not None else None

    def finish_terminations(self) -> None:
        """Pods that were terminating are gone (their kubelet finished them)."""
        with self.lock:
            for key in [k for k, p in self.pods.items() if p["metadata"].get("deletionTimestamp")]:
                del self.pods[key]

    def pdb_status(self, namespace: str, name: str) -> dict:
        with self.lock:
            pdb = self.pdbs[(namespace, name)]
            self._pdb_status(pdb)
            return copy.deepcopy(pdb["status"])

    # -- disruption budgets ----------------------------------------------------------------------------------
    def _pdb_pods(self, pdb: dict) -> list[dict]:
        ns, want = pdb["metadata"]["namespace"], pdb["spec"]["selector"]["matchLabels"]
        return [p for (pns, _), p in self.pods.items()
                if pns == ns and all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]

    def _pdb_status(self, pdb: dict) -> None:
        pods = self._pdb_pods(pdb)
        healthy = sum(1 for p in pods if p["status"]["phase"] == "Running" and not p["metadata"].get(
            "deletionTimestamp") and any(c["type"] == "Ready" and c["status"] == "True"
                                         for c in p["status"].get("conditions", [])))
        expected = pdb["status"]["expectedPods"]
        spec = pdb["spec"]
        if "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected, round_up=True)
        else:
            desired = expected - _scaled(spec.get("maxUnavailable", 0), expected, round_up=True)
        pdb["status"].update({"currentHealthy": healthy, "desiredHealthy": max(desired, 0),
                              "disruptionsAllowed": max(healthy - desired, 0), "observedGeneration": 1})

    # -- request handling (called by the handler with the lock not held) -------------------------------------
    def handle(self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes) -> tuple[int, dict]:
        if self._hang.is_set():
            deadline = time.monotonic() + HANG_LIMIT_S
            while self._hang.is_set() and not self._stopping.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._stopping.is_set():
                raise ConnectionAbortedError("server stopping")
        with self.lock:
            if self._fail:
                code = self._fail.pop(0)
                raise ApiStatus(code, f"fake apiserver: injected {code}")
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            raise ApiStatus(401, "Unauthorized")
        if self.authorizer is not None:
            attrs = request_attributes(method, path, query)
            if not self.authorizer(attrs):
                what = (f'{attrs["resource"]}/{attrs["subresource"]}' if attrs["subresource"] else attrs["resource"]) \
                    if attrs["resource_request"] else path
                raise ApiStatus(403, f'{what} is forbidden: User "system:serviceaccount:gpuwarden:gpuwarden" cannot '
                                     f'{attrs["verb"]} {what!r} in API group {attrs["api_group"]!r}'
                                     + (f' in the namespace {attrs["namespace"]!r}' if attrs["namespace"] else ""))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        return self._route(method, parts, query, headers.get("Content-Type", "").split(";")[0].strip(), body)

    def _check_rbac(self, verb: str, resource: str) -> None:
        if (verb, resource) in self.forbidden:
            raise ApiStatus(403, f'{resource} is forbidden: User "system:serviceaccount:gpuwarden:gpuwarden" cannot '
                                 f'{verb} resource "{resource}"')

    def _route(self, method: str, p: list[str], query: dict, ctype: str, body: bytes) -> tuple[int, dict]:
        if p[:2] == ["api", "v1"]:
            rest = p[2:]
            if rest == ["nodes"] and method == "GET":
                return self._list_nodes(query)
            if len(rest) in (2, 3) and rest[0] == "nodes":
                sub = rest[2] if len(rest) == 3 else ""
                if sub not in ("", "status"):
                    raise ApiStatus(404, f"the server could not find the requested resource (nodes/{sub})")
                return self._node(method, rest[1], sub, ctype, body)
            if rest == ["pods"] and method == "GET":
                return self._list_pods(None, query)
            if len(rest) >= 3 and rest[0] == "namespaces":
                ns, kind = rest[1], rest[2]
                if kind == "pods" and len(rest) == 3 and method == "GET":
                    return self._list_pods(ns, query)
                if kind == "pods" and len(rest) == 4 and method == "GET":
                    self._check_rbac("get", "pods")
                    with self.lock:
                        if (ns, rest[3]) not in self.pods:
                            raise ApiStatus(404, f'pods "{rest[3]}" not found',
                                            details={"name": rest[3], "kind": "pods"})
                        return 200, copy.deepcopy(self.pods[(ns, rest[3])])
                if kind == "pods" and len(rest) == 4 and method == "DELETE":
                    return self._delete_pod(ns, rest[3], query, ctype, body)
                if kind == "pods" and len(rest) == 5 and rest[4] == "eviction" and method == "POST":
                    return self._evict(ns, rest[3], body)
                if kind == "pods" and len(rest) == 5 and rest[4] == "status" and method == "PATCH":
                    return self._patch_pod_status(ns, rest[3], ctype, body)
                if kind == "events" and len(rest) == 3 and method == "POST":
                    return self._event(ns, body, "v1")
        if p[:3] == ["apis", "events.k8s.io", "v1"] and len(p) == 6 and p[3] == "namespaces" and p[5] == "events" \
                and method == "POST":
            return self._event(p[4], body, "events.k8s.io/v1")
        if p[:3] == ["apis", "policy", "v1"] and p[-1] == "poddisruptionbudgets" and method == "GET":
            with self.lock:
                items = []
                for pdb in self.pdbs.values():
                    if len(p) == 6 and pdb["metadata"]["namespace"] != p[4]:
                        continue
                    self._pdb_status(pdb)
                    items.append(copy.deepcopy(pdb))
                return 200, {"kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1",
                             "metadata": {"resourceVersion": str(self.rv)}, "items": items}
        raise ApiStatus(404, "the server could not find the requested resource")

    def _list_nodes(self, query: dict) -> tuple[int, dict]:
        self._check_rbac("list", "nodes")
        with self.lock:
            sel = query.get("labelSelector", "")
            items = [copy.deepcopy(n) for _, n in sorted(self.nodes.items())
                     if selector_matches(sel, n["metadata"].get("labels") or {})]
            for item in items:  # list items carry no kind/apiVersion, as the real server sends them
                item.pop("kind", None)
                item.pop("apiVersion", None)
            return 200, self._page("NodeList", items, query)

    def _page(self, kind: str, items: list[dict], query: dict) -> dict:
        """A list answer, a page of `limit` items with a `continue` token when more follow."""
        try:
            start, limit = int(query.get("continue") or 0), int(query.get("limit") or 0)
        except ValueError as e:
            raise ApiStatus(400, f"bad limit or continue: {e}") from e
        end = start + limit if limit > 0 else len(items)
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if end < len(items):
            meta["continue"] = str(end)
        return {"kind": kind, "apiVersion": "v1", "metadata": meta, "items": items[start:end]}

    def _list_pods(self, ns: str | None, query: dict) -> tuple[int, dict]:
        self._check_rbac("list", "pods")
        node = None
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            key, _, value = term.partition("=")
            if key != "spec.nodeName":
                raise ApiStatus(400, f'"{key}" is not a known field selector: only "spec.nodeName" is modelled')
            node = value
        with self.lock:
            items = []
            for (pns, _), pod in sorted(self.pods.items()):
                if (ns is None or pns == ns) and (node is None or pod["spec"].get("nodeName") == node):
                    item = copy.deepcopy(pod)
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                    items.append(item)
            return 200, self._page("PodList", items, query)

    def _node(self, method: str, name: str, sub: str, ctype: str, body: bytes) -> tuple[int, dict]:
        resource = "nodes/status" if sub else "nodes"
        if method == "GET":
            self._check_rbac("get", resource)
            with self.lock:
                if name not in self.nodes:
                    raise ApiStatus(404, f'nodes "{name}" not found', details={"name": name, "kind": "nodes"})
                return 200, copy.deepcopy(self.nodes[name])
        if method not in ("PATCH", "PUT"):
            raise ApiStatus(405, f"{method} is not supported on {resource}")
        self._check_rbac("patch" if method == "PATCH" else "update", resource)
        doc = self._json(body)
        gate = self._gate
        if gate is not None:
            with self.lock:
                self._gate_left -= 1
                if self._gate_left <= 0:
                    self._gate = None
            try:
                gate.wait()
            except threading.BrokenBarrierError:
                pass
        with self.lock:
            if name not in self.nodes:
                raise ApiStatus(404, f'nodes "{name}" not found', details={"name": name, "kind": "nodes"})
            changes = self._interfere.get(name)
            if changes:
                other = copy.deepcopy(self.nodes[name])
                changes.pop(0)(other)
                other["metadata"]["resourceVersion"] = self._next_rv()
                self.nodes[name] = other
            current = self.nodes[name]
            if method == "PUT":
                if not isinstance(doc, dict) or "metadata" not in doc:
                    raise ApiStatus(400, "PUT needs the whole object")
                new = copy.deepcopy(doc)
                if not new["metadata"].get("resourceVersion"):
                    raise ApiStatus(422, "metadata.resourceVersion: must be specified for an update")
            else:
                new = self._patched(current, ctype, doc)
            if not isinstance(new, dict):
                raise ApiStatus(422, "the patched node is not an object")
            meta = new.setdefault("metadata", {})
            if meta.get("name", name) != name:
                raise ApiStatus(400, "the name of the object does not match the name on the URL")
            want_rv = meta.get("resourceVersion")
            if want_rv and want_rv != current["metadata"]["resourceVersion"]:
                raise ApiStatus(409, f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                     f'modified; please apply your changes to the latest version and try again',
                                details={"name": name, "kind": "nodes"})
            # a write through one endpoint does not change what the other owns
            if sub == "status":
                new["spec"] = copy.deepcopy(current.get("spec", {}))
            else:
                new["status"] = copy.deepcopy(current.get("status", {}))
            for fixed in ("uid", "creationTimestamp", "name"):
                meta[fixed] = current["metadata"][fixed]
            new["kind"], new["apiVersion"] = "Node", "v1"
            validate_node(new)
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            if new == current:
                return 200, copy.deepcopy(current)  # nothing changed: no new resourceVersion, as the server does
            meta["resourceVersion"] = self._next_rv()
            self.nodes[name] = new
            return 200, copy.deepcopy(new)

    @staticmethod
    def _patched(current: dict, ctype: str, doc: Any) -> Any:
        if ctype == "application/strategic-merge-patch+json":
            return strategic_merge_patch(current, doc)
        if ctype == "application/merge-patch+json":
            return merge_patch(current, doc)
        if ctype == "application/json-patch+json":
            return json_patch(current, doc)
        raise ApiStatus(415, f"the body of the request was in an unknown format - accepted media types include: "
                             f"application/json-patch+json, application/merge-patch+json, "
                             f"application/apply-patch+yaml, application/strategic-merge-patch+json (got {ctype!r})")

    def _patch_pod_status(self, ns: str, name: str, ctype: str, body: bytes) -> tuple[int, dict]:
        self._check_rbac("patch", "pods/status")
        doc = self._json(body)
        with self.lock:
            current = self.pods.get((ns, name))
            if current is None:
                raise ApiStatus(404, f'pods "{name}" not found', details={"name": name, "kind": "pods"})
            new = self._patched(current, ctype, doc)
            if not isinstance(new, dict):
                raise ApiStatus(422, "the patched pod is not an object")
            meta = new.setdefault("metadata", {})
            if meta.get("name", name) != name:
                raise ApiStatus(400, "the name of the object does not match the name on the URL")
            if meta.get("uid", current["metadata"]["uid"]) != current["metadata"]["uid"]:
                # ValidateObjectMetaUpdate: a patch that names another UID is the kubelet's precondition idiom
                raise ApiStatus(422, f'Pod "{name}" is invalid: metadata.uid: Invalid value: "{meta["uid"]}": field '
                                     'is immutable')
            want_rv = meta.get("resourceVersion")
            if want_rv and want_rv != current["metadata"]["resourceVersion"]:
                raise ApiStatus(409, f'Operation cannot be fulfilled on pods "{name}": the object has been modified; '
                                     'please apply your changes to the latest version and try again',
                                details={"name": name, "kind": "pods"})
            # the status endpoint changes only the status (podStatusStrategy keeps the spec, the deletion and the
            # owners as they were)
            new["spec"] = copy.deepcopy(current.get("spec", {}))
            new["metadata"] = copy.deepcopy(current["metadata"])
            new["kind"], new["apiVersion"] = "Pod", "v1"
            validate_pod(new)
            if new == current:
                return 200, copy.deepcopy(current)
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.pods[(ns, name)] = new
            return 200, copy.deepcopy(new)

    def _delete_pod(self, ns: str, name: str, query: dict, ctype: str, body: bytes) -> tuple[int, dict]:
        """DELETE of a pod, graceful as kube-apiserver's pod strategy (CheckGracefulDelete) and rest.BeforeDelete
        make it."""
        self._check_rbac("delete", "pods")
        options = self._json(body) if body else {}
        if not isinstance(options, dict):
            raise ApiStatus(400, "DeleteOptions is an object")
        if not body and "gracePeriodSeconds" in query:  # options come from the body, else from the query
            options["gracePeriodSeconds"] = query["gracePeriodSeconds"]
        grace = options.get("gracePeriodSeconds")
        if grace is not None:
            try:
                grace = int(grace)
            except (TypeError, ValueError) as e:
                raise ApiStatus(400, f"gracePeriodSeconds: not an integer ({grace!r})") from e
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                raise ApiStatus(404, f'pods "{name}" not found', details={"name": name, "kind": "pods"})
            meta = pod["metadata"]
            pre = options.get("preconditions") or {}
            for key in ("uid", "resourceVersion"):
                if pre.get(key) and pre[key] != meta[key]:
                    raise ApiStatus(409, f"Precondition failed: {key} in precondition: {pre[key]}, {key} in object "
                                         f"meta: {meta[key]}", details={"name": name, "kind": "pods"})
            if meta.get("deletionTimestamp"):
                # terminating already: a request may only shorten the grace period
                if grace is None or grace >= meta.get("deletionGracePeriodSeconds", 0):
                    return 200, copy.deepcopy(pod)
            else:
                if grace is None:
                    grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
                if not pod["spec"].get("nodeName") or pod["status"].get("phase") in ("Succeeded", "Failed"):
                    grace = 0  # nothing runs it, or nothing runs in it any more
                if grace < 0:
                    grace = 1
            if grace == 0:
                del self.pods[(ns, name)]
            else:
                at = datetime.now(timezone.utc).timestamp() + grace
                meta["deletionTimestamp"] = datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta["deletionGracePeriodSeconds"] = grace
                meta["resourceVersion"] = self._next_rv()
            for budget in self.pdbs.values():
                self._pdb_status(budget)
            return 200, copy.deepcopy(pod)

    def _evict(self, ns: str, name: str, body: bytes) -> tuple[int, dict]:
        self._check_rbac("create", "pods/eviction")
        doc = self._json(body)
        if not isinstance(doc, dict) or doc.get("kind") != "Eviction" or doc.get("apiVersion") != "policy/v1":
            raise ApiStatus(400, f"an eviction is a policy/v1 Eviction (got {str(doc)[:200]})")
        if (doc.get("metadata") or {}).get("name") != name:
            raise ApiStatus(400, f"name in URL does not match name in Eviction object ({name})")
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                raise ApiStatus(404, f'pods "{name}" not found', details={"name": name, "kind": "pods"})
            if pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp"):
                budgets = [b for b in self.pdbs.values() if b["metadata"]["namespace"] == ns and
                           all(pod["metadata"]["labels"].get(k) == v
                               for k, v in b["spec"]["selector"]["matchLabels"].items())]
                if len(budgets) > 1:
                    raise ApiStatus(500, "This pod has more than one PodDisruptionBudget, which the eviction "
                                         "subresource does not support.")
                if budgets:
                    self._pdb_status(budgets[0])
                    if budgets[0]["status"]["disruptionsAllowed"] <= 0:
                        raise ApiStatus(429, "Cannot evict pod as it would violate the pod's disruption budget.",
                                        details={"causes": [{"reason": "DisruptionBudget", "message": (
                                            f"The disruption budget {budgets[0]['metadata']['name']} needs "
                                            f"{budgets[0]['status']['desiredHealthy']} healthy pods and has "
                                            f"{budgets[0]['status']['currentHealthy']} currently")}]})
            if self.linger_evictions:
                pod["metadata"]["deletionTimestamp"] = now_rfc3339()
                pod["metadata"]["resourceVersion"] = self._next_rv()
            else:
                del self.pods[(ns, name)]
            for budget in self.pdbs.values():
                self._pdb_status(budget)
            return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _event(self, ns: str, body: bytes, api: str) -> tuple[int, dict]:
        self._check_rbac("create", "events")
        doc = self._json(body)
        if not isinstance(doc, dict):
            raise ApiStatus(400, "an event is an object")
        meta = doc.setdefault("metadata", {})
        regarding = doc.get("involvedObject" if api == "v1" else "regarding") or {}
        if not regarding.get("kind") or not regarding.get("name"):
            raise ApiStatus(422, "involvedObject: Required value: kind and name")
        # for a cluster-scoped object (a node) the event lives in "default", for a namespaced one (a pod) in its
        # namespace, or the server refuses it (legacyValidateEvent)
        if not regarding.get("namespace") and ns not in ("", "default"):
            raise ApiStatus(422, f"involvedObject.namespace: Invalid value: \"\": does not match event.namespace "
                                 f"{ns!r}")
        if regarding.get("namespace") and regarding["namespace"] != ns:
            raise ApiStatus(422, f"involvedObject.namespace: Invalid value: {regarding['namespace']!r}: does not "
                                 f"match event.namespace {ns!r}")
        if not doc.get("reason") or (api == "v1" and not doc.get("source", {}).get("component")
                                     and not doc.get("reportingComponent")):
            raise ApiStatus(422, "reason and source.component (or reportingComponent) are required")
        with self.lock:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise ApiStatus(422, "metadata.name: Required value: name or generateName is required")
                meta["name"] = f"{meta['generateName']}{self._next_rv()}"
            if any(e["metadata"]["name"] == meta["name"] and e["metadata"].get("namespace") == ns
                   for e in self.events):
                raise ApiStatus(409, f'events "{meta["name"]}" already exists', reason="AlreadyExists")
            meta["namespace"], meta["resourceVersion"] = ns, self._next_rv()
            doc["kind"], doc["apiVersion"] = "Event", api
            self.events.append(copy.deepcopy(doc))
            return 201, doc

    @staticmethod
    def _json(body: bytes) -> Any:
        try:
            return json.loads(body or b"null")
        except ValueError as e:
            raise ApiStatus(400, f"the request body is not JSON: {e}") from e

    def record(self, **entry: Any) -> None:
        with self.lock:
            self.requests.append(entry)


class _Handler(BaseHTTPRequestHandler):
    server_api: FakeKubeApi
    generation: int
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go as separate writes: no 40 ms wait on each answer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the requests are kept in server_api.requests
        pass

    def _serve(self) -> None:
        api = self.server_api
        if api._stopping.is_set() or self.generation != api._generation:
            self.close_connection = True  # the server went away: its open connections with it
            return
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        try:
            if length > MAX_BODY:
                raise ApiStatus(413, "request entity too large")
            body = self.rfile.read(length) if length else b""
            code, doc = api.handle(self.command, url.path, query, self.headers, body)
        except ApiStatus as e:
            code, doc = e.code, e.body()
        except ConnectionAbortedError:
            self.close_connection = True
            return
        api.record(method=self.command, path=url.path, query=query,
                   content_type=self.headers.get("Content-Type", ""), code=code)
        out = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if api.trickle_s <= 0:
            self.wfile.write(out)
            return
        try:
            for i in range(len(out)):
                if api._stopping.is_set():
                    break
                self.wfile.write(out[i:i + 1])
                self.wfile.flush()
                time.sleep(api.trickle_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on it
        self.close_connection = True

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve


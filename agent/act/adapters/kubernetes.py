"""The Kubernetes adapter: carries the remediation engine's decisions to the API server and reads the fleet's marks
back from it.

What the agent writes on a Node (everything it owns carries the `gpuwarden.io/` prefix, or is the `GpuwardenHealthy`
condition):
- cordon: `spec.unschedulable: true` plus the taint `gpuwarden.io/unhealthy` (NoSchedule; NoExecute for a
  quarantine when configured) whose value says how far the node went: cordoned < draining < drained < quarantined.
  When the agent is the one that turned `spec.unschedulable` on, it says so in the annotation
  `gpuwarden.io/unschedulable`; `resume` turns it off only then, so an administrator's cordon is never undone.
- the node condition `GpuwardenHealthy` (as node-problem-detector writes conditions: status, reason, message,
  lastTransitionTime moved only when the status changes), written through the `nodes/status` subresource;
- an Event on the node for every change it makes;
- drain: a policy/v1 Eviction for each pod of the node (not DaemonSet pods, not mirror pods, not finished ones),
  so PodDisruptionBudgets hold: a 429 is `Transient`, and a pod is never deleted around a budget;
- the NVLink domain: read from `nvidia.com/gpu.clique` (GPU feature discovery's label), else
  `gpuwarden.io/nvlink-domain`;
- spares: the label `gpuwarden.io/spare=<domain>`, the taint `gpuwarden.io/spare` and our cordon. Taking one is a
  merge patch that carries the resourceVersion it read, so of two agents racing for one spare the API server lets
  one through and answers the other 409 Conflict; the loser reads again and tries the next spare.

What it does to a doomed job's pod (agent/jobs/respond.py; the job's id is the pod's UID, read from its cgroup):
- the reason: the pod condition `GpuwardenJobDoomed` (status True, message = the reason) through `pods/status`, and a
  Warning Event on the pod, in the pod's namespace;
- Kubernetes has no API that signals a container; what ends a pod is a DELETE (an Eviction is a DELETE that
  PodDisruptionBudgets may refuse). `signal` and `requeue` delete the pod with its own grace period (the kubelet
  sends SIGTERM, the job checkpoints within terminationGracePeriodSeconds, then SIGKILL; its controller makes a new
  pod, on another node since this one is cordoned), `cancel` deletes it with gracePeriodSeconds=0. The signal's name
  is not used. A DELETE and not an Eviction: a gang-scheduled job's PodDisruptionBudget often has minAvailable =
  every worker, so an eviction would be refused for as long as the job runs, every GPU of it idle until PyTorch's
  watchdog fires. A pod already gone is success.

Every write to a Node carries the resourceVersion it was computed from (a 409 is read again and retried a bounded
number of times), every call runs under one deadline (`timeout_s`) shared by all its requests, and each answer is
read up to a size bound. Errors: no connection, a timeout, 409 past the retries, 429 and 5xx are `Transient`;
401, 403, 404, 422 and other refusals are `Refused`.

The client is lightkube, imported when this adapter is built (`pip install 'gpuwarden[kubernetes]'`), so the agent
runs without it wherever another adapter is chosen.
"""
from __future__ import annotations

import functools
import re
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, Sequence

from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import (
    REASON_PREFIX,
    SPARE_REASON,
    Busy,
    JobView,
    NodeView,
    Refused,
    Service,
    Transient,
)

# one set of labels with `gpuwarden topology`
from gpuwarden.agent.node.topology import CLIQUE_LABEL, DOMAIN_LABEL, kubernetes_labels

log = logs.get_logger("gpuwarden.adapter.kubernetes")

TAINT = "gpuwarden.io/unhealthy"
SPARE_TAINT = "gpuwarden.io/spare"
SPARE_LABEL = "gpuwarden.io/spare"
OURS_UNSCHEDULABLE = "gpuwarden.io/unschedulable"  # annotation: "true" when the agent set spec.unschedulable
TAKEN_FOR = "gpuwarden.io/taken-for"  # annotation on a spare taken into service: the node it replaced
CONDITION = "GpuwardenHealthy"
COMPONENT = "gpuwarden"
EVENT_NAMESPACE = "default"  # events about a cluster-scoped object (a Node) live here, as the kubelet's do
LEVELS = ("cordoned", "draining", "drained", "quarantined")  # the taint's value: how far the node went
CONDITION_REASON = {"cordoned": "Cordoned", "draining": "Draining", "drained": "Drained",
                    "quarantined": "Quarantined"}
MAX_RESPONSE_BYTES = 64 << 20  # one answer (a page of a list is at most LIST_PAGE objects)
LIST_PAGE = 500
MAX_MESSAGE = 1024  # a condition's or event's message
JOB_CONDITION = "GpuwardenJobDoomed"  # the pod condition (and the Event reason) that carries a doomed job's reason
# A pod's phase as the job response reads it; a pod with a deletionTimestamp that has not finished is "ending".
POD_STATES = {"Running": "running", "Pending": "pending", "Succeeded": "ended", "Failed": "ended",
              "Unknown": "unknown"}
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # as the API server makes them
EXTRA_HINT = "pip install 'gpuwarden[kubernetes]'"


class ClientMissing(Refused, ImportError):
    """The Kubernetes client library is not installed."""


def _lightkube():
    try:
        import httpx2
        import lightkube
        from lightkube.config import client_adapter
        from lightkube.resources import core_v1
        from lightkube.types import PatchType
    except ImportError as e:
        raise ClientMissing(f"the Kubernetes adapter needs the lightkube client, which is not installed ({e}): "
                            f"{EXTRA_HINT}") from e
    return httpx2, lightkube, client_adapter, core_v1, PatchType


# -- plain decisions over the API's objects (dicts in the API's JSON shape) -------------------------------------
def _is_dns_subdomain(name: Any) -> bool:
    """An object name as the API server accepts it (RFC 1123 subdomain): also keeps '/' and '..' out of URLs."""
    return (isinstance(name, str) and 0 < len(name) <= 253 and name[0].isalnum() and name[-1].isalnum()
            and all(c in "-." or (c.isascii() and (c.isdigit() or c.islower())) for c in name)
            and ".." not in name)


def _is_label_value(value: Any) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()
            and all(c.isascii() and (c.isalnum() or c in "-_.") for c in value))


def _name(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _rv(obj: dict) -> str:
    """The object's resourceVersion: every write is guarded by it, so an answer without one cannot be written."""
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    if not isinstance(rv, str) or not rv:
        raise Transient(f"the API server sent {_name(obj) or 'an object'} without a resourceVersion")
    return rv


def _labels(node: dict) -> dict:
    return (node.get("metadata") or {}).get("labels") or {}


def _annotations(node: dict) -> dict:
    return (node.get("metadata") or {}).get("annotations") or {}


def _taints(node: dict) -> list[dict]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]


def _taint(node: dict, key: str) -> dict | None:
    return next((t for t in _taints(node) if t.get("key") == key), None)


def _condition(node: dict, kind: str) -> dict | None:
    conds = (node.get("status") or {}).get("conditions") or []
    return next((c for c in conds if isinstance(c, dict) and c.get("type") == kind), None)


def _level(node: dict) -> str | None:
    taint = _taint(node, TAINT)
    value = (taint or {}).get("value")
    return value if value in LEVELS else ("cordoned" if taint else None)


def _is_spare(node: dict) -> bool:
    return SPARE_LABEL in _labels(node) and _taint(node, SPARE_TAINT) is not None


def _ours(node: dict) -> bool:
    """Something on the node is the agent's to undo: its taint, its spare mark, its cordon, or its condition
    saying unhealthy."""
    cond = _condition(node, CONDITION)
    return (_taint(node, TAINT) is not None or _taint(node, SPARE_TAINT) is not None
            or _annotations(node).get(OURS_UNSCHEDULABLE) == "true" or (cond or {}).get("status") == "False")


def _epoch(stamp: Any) -> float | None:
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    if not isinstance(stamp, str) or len(stamp) > 40:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def domain_of(node: dict) -> str | None:
    labels = _labels(node)
    return labels.get(CLIQUE_LABEL) or labels.get(DOMAIN_LABEL) or None


def evictable(pod: dict) -> bool:
    """A pod a drain evicts: running work, not a DaemonSet's (its controller would put it straight back and it
    tolerates the cordon) nor a static pod's mirror (the API cannot remove it), nor one already finished."""
    meta = pod.get("metadata") or {}
    if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
        return False
    if any(isinstance(o, dict) and o.get("kind") == "DaemonSet" and o.get("controller")
           for o in meta.get("ownerReferences") or []):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def view(node: dict, jobs: int | None = None) -> NodeView:
    """One Node as a NodeView. `jobs`: the evictable pods still on it, when they were counted."""
    level, spare = _level(node), _is_spare(node) and _level(node) is None
    cond = _condition(node, CONDITION) or {}
    if (_condition(node, "Ready") or {}).get("status") != "True":
        service = Service.DOWN
    elif level in ("drained", "quarantined"):
        service = Service.DRAINED
    elif level or spare or (node.get("spec") or {}).get("unschedulable"):
        service = Service.DRAINED if jobs == 0 else Service.CORDONED
    else:
        service = Service.IN_SERVICE
    reason = since = None
    if level:
        reason = cond.get("message") if cond.get("status") == "False" else None
        reason = reason or f"{REASON_PREFIX} {level}"
        since = _epoch(cond.get("lastTransitionTime")) if cond.get("status") == "False" else None
    elif spare:
        reason = SPARE_REASON  # since: the condition does not move when a healthy node becomes a spare
    elif cond.get("status") == "False":  # our taint was taken off by hand; our condition still says unhealthy
        reason, since = cond.get("message"), _epoch(cond.get("lastTransitionTime"))
    return NodeView(name=(node.get("metadata") or {}).get("name", ""), service=service, reason=reason,
                    reason_since=since, ours=_ours(node), quarantined=level == "quarantined",
                    domain=domain_of(node), spare=spare, jobs=jobs)


def job_view(pod: dict) -> JobView:
    """One pod as the job response sees it (agent/jobs/respond.py): its state, its node, and the reason gpuwarden
    last wrote on it (the message of our condition)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    state = POD_STATES.get(status.get("phase"), "unknown")
    if meta.get("deletionTimestamp") and state != "ended":
        state = "ending"  # deleted or evicted: the kubelet is stopping it within its grace period
    node = spec.get("nodeName")
    cond = _condition(pod, JOB_CONDITION) or {}
    mark = cond.get("message") if cond.get("status") == "True" and isinstance(cond.get("message"), str) else None
    return JobView(id=f"{meta.get('namespace', '')}/{meta.get('name', '')}", state=state,
                   nodes=(node,) if _is_dns_subdomain(node) else (), run=None, requeueable=None, mark=mark)


def _pod_uid(job: Any) -> str:
    uid = getattr(job, "id", None)
    if getattr(job, "scheduler", None) != "kubernetes" or not isinstance(uid, str) or not _POD_UID.fullmatch(uid):
        raise Refused(f"{getattr(job, 'scheduler', None)!r} job {str(uid)[:80]!r}: not a Kubernetes pod UID")
    return uid


def _with_taint(taints: list[dict], key: str, value: str | None, effect: str | None) -> list[dict]:
    """`taints` with the one of `key` replaced (value None: removed); others kept as they are."""
    out = [t for t in taints if t.get("key") != key]
    if value is not None:
        out.append({"key": key, "value": value, "effect": effect})
    return out


# -- the adapter -------------------------------------------------------------------------------------------------
class _HttpError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"HTTP {code}: {message}")
        self.code, self.message = code, message


def _typed(e: _HttpError, what: str) -> Exception:
    if e.code == 429 or e.code >= 500 or e.code == 409:
        return Transient(f"{what}: the API server answered {e.code} ({e.message}); retry later")
    return Refused(f"{what}: the API server refused with {e.code} ({e.message})")


def _bounded(fn: Callable) -> Callable:
    """A public call: one deadline for all its requests, and any HTTP refusal left over made a typed error."""

    @functools.wraps(fn)
    def call(self: KubernetesAdapter, *args: Any, **kwargs: Any) -> Any:
        with self._deadline():
            try:
                return fn(self, *args, **kwargs)
            except _HttpError as e:
                raise _typed(e, f"{fn.__name__}{args!r}") from e

    return call


class KubernetesAdapter:
    """The SchedulerAdapter for Kubernetes (see the module docstring for what it writes)."""

    name = "kubernetes"

    def __init__(self, *, timeout_s: float = 10.0, kubeconfig: str | None = None, context: str | None = None,
                 quarantine_effect: str = "NoSchedule", conflict_retries: int = 5,
                 event_namespace: str = EVENT_NAMESPACE, host: str | None = None, node_name: str | None = None):
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600] seconds, got {timeout_s!r}")
        if quarantine_effect not in ("NoSchedule", "NoExecute"):
            raise ValueError(f"quarantine_effect must be NoSchedule or NoExecute, got {quarantine_effect!r}")
        if not 0 <= conflict_retries <= 100:
            raise ValueError(f"conflict_retries must be in [0, 100], got {conflict_retries!r}")
        self.timeout_s = float(timeout_s)
        self.quarantine_effect = quarantine_effect
        self.conflict_retries = conflict_retries
        if node_name is not None and not _is_dns_subdomain(node_name):
            raise ValueError(f"node_name must be a Kubernetes node name (an RFC 1123 subdomain), got {node_name!r}")
        self.event_namespace = event_namespace
        self.host = host or socket.gethostname()
        # The node this agent speaks for: where a job's pod is looked for (see _job_pod). None: the whole cluster.
        self.node_name = node_name
        self._kubeconfig, self._context = kubeconfig, context
        self._httpx, self._lk, self._client_adapter, self._core, self._patch_type = _lightkube()
        self._local = threading.local()
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._blocked_reported: dict[str, frozenset[str]] = {}

    # -- the connection ----------------------------------------------------------------------------------------
    def _api(self) -> Any:
        with self._client_lock:
            if self._client is None:
                lk, httpx = self._lk, self._httpx
                try:
                    if self._kubeconfig:
                        cfg = lk.KubeConfig.from_file(self._kubeconfig).get(context_name=self._context)
                    else:
                        cfg = lk.KubeConfig.from_env().get(context_name=self._context)
                    verify = self._client_adapter.verify_cluster(cfg.cluster, cfg.user, cfg.abs_file)
                except (lk.ConfigError, OSError, ValueError, AssertionError) as e:
                    where = self._kubeconfig or "in-cluster, then $KUBECONFIG, then ~/.kube/config"
                    raise Refused(f"no usable Kubernetes configuration ({where}): {e}") from e
                transport = _BoundedTransport(httpx, httpx.HTTPTransport(verify=verify), self._local)
                self._client = lk.Client(cfg, timeout=httpx.Timeout(self.timeout_s), transport=transport,
                                         lazy=False, field_manager=COMPONENT, trust_env=False)
            return self._client

    @contextmanager
    def _deadline(self) -> Iterator[None]:
        outer = getattr(self._local, "deadline", None)
        if outer is None:
            self._local.deadline = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            if outer is None:
                self._local.deadline = None

    def _req(self, what: str, verb: str, *args: Any, keep: Callable[[Any], bool] | None = None,
             **kwargs: Any) -> Any:
        """One client call (`verb`: get, list, patch, create, delete): transport trouble is Transient, an HTTP refusal
        an _HttpError for the caller to judge. A list is read whole here, page by page; with `keep`, only the items it
        keeps are held (a search through many pages holds one page at a time). A delete answers None."""
        httpx = self._httpx
        try:
            out = getattr(self._api(), verb)(*args, **kwargs)
            if verb == "list":
                return [item.to_dict() for item in out if keep is None or keep(item)]
            return None if out is None else out.to_dict()
        except self._lk.ApiError as e:
            raise _HttpError(e.response.status_code, (e.status.message or e.status.reason or "")[:300]) from e
        except httpx.HTTPStatusError as e:
            raise _HttpError(e.response.status_code, e.response.text[:300]) from e
        except httpx.TimeoutException as e:
            raise Transient(f"{what}: no answer from the API server within {self.timeout_s:g} s ({e})") from e
        except (httpx.TransportError, OSError) as e:
            raise Transient(f"{what}: could not reach the API server ({type(e).__name__}: {e})") from e
        except (ValueError, KeyError, TypeError) as e:
            raise Transient(f"{what}: the API server's answer could not be read ({e})") from e

    def _get(self, name: str) -> dict:
        if not _is_dns_subdomain(name):
            raise Refused(f"{name!r} is not a Kubernetes node name")
        return self._req(f"get node {name}", "get", self._core.Node, name)

    def _list_nodes(self, labels: dict | None = None) -> list[dict]:
        return self._req("list nodes", "list", self._core.Node, labels=labels, chunk_size=LIST_PAGE)

    def _pods(self, node: str) -> list[dict]:
        return self._req(f"list pods on {node}", "list", self._core.Pod, namespace="*",
                         fields={"spec.nodeName": node}, chunk_size=LIST_PAGE)

    # -- writes ------------------------------------------------------------------------------------------------
    def _write(self, name: str, change: Callable[[dict], dict | None], node: dict | None = None) -> tuple[dict, bool]:
        """Applies `change` (the node -> a merge patch of its metadata/spec, None for nothing to do) with the
        resourceVersion it was computed from; on 409 reads again and retries. Returns the node and whether it
        changed."""
        for attempt in range(self.conflict_retries + 1):
            node = node if node is not None else self._get(name)
            patch = change(node)
            if patch is None:
                return node, False
            patch.setdefault("metadata", {})["resourceVersion"] = _rv(node)
            try:
                return self._req(f"patch node {name}", "patch", self._core.Node, name, patch,
                                 patch_type=self._patch_type.MERGE), True
            except _HttpError as e:
                if e.code != 409:
                    raise
                log.info("node changed under our write, reading it again", node=name, attempt=attempt + 1)
                node = None
        raise Transient(f"node {name} kept changing under our writes ({self.conflict_retries + 1} conflicts); "
                        "retry later")

    def _set_condition(self, name: str, node: dict, status: str, reason: str, message: str) -> bool:
        """The GpuwardenHealthy condition, through nodes/status as a strategic merge patch (conditions merge by
        type, so the kubelet's are left alone). lastTransitionTime moves only when the status does."""
        message = message[:MAX_MESSAGE]
        for _ in range(self.conflict_retries + 1):
            old = _condition(node, CONDITION)
            if old and (old.get("status"), old.get("reason"), old.get("message")) == (status, reason, message):
                return False
            now = _rfc3339(time.time())
            moved = old is None or old.get("status") != status or not old.get("lastTransitionTime")
            cond = {"type": CONDITION, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now if moved else _stamp(old.get("lastTransitionTime"))}
            patch = {"metadata": {"resourceVersion": _rv(node)},
                     "status": {"conditions": [cond]}}
            try:
                self._req(f"patch node {name} status", "patch", self._core.Node.Status, name, patch,
                          patch_type=self._patch_type.STRATEGIC)
                return True
            except _HttpError as e:
                if e.code != 409:
                    raise
                node = self._get(name)
        raise Transient(f"node {name}'s status kept changing under our writes; retry later")

    def _event(self, obj: dict, reason: str, message: str, warning: bool = True, kind: str = "Node") -> None:
        """An Event on the node (or pod). Best effort: the change it reports is made already, so a failure is
        logged."""
        meta = obj.get("metadata") or {}
        name, now = meta.get("name", ""), _rfc3339(time.time())
        involved = {"apiVersion": "v1", "kind": kind, "name": name, "uid": meta.get("uid")}
        # A namespaced object's Events must live in its namespace (the API server refuses any other); a Node's go
        # to event_namespace, as the kubelet's do.
        namespace = meta.get("namespace") if kind != "Node" else None
        if namespace:
            involved["namespace"] = namespace
        where = namespace or self.event_namespace
        event = {
            "metadata": {"name": f"{name[:230]}.{time.time_ns():x}", "namespace": where},
            "involvedObject": involved,
            "reason": reason, "message": message[:MAX_MESSAGE], "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self.host}, "reportingComponent": COMPONENT,
            "reportingInstance": self.host, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self._req(f"event on {kind.lower()} {name}", "create", self._core.Event.from_dict(event), namespace=where)
        except (_HttpError, Transient) as e:
            if namespace:
                log.warning("could not record an event on the pod", pod=f"{namespace}/{name}", reason=reason,
                            error=str(e))
            else:
                log.warning("could not record an event on the node", node=name, reason=reason, error=str(e))

    # -- marks -------------------------------------------------------------------------------------------------
    def _mark(self, name: str, level: str, reason: str, effect: str = "NoSchedule") -> dict:
        """Cordon `name` at least as far as `level` (never back: cordoning a drained node leaves it drained)."""
        if not isinstance(reason, str) or not reason.startswith(REASON_PREFIX):
            raise Refused(f"a reason the agent writes starts with {REASON_PREFIX!r}, got {reason!r}")

        def change(node: dict) -> dict | None:
            now_level = _level(node)
            want = level if now_level is None or LEVELS.index(level) > LEVELS.index(now_level) else now_level
            taint = _taint(node, TAINT) or {}
            want_effect = effect if want == level else taint.get("effect", "NoSchedule")
            spec, annotations = node.get("spec") or {}, _annotations(node)
            patch: dict[str, Any] = {}
            if taint.get("value") != want or taint.get("effect") != want_effect:
                patch.setdefault("spec", {})["taints"] = _with_taint(_with_taint(_taints(node), SPARE_TAINT, None,
                                                                                  None), TAINT, want, want_effect)
            elif _taint(node, SPARE_TAINT):
                patch.setdefault("spec", {})["taints"] = _with_taint(_taints(node), SPARE_TAINT, None, None)
            if not spec.get("unschedulable"):
                patch.setdefault("spec", {})["unschedulable"] = True
                patch.setdefault("metadata", {}).setdefault("annotations", {})[OURS_UNSCHEDULABLE] = "true"
            if SPARE_LABEL in _labels(node):  # a node that goes bad leaves the spare pool
                patch.setdefault("metadata", {}).setdefault("labels", {})[SPARE_LABEL] = None
            if TAKEN_FOR in annotations:
                patch.setdefault("metadata", {}).setdefault("annotations", {})[TAKEN_FOR] = None
            return patch or None

        node, changed = self._write(name, change)
        level_now = _level(node) or level
        cond = _condition(node, CONDITION) or {}
        message = reason if changed or cond.get("status") != "False" else cond.get("message") or reason
        wrote = self._set_condition(name, node, "False", CONDITION_REASON[level_now], message)
        if changed or wrote:
            self._event(node, f"Gpuwarden{CONDITION_REASON[level_now]}", message)
        return node

    @_bounded
    def nodes(self) -> Sequence[NodeView]:
        return [view(n) for n in self._list_nodes()]

    @_bounded
    def node(self, node: str) -> NodeView:
        obj = self._get(node)
        pods = self._pods(node)
        return view(obj, jobs=sum(1 for p in pods if evictable(p)))

    @_bounded
    def cordon(self, node: str, reason: str) -> None:
        self._mark(node, "cordoned", reason)

    @_bounded
    def drain(self, node: str, reason: str) -> None:
        self._drain(node, reason)

    def _drain(self, node: str, reason: str) -> dict:
        obj = self._mark(node, "draining", reason)
        if _level(obj) in ("drained", "quarantined"):
            return obj
        blocked: list[str] = []
        for pod in self._pods(node):
            if not evictable(pod):
                continue
            meta = pod.get("metadata") or {}
            namespace, pod_name = meta.get("namespace"), meta.get("name")
            key = f"{namespace}/{pod_name}"
            if not (_is_dns_subdomain(namespace) and _is_dns_subdomain(pod_name)):
                raise Refused(f"drain {node}: the API server listed a pod whose name is not valid ({key[:300]!r})")
            if meta.get("deletionTimestamp"):  # evicted already, terminating: waited for below
                continue
            try:
                self._evict(namespace, pod_name)
            except _HttpError as e:
                if e.code == 404:  # gone already
                    continue
                if e.code == 429:
                    blocked.append(key)
                    continue
                raise _typed(e, f"evict {key}") from e
        if blocked:
            if self._blocked_reported.get(node) != frozenset(blocked):
                self._blocked_reported[node] = frozenset(blocked)
                self._event(obj, "GpuwardenDrainBlocked", f"{REASON_PREFIX} a PodDisruptionBudget forbids evicting "
                                                          f"{', '.join(sorted(blocked)[:10])} now; will retry")
            raise Busy(f"drain {node}: a PodDisruptionBudget forbids evicting {', '.join(sorted(blocked)[:10])}"
                            " now (429); retry later")
        self._blocked_reported.pop(node, None)
        remaining = [p for p in self._pods(node) if evictable(p)]
        if remaining:
            names = sorted(f"{(p.get('metadata') or {}).get('namespace')}/{_name(p)}" for p in remaining)
            raise Busy(f"drain {node}: {len(names)} pod(s) still terminating ({', '.join(names[:10])}); "
                            "retry later")
        cond = _condition(obj, CONDITION) or {}
        return self._mark(node, "drained", cond.get("message") or reason)

    def _evict(self, namespace: str, name: str) -> None:
        eviction = self._core.Pod.Eviction.from_dict({
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}})
        self._req(f"evict {namespace}/{name}", "create", eviction, name, namespace=namespace)

    @_bounded
    def quarantine(self, node: str, reason: str) -> None:
        self._drain(node, reason)
        self._mark(node, "quarantined", reason, effect=self.quarantine_effect)

    @_bounded
    def resume(self, node: str) -> None:
        obj = self._get(node)
        if not _ours(obj):
            if (obj.get("spec") or {}).get("unschedulable"):
                raise Refused(f"{node} is cordoned, and not by gpuwarden (spec.unschedulable without its taint or "
                              "condition): left as it is")
            return

        def change(n: dict) -> dict | None:
            patch: dict[str, Any] = {}
            taints = _with_taint(_with_taint(_taints(n), TAINT, None, None), SPARE_TAINT, None, None)
            if taints != _taints(n):
                patch.setdefault("spec", {})["taints"] = taints
            annotations = _annotations(n)
            if annotations.get(OURS_UNSCHEDULABLE) == "true" and (n.get("spec") or {}).get("unschedulable"):
                patch.setdefault("spec", {})["unschedulable"] = None
            for key in (OURS_UNSCHEDULABLE, TAKEN_FOR):
                if key in annotations:
                    patch.setdefault("metadata", {}).setdefault("annotations", {})[key] = None
            if SPARE_LABEL in _labels(n):
                patch.setdefault("metadata", {}).setdefault("labels", {})[SPARE_LABEL] = None
            return patch or None

        obj, changed = self._write(node, change, obj)
        wrote = self._set_condition(node, obj, "True", "InService", f"{REASON_PREFIX} in service")
        if changed or wrote:
            self._event(obj, "GpuwardenResume", f"{REASON_PREFIX} back in service", warning=False)
        if (obj.get("spec") or {}).get("unschedulable"):
            raise Refused(f"{node}: gpuwarden's marks are removed, but spec.unschedulable was set by someone else "
                          "before gpuwarden's cordon: left cordoned")

    @_bounded
    def publish_domain(self, node: str, domain: str) -> None:
        if not _is_label_value(domain):
            raise Refused(f"domain {domain!r} is not a Kubernetes label value (at most 63 characters [A-Za-z0-9_.-], "
                          "starting and ending alphanumeric)")

        try:
            wanted = kubernetes_labels(domain)  # the same labels `gpuwarden topology --json` names
        except ValueError as exc:
            raise Refused(str(exc)) from None

        def change(n: dict) -> dict | None:
            labels = _labels(n)
            # GPU feature discovery owns the clique label where it runs: set it only where nothing has.
            want = {k: v for k, v in wanted.items() if labels.get(k) != v and not (k == CLIQUE_LABEL and k in labels)}
            return {"metadata": {"labels": want}} if want else None

        obj, changed = self._write(node, change)
        if changed:
            self._event(obj, "GpuwardenDomain", f"{REASON_PREFIX} NVLink domain {domain}", warning=False)

    def _spare_nodes(self, domain: str, nodes: list[dict]) -> list[dict]:
        return sorted((n for n in nodes if _labels(n).get(SPARE_LABEL) == domain and _is_spare(n)
                       and _level(n) is None and (_condition(n, "Ready") or {}).get("status") == "True"
                       and _is_dns_subdomain(_name(n))), key=_name)

    @_bounded
    def spares(self, domain: str) -> list[str]:
        if not _is_label_value(domain):
            return []
        found = self._list_nodes(labels={SPARE_LABEL: domain})
        return [_name(n) for n in self._spare_nodes(domain, found)]

    @_bounded
    def take_spare(self, domain: str, for_node: str) -> str | None:
        if not _is_label_value(domain) or not _is_dns_subdomain(for_node):
            raise Refused(f"take_spare({domain!r}, {for_node!r}): not a label value and a node name")
        fleet = self._list_nodes()
        for n in fleet:  # a retried intent: the spare already taken for this node
            if _annotations(n).get(TAKEN_FOR) == for_node and domain_of(n) == domain and not _is_spare(n) \
                    and _level(n) is None and _is_dns_subdomain(_name(n)):
                self._took(n, for_node, changed=False)
                return _name(n)
        for candidate in self._spare_nodes(domain, fleet):
            name = _name(candidate)
            node: dict | None = candidate
            for _ in range(self.conflict_retries + 1):
                if node is None:
                    try:
                        node = self._get(name)
                    except _HttpError as e:
                        if e.code == 404:
                            break
                        raise
                if _labels(node).get(SPARE_LABEL) != domain or not _is_spare(node) or _level(node) is not None:
                    break  # another agent took it (or it went bad): the next one
                patch = {"metadata": {"resourceVersion": _rv(node),
                                      "labels": {SPARE_LABEL: None}, "annotations": {TAKEN_FOR: for_node}},
                         "spec": {"taints": _with_taint(_taints(node), SPARE_TAINT, None, None)}}
                if _annotations(node).get(OURS_UNSCHEDULABLE) == "true":
                    patch["spec"]["unschedulable"] = None
                    patch["metadata"]["annotations"][OURS_UNSCHEDULABLE] = None
                try:
                    out = self._req(f"take spare {name}", "patch", self._core.Node, name, patch,
                                    patch_type=self._patch_type.MERGE)
                except _HttpError as e:
                    if e.code == 409:  # someone wrote it since we read it: read again, it may still be free
                        node = None
                        continue
                    if e.code == 404:
                        break
                    raise
                self._took(out, for_node, changed=True)
                return name
        return None

    def _took(self, node: dict, for_node: str, changed: bool) -> None:
        name = _name(node)
        wrote = self._set_condition(name, node, "True", "InService",
                                    f"{REASON_PREFIX} spare in service in place of {for_node}")
        if changed or wrote:
            self._event(node, "GpuwardenSpareTaken", f"{REASON_PREFIX} spare taken into service in place of "
                                                     f"{for_node}", warning=False)

    @_bounded
    def return_to_pool(self, node: str, domain: str) -> None:
        if not _is_label_value(domain):
            raise Refused(f"domain {domain!r} is not a Kubernetes label value")
        obj = self._get(node)
        if (obj.get("spec") or {}).get("unschedulable") and not _ours(obj):
            raise Refused(f"{node} is cordoned, and not by gpuwarden: not put into the spare pool")

        def change(n: dict) -> dict | None:
            patch: dict[str, Any] = {}
            taints = _with_taint(_with_taint(_taints(n), TAINT, None, None), SPARE_TAINT, "true", "NoSchedule")
            if taints != _taints(n):
                patch.setdefault("spec", {})["taints"] = taints
            if _labels(n).get(SPARE_LABEL) != domain:
                patch.setdefault("metadata", {}).setdefault("labels", {})[SPARE_LABEL] = domain
            if domain_of(n) is None:  # so the spare is still known as the domain's once taken into service
                patch.setdefault("metadata", {}).setdefault("labels", {})[DOMAIN_LABEL] = domain
            if not (n.get("spec") or {}).get("unschedulable"):
                patch.setdefault("spec", {})["unschedulable"] = True
                patch.setdefault("metadata", {}).setdefault("annotations", {})[OURS_UNSCHEDULABLE] = "true"
            if TAKEN_FOR in _annotations(n):
                patch.setdefault("metadata", {}).setdefault("annotations", {})[TAKEN_FOR] = None
            return patch or None

        obj, changed = self._write(node, change, obj)
        wrote = self._set_condition(node, obj, "True", "Spare", SPARE_REASON)
        if changed or wrote:
            self._event(obj, "GpuwardenSpare", f"{SPARE_REASON} of domain {domain}", warning=False)

    # -- jobs (agent/jobs/respond.py): a job is a pod, known by its UID -----------------------------------------------
    def _job_pod(self, job: Any) -> dict | None:
        """The pod whose UID is the job's id, as the API server has it now; None when there is none (it went).

        The API server offers no field selector on metadata.uid for pods (only metadata.name, metadata.namespace,
        spec.nodeName, status.phase and a few more), and a UID names no namespace, so the pod is found by listing.
        With node_name, only this node's pods: a pod never moves (spec.nodeName is fixed once it is bound), so a UID
        that is not among them is gone, and the list stays the size of one node's pods. Without it, every pod of the
        cluster is read page by page, holding only the match: right on any cluster, slow on a large one."""
        uid = _pod_uid(job)
        fields = {"spec.nodeName": self.node_name} if self.node_name else None
        found = self._req(f"find pod {uid}", "list", self._core.Pod, namespace="*", fields=fields,
                          chunk_size=LIST_PAGE, keep=lambda p: p.metadata is not None and p.metadata.uid == uid)
        if not found:
            return None
        meta = found[0].get("metadata") or {}
        if not (_is_dns_subdomain(meta.get("namespace")) and _is_dns_subdomain(meta.get("name"))):
            raise Refused(f"pod {uid}: the API server listed it with a name that is not valid "
                          f"({meta.get('namespace')!r}/{meta.get('name')!r})")
        return found[0]

    @_bounded
    def job(self, job: Any) -> JobView | None:
        pod = self._job_pod(job)
        return None if pod is None else job_view(pod)

    @_bounded
    def mark_job(self, job: Any, reason: str) -> None:
        """The condition GpuwardenJobDoomed on the pod (status True, message = the reason) and a Warning Event: where
        `kubectl describe pod` shows them to the job's owner, and where a Job's podFailurePolicy can match it. Written
        as the controllers that set DisruptionTarget or a readiness gate's condition write theirs: through pods/status
        as a strategic merge patch, conditions merging by type, so the kubelet's stay as they are (and the kubelet
        keeps the conditions it does not own)."""
        if not isinstance(reason, str) or not reason.startswith(REASON_PREFIX):
            raise Refused(f"a reason the agent writes starts with {REASON_PREFIX!r}, got {reason!r}")
        pod = self._job_pod(job)
        if pod is None:
            return  # gone: nothing left to carry the reason, nor to end
        message = reason[:MAX_MESSAGE]
        old = _condition(pod, JOB_CONDITION)
        if old and (old.get("status"), old.get("reason"), old.get("message")) == ("True", JOB_CONDITION, message):
            return
        meta = pod["metadata"]
        now = _rfc3339(time.time())
        moved = old is None or old.get("status") != "True" or not old.get("lastTransitionTime")
        cond = {"type": JOB_CONDITION, "status": "True", "reason": JOB_CONDITION, "message": message,
                "lastTransitionTime": now if moved else _stamp(old.get("lastTransitionTime"))}
        # The UID in the patch is a precondition (the kubelet's own status patches carry it the same way): a pod
        # of the same name made since (a StatefulSet's, a JobSet's) is refused, never marked in place of ours.
        patch = {"metadata": {"uid": meta["uid"]}, "status": {"conditions": [cond]}}
        key = f"{meta['namespace']}/{meta['name']}"
        try:
            self._req(f"mark pod {key}", "patch", self._core.Pod.Status, meta["name"], patch,
                      namespace=meta["namespace"], patch_type=self._patch_type.STRATEGIC)
        except _HttpError as e:
            if e.code == 404 or (e.code == 422 and self._job_pod(job) is None):
                return  # gone meanwhile (or replaced by a pod of the same name): nothing of ours left to mark
            raise
        self._event(pod, JOB_CONDITION, message, kind="Pod")
        log.info("pod marked", pod=key, uid=meta["uid"], reason=message)

    # Kubernetes has no API that sends a signal to a container: what ends a pod is a DELETE (an Eviction is a DELETE
    # that PodDisruptionBudgets may refuse), after which the kubelet sends its containers SIGTERM, then SIGKILL once
    # the grace period is over. So signal and requeue are one delete with the pod's own terminationGracePeriodSeconds
    # (time to checkpoint), the pod's controller (Job, JobSet, PyTorchJob, StatefulSet) making a new pod, on another
    # node since this one is cordoned; cancel is a delete with gracePeriodSeconds=0. A DELETE, not an Eviction: a
    # gang-scheduled job's budget often has minAvailable = every worker, so its eviction would be refused (429) for
    # as long as the job runs, and the doomed pod would hold every GPU of the job idle until the watchdog fires.
    @_bounded
    def signal_job(self, job: Any, signal: str) -> None:
        """Deletes the pod with its own grace period. `signal` is not used: the kubelet sends each container its stop
        signal (SIGTERM unless the image sets another STOPSIGNAL), and no API sends another."""
        self._end_pod(job, grace_s=None, what="signal")

    @_bounded
    def requeue_job(self, job: Any) -> None:
        """Deletes the pod with its own grace period; its controller makes the new one."""
        self._end_pod(job, grace_s=None, what="requeue")

    @_bounded
    def cancel_job(self, job: Any) -> None:
        """Deletes the pod at once (gracePeriodSeconds=0)."""
        self._end_pod(job, grace_s=0, what="cancel")

    def _end_pod(self, job: Any, grace_s: int | None, what: str) -> None:
        pod = self._job_pod(job)
        if pod is None:
            return  # gone already
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        if meta.get("deletionTimestamp") and grace_s is None:
            return  # deleted already, terminating within its grace period: a repeat changes nothing
        # lightkube's delete sends no DeleteOptions body, so no UID precondition rides with it: the name is the
        # one the pod had when found by its UID just now. A pod of the same name (a StatefulSet's) can take its
        # place only once ours is gone from the API server, and a terminating pod is still listed, so ours would
        # have to finish terminating and be replaced in the moment between this read and the delete.
        try:
            self._req(f"delete pod {key}", "delete", self._core.Pod, meta["name"], namespace=meta["namespace"],
                      grace_period=grace_s)
        except _HttpError as e:
            if e.code == 404:
                return  # gone meanwhile
            raise
        log.info("pod deleted", pod=key, uid=meta["uid"], action=what,
                 grace_s="the pod's own" if grace_s is None else grace_s)

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _stamp(value: Any) -> Any:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(value, datetime) else value


class _BoundedTransport:
    """Wraps the HTTP transport: each request's timeouts are cut to what is left of its call's deadline, and the
    answer is read whole within that deadline and up to MAX_RESPONSE_BYTES (a server that trickles bytes or
    answers without end still ends the call)."""

    def __init__(self, httpx: Any, inner: Any, local: threading.local):
        self._httpx, self._inner, self._local = httpx, inner, local

    def __enter__(self) -> _BoundedTransport:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)

    def close(self) -> None:
        self._inner.close()

    def handle_request(self, request: Any) -> Any:
        httpx = self._httpx
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpx.TimeoutException("the call's time ran out before this request", request=request)
            timeouts = request.extensions.get("timeout") or {}
            request.extensions["timeout"] = {k: left if timeouts.get(k) is None else min(timeouts[k], left)
                                             for k in ("connect", "read", "write", "pool")}
        response = self._inner.handle_request(request)
        chunks, size = [], 0
        try:
            for chunk in response.stream:
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise httpx.RemoteProtocolError(f"the answer is over {MAX_RESPONSE_BYTES} bytes",
                                                    request=request)
                if deadline is not None and time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the call's time ran out while reading the answer", request=request)
                chunks.append(chunk)
        finally:
            response.stream.close()
        return httpx.Response(response.status_code, headers=response.headers, content=b"".join(chunks),
                              extensions=response.extensions, request=request)

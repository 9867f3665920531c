"""The Kubernetes adapter's plain decisions over the API's objects (Nodes and Pods as dicts in the API's JSON shape):
the names and marks the agent owns, what a Node's labels, taints and conditions say (its NodeView), and what a pod is
to a drain and to the job response. No client here: these run the same on any answer."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, JobView, NodeView, Refused, Service, Transient

# one set of labels with `gpuwarden topology`
from gpuwarden.agent.node.topology import CLIQUE_LABEL, DOMAIN_LABEL

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
MAX_MESSAGE = 1024  # a condition's or event's message
JOB_CONDITION = "GpuwardenJobDoomed"  # the pod condition (and the Event reason) that carries a doomed job's reason
# A pod's phase as the job response reads it; a pod with a deletionTimestamp that has not finished is "ending".
POD_STATES = {"Running": "running", "Pending": "pending", "Succeeded": "ended", "Failed": "ended",
              "Unknown": "unknown"}
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # as the API server makes them


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


def _stamp(value: Any) -> Any:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(value, datetime) else value


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

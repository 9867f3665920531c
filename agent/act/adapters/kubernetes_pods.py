"""The Kubernetes adapter's pods: a drain's evictions (policy/v1 Eviction, so PodDisruptionBudgets hold), and the job
response's doomed pod (agent/jobs/respond.py): found by its UID, marked with the GpuwardenJobDoomed condition, ended
with a DELETE. A mixin of KubernetesAdapter (agent/act/adapters/kubernetes.py)."""
from __future__ import annotations

import time
from typing import Any

from gpuwarden.agent.act.adapters.kubernetes_api import LIST_PAGE, KubernetesApi, _bounded, _HttpError, _typed
from gpuwarden.agent.act.adapters.kubernetes_objects import (
    CONDITION,
    JOB_CONDITION,
    MAX_MESSAGE,
    _condition,
    _is_dns_subdomain,
    _level,
    _name,
    _pod_uid,
    _rfc3339,
    _stamp,
    evictable,
    job_view,
)
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import REASON_PREFIX, Busy, JobView, Refused

log = logs.get_logger("gpuwarden.adapter.kubernetes")


class PodActions(KubernetesApi):
    """Evicting a node's pods and ending a doomed job's pod."""

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

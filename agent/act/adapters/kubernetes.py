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
runs without it wherever another adapter is chosen. The parts: the node's state here; its pods and a drain's evictions
in kubernetes_pods.py; the spare pool in kubernetes_spares.py; the client wiring, its errors and the guarded writes in
kubernetes_api.py; the plain decisions over the API's objects in kubernetes_objects.py.
"""
from __future__ import annotations

from typing import Any, Sequence

from gpuwarden.agent.act.adapters.kubernetes_api import KubernetesApi, _bounded
from gpuwarden.agent.act.adapters.kubernetes_objects import (
    CONDITION,
    CONDITION_REASON,
    LEVELS,
    OURS_UNSCHEDULABLE,
    SPARE_LABEL,
    SPARE_TAINT,
    TAINT,
    TAKEN_FOR,
    _annotations,
    _condition,
    _is_label_value,
    _labels,
    _level,
    _ours,
    _taint,
    _taints,
    _with_taint,
    evictable,
    view,
)
from gpuwarden.agent.act.adapters.kubernetes_pods import PodActions
from gpuwarden.agent.act.adapters.kubernetes_spares import NodeSpares
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import REASON_PREFIX, NodeView, Refused

# one set of labels with `gpuwarden topology`
from gpuwarden.agent.node.topology import CLIQUE_LABEL, kubernetes_labels

log = logs.get_logger("gpuwarden.adapter.kubernetes")


class KubernetesAdapter(NodeSpares, PodActions, KubernetesApi):
    """The SchedulerAdapter for Kubernetes (see the module docstring for what it writes): the node's state here, its
    pods in agent/act/adapters/kubernetes_pods.py, the spare pool in agent/act/adapters/kubernetes_spares.py, the
    connection in agent/act/adapters/kubernetes_api.py."""

    name = "kubernetes"

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

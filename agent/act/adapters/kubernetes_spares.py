"""The Kubernetes adapter's spare pool: the spares of an NVLink domain (label `gpuwarden.io/spare=<domain>`, taint
`gpuwarden.io/spare`, our cordon), the claim on one (a merge patch guarded by the resourceVersion it read, so of two
agents racing for one spare the API server lets one through and answers the other 409), and a node put back into the
pool. A mixin of KubernetesAdapter (agent/act/adapters/kubernetes.py)."""
from __future__ import annotations

from typing import Any

from gpuwarden.agent.act.adapters.kubernetes_api import KubernetesApi, _bounded, _HttpError
from gpuwarden.agent.act.adapters.kubernetes_objects import (
    OURS_UNSCHEDULABLE,
    SPARE_LABEL,
    SPARE_TAINT,
    TAINT,
    TAKEN_FOR,
    _annotations,
    _condition,
    _is_dns_subdomain,
    _is_label_value,
    _is_spare,
    _labels,
    _level,
    _name,
    _ours,
    _rv,
    _taints,
    _with_taint,
    domain_of,
)
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, Refused

# one set of labels with `gpuwarden topology`
from gpuwarden.agent.node.topology import DOMAIN_LABEL

log = logs.get_logger("gpuwarden.adapter.kubernetes")


class NodeSpares(KubernetesApi):
    """Listing, taking and returning spares."""

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

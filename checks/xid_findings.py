"""What an XID incident shows: the action NVIDIA's XID catalogue recommends for it (with the rules the catalogue
states), its finding and its samples, cached by the incident object they were made from (checks/xid.py judges).
"""
from __future__ import annotations

from typing import Any, Mapping

from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import MetricSample
from gpuwarden.checks.xid_catalog import XidInfo, recovery_action

CHECK_NAME = "xid"
SOURCES = ("kmsg", "nvml")


def _action(inc: Mapping[str, Any], xids_on: Mapping[str, set[int]], catalog: Mapping[int, XidInfo],
            force: set[int]) -> Action:
    xid, pci = int(inc["xid"]), inc["pci"]
    others = bool(xids_on.get(pci, set()) - {45, xid})
    # An NVML-only incident has no driver text: XID 154 then falls back to the catalogue's own action.
    return xid_action(xid, catalog.get(xid), inc.get("last_detail", ""), xid == 45 and others, xid in force)


# An incident's action, finding and samples, by the incident object they were made from: an incident no batch touched
# is the same object from batch to batch (see xid._incident), so a node holding many incidents rebuilds only what
# changed.
# The mark holds what else they depend on, and a fingerprint of the incident's changing fields guards against a
# caller that changed an incident in place. Only the last judgement's incidents are kept (its incidents are the next
# one's): bounded by what a node holds, and a copy an XID replaced is let go.
_SHOWN: list[dict[int, tuple[Any, ...]]] = [{}]
# The entity of each GPU as the last judgement made it: an equal one is replaced by that same object, so comparing a
# cached mark costs an identity test per incident rather than an Entity comparison. Bounded: cleared when it outgrows
# what any node holds.
_ENTITIES: dict[str, Entity] = {}


def _same_entity(pci: str, entity: Entity) -> Entity:
    held = _ENTITIES.get(pci)
    if held is not None and held == entity:
        return held
    if len(_ENTITIES) >= 4096:
        _ENTITIES.clear()
    _ENTITIES[pci] = entity
    return entity


def _shown(inc: Mapping[str, Any], entity: Entity, xids_on: Mapping[str, set[int]], catalog: Mapping[int, XidInfo],
           force: set[int], shown: dict[int, tuple[Any, ...]]
           ) -> tuple[Action, Finding, tuple[MetricSample, ...], tuple[MetricSample, ...]]:
    """The incident's action, finding, and samples (its gpuwarden_xid_events, then its per-source ones)."""
    xid = inc["xid"]
    # What the action depends on besides the incident: for XID 45 whether other XIDs share its GPU; the policy.
    mark = (entity, xid == 45 and bool(xids_on[inc["pci"]] - {45}), xid in force, inc["count"], inc.get("last_at"))
    hit = _SHOWN[0].get(id(inc))
    if hit is not None and hit[0] is inc and hit[1] == mark:
        shown[id(inc)] = hit
        return hit[2]
    action = _action(inc, xids_on, catalog, force)
    samples = _metrics({"": inc})
    made = (action, _finding(inc, entity, catalog.get(int(xid)), action, forced=mark[2]), samples[:1], samples[1:])
    shown[id(inc)] = (inc, mark, made)  # holds the incident: its id is not reused while cached
    return made


def xid_action(xid: int, info: XidInfo | None, last_detail: str, accompanied_45: bool, forced: bool) -> Action:
    """The recommended action for one GPU's XID: the catalogue's, with the rules the catalogue itself states,
    raised to at least DRAIN when the operator's policy says so (fail_xids)."""
    action = info.action if info else Action.MONITOR
    if xid == 154:
        # Each 154 reports a change of the GPU's recovery action; the latest one is what holds now.
        named = recovery_action(last_detail)
        action = named if named is not None else action
    if forced:
        return max(action, Action.DRAIN)
    if accompanied_45:
        return Action.NONE  # catalogue, XID 45: "Not Solo: IGNORE (follow guidance in other Xid)"
    return action


def xid_status(action: Action) -> Status:
    return Status.FAIL if action >= Action.DRAIN else Status.WARN if action > Action.NONE else Status.OK


def _seen(inc: Mapping[str, Any], source: str) -> int:
    """How many events of an incident `source` saw (state from before NVML was a source: all the kernel log's)."""
    return int(inc.get(f"{source}_count", inc["count"] if source == "kmsg" else 0))


def _finding(inc: Mapping[str, Any], entity: Entity, info: XidInfo | None, action: Action, forced: bool) -> Finding:
    xid = int(inc["xid"])
    counts = {source: _seen(inc, source) for source in SOURCES}
    what = f"XID {xid} ({info.description}) on {entity.label()}: {info.name}" if info else (
        f"XID {xid} on {entity.label()}: not in NVIDIA's XID catalogue; watch for repeats")
    detail = inc.get("last_detail", "")
    detail = detail if len(detail) <= 120 else detail[:117] + "..."
    last = f'last: "{detail}"' if counts["kmsg"] else "seen by NVML only (no driver text)"
    mig = f" (MIG {', '.join(inc['mig'])})" if inc.get("mig") else ""
    why = " (policy fail_xids)" if forced else ""
    message = f"{what}{mig}; {inc['count']} event(s), {last}; recommended: {action.name}{why}"
    evidence = {
        "count": inc["count"], "sources": [s for s in SOURCES if counts[s]], "kmsg_count": counts["kmsg"],
        "nvml_count": counts["nvml"], "source": inc.get("source"), "first_line": inc.get("first_line"),
        "last_line": inc.get("last_line"), "first_seq": inc["first_seq"], "last_seq": inc.get("last_seq"),
        # The log's own times (kernel clock or text stamp): the same in every mode and every run, unlike the wall
        # clock the daemon's state keeps (first_at, last_at).
        "first_time": inc.get("first_time"), "last_time": inc.get("last_time"),
        "first_message": inc["first_message"], "bucket": info.bucket if info else None,
        "pids": inc["pids"], "processes": inc["processes"], "mig_instances": inc.get("mig", []),
    }
    return Finding(CHECK_NAME, str(xid), entity, xid_status(action), message, action, evidence)


def _metrics(kept: Mapping[str, Mapping[str, Any]]) -> tuple[MetricSample, ...]:
    out = tuple(MetricSample("gpuwarden_xid_events", "XID events seen this boot, per GPU and XID code.",
                             {"pci": inc["pci"], "xid": str(inc["xid"])}, float(inc["count"]))
                for inc in kept.values())
    return out + tuple(MetricSample("gpuwarden_xid_source_events",
                                    "XID events each source saw this boot (gpuwarden_xid_events counts each once).",
                                    {"pci": inc["pci"], "xid": str(inc["xid"]), "source": source},
                                    float(_seen(inc, source)))
                       for inc in kept.values() for source in SOURCES)

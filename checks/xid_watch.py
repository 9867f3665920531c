"""XIDs as they happen, from two sources: the daemon's kernel-log follower hands new records here, and NVML's XID
events where the node has them. Repeats of one XID on one GPU are one incident (a burst); an XID 45 beside another
XID on the same GPU follows that XID; per-XID policy (ignore_xids, fail_xids). The incidents are the persisted
state, so a restart neither loses nor repeats one.

De-duplication: both sources see every XID the driver raises, but an NVML event has no pid, process, text or
time of its own, so single events cannot be paired. Each incident counts per source instead, and its count is
the larger of the two: an XID seen by both counts once, one seen only by NVML (no /dev/kmsg in a container) or
one the kernel's printk rate limit dropped still counts.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from gpuwarden.agent.model import Action, Entity, Finding, Status
from gpuwarden.agent.passive import Judgement, KernelBatch, KernelConsumer, MetricSample

from .xid import CHECK_NAME as BOOT_CHECK
from .xid import LoggedGpu, entity_lookup, collect, xid_action, xid_status
from .xid_catalog import load_catalog

CHECK_NAME = "xid_watch"
_MAX_EVIDENCE = 10
SOURCES = ("kmsg", "nvml")


def _key(pci: str, xid: int) -> str:
    return f"{pci}|{xid}"


def _incident(incidents: dict[str, dict[str, Any]], pci: str, xid: int, source: str, now: float) -> dict[str, Any]:
    inc = incidents.setdefault(_key(pci, xid), {"pci": pci, "xid": xid, "count": 0, "first_at": now,
                                                "first_seq": None, "first_message": "", "pids": [],
                                                "processes": [], "kmsg_count": 0, "nvml_count": 0})
    # State written before NVML was a source has only "count": every one of those came from the kernel log.
    inc.setdefault("kmsg_count", inc["count"])
    inc.setdefault("nvml_count", 0)
    inc[f"{source}_count"] += 1
    inc["count"] = max(inc["kmsg_count"], inc["nvml_count"])
    inc["last_at"] = now
    inc.setdefault("last_seq", None)
    return inc


def judge(state: Mapping[str, Any], batch: KernelBatch, cfg: Mapping[str, Any], now: float) -> Judgement:
    # Records of an earlier boot are gone with it, and so is every GPU-level fault that a reboot clears.
    same_boot = state.get("boot_id") == batch.boot_id
    previous = state.get("incidents", {}) if same_boot else {}
    incidents: dict[str, dict[str, Any]] = json.loads(json.dumps(previous))  # a deep copy: judge stays pure
    uuids: dict[str, str] = dict(state.get("uuids", {})) if same_boot else {}
    # Whether NVML's events can be watched is news only in NVML's own batches; it outlives a reboot.
    nvml_error = batch.nvml_error if batch.source == "nvml" else state.get("nvml_error")
    ignore = set(cfg["ignore_xids"])
    events, logged = collect(batch.records)
    uuids.update({g.pci: g.uuid for g in logged})
    for e in events:
        if e.xid in ignore:
            continue
        inc = _incident(incidents, e.pci, e.xid, "kmsg", now)
        if inc["first_seq"] is None and e.record is not None:
            inc["first_seq"], inc["first_message"] = e.record.seq, e.record.message
        inc["last_seq"] = e.record.seq if e.record else None
        inc["last_detail"] = e.detail[:300]
        for field_name, value in (("pids", e.pid), ("processes", e.process)):
            if value and value not in inc[field_name] and len(inc[field_name]) < _MAX_EVIDENCE:
                inc[field_name].append(value)
    for x in batch.nvml_xids:
        if x.xid in ignore:
            continue
        # Without an address (NVML's device matched no GPU it listed: rare) the XID still counts, on what is known.
        pci = x.pci or x.uuid or (f"index-{x.gpu}" if x.gpu is not None else "unknown")
        _incident(incidents, pci, x.xid, "nvml", now)
        if x.pci and x.uuid:
            uuids[x.pci] = x.uuid

    catalog = load_catalog()
    force = set(cfg["fail_xids"])
    entity_at = entity_lookup([*batch.gpus, *_logged(uuids)])
    findings: list[Finding] = []
    kept: dict[str, dict[str, Any]] = {}
    for key, inc in incidents.items():
        xid, pci = int(inc["xid"]), inc["pci"]
        others = {i["xid"] for i in incidents.values() if i["pci"] == pci and i["xid"] != 45}
        info = catalog.get(xid)
        # An NVML-only incident has no driver text: the catalogue's action for empty detail (XID 154 then
        # falls back to the catalogue's own action).
        action = xid_action(xid, info, inc.get("last_detail", ""), xid == 45 and bool(others), xid in force)
        # An incident stands for hold_s after its last event; one that needs a reboot (or service) stands
        # until the boot changes, which resets this state.
        if action < Action.REBOOT and now - inc["last_at"] > cfg["hold_s"]:
            continue
        kept[key] = inc
        findings.append(_finding(inc, entity_at(pci), info, action))
    if nvml_error:
        findings.append(Finding(CHECK_NAME, "nvml-events", Entity("node", "nvml"), Status.UNKNOWN,
                                f"cannot watch NVML XID events: {nvml_error}; the kernel log is still followed",
                                Action.NONE, {"nvml_error": nvml_error}))
    metrics = tuple(MetricSample("gpuwarden_xid_events", "XID events seen this boot, per GPU and XID code.",
                                 {"pci": inc["pci"], "xid": str(inc["xid"])}, float(inc["count"]))
                    for inc in kept.values())
    metrics += tuple(MetricSample("gpuwarden_xid_source_events",
                                  "XID events each source saw this boot (gpuwarden_xid_events counts each once).",
                                  {"pci": inc["pci"], "xid": str(inc["xid"]), "source": source},
                                  float(_seen(inc, source)))
                     for inc in kept.values() for source in SOURCES)
    new_state: dict[str, Any] = {"boot_id": batch.boot_id, "incidents": kept, "uuids": uuids}
    if nvml_error:
        new_state["nvml_error"] = nvml_error
    return Judgement(new_state, tuple(findings), metrics)


def _seen(inc: Mapping[str, Any], source: str) -> int:
    """How many events of an incident `source` saw (state from before NVML was a source: all the kernel log's)."""
    return int(inc.get(f"{source}_count", inc["count"] if source == "kmsg" else 0))


def _finding(inc: Mapping[str, Any], entity: Entity, info: Any, action: Action) -> Finding:
    xid = int(inc["xid"])
    counts = {source: _seen(inc, source) for source in SOURCES}
    seen_by = [source for source in SOURCES if counts[source]]
    what = f"XID {xid} ({info.description})" if info else f"XID {xid} (not in NVIDIA's XID catalogue)"
    last = f'last: "{inc.get("last_detail", "")}"' if counts["kmsg"] else "seen by NVML only (no driver text)"
    return Finding(
        CHECK_NAME, str(xid), entity, xid_status(action),
        f"{entity.label()}: {what}: {inc['count']} event(s), {last}; recommended: {action.name}", action,
        {"count": inc["count"], "sources": seen_by, "kmsg_count": counts["kmsg"], "nvml_count": counts["nvml"],
         "first_seq": inc["first_seq"], "last_seq": inc.get("last_seq"), "first_at": inc["first_at"],
         "last_at": inc["last_at"], "first_message": inc["first_message"],
         "bucket": info.bucket if info else None, "pids": inc["pids"], "processes": inc["processes"]})


def _logged(uuids: Mapping[str, str]) -> list[Any]:
    return [LoggedGpu(uuid, pci) for pci, uuid in uuids.items()]


CONSUMER = KernelConsumer(
    name=CHECK_NAME,
    summary=f"XIDs from the followed kernel log and NVML's XID events, as incidents (the continuous form of "
            f"`{BOOT_CHECK}`)",
    judge=judge,
    defaults={
        "ignore_xids": [],  # never reported
        "fail_xids": [],  # always at least DRAIN
        "hold_s": 3600.0,  # an incident below REBOOT stands this long after its last event
    },
    list_types={"ignore_xids": int, "fail_xids": int},
    interest=("NVRM: ",),  # XIDs and the driver's "GPU at PCI" lines that name the GPU
)

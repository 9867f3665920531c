"""XIDs as they happen: the daemon's kernel-log follower hands new records here. Repeats of one XID on one GPU
are one incident (a burst); an XID 45 beside another XID on the same GPU follows that XID; per-XID policy
(ignore_xids, fail_xids). The incidents are the persisted state, so a restart neither loses nor repeats one.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from gpuwarden.agent.model import Action, Finding
from gpuwarden.agent.passive import Judgement, KernelBatch, KernelConsumer, MetricSample

from .xid import CHECK_NAME as BOOT_CHECK
from .xid import LoggedGpu, entity_lookup, collect, xid_action, xid_status
from .xid_catalog import load_catalog

CHECK_NAME = "xid_watch"
_MAX_EVIDENCE = 10


def _key(pci: str, xid: int) -> str:
    return f"{pci}|{xid}"


def judge(state: Mapping[str, Any], batch: KernelBatch, cfg: Mapping[str, Any], now: float) -> Judgement:
    # Records of an earlier boot are gone with it, and so is every GPU-level fault that a reboot clears.
    same_boot = state.get("boot_id") == batch.boot_id
    previous = state.get("incidents", {}) if same_boot else {}
    incidents: dict[str, dict[str, Any]] = json.loads(json.dumps(previous))  # a deep copy: judge stays pure
    uuids: dict[str, str] = dict(state.get("uuids", {})) if same_boot else {}
    ignore = set(cfg["ignore_xids"])
    events, logged = collect(batch.records)
    uuids.update({g.pci: g.uuid for g in logged})
    for e in events:
        if e.xid in ignore:
            continue
        inc = incidents.setdefault(_key(e.pci, e.xid), {"pci": e.pci, "xid": e.xid, "count": 0, "first_at": now,
                                                        "first_seq": e.record.seq if e.record else None,
                                                        "first_message": e.record.message if e.record else "",
                                                        "pids": [], "processes": []})
        inc["count"] += 1
        inc["last_at"] = now
        inc["last_seq"] = e.record.seq if e.record else None
        inc["last_detail"] = e.detail[:300]
        for field_name, value in (("pids", e.pid), ("processes", e.process)):
            if value and value not in inc[field_name] and len(inc[field_name]) < _MAX_EVIDENCE:
                inc[field_name].append(value)

    catalog = load_catalog()
    force = set(cfg["fail_xids"])
    entity_at = entity_lookup([*batch.gpus, *_logged(uuids)])
    findings: list[Finding] = []
    kept: dict[str, dict[str, Any]] = {}
    for key, inc in incidents.items():
        xid, pci = int(inc["xid"]), inc["pci"]
        others = {i["xid"] for i in incidents.values() if i["pci"] == pci and i["xid"] != 45}
        info = catalog.get(xid)
        action = xid_action(xid, info, inc.get("last_detail", ""), xid == 45 and bool(others), xid in force)
        # An incident stands for hold_s after its last event; one that needs a reboot (or service) stands
        # until the boot changes, which resets this state.
        if action < Action.REBOOT and now - inc["last_at"] > cfg["hold_s"]:
            continue
        kept[key] = inc
        entity = entity_at(pci)
        what = f"XID {xid} ({info.description})" if info else f"XID {xid} (not in NVIDIA's XID catalogue)"
        findings.append(Finding(
            CHECK_NAME, str(xid), entity, xid_status(action),
            f"{entity.label()}: {what}: {inc['count']} event(s), last: \"{inc.get('last_detail', '')}\"; "
            f"recommended: {action.name}", action,
            {"count": inc["count"], "first_seq": inc["first_seq"], "last_seq": inc["last_seq"],
             "first_at": inc["first_at"], "last_at": inc["last_at"], "first_message": inc["first_message"],
             "bucket": info.bucket if info else None, "pids": inc["pids"], "processes": inc["processes"]}))
    metrics = tuple(MetricSample("gpuwarden_xid_events", "XID events seen this boot, per GPU and XID code.",
                                 {"pci": inc["pci"], "xid": str(inc["xid"])}, float(inc["count"]))
                    for inc in kept.values())
    return Judgement({"boot_id": batch.boot_id, "incidents": kept, "uuids": uuids}, tuple(findings), metrics)


def _logged(uuids: Mapping[str, str]) -> list[Any]:
    return [LoggedGpu(uuid, pci) for pci, uuid in uuids.items()]


CONSUMER = KernelConsumer(
    name=CHECK_NAME,
    summary=f"XIDs from the followed kernel log, as incidents (the continuous form of `{BOOT_CHECK}`)",
    judge=judge,
    defaults={
        "ignore_xids": [],  # never reported
        "fail_xids": [],  # always at least DRAIN
        "hold_s": 3600.0,  # an incident below REBOOT stands this long after its last event
    },
    list_types={"ignore_xids": int, "fail_xids": int},
    interest=("NVRM: ",),  # XIDs and the driver's "GPU at PCI" lines that name the GPU
)

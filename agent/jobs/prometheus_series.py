"""The gpuwarden series Prometheus answered for a node's scrape targets (`Rows`), turned into that node's evidence
over the window (`node_evidence`, pure): the findings that held, the state's changes, the checks that could not
look, the scrapes that failed and the jobs acted on. What the series can and cannot say is in
agent/jobs/prometheus_evidence.py's docstring."""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.render import iso_utc
from gpuwarden.agent.jobs.node_evidence import NodeEvidence
from gpuwarden.agent.jobs.prometheus_api import PrometheusError

_STATUS_NAMES = {"ok": "OK", "warn": "WARN", "fail": "FAIL", "unknown": "UNKNOWN", "skipped": "SKIPPED"}


@dataclass(frozen=True)
class Target:
    """One scrape target of gpuwarden as Prometheus labels it."""

    job: str
    instance: str
    node: str | None  # gpuwarden_node_info's `node` (the scheduler's name); None where only other series were seen


@dataclass(frozen=True)
class Rows:
    """What Prometheus answered for one batch of targets, each row {metric: labels, value | values}."""

    findings: tuple[Mapping[str, Any], ...]  # edge first | last | now: the raw time of the first / last sample
    gpus: tuple[Mapping[str, Any], ...]  # gpuwarden_gpu_info: index <-> UUID
    events: tuple[Mapping[str, Any], ...]  # the most XID / SXid events this boot in the window
    before: tuple[Mapping[str, Any], ...]  # the state just before the window, value: since when
    rises: tuple[Mapping[str, Any], ...]  # range: a state newly 1 at a point, value: since when
    after: tuple[Mapping[str, Any], ...]  # the state at the window's end
    down: tuple[Mapping[str, Any], ...]  # edge first | last | now: the points whose scrape failed
    blind: tuple[Mapping[str, Any], ...]  # the same for each check whose status was unknown
    jobs: tuple[Mapping[str, Any], ...]  # range: job actions counted at a point, value: how many
    held: tuple[Mapping[str, Any], ...] = ()  # the jobs seen on the node in the window (gpuwarden_job_gpus)


# -- series to evidence --------------------------------------------------------------------------------------------
def node_evidence(host: str, source: str, url: str, targets: Sequence[Target], rows: Rows, since: float,
                  until: float, step: float) -> NodeEvidence:
    """One host's evidence from its targets' rows (pure)."""
    keys = {(t.job, t.instance) for t in targets}

    def of(rs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [r for r in rs if (r["metric"].get("job", ""), r["metric"].get("instance", "")) in keys]

    return NodeEvidence(host, source, True, None,
                        findings=tuple(_findings(of(rows.findings), of(rows.gpus), of(rows.events), url, step)),
                        transitions=tuple(_transitions(of(rows.before), of(rows.rises), since, until)),
                        jobs=tuple(_jobs(of(rows.jobs), of(rows.held), step)),
                        state=_state(of(rows.after), of(rows.before), of(rows.rises)),
                        unknown=tuple(_unknown(of(rows.down), of(rows.blind), step)))


_FINDING_LABELS = ("check", "code", "entity_kind", "entity", "pci", "status", "action")


def _findings(rows: list[Mapping[str, Any]], gpus: list[Mapping[str, Any]], events: list[Mapping[str, Any]],
              url: str, step: float) -> list[dict[str, Any]]:
    index = {}
    for r in gpus:
        m = r["metric"]
        if m.get("uuid") and str(m.get("gpu", "")).isdigit():
            index[m["uuid"]] = int(m["gpu"])
    counts = {}
    for r in events:
        m = r["metric"]
        code = m["xid"] if "xid" in m else f"sxid-{m['sxid']}" if "sxid" in m else None
        if code is not None and m.get("pci"):
            key = (code, m["pci"])
            n = _value(r)
            if math.isfinite(n):
                counts[key] = max(counts.get(key, 0), int(n))
    spans: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rows:
        m = r["metric"]
        key = tuple(m.get(k, "") for k in _FINDING_LABELS)  # the same finding through two scrape jobs is one
        span = spans.setdefault(key, {"first": math.inf, "last": -math.inf, "targets": set()})
        t = _value(r)
        edge = m.get("edge")
        if edge in ("first", "now"):
            span["first"] = min(span["first"], t)
        if edge in ("last", "now"):
            span["last"] = max(span["last"], t)
        span["targets"].add((m.get("job", ""), m.get("instance", "")))
    out = []
    for key, span in spans.items():
        check, code, kind, ident, pci, status, action = key
        first = span["first"] if math.isfinite(span["first"]) else None
        last = span["last"] if math.isfinite(span["last"]) else first
        entity = _entity(kind, ident, pci or None, index)
        shown = ",".join(f'{k}="{v}"' for k, v in zip(_FINDING_LABELS, key, strict=True) if v)
        series = f"gpuwarden_finding{{{shown}}}"
        evidence: dict[str, Any] = {"series": series, "prometheus": url, "message": "not exported (the agent's own: "
                                    "gpuwarden status on the node)",
                                    "targets": [f"job={j} instance={i}" for j, i in sorted(span["targets"])],
                                    "resolution_s": step}
        count = counts.get((code, pci)) if pci else None
        if count is not None:
            evidence["events_this_boot"] = count
        out.append({"check": check, "code": code, "status": _STATUS_NAMES.get(status, status.upper()),
                    "action": action or "NONE", "message": _message(check, code, entity, count, first, last),
                    "entity": entity, "evidence": evidence, "first_at": first, "last_at": last,
                    "recorded_at": last})
    out.sort(key=lambda f: (f["first_at"] if f["first_at"] is not None else math.inf, f["check"], f["code"]))
    return out


def _entity(kind: str, ident: str, pci: str | None, index: Mapping[str, int]) -> dict[str, Any]:
    link = None
    uuid = ident
    if kind == "nvlink" and "/link" in ident:  # checks/nvlink_lanes.py: "<GPU UUID>/link<n>"
        uuid, _, number = ident.rpartition("/link")
        link = int(number) if number.isdigit() else None
    return {"kind": kind or "node", "id": ident, "index": index.get(uuid) if kind in ("gpu", "nvlink") else None,
            "pci": pci, "link": link}


def _message(check: str, code: str, entity: Mapping[str, Any], count: int | None, first: float | None,
             last: float | None) -> str:
    what = f"XID {code}" if check == "xid" else f"SXid {code.removeprefix('sxid-')}" if check == "nvswitch_sxid" \
        else code
    where = {"gpu": "GPU", "nvlink": "NVLink", "ib_port": "IB port", "nvswitch": "NVSwitch"}.get(
        entity["kind"], entity["kind"])
    if entity["kind"] == "nvlink" and entity.get("link") is not None:
        gpu = entity["index"] if entity.get("index") is not None else entity["id"].rpartition("/link")[0]
        name = f"GPU {gpu} NVLink {entity['link']}"
    elif entity["kind"] == "gpu" and entity.get("index") is not None:
        name = f"GPU {entity['index']}"
    else:
        name = f"{where} {entity['id']}"
    if entity.get("pci") and entity["pci"] != entity["id"]:
        name += f" ({entity['pci']})"
    events = f", {count} event{'s' if count != 1 else ''} this boot" if count is not None else ""
    held = f"in Prometheus from {_utc(first)} to {_utc(last)}" if first is not None else "in Prometheus"
    return f"{what} on {name}{events}; {held}"


def _transitions(before: list[Mapping[str, Any]], rises: list[Mapping[str, Any]], since: float,
                 until: float) -> list[dict[str, Any]]:
    """The changes of the node's state in the window, in time order; the state just before the window is where the
    first one comes from."""
    points: list[tuple[float, str, float]] = []  # (point time, state entered, since when)
    for r in rises:
        for t, v in r.get("values", ()):
            points.append((_number(t), r["metric"].get("state", ""), _number(v)))
    points.sort()
    prev = before[0]["metric"].get("state") if before else None
    out = []
    for _, to, at in points:
        if to == prev:
            continue  # the series came back after a gap in scrapes (an agent restart): not a change
        if since <= at <= until:
            out.append({"at": at, "from": prev, "to": to, "reason": "gpuwarden_node_state (the agent's reason is "
                        "not exported: gpuwarden status on the node)", "actions": []})
        prev = to
    return out


def _state(after: list[Mapping[str, Any]], before: list[Mapping[str, Any]],
           rises: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The node's state at the window's end (or its last one in the window, where its scrapes stopped before)."""
    if after:
        r = after[0]
        return {"state": r["metric"].get("state", ""), "since": _value(r), "reason": ""}
    last = max(((_number(t), r["metric"].get("state", ""), _number(v)) for r in rises for t, v in r.get("values", ())),
               default=None)
    if last is not None:
        return {"state": last[1], "since": last[2], "reason": ""}
    if before:
        return {"state": before[0]["metric"].get("state", ""), "since": _value(before[0]), "reason": ""}
    return None


def _unknown(down: list[Mapping[str, Any]], blind: list[Mapping[str, Any]], step: float) -> list[dict[str, Any]]:
    out = []
    for (job, instance, _), edge in _edges(down, ()).items():
        out.append({"check": "scrape", "error": f"Prometheus could not scrape the agent ({instance}, job {job}) "
                    f"from {_utc(edge['first'])} to {_utc(edge['last'])} (up == 0, to within {step:g} s): nothing was "
                    "seen of the node then",
                    "recorded_at": edge["last"]})
    for (_, _, check), edge in _edges(blind, ("check",)).items():
        out.append({"check": check, "error": f"could not look from {_utc(edge['first'])} to {_utc(edge['last'])} "
                    "(gpuwarden_check_status unknown; the reason is on the node: gpuwarden status)",
                    "recorded_at": edge["last"]})
    return out


def _edges(rows: list[Mapping[str, Any]], by: tuple[str, ...]) -> dict[tuple[str, str, str], dict[str, float]]:
    """first / last of each (job, instance, labels `by`), the instant at the window's end ("now") taken in."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in rows:
        m = r["metric"]
        key = (m.get("job", ""), m.get("instance", ""), "/".join(m.get(k, "") for k in by))
        e, v, edge = out.setdefault(key, {}), _value(r), m.get("edge", "")
        if edge in ("first", "now"):
            e["first"] = min(e.get("first", v), v)
        if edge in ("last", "now"):
            e["last"] = max(e.get("last", v), v)
    return {k: v for k, v in out.items() if "first" in v and "last" in v}


def _jobs(rows: list[Mapping[str, Any]], held: list[Mapping[str, Any]], step: float) -> list[dict[str, Any]]:
    """The job actions the agent counted in the window (gpuwarden_job_actions_total, by action and doom rule).
    Which job each was on is not exported: `jobs_on_node` lists the jobs the agent saw on the node in the window."""
    on_node = sorted({r["metric"]["exported_job"] for r in held if r["metric"].get("exported_job")})
    out = []
    for r in rows:
        m = r["metric"]
        for t, v in r.get("values", ()):
            at = _number(t)
            out.append({"key": None, "action": "job", "created": at, "done": at, "outcome": None,
                        "detail": {"action": m.get("action", ""), "rule": m.get("reason", ""), "count": _number(v),
                                   "jobs_on_node": on_node, "series": "gpuwarden_job_actions_total",
                                   "resolution_s": step}})
    out.sort(key=lambda j: j["created"])
    return out


def _value(r: Mapping[str, Any]) -> float:
    return _number(r["value"][1])


def _number(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise PrometheusError(f"a sample value {str(text)[:40]!r} is not a number") from None


def _utc(t: float | None) -> str:
    return (iso_utc(t) or f"{t:.0f}") if t is not None else "?"

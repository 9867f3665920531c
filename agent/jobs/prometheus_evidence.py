"""`gpuwarden explain --prometheus URL`: each node's evidence over a job's window, from the gpuwarden series a
Prometheus server scraped (docs/prometheus.md): the findings that held (`gpuwarden_finding`, with the GPU's PCI bus
id), the node state's changes, the checks that could not look, the scrapes that failed and the jobs acted on.

What the series can and cannot say:
- a node is the scrape target whose `gpuwarden_node_info{node}` (the scheduler's name) or `instance` (the shipped
  relabelling makes it the host without the port) names it; a short name matches its full one;
- a finding is one `gpuwarden_finding` series; its first_at / last_at are the first and last samples Prometheus
  kept of it in the window (raw scrape times; within one step where the step is longer than the scrape interval).
  The finding's own message and evidence are not exported: the message here is made from the labels, the evidence
  is where it was read (and an XID's or SXid's event count this boot);
- a transition is a change of the state whose `gpuwarden_node_state` is 1, at the time the agent gives
  (`gpuwarden_node_state_since_seconds`); changes quicker than one step show only their last state, and their
  reason is not exported; `from` None: the state before was not scraped (the agent started in the window);
- `unknown` holds the checks whose `gpuwarden_check_status` was unknown, and ("scrape") the times Prometheus could
  not scrape the agent (`up` 0): nothing was seen of the node then;
- a job action is a rise of `gpuwarden_job_actions_total` (action, doom rule); which job is not exported, so its
  key is None and `jobs_on_node` lists the jobs the agent saw there (`gpuwarden_job_gpus`);
- a window any length costs a bounded number of points: the step is at least the window over 11,000 (the most a
  Prometheus range query returns per series), and every query asks for at most that many points per series.
A server that cannot be reached or answers anything but its JSON API makes every node unreachable with the reason,
and a node that Prometheus holds nothing of in the window is unreachable too: silence there is not health."""
from __future__ import annotations

import base64
import ipaddress
import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlencode, urlsplit

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs.node_evidence import NodeEvidence

MAX_POINTS = 11_000  # Prometheus refuses a range query of more points per series (its web API's own limit)
MIN_STEP_S = 1.0  # finer than any scrape interval in use; a shorter window still costs at most this many points
BATCH = 32  # nodes per query: a job's thousand nodes are a few dozen queries, each answer bounded
NO_SERIES = "no gpuwarden series for this node in the window"
HISTORY_S = 7 * 86400.0  # how far back the target of a node without series in the window is looked for
_STATUS_NAMES = {"ok": "OK", "warn": "WARN", "fail": "FAIL", "unknown": "UNKNOWN", "skipped": "SKIPPED"}


class PrometheusError(Exception):
    """Prometheus could not be asked, or its answer was not its JSON API's: the message says which and why."""


@dataclass(frozen=True)
class Target:
    """One scrape target of gpuwarden as Prometheus labels it."""

    job: str
    instance: str
    node: str | None  # gpuwarden_node_info's `node` (the scheduler's name); None where only other series were seen


def query_prometheus(url: str, hosts: Sequence[str], since: float, until: float, *, timeout_s: float = 10.0,
                     max_bytes: int = 32 << 20, step_s: float | None = None, auth: tuple[str, str] | None = None,
                     ca_file: Path | None = None) -> list[NodeEvidence]:
    """One NodeEvidence per host, in the order given, from the Prometheus at `url` over [since, until].

    `timeout_s` bounds the whole call (every query shares it); each answer is at most `max_bytes`. `step_s`: the
    resolution asked for (default 1 s), never finer than the window over MAX_POINTS. `auth`: basic auth (user,
    password); `ca_file`: the CA of an https URL. Nothing raises for a server or a host: each is a NodeEvidence
    with reachable False and the reason."""
    hosts = [str(h) for h in hosts]
    if not hosts:
        return []
    source = url
    problem = _window_problem(since, until) or _url_problem(url)
    if problem:
        return [NodeEvidence.unreachable(_host_name(h), source, problem) for h in hosts]
    # Prometheus takes times to the millisecond: the window is rounded inwards, never past what was asked.
    since, until = math.ceil(since * 1000) / 1000, math.floor(until * 1000) / 1000
    step = plan_step(since, until, step_s)
    api = _Api(url, auth, ca_file, timeout_s, max_bytes)
    try:
        targets = _targets(api, since, until, step)
    except PrometheusError as exc:
        return [NodeEvidence.unreachable(_host_name(h), source, f"Prometheus at {url}: {exc}") for h in hosts]
    # Keyed by the host as given: its port, if any, decides between two agents' targets on one address.
    matched = {h: [t for t in targets if matches(h, t)] for h in dict.fromkeys(hosts)}
    done: dict[str, NodeEvidence] = {}
    missing = [h for h, ts in matched.items() if not ts]
    if missing:
        try:
            reasons = _why_missing(api, missing, {t.job for t in targets}, since, until, step)
        except PrometheusError as exc:
            reasons = {h: f"{NO_SERIES} (and asking Prometheus why failed: {exc})" for h in missing}
        for h in missing:
            done[h] = NodeEvidence.unreachable(_host_name(h), source, reasons.get(h, NO_SERIES))
    present = [h for h in matched if matched[h]]
    for i in range(0, len(present), BATCH):
        group = present[i:i + BATCH]
        wanted = list(dict.fromkeys(t for h in group for t in matched[h]))
        try:
            rows = _ask(api, wanted, since, until, step)
        except PrometheusError as exc:
            for h in group:
                done[h] = NodeEvidence.unreachable(_host_name(h), _source(url, matched[h]), f"Prometheus at {url}: "
                                                   f"{exc}")
            continue
        for h in group:
            name, where = _host_name(h), _source(url, matched[h])
            try:
                done[h] = node_evidence(name, where, url, matched[h], rows, since, until, step)
            except PrometheusError as exc:
                done[h] = NodeEvidence.unreachable(name, where, f"Prometheus at {url}: {exc}")
    return [done[h] for h in hosts]


def plan_step(since: float, until: float, step_s: float | None = None) -> float:
    """The step of every query over the window: `step_s` (default MIN_STEP_S), raised so that no series has more
    than MAX_POINTS points; whole milliseconds, as Prometheus takes durations."""
    wanted = MIN_STEP_S if step_s is None or not math.isfinite(step_s) or step_s <= 0 else float(step_s)
    floor = max(until - since, 0.0) / (MAX_POINTS - 1)
    return math.ceil(max(wanted, floor, 0.001) * 1000) / 1000


# -- which targets are the hosts -------------------------------------------------------------------------------------
def matches(host: str, t: Target) -> bool:
    """Whether the host (as explain names it: the scheduler's name, or host[:port]) is this target: its node name,
    or its instance (a port on both must be the same; the shipped relabelling drops the instance's); a short name
    matches its full one (gpu01 is gpu01.cluster), an IP address only itself."""
    name, port = _split(host)
    name = name.lower()
    where, at = _split(t.instance)
    names = {n.lower() for n in (t.node, where if port is None or at is None or port == at else None) if n}
    return name in names or any(_same_short(name, n) for n in names)


def _same_short(a: str, b: str) -> bool:
    if _is_ip(a) or _is_ip(b) or ("." in a) == ("." in b):
        return False  # both full (or both short) and not equal: different hosts
    return a.split(".")[0] == b.split(".")[0]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _host_name(host: str) -> str:
    """The host without a port: "gpu01:9456" -> "gpu01", "[fe80::1]:9456" -> "fe80::1"; a bare IPv6 address as is."""
    return _split(host)[0]


def _split(host: str) -> tuple[str, str | None]:
    host = host.strip()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") and rest[1:].isdigit() else None
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        if port.isdigit():
            return name, port
    return host, None


def _targets(api: "_Api", since: float, until: float, step: float) -> list[Target]:
    """Every gpuwarden target with a sample in the window: its node_info (whose `node` names it), else its
    build_info (an agent whose node_info Prometheus does not have)."""
    w = _range(since, until, step)
    rows = api.instant(f"group by (job, instance, node) (last_over_time(gpuwarden_node_info[{w}]) or "
                       f"gpuwarden_node_info) or group by (job, instance) (last_over_time(gpuwarden_build_info[{w}]) "
                       f"or gpuwarden_build_info)", until)
    named: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        m = r["metric"]
        named.setdefault((m.get("job", ""), m.get("instance", "")), set()).update(
            {m["node"]} if m.get("node") else set())
    out = []
    for (job, instance), nodes in sorted(named.items()):
        for node in sorted(nodes) or [None]:  # a node renamed inside the window answers to both names
            out.append(Target(job, instance, node))
    return out


def _why_missing(api: "_Api", hosts: Sequence[str], jobs: set[str], since: float, until: float,
                 step: float) -> dict[str, str]:
    """Why Prometheus has no gpuwarden series of these hosts in the window: a target of theirs it could not scrape
    then (up == 0 throughout), their agent's target it knows from around the window (the week before), or the job
    it scrapes them in for something else."""
    # The series API answers which targets had node_info in the week, however briefly (a grid of points could
    # miss an agent that lived a minute); it says which, not when.
    known: dict[str, list[Target]] = {}
    for m in api.series("gpuwarden_node_info", until - HISTORY_S, until):
        t = Target(m.get("job", ""), m.get("instance", ""), m.get("node") or None)
        for host in hosts:
            if matches(host, t):
                known.setdefault(host, []).append(t)
    w = _range(since, until, step)
    names = [_regex(_host_name(x)) + "(\\..*)?(:[0-9]+)?" for x in hosts]
    names += [_regex(t.instance) for ts in known.values() for t in ts]
    up = f'up{{instance=~"{_string("|".join(names))}"}}'
    rows = api.instant(f"max by (job, instance) ({_tagged(f'max_over_time({up}[{w}])', 'window')} or "
                       f"{_tagged(up, 'now')})", until)
    gpuwarden_jobs = jobs | {"gpuwarden"} | {t.job for ts in known.values() for t in ts}
    out: dict[str, str] = {}
    for host in hosts:
        mine = {(t.job, t.instance) for t in known.get(host, ())}
        seen = [r for r in rows if (r["metric"].get("job", ""), r["metric"].get("instance", "")) in mine
                or matches(host, Target(r["metric"].get("job", ""), r["metric"].get("instance", ""), None))]
        down = sorted(f"{r['metric'].get('instance', '')}, job {r['metric'].get('job', '')}" for r in seen
                      if r["metric"].get("job") in gpuwarden_jobs and _value(r) == 0)
        other = sorted({r["metric"].get("job", "") for r in seen if r["metric"].get("job") not in gpuwarden_jobs})
        if down:
            out[host] = f"{NO_SERIES}: Prometheus could not scrape its agent ({'; '.join(down)}: up == 0 throughout)"
        elif known.get(host):
            where = "; ".join(f"{t.instance}, job {t.job}" for t in dict.fromkeys(known[host]))
            out[host] = f"{NO_SERIES}: Prometheus knows its agent ({where}) but holds no series of it then"
        elif other:
            out[host] = f"{NO_SERIES} (Prometheus scrapes it only in job {', '.join(other)})"
    return out


# -- the queries -------------------------------------------------------------------------------------------------
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


def _ask(api: "_Api", targets: Sequence[Target], since: float, until: float, step: float) -> Rows:
    sel = _selector(targets)
    w, s = _range(since, until, step), _duration(step)
    keys = {(t.job, t.instance) for t in targets}
    start = _grid_start(since, until, step)

    def mine(rows: Iterable[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
        # The selector's two regexes could pair one target's job with another's instance.
        return tuple(r for r in rows if (r["metric"].get("job", ""), r["metric"].get("instance", "")) in keys)

    def edges(expr: str) -> str:
        # A subquery's points are multiples of its step: the instant at `until` ("now") covers what came after
        # the last of them.
        return " or ".join([_tagged(f"min_over_time({expr}[{w}])", "first"),
                            _tagged(f"max_over_time({expr}[{w}])", "last"), _tagged(expr, "now")])

    # timestamp() of a plain selector is the sample's own time; of an expression, the point's.
    state = (f"gpuwarden_node_state_since_seconds{{{sel}}} * on(job, instance) group_left(state) "
             f"(gpuwarden_node_state{{{sel}}} == 1)")
    events = f'{{__name__=~"gpuwarden_(xid|nvswitch_sxid)_events",{sel}}}'
    actions = f"gpuwarden_job_actions_total{{{sel}}}"
    return Rows(
        findings=mine(api.instant(edges(f"timestamp(gpuwarden_finding{{{sel}}})"), until)),
        gpus=mine(api.instant(f"last_over_time(gpuwarden_gpu_info{{{sel}}}[{w}]) or gpuwarden_gpu_info{{{sel}}}",
                              until)),
        events=mine(api.instant(f"{_tagged(f'max_over_time({events}[{w}])', 'window')} or {_tagged(events, 'now')}",
                                until)),
        before=mine(api.instant(state, start - step)),
        rises=mine(api.range(
            f"gpuwarden_node_state_since_seconds{{{sel}}} * on(job, instance) group_left(state) "
            f"((gpuwarden_node_state{{{sel}}} == 1) unless (gpuwarden_node_state{{{sel}}} offset {s} == 1))",
            start, until, step)),
        after=mine(api.instant(state, until)),
        down=mine(api.instant(edges(f"timestamp(up{{{sel}}} == 0)"), until)),
        blind=mine(api.instant(edges(f'timestamp(gpuwarden_check_status{{status="unknown",{sel}}} == 1)'), until)),
        jobs=mine(api.range(f"(({actions} - {actions} offset {s}) > 0) or ({actions} unless {actions} offset {s})",
                            start, until, step)),
        # The agent's own `job` label (the job's key) is `exported_job` once scraped: `job` is the scrape job's.
        held=mine(api.instant(f"group by (job, instance, exported_job) (last_over_time(gpuwarden_job_gpus{{{sel}}}"
                              f"[{w}]) or gpuwarden_job_gpus{{{sel}}})", until)),
    )


def _tagged(expr: str, edge: str) -> str:
    """`expr` with the label edge="..." (which part of a query a row answers)."""
    return f'label_replace({expr}, "edge", "{edge}", "", "")'


def _grid_start(since: float, until: float, step: float) -> float:
    """The first point of a range query whose last point is `until` itself, at or before `since`."""
    return until - math.ceil(round(max(until - since, 0.0) / step, 6)) * step


def _selector(targets: Sequence[Target]) -> str:
    jobs = "|".join(_regex(j) for j in sorted({t.job for t in targets}))
    instances = "|".join(_regex(i) for i in sorted({t.instance for t in targets}))
    return f'job=~"{_string(jobs)}",instance=~"{_string(instances)}"'


def _regex(text: str) -> str:
    """A literal in an RE2 regex (which takes a backslash before any punctuation)."""
    return "".join(c if c.isalnum() or c == "_" else "\\" + c for c in text)


def _string(text: str) -> str:
    """A PromQL double-quoted string's content (Go's escapes)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _range(since: float, until: float, step: float) -> str:
    """A subquery's range over the window, at the step: at most MAX_POINTS points per series, one at least."""
    return f"{_duration(max(until - since, step))}:{_duration(step)}"


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
    from gpuwarden.agent.core.render import iso_utc

    return (iso_utc(t) or f"{t:.0f}") if t is not None else "?"


def _source(url: str, targets: Sequence[Target]) -> str:
    return f"{url} ({', '.join(f'job={t.job} instance={t.instance}' for t in dict.fromkeys(targets))})"


def _window_problem(since: float, until: float) -> str | None:
    if not (isinstance(since, (int, float)) and isinstance(until, (int, float))
            and math.isfinite(since) and math.isfinite(until)):
        return f"the window {since!r} .. {until!r} is not two times"
    if until < since:
        return f"the window ends ({_utc(until)}, {until:.3f}) before it starts ({_utc(since)}, {since:.3f})"
    return None


def _url_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        return f"{url!r} is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http:// or https:// URL of a Prometheus server"
    return None


# -- the HTTP API ----------------------------------------------------------------------------------------------------
class _Api:
    """Prometheus' HTTP API (/api/v1/query, /api/v1/query_range), POSTed (a thousand nodes' selector is long). All
    the queries of one call share `timeout_s`, from the first connect to the last byte."""

    def __init__(self, url: str, auth: tuple[str, str] | None, ca_file: Path | None, timeout_s: float,
                 max_bytes: int):
        parts = urlsplit(url)
        self.url, self.https = url.rstrip("/"), parts.scheme == "https"
        self.host, self.port = parts.hostname or "", parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")  # a Prometheus behind a path (--web.route-prefix, a proxy)
        self.auth, self.ca_file, self.timeout_s, self.max_bytes = auth, ca_file, timeout_s, max_bytes
        self.deadline = time.monotonic() + timeout_s

    def instant(self, expr: str, at: float) -> list[Mapping[str, Any]]:
        return self._result(self._post("/api/v1/query", {"query": expr, "time": _stamp(at)}), "vector")

    def range(self, expr: str, start: float, end: float, step: float) -> list[Mapping[str, Any]]:
        return self._result(self._post("/api/v1/query_range", {"query": expr, "start": _stamp(start),
                                                               "end": _stamp(end), "step": _duration(step)}),
                            "matrix")

    def series(self, match: str, start: float, end: float) -> list[Mapping[str, str]]:
        doc = self._post("/api/v1/series", {"match[]": match, "start": _stamp(start), "end": _stamp(end)})
        data = doc.get("data")
        if not isinstance(data, list) or not all(_labels(m) for m in data):
            raise PrometheusError("the answer is not a list of series of Prometheus' series API")
        return data

    def _result(self, doc: Any, kind: str) -> list[Mapping[str, Any]]:
        data = doc.get("data") if isinstance(doc, dict) else None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("resultType") != kind or not isinstance(result, list):
            raise PrometheusError(f"the answer is not a {kind} of Prometheus' query API")
        field = "values" if kind == "matrix" else "value"
        for r in result:
            if not (isinstance(r, dict) and _labels(r.get("metric")) and isinstance(r.get(field), list)):
                raise PrometheusError(f"a result of the {kind} is not a series with its {field}")
            samples = [r["value"]] if kind == "vector" else r["values"]
            if not all(isinstance(p, list) and len(p) == 2 for p in samples):
                raise PrometheusError(f"a sample of the {kind} is not [time, value]")
        return result

    def _post(self, path: str, form: Mapping[str, str]) -> Any:
        import http.client
        import ssl

        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(f"no complete answer within {self.timeout_s:g} s")
        form = {**form, "timeout": _duration(left)}  # Prometheus stops evaluating when the caller stops waiting
        body = urlencode(form).encode()
        if self.https:
            try:
                ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise PrometheusError(f"cannot read the CA file {self.ca_file}: {exc}") from None
            conn: Any = http.client.HTTPSConnection(self.host, self.port, timeout=left, context=ctx)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=left)
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
                   "User-Agent": "gpuwarden-explain"}
        if self.auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
        cut = _Cutoff(conn, left)
        where = f"{self.prefix}{path}"
        try:
            conn.request("POST", where, body=body, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length and length.isdigit() and int(length) > self.max_bytes:
                raise PrometheusError(f"an answer of {int(length)} bytes, over the {self.max_bytes} bytes allowed "
                                      "(a shorter window, or fewer nodes)")
            data = resp.read(self.max_bytes + 1)
        except ssl.SSLError as exc:
            raise PrometheusError(f"TLS failed: {exc.reason or exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            if cut.fired:
                raise PrometheusError(f"no complete answer within {self.timeout_s:g} s") from None
            raise PrometheusError(_why(exc, self.timeout_s)) from None
        finally:
            cut.cancel()
            conn.close()
        if cut.fired:
            raise PrometheusError(f"no complete answer within {self.timeout_s:g} s")
        if len(data) > self.max_bytes:
            raise PrometheusError(f"an answer over the {self.max_bytes} bytes allowed (a shorter window, or fewer "
                                  "nodes)")
        return _answer(resp.status, resp.reason, data, where, self.auth)


def _labels(m: Any) -> bool:
    """Whether `m` is a label set as Prometheus writes one: names and values strings."""
    return isinstance(m, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in m.items())


def _answer(code: int, reason: str, data: bytes, path: str, auth: tuple[str, str] | None) -> Any:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict) and doc.get("status") == "error":
        # Prometheus' own refusal (bad_data, timeout, execution): its words, which name the problem.
        raise PrometheusError(f"HTTP {code}: the query was refused ({doc.get('errorType', '?')}): "
                              f"{str(doc.get('error', ''))[:300]}")
    if code == 401:
        raise PrometheusError("HTTP 401: the user and password were refused" if auth else
                              "HTTP 401: it asks for a user and password (basic auth)")
    if code == 404:
        raise PrometheusError(f"HTTP 404: no {path} there (is this Prometheus' address, with its route prefix?)")
    if code != 200:
        text = data[:200].decode("utf-8", "replace").strip().splitlines()
        raise PrometheusError(f"HTTP {code} {reason}" + (f": {text[0]}" if text else ""))
    if not isinstance(doc, dict) or doc.get("status") != "success":
        text = data[:80].decode("utf-8", "replace").strip().splitlines()
        raise PrometheusError(f"the answer to {path} is not Prometheus' JSON API"
                              + (f" (it begins {text[0]!r})" if text else " (it is empty)"))
    return doc


def _stamp(t: float) -> str:
    return f"{t:.3f}"


class _Cutoff:
    """Cuts a connection off `timeout_s` after it was made, whatever it waits in (the connect, a trickled head, the
    body): a socket timeout bounds each wait, not the whole answer."""

    def __init__(self, conn: Any, timeout_s: float):
        self.conn, self.fired = conn, False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: a TLS one's state is its own
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there: Prometheus' address and port?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the name: {exc.strerror or exc}"
    if isinstance(exc, ConnectionResetError):
        return "connection reset before a complete answer (an https server asked in plain http?)"
    if isinstance(exc, OSError):
        return exc.strerror or f"{type(exc).__name__}: {exc}"
    return f"not an HTTP answer: {type(exc).__name__}: {exc}"

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

import ipaddress
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from gpuwarden.agent.jobs.node_evidence import NodeEvidence
from gpuwarden.agent.jobs.prometheus_api import PrometheusError, _Api, _duration
from gpuwarden.agent.jobs.prometheus_series import Rows, Target, _utc, _value, node_evidence

MAX_POINTS = 11_000  # Prometheus refuses a range query of more points per series (its web API's own limit)
MIN_STEP_S = 1.0  # finer than any scrape interval in use; a shorter window still costs at most this many points
BATCH = 32  # nodes per query: a job's thousand nodes are a few dozen queries, each answer bounded
NO_SERIES = "no gpuwarden series for this node in the window"
HISTORY_S = 7 * 86400.0  # how far back the target of a node without series in the window is looked for


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


def _targets(api: _Api, since: float, until: float, step: float) -> list[Target]:
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


def _why_missing(api: _Api, hosts: Sequence[str], jobs: set[str], since: float, until: float,
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
def _ask(api: _Api, targets: Sequence[Target], since: float, until: float, step: float) -> Rows:
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


def _range(since: float, until: float, step: float) -> str:
    """A subquery's range over the window, at the step: at most MAX_POINTS points per series, one at least."""
    return f"{_duration(max(until - since, step))}:{_duration(step)}"


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

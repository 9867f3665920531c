"""What one node's gpuwarden saw over a job's window, as `gpuwarden explain` reads it: from the node's daemon
(`/api/v1/findings`), a saved store or recording (`--evidence DIR`), or Prometheus (`--prometheus URL`).

A node that could not be asked is kept, with the reason (`reachable` False): explain names it rather than taking
its silence for health."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.render import iso_utc


@dataclass(frozen=True)
class NodeEvidence:
    """One node's findings, transitions and job intents inside a window.

    `findings`: dicts with check, code, status, action (names, e.g. "FAIL", "RESET_GPU"), message,
    entity {kind, id, index, pci, link}, evidence (the finding's own), first_at / last_at (wall clock, None where
    the node does not know). `transitions`: {at, from, to, reason}. `jobs`: the node's job intents
    {key, action, created, done, outcome, detail}. `state`: the node's state {state, since, reason} when the
    evidence was read (None: not known, as for a recording). `unknown`: the checks that could not look
    {check, error, recorded_at}: their silence is not health."""

    host: str
    source: str  # the URL, path or Prometheus server it came from
    reachable: bool
    error: str | None = None  # why it could not be read (reachable False), or what was cut (truncated)
    findings: tuple[Mapping[str, Any], ...] = ()
    transitions: tuple[Mapping[str, Any], ...] = ()
    jobs: tuple[Mapping[str, Any], ...] = ()
    truncated: bool = False
    state: Mapping[str, Any] | None = None
    unknown: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def unreachable(cls, host: str, source: str, error: str) -> "NodeEvidence":
        return cls(host, source, False, error)


# -- reading a window document (agent/jobs/evidence_window.py) ----------------------------------------------------
SCHEMA = 1
PATH = "/api/v1/findings"
DEFAULT_PORT = 9456
MAX_EVIDENCE_PATHS = 4096  # nodes one --evidence folder may hold


class DocumentError(ValueError):
    """A window document that is not what a gpuwarden endpoint writes; says where in it."""


def from_document(doc: Mapping[str, Any], source: str, host: str | None = None) -> NodeEvidence:
    """A node's evidence from a window document (schema 1), its types checked: a value of the wrong type is a
    DocumentError naming where it is ("findings[2].entity.index: want an integer, got 'x'"); keys the reader does
    not know are ignored. `host`: the name the node was asked by (default: the name the document gives). A
    document whose node watched only up to before the window is kept, reachable False: it says nothing of it."""
    if not isinstance(doc, Mapping):
        raise DocumentError(f"want a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise DocumentError(f"schema {doc.get('schema')!r}, not {SCHEMA} (a gpuwarden of another version?)")
    node = _want(doc, "node", str, "")
    since, until = _want(doc, "since", float, ""), _want(doc, "until", float, "")
    watched = _want(doc, "watched_until", float, "", optional=True)
    findings = tuple(_finding(f, f"findings[{i}]") for i, f in enumerate(_list(doc, "findings", "")))
    transitions = tuple({"at": _want(t, "at", float, w), "from": _want(t, "from", str, w), "to": _want(t, "to", str, w),
                         "reason": _want(t, "reason", str, w),
                         "actions": [str(a) for a in _list(t, "actions", w, optional=True)]}
                        for i, t in enumerate(_list(doc, "transitions", "")) if (w := f"transitions[{i}]."))
    jobs = tuple({"key": _want(j, "key", str, w), "action": _want(j, "action", str, w),
                  "created": _want(j, "created", float, w), "done": _want(j, "done", float, w, optional=True),
                  "outcome": _want(j, "outcome", str, w, optional=True),
                  "detail": dict(_want(j, "detail", Mapping, w, optional=True) or {})}
                 for i, j in enumerate(_list(doc, "jobs", "")) if (w := f"jobs[{i}]."))
    unknown = tuple({"check": _want(u, "check", str, w), "error": _want(u, "error", str, w),
                     "recorded_at": _want(u, "recorded_at", float, w, optional=True)}
                    for i, u in enumerate(_list(doc, "unknown", "", optional=True)) if (w := f"unknown[{i}]."))
    state = doc.get("state")
    if state is not None:
        state = {"state": _want(state, "state", str, "state."), "since": _want(state, "since", float, "state."),
                 "reason": _want(state, "reason", str, "state.", optional=True) or ""}
    truncated = doc.get("truncated", False)
    if not isinstance(truncated, bool):
        raise DocumentError(f"truncated: want true or false, got {truncated!r}")
    name = host or node or source
    if watched is not None and watched < since:
        return NodeEvidence(name, source, False, f"its record ends at {_utc(watched)}, before the window "
                            f"({_utc(since)} .. {_utc(until)}): it says nothing of it", state=state)
    error = "cut to the newest entries (more than the node returns at once)" if truncated else None
    return NodeEvidence(name, source, True, error, findings, transitions, jobs, truncated, state, unknown)


def _finding(f: Any, where: str) -> dict[str, Any]:
    w = where + "."
    head = {key: _want(f, key, str, w) for key in ("check", "code", "status", "action", "message")}
    entity = _want(f, "entity", Mapping, w)
    e = w + "entity."
    return {**head,
            "entity": {"kind": _want(entity, "kind", str, e), "id": _want(entity, "id", str, e),
                       "index": _want(entity, "index", int, e, optional=True),
                       "pci": _want(entity, "pci", str, e, optional=True),
                       "link": _want(entity, "link", int, e, optional=True)},
            "evidence": dict(_want(f, "evidence", Mapping, w, optional=True) or {}),
            "first_at": _want(f, "first_at", float, w, optional=True),
            "last_at": _want(f, "last_at", float, w, optional=True),
            "recorded_at": _want(f, "recorded_at", float, w, optional=True)}


_KINDS = {str: "a string", int: "an integer", float: "a number", Mapping: "an object", list: "a list"}


def _want(d: Any, key: str, kind: type, where: str, optional: bool = False) -> Any:
    if not isinstance(d, Mapping):
        raise DocumentError(f"{where.rstrip('.') or 'document'}: want an object, got {type(d).__name__}")
    value = d.get(key)
    if value is None:
        if optional:
            return None
        raise DocumentError(f"{where}{key}: missing")
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise DocumentError(f"{where}{key}: want {_KINDS[kind]}, got {_shown(value)}")
    return value


def _list(d: Any, key: str, where: str, optional: bool = False) -> list[Any]:
    value = _want(d, key, list, where, optional)
    return value if value is not None else []


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _utc(t: float) -> str:
    return iso_utc(t) or f"{t:.0f}"


# -- asking the nodes' daemons -------------------------------------------------------------------------------------
def fetch_nodes(hosts: Sequence[str], since: float, until: float, *, port: int = DEFAULT_PORT, tls: bool = False,
                ca_file: Path | None = None, auth: tuple[str, str] | None = None, timeout_s: float = 5.0,
                max_bytes: int = 16 << 20) -> list[NodeEvidence]:
    """Each node's window from its daemon (`GET /api/v1/findings`), all asked at once, in the order given. A host
    is `name` or `name:port` (`[v6]:port`). Each answer is bounded: `timeout_s` from the connect to the last byte
    (a server that trickles or never answers is cut off then), at most `max_bytes`. A node that refuses, times
    out, answers anything but 200 with a window document, or one of the wrong schema is kept as unreachable with
    the reason; nothing raises for one bad node."""
    from urllib.parse import urlencode  # at use: +2 ms to `explain LOG`, which asks no node (-X importtime)

    hosts = list(hosts)
    ctx = _tls_context(ca_file) if tls else None
    out: list[NodeEvidence | None] = [None] * len(hosts)
    query = urlencode({"since": repr(float(since)), "until": repr(float(until))})

    def ask(i: int, host: str) -> None:
        try:
            out[i] = _fetch(host, port, query, ctx, auth, timeout_s, max_bytes)
        except Exception as exc:  # noqa: BLE001 - one node's defect costs that node, named, never the rest
            out[i] = NodeEvidence.unreachable(_name(host), host, f"could not ask: {type(exc).__name__}: {exc}")

    # at use: +7 ms (-X importtime) to `gpuwarden analyze` of a job log, which imports this module and asks no node
    from concurrent.futures import ThreadPoolExecutor, wait

    # At most MAX_ASKING at once: a job's thousand nodes do not open a thousand sockets. Each ask cuts itself off at
    # timeout_s (Cutoff); the wait below is only the backstop.
    pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_ASKING, len(hosts))), thread_name_prefix="gw-evidence")
    try:
        futures = [pool.submit(ask, i, h) for i, h in enumerate(hosts)]
        rounds = -(-len(hosts) // MAX_ASKING)
        wait(futures, timeout=rounds * (timeout_s + 1.0) + 1.0)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [e if e is not None else NodeEvidence.unreachable(_name(h), h, f"no answer within {timeout_s:g} s")
            for h, e in zip(hosts, out, strict=True)]


def _name(host: str) -> str:
    try:
        return split_host(host, DEFAULT_PORT)[0] or host
    except ValueError:
        return host


MAX_ASKING = 64  # nodes asked at once


def split_host(host: str, port: int) -> tuple[str, int]:
    """("n1", 9456) from "n1", "n1:9000", "[fe80::1]:9000" or "fe80::1". ValueError for a bad port."""
    host = host.strip()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        if rest.startswith(":"):
            return name, _port(rest[1:], host)
        return name, port
    if host.count(":") == 1:
        name, _, text = host.partition(":")
        return name, _port(text, host)
    return host, port


def _port(text: str, host: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{host!r}: {text!r} is not a port")
    return int(text)


def _tls_context(ca_file: Path | None) -> Any:
    import ssl  # at use: +12 ms (-X importtime) to `gpuwarden analyze` of a job log, which asks no node

    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)


def _fetch(host: str, port: int, query: str, ctx: Any, auth: tuple[str, str] | None, timeout_s: float,
           max_bytes: int) -> NodeEvidence:
    # at use: http.client and ssl, +28 ms (-X importtime) to `gpuwarden analyze` of a job log, which asks no node
    import base64
    import http.client
    import ssl

    from gpuwarden.agent.jobs.http_cutoff import Cutoff

    try:
        name, number = split_host(host, port)
    except ValueError as exc:
        return NodeEvidence.unreachable(host, host, str(exc))
    label = name or host
    url = (f"{'https' if ctx is not None else 'http'}://{f'[{name}]' if ':' in name else name}:{number}"
           f"{PATH}?{query}")
    if ctx is not None:
        conn: Any = http.client.HTTPSConnection(name, number, timeout=timeout_s, context=ctx)
    else:
        conn = http.client.HTTPConnection(name, number, timeout=timeout_s)
    cut = Cutoff(conn, timeout_s)
    try:
        headers = {"Accept": "application/json", "User-Agent": "gpuwarden-explain"}
        if auth is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        conn.request("GET", f"{PATH}?{query}", headers=headers)
        resp = conn.getresponse()
        length = resp.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            return NodeEvidence.unreachable(label, url, f"answer of {int(length)} bytes, over the {max_bytes} "
                                                        "allowed")
        body = resp.read(max_bytes + 1)
    except ssl.SSLError as exc:
        return NodeEvidence.unreachable(label, url, f"TLS failed: {exc.reason or exc}")
    except (OSError, http.client.HTTPException) as exc:
        if cut.fired:
            return NodeEvidence.unreachable(label, url, f"no complete answer within {timeout_s:g} s")
        return NodeEvidence.unreachable(label, url, _why(exc, timeout_s))
    finally:
        cut.cancel()
        conn.close()
    if cut.fired:
        return NodeEvidence.unreachable(label, url, f"no complete answer within {timeout_s:g} s")
    if len(body) > max_bytes:
        return NodeEvidence.unreachable(label, url, f"answer over the {max_bytes} bytes allowed")
    if resp.status != 200:
        return NodeEvidence.unreachable(label, url, _status(resp.status, resp.reason, body, auth))
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return NodeEvidence.unreachable(label, url, f"answer is not JSON ({exc}); is this gpuwarden's port?")
    try:
        return from_document(doc, url, host=label)
    except DocumentError as exc:
        return NodeEvidence.unreachable(label, url, f"not a gpuwarden window document: {exc}")


def _why(exc: BaseException, timeout_s: float) -> str:
    import socket  # at use: +3 ms to `explain LOG` (-X importtime); loaded already by the ask that failed

    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (no gpuwarden daemon listening there, or another port)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the name: {exc.strerror or exc}"
    if isinstance(exc, ConnectionResetError):
        return "connection reset before a complete answer (a TLS port asked in plain HTTP?)"
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}" + (f" ({exc})" if not exc.strerror else "")
    return f"bad HTTP answer: {type(exc).__name__}: {exc}"


def _status(code: int, reason: str, body: bytes, auth: tuple[str, str] | None) -> str:
    text = body[:200].decode("utf-8", "replace").strip().splitlines()
    said = f": {text[0]}" if text else ""
    if code == 401:
        return ("HTTP 401: the user and password were refused" if auth else
                "HTTP 401: the endpoint asks for a user and password (basic auth)")
    if code == 404:
        return f"HTTP 404: no {PATH} there (a gpuwarden older than this endpoint, or not gpuwarden)"
    return f"HTTP {code} {reason}{said}"

"""The Kubernetes adapter's client wiring: lightkube loaded (an optional dependency), the connection built from a
kubeconfig or the pod's service account, one deadline per call shared by all its requests, every answer read up to a
size bound, the API server's refusals made typed errors (`Transient`, `Refused`), and the guarded writes to a Node
(resourceVersion, retried on 409), its condition and its Events that every part of the adapter makes."""
from __future__ import annotations

import functools
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from gpuwarden.agent.act.adapters.kubernetes_objects import (
    COMPONENT,
    CONDITION,
    EVENT_NAMESPACE,
    MAX_MESSAGE,
    _condition,
    _is_dns_subdomain,
    _rfc3339,
    _rv,
    _stamp,
)
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import Refused, Transient

log = logs.get_logger("gpuwarden.adapter.kubernetes")

MAX_RESPONSE_BYTES = 64 << 20  # one answer (a page of a list is at most LIST_PAGE objects)
LIST_PAGE = 500
EXTRA_HINT = "pip install 'gpuwarden[kubernetes]'"


class ClientMissing(Refused, ImportError):
    """The Kubernetes client library is not installed."""


def _lightkube():
    try:
        # optional dependency: lightkube and its httpx2 (`pip install 'gpuwarden[kubernetes]'`), loaded when the
        # adapter is built, so the agent runs without them wherever another adapter is chosen
        import httpx2
        import lightkube  # optional dependency, as above
        from lightkube.config import client_adapter  # optional dependency, as above
        from lightkube.resources import core_v1  # optional dependency, as above
        from lightkube.types import PatchType  # optional dependency, as above
    except ImportError as e:
        raise ClientMissing(f"the Kubernetes adapter needs the lightkube client, which is not installed ({e}): "
                            f"{EXTRA_HINT}") from e
    return httpx2, lightkube, client_adapter, core_v1, PatchType


# -- the API server's refusals ---------------------------------------------------------------------------------
class _HttpError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"HTTP {code}: {message}")
        self.code, self.message = code, message


def _typed(e: _HttpError, what: str) -> Exception:
    if e.code == 429 or e.code >= 500 or e.code == 409:
        return Transient(f"{what}: the API server answered {e.code} ({e.message}); retry later")
    return Refused(f"{what}: the API server refused with {e.code} ({e.message})")


def _bounded(fn: Callable) -> Callable:
    """A public call: one deadline for all its requests, and any HTTP refusal left over made a typed error."""

    @functools.wraps(fn)
    def call(self: KubernetesApi, *args: Any, **kwargs: Any) -> Any:
        with self._deadline():
            try:
                return fn(self, *args, **kwargs)
            except _HttpError as e:
                raise _typed(e, f"{fn.__name__}{args!r}") from e

    return call


class KubernetesApi:
    """The connection and the writes every part of the Kubernetes adapter shares (agent/act/adapters/kubernetes.py
    puts the parts together)."""

    def __init__(self, *, timeout_s: float = 10.0, kubeconfig: str | None = None, context: str | None = None,
                 quarantine_effect: str = "NoSchedule", conflict_retries: int = 5,
                 event_namespace: str = EVENT_NAMESPACE, host: str | None = None, node_name: str | None = None):
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600] seconds, got {timeout_s!r}")
        if quarantine_effect not in ("NoSchedule", "NoExecute"):
            raise ValueError(f"quarantine_effect must be NoSchedule or NoExecute, got {quarantine_effect!r}")
        if not 0 <= conflict_retries <= 100:
            raise ValueError(f"conflict_retries must be in [0, 100], got {conflict_retries!r}")
        self.timeout_s = float(timeout_s)
        self.quarantine_effect = quarantine_effect
        self.conflict_retries = conflict_retries
        if node_name is not None and not _is_dns_subdomain(node_name):
            raise ValueError(f"node_name must be a Kubernetes node name (an RFC 1123 subdomain), got {node_name!r}")
        self.event_namespace = event_namespace
        self.host = host or socket.gethostname()
        # The node this agent speaks for: where a job's pod is looked for (see _job_pod). None: the whole cluster.
        self.node_name = node_name
        self._kubeconfig, self._context = kubeconfig, context
        self._httpx, self._lk, self._client_adapter, self._core, self._patch_type = _lightkube()
        self._local = threading.local()
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._blocked_reported: dict[str, frozenset[str]] = {}

    # -- the connection ----------------------------------------------------------------------------------------
    def _api(self) -> Any:
        with self._client_lock:
            if self._client is None:
                lk, httpx = self._lk, self._httpx
                try:
                    if self._kubeconfig:
                        cfg = lk.KubeConfig.from_file(self._kubeconfig).get(context_name=self._context)
                    else:
                        cfg = lk.KubeConfig.from_env().get(context_name=self._context)
                    verify = self._client_adapter.verify_cluster(cfg.cluster, cfg.user, cfg.abs_file)
                except (lk.ConfigError, OSError, ValueError, AssertionError) as e:
                    where = self._kubeconfig or "in-cluster, then $KUBECONFIG, then ~/.kube/config"
                    raise Refused(f"no usable Kubernetes configuration ({where}): {e}") from e
                transport = _BoundedTransport(httpx, httpx.HTTPTransport(verify=verify), self._local)
                self._client = lk.Client(cfg, timeout=httpx.Timeout(self.timeout_s), transport=transport,
                                         lazy=False, field_manager=COMPONENT, trust_env=False)
            return self._client

    @contextmanager
    def _deadline(self) -> Iterator[None]:
        outer = getattr(self._local, "deadline", None)
        if outer is None:
            self._local.deadline = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            if outer is None:
                self._local.deadline = None

    def _req(self, what: str, verb: str, *args: Any, keep: Callable[[Any], bool] | None = None,
             **kwargs: Any) -> Any:
        """One client call (`verb`: get, list, patch, create, delete): transport trouble is Transient, an HTTP refusal
        an _HttpError for the caller to judge. A list is read whole here, page by page; with `keep`, only the items it
        keeps are held (a search through many pages holds one page at a time). A delete answers None."""
        httpx = self._httpx
        try:
            out = getattr(self._api(), verb)(*args, **kwargs)
            if verb == "list":
                return [item.to_dict() for item in out if keep is None or keep(item)]
            return None if out is None else out.to_dict()
        except self._lk.ApiError as e:
            raise _HttpError(e.response.status_code, (e.status.message or e.status.reason or "")[:300]) from e
        except httpx.HTTPStatusError as e:
            raise _HttpError(e.response.status_code, e.response.text[:300]) from e
        except httpx.TimeoutException as e:
            raise Transient(f"{what}: no answer from the API server within {self.timeout_s:g} s ({e})") from e
        except (httpx.TransportError, OSError) as e:
            raise Transient(f"{what}: could not reach the API server ({type(e).__name__}: {e})") from e
        except (ValueError, KeyError, TypeError) as e:
            raise Transient(f"{what}: the API server's answer could not be read ({e})") from e

    def _get(self, name: str) -> dict:
        if not _is_dns_subdomain(name):
            raise Refused(f"{name!r} is not a Kubernetes node name")
        return self._req(f"get node {name}", "get", self._core.Node, name)

    def _list_nodes(self, labels: dict | None = None) -> list[dict]:
        return self._req("list nodes", "list", self._core.Node, labels=labels, chunk_size=LIST_PAGE)

    def _pods(self, node: str) -> list[dict]:
        return self._req(f"list pods on {node}", "list", self._core.Pod, namespace="*",
                         fields={"spec.nodeName": node}, chunk_size=LIST_PAGE)

    # -- writes ------------------------------------------------------------------------------------------------
    def _write(self, name: str, change: Callable[[dict], dict | None], node: dict | None = None) -> tuple[dict, bool]:
        """Applies `change` (the node -> a merge patch of its metadata/spec, None for nothing to do) with the
        resourceVersion it was computed from; on 409 reads again and retries. Returns the node and whether it
        changed."""
        for attempt in range(self.conflict_retries + 1):
            node = node if node is not None else self._get(name)
            patch = change(node)
            if patch is None:
                return node, False
            patch.setdefault("metadata", {})["resourceVersion"] = _rv(node)
            try:
                return self._req(f"patch node {name}", "patch", self._core.Node, name, patch,
                                 patch_type=self._patch_type.MERGE), True
            except _HttpError as e:
                if e.code != 409:
                    raise
                log.info("node changed under our write, reading it again", node=name, attempt=attempt + 1)
                node = None
        raise Transient(f"node {name} kept changing under our writes ({self.conflict_retries + 1} conflicts); "
                        "retry later")

    def _set_condition(self, name: str, node: dict, status: str, reason: str, message: str) -> bool:
        """The GpuwardenHealthy condition, through nodes/status as a strategic merge patch (conditions merge by
        type, so the kubelet's are left alone). lastTransitionTime moves only when the status does."""
        message = message[:MAX_MESSAGE]
        for _ in range(self.conflict_retries + 1):
            old = _condition(node, CONDITION)
            if old and (old.get("status"), old.get("reason"), old.get("message")) == (status, reason, message):
                return False
            now = _rfc3339(time.time())
            moved = old is None or old.get("status") != status or not old.get("lastTransitionTime")
            cond = {"type": CONDITION, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now if moved else _stamp(old.get("lastTransitionTime"))}
            patch = {"metadata": {"resourceVersion": _rv(node)},
                     "status": {"conditions": [cond]}}
            try:
                self._req(f"patch node {name} status", "patch", self._core.Node.Status, name, patch,
                          patch_type=self._patch_type.STRATEGIC)
                return True
            except _HttpError as e:
                if e.code != 409:
                    raise
                node = self._get(name)
        raise Transient(f"node {name}'s status kept changing under our writes; retry later")

    def _event(self, obj: dict, reason: str, message: str, warning: bool = True, kind: str = "Node") -> None:
        """An Event on the node (or pod). Best effort: the change it reports is made already, so a failure is
        logged."""
        meta = obj.get("metadata") or {}
        name, now = meta.get("name", ""), _rfc3339(time.time())
        involved = {"apiVersion": "v1", "kind": kind, "name": name, "uid": meta.get("uid")}
        # A namespaced object's Events must live in its namespace (the API server refuses any other); a Node's go
        # to event_namespace, as the kubelet's do.
        namespace = meta.get("namespace") if kind != "Node" else None
        if namespace:
            involved["namespace"] = namespace
        where = namespace or self.event_namespace
        event = {
            "metadata": {"name": f"{name[:230]}.{time.time_ns():x}", "namespace": where},
            "involvedObject": involved,
            "reason": reason, "message": message[:MAX_MESSAGE], "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self.host}, "reportingComponent": COMPONENT,
            "reportingInstance": self.host, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self._req(f"event on {kind.lower()} {name}", "create", self._core.Event.from_dict(event), namespace=where)
        except (_HttpError, Transient) as e:
            if namespace:
                log.warning("could not record an event on the pod", pod=f"{namespace}/{name}", reason=reason,
                            error=str(e))
            else:
                log.warning("could not record an event on the node", node=name, reason=reason, error=str(e))

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class _BoundedTransport:
    """Wraps the HTTP transport: each request's timeouts are cut to what is left of its call's deadline, and the
    answer is read whole within that deadline and up to MAX_RESPONSE_BYTES (a server that trickles bytes or
    answers without end still ends the call)."""

    def __init__(self, httpx: Any, inner: Any, local: threading.local):
        self._httpx, self._inner, self._local = httpx, inner, local

    def __enter__(self) -> _BoundedTransport:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)

    def close(self) -> None:
        self._inner.close()

    def handle_request(self, request: Any) -> Any:
        httpx = self._httpx
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise httpx.TimeoutException("the call's time ran out before this request", request=request)
            timeouts = request.extensions.get("timeout") or {}
            request.extensions["timeout"] = {k: left if timeouts.get(k) is None else min(timeouts[k], left)
                                             for k in ("connect", "read", "write", "pool")}
        response = self._inner.handle_request(request)
        chunks, size = [], 0
        try:
            for chunk in response.stream:
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise httpx.RemoteProtocolError(f"the answer is over {MAX_RESPONSE_BYTES} bytes",
                                                    request=request)
                if deadline is not None and time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the call's time ran out while reading the answer", request=request)
                chunks.append(chunk)
        finally:
            response.stream.close()
        return httpx.Response(response.status_code, headers=response.headers, content=b"".join(chunks),
                              extensions=response.extensions, request=request)

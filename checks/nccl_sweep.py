"""The node's side of a multi-node sweep (`gpuwarden sweep`, agent/fleet/sweep/sweep.py): the sweep's latest verdict on
this node, `<results_dir>/nodes/<node>.json`, turned into findings that go through this node's state machine,
circuit breaker and remediation like any other.

The file is written by another machine, often on a shared filesystem: it is read as hostile input. Bounded in size,
never through a symbolic link, its node name must be this node's, its time finite and not in the future, and its
findings only this check's, about this node, at most DRAIN (a file cannot ask for a GPU reset, a reboot or a
service ticket). A file that cannot be read or used is an UNKNOWN finding naming the file and the reason, never OK
and never a fault.

A verdict holds `hold_s` after the sweep judged it: a drained node runs no sweep, so its finding clears when the
hold ends (and a retest follows), or earlier when a later sweep passes the node."""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.core.passive import Judgement, MetricSample, PassiveSpec
from gpuwarden.agent.core.sweep_names import CHECK_NAME, FORMAT, valid_name

MAX_BYTES = 1 << 20
MAX_FINDINGS = 64
MAX_MESSAGE = 4096
FUTURE_SLACK_S = 300.0  # clocks of two machines differ; a verdict from further ahead is not believed


def verdict_path(cfg: Mapping[str, Any], node: str) -> Path:
    return Path(cfg["results_dir"]) / "nodes" / f"{node}.json"


def sample(node: Any, cfg: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """{"node", "path", "text"}; text None when no sweep has judged this node yet, "error" when the file could not
    be read."""
    name = cfg.get("node_name") or node.hostname
    out: dict[str, Any] = {"node": name, "path": None, "text": None, "error": None}
    if not valid_name(name):
        out["error"] = f"node name {name!r} cannot name a verdict file"
        return out
    path = verdict_path(cfg, name)
    out["path"] = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return out
    except OSError as exc:
        out["error"] = ("a symbolic link (not followed)" if exc.errno == errno.ELOOP
                        else f"cannot open: {exc.strerror or exc}")
        return out
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            out["error"] = "not a regular file"
            return out
        data = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        out["error"] = f"cannot read: {exc.strerror or exc}"
        return out
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        out["error"] = f"larger than {MAX_BYTES >> 10} KiB"
        return out
    out["text"] = data.decode("utf-8", errors="replace")
    return out


def _finding(d: Any, node: str) -> Finding:
    if not isinstance(d, dict):
        raise ValueError("a finding that is not an object")
    f = Finding.from_dict(d)
    if f.check != CHECK_NAME or f.entity.kind != "node" or f.entity.id != node:
        raise ValueError(f"a finding of {f.check!r} about {f.entity.kind} {f.entity.id!r}: only {CHECK_NAME} "
                         f"findings about {node} are taken")
    if f.status not in (Status.WARN, Status.FAIL) or f.action > Action.DRAIN:
        raise ValueError(f"a finding with status {f.status.value} and action {f.action.name}: a sweep verdict is a "
                         "warning or a fault, and asks for a drain at most")
    if not isinstance(f.message, str) or len(f.message) > MAX_MESSAGE or len(json.dumps(d)) > 64 << 10:
        raise ValueError("a finding too large")
    return f


def parse_verdict(text: str, node: str, now: float) -> tuple[float, str, list[Finding]]:
    """(time, sweep id, findings) of a verdict file; ValueError naming what is wrong."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a sweep verdict of format {FORMAT}")
    if doc.get("node") != node:
        raise ValueError(f"the verdict is about {str(doc.get('node'))[:100]!r}, not {node}")
    when = doc.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when) or when < 0 \
            or when > now + FUTURE_SLACK_S:
        raise ValueError(f"time {str(when)[:40]}: not a time at or before now")
    sweep_id = doc.get("sweep_id")
    if not isinstance(sweep_id, str) or not 0 < len(sweep_id) <= 100:
        raise ValueError("no sweep id")
    raw = doc.get("findings")
    if not isinstance(raw, list) or len(raw) > MAX_FINDINGS:
        raise ValueError(f"findings: not a list of at most {MAX_FINDINGS}")
    try:
        return float(when), sweep_id, [_finding(d, node) for d in raw]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"findings: {exc}") from None


def judge(state: Mapping[str, Any], sample: Mapping[str, Any], cfg: Mapping[str, Any], now: float) -> Judgement:
    node, path = sample["node"], sample.get("path") or f"{cfg['results_dir']}/nodes/{sample['node']}.json"
    entity = Entity.node(node)
    if sample.get("error"):
        return Judgement({}, (Finding(CHECK_NAME, "sweep-verdict-unreadable", entity, Status.UNKNOWN,
                                      f"{path}: {sample['error']}", Action.NONE, {"path": path}),))
    if sample.get("text") is None:
        return Judgement({})  # no sweep has judged this node yet
    try:
        when, sweep_id, findings = parse_verdict(sample["text"], node, now)
    except ValueError as exc:
        return Judgement({}, (Finding(CHECK_NAME, "sweep-verdict-unreadable", entity, Status.UNKNOWN,
                                      f"{path}: {exc}", Action.NONE, {"path": path}),))
    until = when + float(cfg["hold_s"])
    metrics = (MetricSample("gpuwarden_sweep_verdict_timestamp_seconds",
                            "When the latest multi-node sweep verdict on this node was written (epoch seconds).",
                            {}, when),)
    state_out = {"sweep_id": sweep_id, "time": when}
    if now >= until or not findings:
        return Judgement(state_out, (), metrics)
    held = tuple(Finding(f.check, f.code, f.entity, f.status, f.message, f.action,
                         {**f.evidence, "verdict": path, "holds_until": until}) for f in findings)
    return Judgement(state_out, held, metrics, wake_at=until)


SPEC = PassiveSpec(
    name=CHECK_NAME,
    summary="the multi-node sweep's latest verdict on this node (gpuwarden sweep): slow, wrong or hung collectives",
    sample=sample,
    judge=judge,
    interval_s=30.0,
    defaults={
        "results_dir": "",  # where sweep verdicts are ("" = [sweep] results_dir)
        "node_name": "",  # this node's name in the verdicts ("" = [remediation] node_name, else the hostname)
        "hold_s": 14400.0,  # a verdict's findings hold this long after the sweep (a drained node is not swept)
    },
    # The same file again judges the same, once no finding holds (the daemon counts a check quiet only while its
    # record has no findings): a node no sweep has judged, or one a sweep passed, is not judged every 30 s.
    quiet=lambda state: True,
    quiet_rejudge_s=300.0,
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="nccl_sweep", order=180, level=None, poll="SPEC", poll_order=8,
)

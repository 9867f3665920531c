"""Which findings doom which job on this node: the rules of doom_rules.toml (data) applied to the node's findings and
the jobs it runs. Pure: the daemon calls it at every observation (agent/jobs/guard.py), tests call it directly.

A doom names the job, the finding, the rule, the incident (a stable key of the fault, so one fault is acted on once
per job however many observations hold it) and when the fault first doomed the job: the kernel line's observation for
an XID or a lost GPU, the moment the port's outage passed the job's effective IB timeout for a port.
"""
from __future__ import annotations

import functools
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core.job import JobOnNode, JobRef
from gpuwarden.agent.core.model import Action, Finding, Status, finding_text
from gpuwarden.agent.core.records import dataclass

RULES_FILE = Path(__file__).with_name("doom_rules.toml")
HITS = ("gpu", "nvlink", "domain", "ib_port")


@dataclass(frozen=True)
class Rule:
    name: str
    hits: str
    check: str | None = None
    codes: tuple[str, ...] = ()
    buckets: tuple[str, ...] = ()  # xid: the catalogue's resolution buckets that end every context on the GPU
    recovery_bucket: str | None = None  # xid: the bucket whose finding's own action decides (XID 154)
    recovery_actions: tuple[Action, ...] = ()
    fatal: bool | None = None  # nvswitch_sxid: the finding's evidence "fatal" must be this


@dataclass(frozen=True)
class Doom:
    job: JobOnNode
    finding: Finding
    rule: str
    incident: str  # the fault, stable across observations: "<rule>:<entity>:<since>"
    fault_at: float  # when the fault first doomed the job (wall clock)
    reason: str  # `xid 79 GPU2 0018:01:00.0`: what the scheduler's comment and the log say

    @property
    def key(self) -> str:
        """The journal's key of the action on this job for this fault: one action per (job run, incident)."""
        return intent_key(self.job.job, self.incident)


def intent_key(job: JobRef, incident: str) -> str:
    """`job:slurm:4242.0:<incident>`: the journal's key of the action on one run of a job for one fault."""
    return f"job:{job.key}:{incident}"


def parse_rules(data: Mapping[str, Any], origin: str) -> tuple[Rule, ...]:
    """The rules of a doom_rules.toml document; ValueError naming the rule and key that is wrong."""
    out = []
    for i, raw in enumerate(data.get("rule", [])):
        where = f"{origin}: rule {i + 1}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: not a table")
        known = {"name", "hits", "check", "codes", "buckets", "recovery_bucket", "recovery_actions", "fatal"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}")
        if raw.get("hits") not in HITS or not isinstance(raw.get("name"), str):
            raise ValueError(f"{where}: needs a name and hits = one of {', '.join(HITS)}")
        try:
            actions = tuple(Action[a] for a in raw.get("recovery_actions", ()))
        except KeyError as exc:
            raise ValueError(f"{where}: recovery_actions: {exc} is not an action") from None
        out.append(Rule(raw["name"], raw["hits"], raw.get("check"), tuple(map(str, raw.get("codes", ()))),
                        tuple(map(str, raw.get("buckets", ()))), raw.get("recovery_bucket"), actions,
                        raw.get("fatal")))
    if not out:
        raise ValueError(f"{origin}: no [[rule]]")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def rules() -> tuple[Rule, ...]:
    """The bundled rules (read once per process)."""
    return parse_rules(tomllib.loads(RULES_FILE.read_text(encoding="utf-8")), str(RULES_FILE))


def _applies(rule: Rule, f: Finding) -> bool:
    if rule.check is not None and f.check != rule.check:
        return False
    if rule.codes and f.code not in rule.codes:
        return False
    if rule.fatal is not None and bool(f.evidence.get("fatal")) is not rule.fatal:
        return False
    if rule.buckets or rule.recovery_bucket:
        bucket = f.evidence.get("bucket")
        if bucket == rule.recovery_bucket:
            return f.action in rule.recovery_actions
        return bucket in rule.buckets
    return True


def _reaches_peer_over_nvlink(job: JobOnNode, domain_spans_nodes: bool) -> bool:
    """Whether the job's traffic crosses NVLink: two or more of its GPUs here, or it spans nodes of one NVLink
    domain (an NVL72 rack)."""
    return len(job.gpus) >= 2 or (domain_spans_nodes and job.multi_node is True)


def _hit(rule: Rule, f: Finding, job: JobOnNode, domain_spans_nodes: bool) -> str | None:
    """What of the job the finding hits ("its GPU 2", "its port mlx5_0/1"), or None."""
    e = f.entity
    if rule.hits == "gpu":
        g = job.gpu(e.id if e.id != e.pci else None, e.pci, e.index) if e.kind == "gpu" else None
        return f"its GPU {g.index}" if g is not None else None
    if rule.hits == "nvlink":
        g = job.gpu(None, e.pci, e.index) if e.kind == "nvlink" else None
        if g is not None and _reaches_peer_over_nvlink(job, domain_spans_nodes):
            return f"its GPU {g.index}'s NVLink {e.link}"
        return None
    if rule.hits == "domain":
        if e.kind == "nvswitch" and _reaches_peer_over_nvlink(job, domain_spans_nodes):
            return f"the NVSwitch {e.id} its NVLink traffic crosses"
        return None
    if rule.hits == "ib_port":
        if e.kind == "ib_port" and e.id in job.ports and job.multi_node is True and not job.ib_disabled:
            return f"its port {e.id}"
        return None
    return None


def decide(findings: Iterable[Finding], jobs: Sequence[JobOnNode], now: float, boot_id: str | None,
           domain_spans_nodes: bool = False, first_seen: Mapping[str, float] | None = None,
           rule_set: Sequence[Rule] | None = None) -> list[Doom]:
    """The jobs the findings doom now. `first_seen`: when each incident was first seen (the guard keeps it; absent:
    now). `domain_spans_nodes`: this node's NVLink domain holds other nodes (an NVL72 rack)."""
    if not jobs:
        return []
    out: list[Doom] = []
    faults = [f for f in findings if f.status is Status.FAIL and f.action >= Action.DRAIN]
    for f in faults:
        for rule in rule_set if rule_set is not None else rules():
            if not _applies(rule, f):
                continue
            for job in jobs:
                if job.job.scheduler == "unknown":
                    continue  # no scheduler to act through (listed by `gpuwarden jobs`, never acted on)
                hit = _hit(rule, f, job, domain_spans_nodes)
                if hit is None:
                    continue
                doomed = _when(rule, f, job, now, boot_id, first_seen or {})
                if doomed is None:
                    continue
                incident, at = doomed
                out.append(Doom(job, f, rule.name, incident, at, f"{finding_text(f.to_dict())} ({hit})"))
            break  # one rule per finding: the first that applies
    return out


def _when(rule: Rule, f: Finding, job: JobOnNode, now: float, boot_id: str | None,
          first_seen: Mapping[str, float]) -> tuple[str, float] | None:
    """(incident, when it doomed the job), or None while it does not yet (a port down shorter than the job's IB
    timeout)."""
    if rule.hits == "ib_port":
        timeout = job.effective_ib_timeout_s.value
        down_for, since = f.evidence.get("down_for_s"), f.evidence.get("down_since")
        if not isinstance(timeout, (int, float)) or math.isinf(timeout) or not isinstance(down_for, (int, float)):
            return None  # a rail NCCL never gives up on, or an outage of unknown length: the job rides it out
        if down_for < timeout:
            return None
        start = float(since) if isinstance(since, (int, float)) else now - float(down_for)
        return f"{rule.name}:{f.entity.id}:{start:.3f}", start + float(timeout)
    incident = f"{rule.name}:{f.check}:{f.code}:{f.entity.id}:{boot_id or 'boot'}"
    return incident, float(first_seen.get(incident, now))

"""The result model every check, source and output shares: statuses, entities, findings, actions.

"Could not look" is never "healthy": UNKNOWN means a check (or one entity of it) could not be
judged; SKIPPED means it does not apply to this node. Both are distinct from OK.
"""
from __future__ import annotations

import enum
import json
from dataclasses import field
from operator import attrgetter
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.records import dataclass


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"  # the check could not run or could not read a device
    SKIPPED = "skipped"  # not applicable on this node (no IB HCA, no DCGM, ...)

    @property
    def rank(self) -> int:
        # Worst-of ordering used to fold findings into one check status.
        return _STATUS_RANK[self]


_STATUS_RANK = {Status.SKIPPED: 0, Status.OK: 1, Status.WARN: 2, Status.UNKNOWN: 3, Status.FAIL: 4}
_RANK_BY_NAME = {s._name_: r for s, r in _STATUS_RANK.items()}  # str keys hash in C


class Action(enum.IntEnum):
    """Recommended remediation, ordered: a larger value is a bigger hammer."""

    NONE = 0
    MONITOR = 1
    RESTART_APP = 2
    DRAIN = 3
    RESET_GPU = 4
    REBOOT = 5
    SERVICE = 6  # hardware service / RMA: no software action fixes it


@dataclass(frozen=True)
class Entity:
    """What a finding is about. ``id`` is stable across reboots where one exists (GPU UUID)."""

    kind: str  # gpu | ib_port | pcie | nvlink | node | nvswitch
    id: str
    index: int | None = None  # GPU index (NVML order) where known
    pci: str | None = None  # PCI bus id, e.g. 0000:91:00.0, where known
    link: int | None = None  # NVLink number for kind == "nvlink"

    @classmethod
    def node(cls, hostname: str) -> "Entity":
        return cls("node", hostname)

    def label(self) -> str:
        if self.kind == "gpu":
            parts = [f"GPU {self.index}" if self.index is not None else "GPU"]
            if self.id and self.id != self.pci:
                parts.append(self.id)
            if self.pci:
                parts.append(self.pci)
            return " ".join(parts)
        if self.kind == "nvlink" and self.link is not None:
            return f"GPU {self.index} link {self.link}"
        return f"{self.kind} {self.id}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "id": self.id}
        for key in ("index", "pci", "link"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Entity":
        return cls(d["kind"], d["id"], d.get("index"), d.get("pci"), d.get("link"))


@dataclass(frozen=True)
class Finding:
    """One observation about one entity, with the action an operator (or the agent) should take."""

    check: str
    code: str  # stable machine code: the XID number for XIDs, e.g. "79"; else kebab-case
    entity: Entity
    status: Status  # WARN, FAIL or UNKNOWN
    message: str
    action: Action = Action.NONE
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "code": self.code,
            "entity": self.entity.to_dict(),
            "status": self.status.value,
            "message": self.message,
            "action": self.action.name,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Finding":
        return cls(
            check=d["check"],
            code=str(d["code"]),
            entity=Entity.from_dict(d["entity"]),
            status=Status(d["status"]),
            message=d["message"],
            action=Action[d["action"]],
            evidence=dict(d.get("evidence", {})),
        )


@dataclass(frozen=True)
class CheckResult:
    """How one check ended: its status, what it found, and why it could not look when it could not."""

    check: str
    status: Status
    findings: tuple[Finding, ...] = ()
    error: str | None = None  # why the check is UNKNOWN or SKIPPED
    duration_s: float = 0.0
    source: str | None = None  # the file analysed (analyze), None for a check run on a node
    notes: tuple[str, ...] = ()  # problems that did not stop the check (malformed input lines)

    @property
    def action(self) -> Action:
        return max((f.action for f in self.findings), default=Action.NONE)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status.value,
            "action": self.action.name,
            "error": self.error,
            "duration_s": round(self.duration_s, 3),
            "findings": [f.to_dict() for f in self.findings],
            **({"source": self.source} if self.source is not None else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CheckResult":
        return cls(
            check=d["check"],
            status=Status(d["status"]),
            findings=tuple(Finding.from_dict(f) for f in d.get("findings", ())),
            error=d.get("error"),
            duration_s=float(d.get("duration_s", 0.0)),
            source=d.get("source"),
            notes=tuple(d.get("notes", ())),
        )


def fold_status(findings: Iterable[Finding]) -> Status:
    """The status of a check that ran to completion: OK unless a finding says worse."""
    # This runs at every observation over every finding a node holds (one per GPU and XID): the statuses are read and
    # looked for by identity at C speed (an enum member's hash is a Python-level call), the worst first.
    statuses = list(map(_STATUS, findings))
    if statuses:
        for status in _WORST_FIRST:
            if status in statuses:
                return status
    return Status.OK


_STATUS = attrgetter("status")
_WORST_FIRST = tuple(sorted(_STATUS_RANK, key=_STATUS_RANK.__getitem__, reverse=True))


def finding_text(finding: Any) -> str:
    """`check code entity` of a finding as the journal keeps it (Finding.to_dict): `xid 79 GPU3 0000:1b:00.0`,
    `nvlink_lanes nvlink-down GPU0 link 5`, `ib_port ib-port-down ib_port mlx5_1/1`; "" when it is not one."""
    if not isinstance(finding, Mapping) or not finding.get("check") or not finding.get("code"):
        return ""
    entity = finding.get("entity") if isinstance(finding.get("entity"), Mapping) else {}
    kind, index = str(entity.get("kind", "")), entity.get("index")
    if kind in ("gpu", "nvlink") and isinstance(index, int) and not isinstance(index, bool):
        where = [f"GPU{index}"]
        if kind == "nvlink" and entity.get("link") is not None:
            where.append(f"link {entity['link']}")
        elif entity.get("pci"):
            where.append(str(entity["pci"]))
    elif kind and kind != "node":
        where = [kind, str(entity.get("id", ""))]
    else:
        where = []
    return " ".join(str(p)[:100] for p in (finding["check"], finding["code"], *where) if p)


# Exit codes of `preflight` and `analyze` (Slurm's health check and Prolog go through `gpuwarden slurm`).
EXIT_PASS = 0  # every check passed or only warned
EXIT_FAULT = 1  # a fault that needs action (any FAIL)
EXIT_UNDECIDED = 2  # no fault found, but something could not be judged (any UNKNOWN)


def verdict_exit_code(results: Iterable[CheckResult]) -> int:
    statuses = {r.status for r in results}
    if Status.FAIL in statuses:
        return EXIT_FAULT
    if Status.UNKNOWN in statuses:
        return EXIT_UNDECIDED
    return EXIT_PASS


@dataclass(frozen=True)
class Report:
    """What one preflight or analyze run produced; the JSON form is a contract for other tools."""

    node: str
    results: tuple[CheckResult, ...]
    source: str = "live"  # "live", a scenario root, or the analysed file names
    tool: str = "preflight"

    @property
    def exit_code(self) -> int:
        return verdict_exit_code(self.results)

    @property
    def status(self) -> Status:
        return max((r.status for r in self.results), key=lambda s: s.rank, default=Status.UNKNOWN)

    def to_dict(self) -> dict[str, Any]:
        findings = [f.to_dict() for r in self.results for f in r.findings]
        return {
            "tool": self.tool,
            "node": self.node,
            "source": self.source,
            "status": self.status.value,
            "exit_code": self.exit_code,
            "action": max((r.action for r in self.results), default=Action.NONE).name,
            "results": [r.to_dict() for r in self.results],
            "findings": findings,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Report":
        return cls(
            node=d["node"],
            results=tuple(CheckResult.from_dict(r) for r in d["results"]),
            source=d.get("source", "live"),
            tool=d.get("tool", "preflight"),
        )

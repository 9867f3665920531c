"""Where each rank of a failed job ran, from its logs' tables (NCCL's comm lines, nccl-tests' rank lines, the bootstrap
and NET/IB lines, torchrun's summary), and the shapes `gpuwarden explain`'s reasoning passes around: a `Step` of
evidence, a `_Pointer` (one line of reasoning's answer), a culprit. Pure."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.jobs.joblog import LogEvent


@dataclass(frozen=True)
class Step:
    step: str  # "a" node evidence, "b" stalled rank, "c" peer errors, "d" first failure, "map" a table line
    source: str
    line: int | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "source": self.source, "line": self.line, "text": self.text}


def culprit(kind: str = "none", host: str | None = None, rank: int | None = None, gpu: Any = None,
            port: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "host": host, "rank": rank, "gpu": gpu, "port": port, **extra}


def short(host: str | None) -> str | None:
    """A host as a scheduler names it: the first label, lower case (NCCL prints gethostname(), Slurm the node)."""
    if not host:
        return None
    return host.split(".")[0].lower() if not _is_ip(host) else host


def _is_ip(text: str) -> bool:
    parts = text.split(".")
    return (len(parts) == 4 and all(p.isdigit() for p in parts)) or text.count(":") >= 2


@dataclass(frozen=True)
class RankPlace:
    rank: int
    host: str | None
    cuda_dev: int | None
    bus: int | None
    event: LogEvent

    def gpu_text(self) -> str:
        parts = []
        if self.cuda_dev is not None:
            parts.append(f"cudaDev {self.cuda_dev}")
        if self.bus is not None:
            parts.append(f"busId {pci_text(self.bus)}")
        return ", ".join(parts)


def pci_text(bus: int) -> str:
    return f"{bus >> 20:04x}:{(bus >> 12) & 0xff:02x}:{(bus >> 4) & 0xff:02x}.{bus & 0xf:x}"


class _Tables:
    """What the logs say about where each rank ran: rank -> host/GPU, (host, pid) -> rank, IP -> host."""

    def __init__(self, events: Sequence[LogEvent]):
        self.world = max((e.fields["nranks"] for e in events if e.kind == "comm"), default=None)
        self.places: dict[int, RankPlace] = {}
        self.pid_rank: dict[tuple[str | None, int], int] = {}
        self.ip_host: dict[str, str] = {}
        self.hosts: set[str] = set()
        for e in events:
            if e.host and not e.host.startswith("<"):
                self.hosts.add(short(e.host) or "")
            if e.kind == "comm":
                rank = e.rank if e.rank is not None and e.fields.get("_rank_from") != "tag" else None
                if rank is None and e.fields["nranks"] == self.world:
                    rank = e.fields["comm_rank"]
                if rank is None and e.rank is not None:
                    rank = e.rank
                if rank is not None:
                    self._place(RankPlace(rank, e.host, e.fields["cuda_dev"], e.fields["bus"], e))
                    if e.pid is not None:
                        self.pid_rank[(short(e.host), e.pid)] = rank
            elif e.kind == "tests_rank":
                self._place(RankPlace(e.fields["rank"], e.fields["host"], e.fields["dev"], e.fields["bus"], e))
            elif e.kind in ("bootstrap", "ib_devices") and e.host:
                for ip in e.fields.get("ips") or [e.fields.get("oob_ip")]:
                    if ip:
                        self.ip_host[ip] = e.host
            elif e.kind == "torchrun_failure" and e.rank is not None and e.host:
                self.places.setdefault(e.rank, RankPlace(e.rank, e.host, None, None, e))
        for e in events:  # a line whose rank its launcher prefix gives, and NCCL's host prefix
            if e.rank is not None and e.host and e.rank not in self.places and e.kind != "torchrun_failure":
                self.places[e.rank] = RankPlace(e.rank, e.host, e.dev, None, e)

    def _place(self, p: RankPlace) -> None:
        old = self.places.get(p.rank)
        if old is None or (old.bus is None and p.bus is not None):
            self.places[p.rank] = p

    def rank_of(self, e: LogEvent) -> int | None:
        if e.rank is not None:
            return e.rank
        if e.pid is not None and (short(e.host), e.pid) in self.pid_rank:
            return self.pid_rank[(short(e.host), e.pid)]
        pg, name, pg_rank = e.fields.get("pg"), e.fields.get("pg_name"), e.fields.get("pg_rank")
        if pg_rank is not None and (pg == 0 or name == "default_pg"):
            return pg_rank
        return None

    def host_of(self, e: LogEvent) -> str | None:
        if e.host and not e.host.startswith("<"):
            return e.host
        r = self.rank_of(e)
        return self.places[r].host if r is not None and r in self.places else None

    def peer_host(self, peer: str) -> str:
        return self.ip_host.get(peer, peer)


@dataclass(frozen=True)
class _Pointer:
    """One line of reasoning's answer: a rank and/or host, with its evidence. `extra`: culprit fields it knows
    itself (kind, link, local_rank); `action` what to do where it knows. A node finding (step "a") also carries the
    culprit it names whole (`culprit`), the ranks it maps to, its GPU's bus id and how severe it is."""

    step: str
    rank: int | None
    host: str | None
    steps: tuple[Step, ...]
    what: str
    cause: str | None = None
    extra: Mapping[str, Any] | None = None
    action: str | None = None
    culprit: Mapping[str, Any] | None = None
    ranks: tuple[int, ...] = ()
    bus: int | None = None
    severity: int = 0


def _step(step: str, e: LogEvent) -> Step:
    return Step(step, e.source, e.line, e.text)


def _map_step(p: RankPlace) -> Step:
    return Step("map", p.event.source, p.event.line,
                f"rank {p.rank} ran on {p.host}" + (f" ({p.gpu_text()})" if p.gpu_text() else "") + ": "
                + p.event.text)

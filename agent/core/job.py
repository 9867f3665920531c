"""What a job on this node is, as the job response sees it: the job's identity at its scheduler, the GPUs, ranks and
IB ports it uses here, and the settings that decide how a fault ends it, each figure with where it came from.

Everything here round-trips through JSON: the daemon keeps the jobs it knows in its store, so a restart (or a GPU
that can no longer be read after it fell off the bus) still knows which job was on which GPU."""
from __future__ import annotations

import math
from typing import Any, Mapping

from gpuwarden.agent.core.records import dataclass

SCHEDULERS = ("slurm", "kubernetes", "unknown")


@dataclass(frozen=True)
class Figure:
    """A value and where it came from ("NCCL_IB_TIMEOUT=18 in the environment of pid 4242", "NCCL 2.21.5's
    default"). `value` None: not known (the source says why)."""

    value: Any
    source: str

    def to_dict(self) -> dict[str, Any]:
        value = self.value
        if isinstance(value, float) and math.isinf(value):
            value = "infinite"  # JSON has no infinity
        return {"value": value, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Figure":
        value = d.get("value")
        return cls(math.inf if value == "infinite" else value, str(d.get("source", "")))


@dataclass(frozen=True)
class JobRef:
    """A job at its scheduler: a Slurm job id (and which run of it: Slurm's restart count), or a Kubernetes pod's
    UID. `source` says how the agent knows."""

    scheduler: str  # slurm | kubernetes | unknown
    id: str
    run: int | None = None  # Slurm: the job's restart count when it was seen (SLURM_RESTART_COUNT, 0 when absent)
    source: str = ""

    @property
    def key(self) -> str:
        """The job's run as one word for keys and labels: `slurm:4242.0`, `kubernetes:<uid>`."""
        return f"{self.scheduler}:{self.id}" + (f".{self.run}" if self.run is not None else "")

    def label(self) -> str:
        if self.scheduler == "slurm":
            return f"Slurm job {self.id}" + (f" (run {self.run})" if self.run else "")
        if self.scheduler == "kubernetes":
            return f"pod {self.id}"
        return f"job {self.id}"

    def to_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler, "id": self.id, "run": self.run, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobRef":
        run = d.get("run")
        return cls(str(d["scheduler"]), str(d["id"]), int(run) if isinstance(run, int) else None,
                   str(d.get("source", "")))


@dataclass(frozen=True)
class GpuUse:
    """A GPU of this node that a process of the job holds a context on (NVML's compute processes)."""

    index: int
    uuid: str | None
    pci: str | None
    pids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "pci": self.pci, "pids": list(self.pids)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GpuUse":
        return cls(int(d["index"]), d.get("uuid"), d.get("pci"), tuple(int(p) for p in d.get("pids", ())))


@dataclass(frozen=True)
class JobOnNode:
    """One job's share of this node, and what decides how a fault ends it."""

    job: JobRef
    gpus: tuple[GpuUse, ...]
    pids: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks of its processes here (RANK, else SLURM_PROCID); empty: none said
    local_ranks: tuple[int, ...]
    ranks_source: str
    ports: tuple[str, ...]  # "mlx5_0/1": the IB ports NCCL may use (NCCL_IB_HCA, else every active port)
    ports_source: str
    nodes: Figure  # nodes the job runs on (SLURM_NNODES, WORLD_SIZE / LOCAL_WORLD_SIZE); None: not known
    gpus_total: Figure  # the job's GPUs on every node (the GPU-seconds estimate)
    nccl_version: Figure  # "2.21.5"
    ib_timeout: Figure  # NCCL_IB_TIMEOUT's exponent in effect
    ib_retry_cnt: Figure  # NCCL_IB_RETRY_CNT in effect
    effective_ib_timeout_s: Figure  # 4.096 us x 2^timeout x retries: how long a rail may be silent (inf: never)
    watchdog_s: Figure  # PyTorch's NCCL watchdog timeout (the process group's timeout)
    heartbeat_s: Figure  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
    async_error_handling: Figure  # TORCH_NCCL_ASYNC_ERROR_HANDLING
    ib_disabled: bool = False  # NCCL_IB_DISABLE=1: NCCL uses sockets, not the IB verbs transport
    socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME, as set
    seen_at: float | None = None  # when the agent first saw the job on this node

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def gpu(self, uuid: str | None, pci: str | None, index: int | None) -> GpuUse | None:
        """The job's GPU that a finding's entity names (by UUID, else PCI address, else NVML index), or None."""
        for g in self.gpus:
            if (uuid and g.uuid == uuid) or (pci and g.pci == pci) or (
                    uuid is None and pci is None and index is not None and g.index == index):
                return g
        return None

    @property
    def multi_node(self) -> bool | None:
        """Whether the job runs on more than this node (None: not known)."""
        n = self.nodes.value
        return None if not isinstance(n, int) else n > 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job.to_dict(), "gpus": [g.to_dict() for g in self.gpus], "pids": list(self.pids),
            "ranks": list(self.ranks), "local_ranks": list(self.local_ranks), "ranks_source": self.ranks_source,
            "ports": list(self.ports), "ports_source": self.ports_source, "nodes": self.nodes.to_dict(),
            "gpus_total": self.gpus_total.to_dict(), "nccl_version": self.nccl_version.to_dict(),
            "ib_timeout": self.ib_timeout.to_dict(), "ib_retry_cnt": self.ib_retry_cnt.to_dict(),
            "effective_ib_timeout_s": self.effective_ib_timeout_s.to_dict(),
            "watchdog_s": self.watchdog_s.to_dict(), "heartbeat_s": self.heartbeat_s.to_dict(),
            "async_error_handling": self.async_error_handling.to_dict(), "ib_disabled": self.ib_disabled,
            "socket_ifname": self.socket_ifname, "seen_at": self.seen_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobOnNode":
        fig = Figure.from_dict
        return cls(
            job=JobRef.from_dict(d["job"]), gpus=tuple(GpuUse.from_dict(g) for g in d.get("gpus", ())),
            pids=tuple(int(p) for p in d.get("pids", ())), ranks=tuple(int(r) for r in d.get("ranks", ())),
            local_ranks=tuple(int(r) for r in d.get("local_ranks", ())), ranks_source=str(d.get("ranks_source", "")),
            ports=tuple(str(p) for p in d.get("ports", ())), ports_source=str(d.get("ports_source", "")),
            nodes=fig(d["nodes"]), gpus_total=fig(d["gpus_total"]), nccl_version=fig(d["nccl_version"]),
            ib_timeout=fig(d["ib_timeout"]), ib_retry_cnt=fig(d["ib_retry_cnt"]),
            effective_ib_timeout_s=fig(d["effective_ib_timeout_s"]), watchdog_s=fig(d["watchdog_s"]),
            heartbeat_s=fig(d["heartbeat_s"]), async_error_handling=fig(d["async_error_handling"]),
            ib_disabled=bool(d.get("ib_disabled", False)), socket_ifname=d.get("socket_ifname"),
            seen_at=d.get("seen_at"))


def jobs_in(state: Mapping[str, Any]) -> list[JobOnNode]:
    """The jobs the `jobs` check's state holds (checks/jobs.py): what the doom rules and `status` read. An entry that
    does not read (written by another version) is left out: the next poll writes it again."""
    out = []
    jobs = state.get("jobs") if isinstance(state, Mapping) else None
    for raw in (jobs.values() if isinstance(jobs, Mapping) else ()):
        try:
            out.append(JobOnNode.from_dict(raw))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out

"""Which job uses what on this node: NVML's compute processes per GPU, each read (checks/job_process.py: its job, its
rank, the settings that decide how a fault ends it, the NCCL release it runs), and the processes of one job put
together into the JobOnNode the jobs check and `gpuwarden jobs` report, with the figures of the job.

Every read goes through the node's sources (its root: / live, the scenario folder on a recorded node; its tool
runner: the real `scontrol`, or a recorded output), so a scenario records jobs and replays them. A process is read
once per (pid, start time): a PID the kernel gives to another process is read again.

Where the agent cannot look (a process in another PID namespace, /proc mounted with hidepid, an environment it may
not read), the job is still listed, with the reason, and the figures it could not read say so.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from gpuwarden.agent.core import nccl_env as nccl
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.job import Figure, GpuUse, JobOnNode
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.job_process import ProcessInfo, Tape, _int, read_process

# PyTorch's ProcessGroupNCCL timeout when the job gives none: "Default value is 10 minutes for NCCL" (the
# torch.distributed docs, since pytorch/pytorch#110947 in 2.2; 30 minutes before).
WATCHDOG_DEFAULT_S = 600.0
WATCHDOG_BEFORE_2_2_S = 1800.0
# The watchdog's own heartbeat monitor: 8 minutes in the releases whose logs say "stuck for 480 seconds" (2.3 and
# later), 10 minutes in 2.2.
HEARTBEAT_DEFAULT_S = 480.0


@dataclass(frozen=True)
class Discovery:
    """What one look found: the jobs on the node, and the GPUs whose processes could not be read (index -> why, and
    each GPU with its NVML error, for the findings)."""

    jobs: tuple[JobOnNode, ...]
    unreadable: Mapping[int, str]
    problems: tuple[str, ...] = ()
    errors: tuple[tuple[Any, NvmlError], ...] = ()  # (the GPU, what NVML said)


def discover(node: Any, ports: Sequence[tuple[str, bool]] | Callable[[], Sequence[tuple[str, bool]]], now: float,
             tape: Tape | None = None) -> Discovery:
    """The jobs using this node's GPUs now. `ports`: (name "mlx5_0/1", up) of the node's IB ports, or what reads them
    (read only where a GPU has a process: an idle node's look is NVML's process lists alone). Raises SourceError
    (NvmlError) when NVML cannot list the GPUs at all."""
    gpus = node.gpus()
    procs: dict[int, list[Any]] = {}  # pid -> the GPUs it holds
    unreadable: dict[int, str] = {}
    errors: list[tuple[Any, NvmlError]] = []
    for gpu in gpus:
        try:
            if gpu.error is not None:
                raise gpu.error
            listed = node.nvml.processes(gpu)
        except NvmlError as exc:
            unreadable[gpu.index] = str(exc)
            errors.append((gpu, exc))
            continue
        for p in listed:
            if p["type"] == "compute":
                procs.setdefault(int(p["pid"]), []).append(gpu)
    infos = [read_process(node, pid, tape) for pid in sorted(procs)]
    if callable(ports):
        ports = ports() if infos else ()
    jobs: dict[str, list[ProcessInfo]] = {}
    for info in infos:
        jobs.setdefault(info.job.key, []).append(info)
    out = [_job(members, procs, ports, now) for members in jobs.values()]
    problems = tuple(p for info in infos for p in info.problems)
    return Discovery(tuple(out), unreadable, problems, tuple(errors))


def _job(members: list[ProcessInfo], procs: Mapping[int, list[Any]], ports: Sequence[tuple[str, bool]],
         now: float) -> JobOnNode:
    members = sorted(members, key=lambda m: (m.rank if m.rank is not None else 1 << 30, m.pid))
    lead = members[0]  # the lowest rank here speaks for the job's settings (its ranks share one launch)
    by_gpu: dict[int, tuple[Any, list[int]]] = {}
    for m in members:
        for gpu in procs[m.pid]:
            by_gpu.setdefault(gpu.index, (gpu, []))[1].append(m.pid)
    gpus = tuple(GpuUse(i, g.uuid, g.pci, tuple(pids)) for i, (g, pids) in sorted(by_gpu.items()))
    ranks = tuple(sorted({m.rank for m in members if m.rank is not None}))
    local = tuple(sorted({m.local_rank for m in members if m.local_rank is not None}))
    env, settings = lead.env, lead.settings
    version = nccl.parse_version(lead.nccl_version.value) if lead.nccl_version.value else None
    timeout = nccl.ib_timeout(settings, version)
    ib_disabled = settings.get("NCCL_IB_DISABLE", ("0", ""))[0].strip() not in ("", "0")
    chosen, why = nccl.job_ports(settings, ports)
    if ib_disabled:
        chosen, why = (), f"NCCL_IB_DISABLE={settings['NCCL_IB_DISABLE'][0]} ({settings['NCCL_IB_DISABLE'][1]}): " \
                          "NCCL uses sockets, not the IB ports"
    nodes = _nodes(env, lead.pid)
    return JobOnNode(
        job=lead.job, gpus=gpus, pids=tuple(m.pid for m in members), ranks=ranks, local_ranks=local,
        ranks_source=lead.rank_source, ports=chosen, ports_source=why, nodes=nodes,
        gpus_total=_gpus_total(env, nodes, len(gpus), lead.pid), nccl_version=lead.nccl_version,
        ib_timeout=timeout.exponent, ib_retry_cnt=timeout.retries, effective_ib_timeout_s=timeout.effective_s,
        watchdog_s=_watchdog(lead.torch_version), heartbeat_s=_heartbeat(env, lead.torch_version, lead.pid),
        async_error_handling=_async(env, lead.pid), ib_disabled=ib_disabled,
        socket_ifname=settings.get("NCCL_SOCKET_IFNAME", (None, ""))[0], seen_at=now)


# -- figures of the job ----------------------------------------------------------------------------------------------
def _nodes(env: Mapping[str, str], pid: int) -> Figure:
    for key in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        n = _int(env.get(key))
        if n is not None and n > 0:
            return Figure(n, f"{key} in the environment of pid {pid}")
    world, local = _int(env.get("WORLD_SIZE")), _int(env.get("LOCAL_WORLD_SIZE"))
    if world and local:
        return Figure(-(-world // local), f"WORLD_SIZE {world} / LOCAL_WORLD_SIZE {local} (pid {pid})")
    return Figure(None, "not known (no SLURM_NNODES, WORLD_SIZE or LOCAL_WORLD_SIZE): a fault off this node's GPUs "
                        "and NVLinks does not end it")


def _gpus_total(env: Mapping[str, str], nodes: Figure, here: int, pid: int) -> Figure:
    world = _int(env.get("WORLD_SIZE"))
    if world:
        return Figure(world, f"WORLD_SIZE in the environment of pid {pid} (one GPU a rank)")
    if isinstance(nodes.value, int):
        return Figure(nodes.value * here, f"{nodes.value} node(s) x the {here} GPU(s) it holds here")
    return Figure(here, "the GPUs it holds here (its other nodes are not known)")


def _watchdog(torch: Figure) -> Figure:
    version = nccl.parse_version(torch.value) if torch.value else None
    if version is not None and version < (2, 2, 0):
        return Figure(WATCHDOG_BEFORE_2_2_S, f"PyTorch {torch.value}'s default (30 min before 2.2); the job's own "
                                             "timeout= is not visible to the agent")
    shown = f"PyTorch {torch.value}'s" if version else "PyTorch's (2.2 and later)"
    return Figure(WATCHDOG_DEFAULT_S, f"{shown} default, 10 min (torch.distributed docs); the job's own timeout= is "
                                      "not visible to the agent")


def _heartbeat(env: Mapping[str, str], torch: Figure, pid: int) -> Figure:
    value = env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if value is not None and _int(value) is not None:
        return Figure(float(_int(value)), f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={value} (environment of pid {pid})")
    version = nccl.parse_version(torch.value) if torch.value else None
    if version is not None and version < (2, 2, 0):
        return Figure(None, f"PyTorch {torch.value} has no heartbeat monitor")
    if version is not None and version < (2, 3, 0):
        return Figure(600.0, f"PyTorch {torch.value}'s default, 10 min")
    return Figure(HEARTBEAT_DEFAULT_S, "PyTorch's default, 8 min (2.3 and later)")


def _async(env: Mapping[str, str], pid: int) -> Figure:
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if key in env:
            return Figure(env[key], f"{key} in the environment of pid {pid}")
    return Figure("3", "PyTorch's default (3: tear the process down on an error; torch_nccl_environment_variables)")

"""One GPU process as /proc and `scontrol pidinfo` say, for checks/job_discovery.py: its job (its cgroup: Slurm's
`job_<id>`, a Kubernetes pod's UID; `scontrol pidinfo` where the cgroup does not say; SLURM_JOB_ID in its environment
last), its rank and NCCL's settings (/proc/<pid>/environ, NCCL's config files), and the NCCL and PyTorch releases it
runs (the libraries it has mapped: /proc/<pid>/maps). Read once per (pid, start time); a Tape keeps what was read.
"""
from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

from gpuwarden.agent.core import nccl_env as nccl
from gpuwarden.agent.core.errors import SourceError, ToolError, ToolMissing
from gpuwarden.agent.core.job import Figure, JobRef
from gpuwarden.agent.core.records import dataclass

# The environment a job's process is read for (nothing else of it is kept: an environment holds tokens and keys).
ENV_KEYS = frozenset((
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID",
    "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_RESTART_COUNT", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "HOME", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_HCA",
    "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_CONF_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"))
NCCL_FILE_KEYS = ("NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME")
MAX_ENVIRON = 1 << 21  # ARG_MAX-sized: a process's whole initial environment
MAX_MAPS = 8 << 20  # /proc/<pid>/maps of a large PyTorch process is a few hundred KB
MAX_SMALL = 1 << 16  # a cgroup file, a stat line, a config file, version.py
BANNER_SCAN = 64 << 20  # how far into a mapped libnccl its banner is looked for (2.32.3: at 3.4 MB of 452 MB)
BANNER_CHUNK = 1 << 20
BANNER_WINDOW = 256  # the bytes around the banner `gpuwarden record` keeps of a library
PIDINFO_TIMEOUT_S = 5.0
CACHE = 4096  # processes remembered (by pid and start time)

_SLURM_CGROUP = re.compile(r"/job_(\d{1,12})(?:/|$)")
_POD_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_PIDINFO = re.compile(r"Slurm job id (\d{1,12})")
_LIB_VERSION = re.compile(r"libnccl\.so\.(\d+\.\d+\.\d+)$")
_BANNER = re.compile(rb"NCCL version (\d{1,3}\.\d{1,3}\.\d{1,4})\+cuda")
_DIST_INFO = re.compile(r"^nvidia_nccl_cu\d+-(\d+\.\d+\.\d+)(?:\.[^-]*)?\.dist-info$")
_TORCH_VERSION = re.compile(r"""^__version__\s*=\s*['"]([^'"]{1,64})['"]""", re.M)


@dataclass(frozen=True)
class ProcessInfo:
    """One GPU process, as read from /proc (and scontrol)."""

    pid: int
    job: JobRef
    rank: int | None
    local_rank: int | None
    rank_source: str
    env: Mapping[str, str]  # ENV_KEYS only
    settings: Mapping[str, tuple[str, str]]  # NCCL's settings in effect: {NAME: (value, where)}
    nccl_version: Figure
    torch_version: Figure
    problems: tuple[str, ...] = ()


class Tape:
    """What a look read of /proc, kept for `gpuwarden record` (kernel path -> bytes): a scenario written from it
    replays the same answers. Only what the reading keeps is taped (the environment's ENV_KEYS, maps' library lines,
    the bytes around a library's banner). The tools it runs (`scontrol pidinfo`) are the node's tool runner's: record
    saves them as it saves every tool's (agent/node/record_tools.py)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.windows: dict[str, tuple[int, bytes]] = {}  # a library's banner: (offset, bytes), the rest not kept


_cache: "OrderedDict[tuple[str, int, str], ProcessInfo]" = OrderedDict()
_banners: dict[tuple[str, str, tuple[int, ...]], tuple[str | None, int | None]] = {}
_lock = threading.Lock()


# -- one process -------------------------------------------------------------------------------------------------
def read_process(node: Any, pid: int, tape: Tape | None = None) -> ProcessInfo:
    """What /proc (and scontrol) say of one GPU process; cached by (pid, start time) unless taping."""
    sysfs = node.sysfs
    start = _read_text(sysfs, f"/proc/{pid}/stat", tape)
    key = (str(sysfs.root), pid, _start_time(start))
    if tape is None:
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
    info = _read_process(node, pid, tape)
    if tape is None and start is not None:  # a process that is gone is not remembered
        with _lock:
            _cache[key] = info
            while len(_cache) > CACHE:
                _cache.popitem(last=False)
    return info


def _read_process(node: Any, pid: int, tape: Tape | None) -> ProcessInfo:
    sysfs = node.sysfs
    problems: list[str] = []
    env = _environ(sysfs, pid, tape, problems)
    job = _job_of(node, pid, env, tape, problems)
    rank, source = _first_int(env, ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    local_rank, _ = _first_int(env, ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"))
    rank_source = f"{source} in the environment of pid {pid}" if source else "no rank in the process's environment"
    maps = _maps(sysfs, pid, tape, problems)
    settings = {k: (v, f"environment of pid {pid}") for k, v in env.items() if k.startswith("NCCL_")}
    for name, (value, where) in _nccl_files(sysfs, pid, env, tape).items():
        if name in NCCL_FILE_KEYS and name not in settings:
            settings[name] = (value, where)
    version = _nccl_version(sysfs, pid, maps, tape)
    torch = _torch_version(sysfs, pid, maps, tape)
    return ProcessInfo(pid, job, rank, local_rank, rank_source, env, settings, version, torch, tuple(problems))


def _environ(sysfs: Any, pid: int, tape: Tape | None, problems: list[str]) -> dict[str, str]:
    path = f"/proc/{pid}/environ"
    try:
        raw = sysfs.read_bytes(path, MAX_ENVIRON)
    except (OSError, SourceError) as exc:
        problems.append(f"{sysfs.path(path)}: cannot read: {getattr(exc, 'strerror', None) or exc}")
        return {}
    env: dict[str, str] = {}
    for item in raw[:MAX_ENVIRON].split(b"\0"):
        name, sep, value = item.partition(b"=")
        key = name.decode(errors="replace")
        if sep and key in ENV_KEYS:
            env[key] = value[:4096].decode(errors="replace")
    if tape is not None:
        tape.files[path] = b"".join(f"{k}={v}".encode() + b"\0" for k, v in sorted(env.items()))
    return env


def _job_of(node: Any, pid: int, env: Mapping[str, str], tape: Tape | None, problems: list[str]) -> JobRef:
    run = _int(env.get("SLURM_RESTART_COUNT"))
    run = 0 if run is None else run
    cgroup = _read_text(node.sysfs, f"/proc/{pid}/cgroup", tape)
    if cgroup is not None:
        found = job_from_cgroup(cgroup)
        if found is not None:
            scheduler, ident = found
            return JobRef(scheduler, ident, run if scheduler == "slurm" else None,
                          f"cgroup of pid {pid} ({_cgroup_line(cgroup, ident)})")
    else:
        problems.append(f"{node.sysfs.path(f'/proc/{pid}/cgroup')}: cannot read (the process is gone, or not in "
                        "this PID namespace)")
    try:
        out = node.tools.run(f"scontrol-pidinfo-{pid}", ["scontrol", "pidinfo", str(pid)], PIDINFO_TIMEOUT_S)
        text, rc = out.output, out.returncode
    except ToolMissing:
        text, rc = None, None
    except ToolError as exc:
        text, rc = None, None
        problems.append(f"scontrol pidinfo {pid}: {exc}")
    m = _PIDINFO.search(text or "") if rc == 0 else None
    if m:
        return JobRef("slurm", m[1], run, f"scontrol pidinfo {pid}")
    if env.get("SLURM_JOB_ID", "").isdigit():
        return JobRef("slurm", env["SLURM_JOB_ID"], run, f"SLURM_JOB_ID in the environment of pid {pid} (its cgroup "
                      "names no job: Slurm's proctrack/cgroup is not in use)")
    return JobRef("unknown", f"pid-{pid}", None, f"pid {pid}: no job in its cgroup, environment or scontrol pidinfo")


def job_from_cgroup(text: str) -> tuple[str, str] | None:
    """("slurm", "4242") from a Slurm job's cgroup (v1 `/slurm/uid_0/job_4242/step_0`, v2
    `/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0`), ("kubernetes", "<pod uid>") from a pod's (cgroupfs
    `/kubepods/burstable/pod<uid>/...`, systemd `kubepods-burstable-pod<uid with _>.slice`); None otherwise."""
    for line in text.splitlines()[:64]:
        path = line.split(":", 2)[-1]
        m = _SLURM_CGROUP.search(path)
        if m:
            return "slurm", m[1]
        m = _POD_CGROUP.search(path)
        if m:
            return "kubernetes", m[1].replace("_", "-")
    return None


def _cgroup_line(text: str, ident: str) -> str:
    for line in text.splitlines():
        if ident in line or ident.replace("-", "_") in line:
            return line.strip()[:200]
    return ""


def _maps(sysfs: Any, pid: int, tape: Tape | None, problems: list[str]) -> list[str]:
    """The paths of the NCCL and PyTorch libraries the process has mapped."""
    path = f"/proc/{pid}/maps"
    try:
        raw = sysfs.read_bytes(path, MAX_MAPS)
    except (OSError, SourceError) as exc:
        problems.append(f"{sysfs.path(path)}: cannot read: {getattr(exc, 'strerror', None) or exc}")
        return []
    lines = [line for line in raw[:MAX_MAPS].decode(errors="replace").splitlines()
             if "libnccl" in line or "/torch/lib/" in line]
    if tape is not None:
        tape.files[path] = "".join(line + "\n" for line in lines).encode()
    seen: list[str] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and parts[5] not in seen:
            seen.append(parts[5].removesuffix(" (deleted)"))
    return seen


def _nccl_version(sysfs: Any, pid: int, libraries: Sequence[str], tape: Tape | None) -> Figure:
    """The NCCL release the process runs: from the mapped library's file name (libnccl.so.2.21.5), else the wheel it
    came from (nvidia_nccl_cu12-2.21.5.dist-info beside it), else the banner inside the library ("NCCL version
    2.21.5+cuda12.4", what NCCL prints at init)."""
    lib = next((p for p in libraries if os.path.basename(p).startswith("libnccl.so")), None)
    if lib is None:
        return Figure(None, f"pid {pid} has no libnccl mapped (not started yet, or NCCL linked statically)")
    m = _LIB_VERSION.search(lib)
    if m:
        return Figure(m[1], f"the library pid {pid} has mapped: {lib}")
    root = f"/proc/{pid}/root"
    parts = lib.split("/")
    if len(parts) > 4 and parts[-4:-1] == ["nvidia", "nccl", "lib"]:
        site = "/".join(parts[:-4])
        try:
            names = sysfs.listdir(root + site)
        except SourceError:
            names = []
        for name in names:
            d = _DIST_INFO.match(name)
            if d:
                if tape is not None:
                    tape.files[f"{root}{site}/{name}/METADATA"] = b""
                return Figure(d[1], f"the wheel of the library pid {pid} has mapped: {site}/{name}")
    version, offset = _banner(sysfs, root + lib)
    if version is not None:
        if tape is not None and offset is not None:
            tape.windows[root + lib] = _window(sysfs, root + lib, offset)
        return Figure(version, f"the banner in the library pid {pid} has mapped: {lib}")
    return Figure(None, f"the library pid {pid} has mapped ({lib}) names no version")


def _banner(sysfs: Any, path: str) -> tuple[str | None, int | None]:
    """The version in a library's "NCCL version X.Y.Z+cuda" banner and its offset, cached by the file's identity."""
    try:
        fd = sysfs.open_fd(path)
    except SourceError:
        return None, None
    try:
        st = os.fstat(fd)
        key = (str(sysfs.root), path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        with _lock:
            if key in _banners:
                return _banners[key]
        found: tuple[str | None, int | None] = (None, None)
        tail, offset = b"", 0
        while offset < BANNER_SCAN:
            chunk = os.pread(fd, BANNER_CHUNK, offset)
            if not chunk:
                break
            data = tail + chunk
            m = _BANNER.search(data)
            if m:
                found = (m[1].decode(), offset - len(tail) + m.start())
                break
            tail = data[-64:]
            offset += len(chunk)
    except OSError:
        return None, None
    finally:
        os.close(fd)
    with _lock:
        if len(_banners) > 64:
            _banners.clear()
        _banners[key] = found
    return found


def _window(sysfs: Any, path: str, offset: int) -> tuple[int, bytes]:
    """The library's bytes around its banner, and where they start: a file holding only them, in place (the rest a
    hole), replays the same reading."""
    start = max(0, offset - BANNER_WINDOW)
    try:
        fd = sysfs.open_fd(path)
    except SourceError:
        return start, b""
    try:
        return start, os.pread(fd, 2 * BANNER_WINDOW, start)
    finally:
        os.close(fd)


def _torch_version(sysfs: Any, pid: int, libraries: Sequence[str], tape: Tape | None) -> Figure:
    lib = next((p for p in libraries if "/torch/lib/" in p), None)
    if lib is None:
        return Figure(None, f"pid {pid} has no PyTorch library mapped")
    site_torch = lib.split("/torch/lib/", 1)[0] + "/torch"
    text = _read_text(sysfs, f"/proc/{pid}/root{site_torch}/version.py", tape)
    m = _TORCH_VERSION.search(text or "")
    if not m:
        return Figure(None, f"{site_torch}/version.py of pid {pid}: not readable")
    return Figure(m[1], f"{site_torch}/version.py of pid {pid}")


def _nccl_files(sysfs: Any, pid: int, env: Mapping[str, str], tape: Tape | None) -> dict[str, tuple[str, str]]:
    """NCCL's config files as the process sees them (its root): NCCL_CONF_FILE or ~/.nccl.conf, then /etc/nccl.conf.
    ~ is the HOME of the process's environment (NCCL asks the password database; the two agree for a login)."""
    user = env.get("NCCL_CONF_FILE") or (f"{env['HOME'].rstrip('/')}/.nccl.conf" if env.get("HOME") else None)
    texts = []
    for path in (user, "/etc/nccl.conf"):
        if path and path.startswith("/"):
            text = _read_text(sysfs, f"/proc/{pid}/root{path}", tape)
            if text is not None:
                texts.append((f"{path} of pid {pid}", text))
    return nccl.settings_in_files(texts)

# -- small reads -----------------------------------------------------------------------------------------------------
def _read_text(sysfs: Any, path: str, tape: Tape | None) -> str | None:
    try:
        raw = sysfs.read_bytes(path, MAX_SMALL)
    except (OSError, SourceError):
        return None
    raw = raw[:MAX_SMALL]
    if tape is not None:
        tape.files[path] = raw
    return raw.decode(errors="replace")


def _start_time(stat: str | None) -> str:
    """Field 22 of /proc/<pid>/stat (after the command in parentheses, which may hold spaces): the process's start."""
    if not stat:
        return ""
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


def _first_int(env: Mapping[str, str], keys: Iterable[str]) -> tuple[int | None, str | None]:
    for key in keys:
        value = _int(env.get(key))
        if value is not None:
            return value, key
    return None, None


def forget() -> None:
    """Drops what was read (tests that rewrite a recorded process)."""
    with _lock:
        _cache.clear()
        _banners.clear()

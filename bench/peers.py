"""The programs gpuwarden is measured beside, set up as a user of this machine can have them, and the one way every
whole-process figure is taken.

- Meta's gcm (PyPI `gpucm`, pinned below) in a venv of its own under the cache folder. Its XID check
  (`health_checks check-syslogs xid`) runs `dmesg | grep NVRM:.Xid`; to hand it a saved log, a `dmesg` that cats
  that file is put first on its PATH.
- Debian's node_exporter (`apt-get install prometheus-node-exporter`), found on the machine, never installed here.
- `grep`.
- gpuwarden itself as a user has it: the working tree built into a wheel and installed (not editable: an editable
  install adds its import finder to every start) in a scratch venv under the cache folder, with the `bench` extra.

The cache folder is $GPUWARDEN_BENCH_CACHE, else ~/.cache/gpuwarden-bench.
"""
from __future__ import annotations

import hashlib
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GCM_PACKAGE = "gpucm==0.0.2"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"


def cache_dir() -> Path:
    path = Path(os.environ.get("GPUWARDEN_BENCH_CACHE") or Path.home() / ".cache/gpuwarden-bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


class SetupError(Exception):
    """A peer or the product could not be set up; the message says what was run and what it said."""


def _run(argv: list[str], timeout: float = 900, **kw) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{shlex.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise SetupError(f"{shlex.join(argv)}: exit {proc.returncode}: {tail}")
    return proc.stdout


def _venv(path: Path) -> Path:
    python = path / "bin/python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(path)])
    return python


# ---------------------------------------------------------------- the peers

def gcm_health_checks() -> Path:
    """The `health_checks` command of gcm, installed once into its own venv."""
    venv = cache_dir() / ("gcm-" + GCM_PACKAGE.replace("==", "-"))
    exe = venv / "bin/health_checks"
    if not exe.exists():
        python = _venv(venv)
        _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", GCM_PACKAGE])
    if not exe.exists():
        raise SetupError(f"{GCM_PACKAGE} installed into {venv} but has no bin/health_checks")
    return exe


def dmesg_shim(directory: Path, log: Path) -> Path:
    """A folder holding a `dmesg` that prints ``log``: put it first on PATH and `dmesg` reads the saved file."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "dmesg"
    shim.write_text(f"#!/bin/sh\nexec cat -- {shlex.quote(str(log))}\n")
    shim.chmod(0o755)
    return directory


def gcm_xid_argv(health_checks: Path, log_folder: Path) -> list[str]:
    """gcm's XID check as a Slurm prolog runs it, no config file, telemetry to nowhere."""
    return [str(health_checks), "--config", "/dev/null", "check-syslogs", "xid", "bench", "prolog",
            "--log-folder", str(log_folder), "--sink", "do_nothing"]


def node_exporter() -> Path:
    path = shutil.which("prometheus-node-exporter") or (NODE_EXPORTER if os.access(NODE_EXPORTER, os.X_OK) else None)
    if not path:
        raise SetupError("node_exporter not found: apt-get install prometheus-node-exporter")
    return Path(path)


def grep() -> Path:
    path = shutil.which("grep")
    if not path:
        raise SetupError("grep not found on PATH")
    return Path(path)


# ---------------------------------------------------------------- gpuwarden as installed

def product_venv(source: Path = ROOT) -> Path:
    """A venv under the cache holding the working tree at ``source`` as a user installs it (a wheel, with the
    `bench` extra); made again on every call, so it is the tree as it is now. Returns its python."""
    # One venv per source tree, so that runs from two checkouts do not install over each other.
    venv = cache_dir() / f"gpuwarden-venv-{hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]}"
    python = _venv(venv)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-wheel-") as tmp:
        _run([str(python), "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", tmp,
              str(source)])
        wheels = sorted(Path(tmp).glob("gpuwarden-*.whl"))
        if not wheels:
            raise SetupError(f"pip wheel {source} made no gpuwarden wheel")
        wheel = str(wheels[-1])
        _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel + "[bench]"])
        _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
              "--force-reinstall", wheel])
    # From a folder that is not the source tree: the import must come from the venv, not from the tree.
    where = _run([str(python), "-c", "import gpuwarden.agent as a; print(a.__file__)"], cwd="/").strip()
    if not where.startswith(str(venv)):
        raise SetupError(f"gpuwarden imports from {where}, not from the venv {venv}")
    return python


# ---------------------------------------------------------------- one whole-process measurement

@dataclass(frozen=True)
class Run:
    wall_s: float
    max_rss_mib: float  # the process's peak, or its children's where one of them peaked higher (wait4)
    cpu_s: float
    rc: int | None  # None: killed at the time limit
    stdout: Path | None

    @property
    def ok(self) -> bool:
        return self.rc is not None


def spawn(argv: list[str], *, env: dict | None = None, stdout: Path | None = None, stderr: Path | None = None,
          timeout_s: float = 300, max_address_space: int | None = None, cwd: Path | None = None) -> Run:
    """Run ``argv`` once as a fresh process (posix_spawn, its own session) and wait for it with wait4: wall time
    from before the spawn to the reap, peak RSS and CPU from its rusage. Past ``timeout_s`` its whole session
    is killed (rc None). ``max_address_space`` caps its virtual memory (RLIMIT_AS, inherited at spawn), so a
    reader that grows with its input stops with a MemoryError instead of taking the machine's memory."""
    env = dict(os.environ if env is None else env)
    out_fd = os.open(stdout if stdout else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    actions = [(os.POSIX_SPAWN_DUP2, out_fd, 1), (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    if stderr is not None:
        actions.append((os.POSIX_SPAWN_OPEN, 2, str(stderr), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    elif os.environ.get("GPUWARDEN_BENCH_STDERR") != "1":
        actions.append((os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0))
    if cwd is not None:
        argv = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(cwd), *argv]
    saved = resource.getrlimit(resource.RLIMIT_AS)
    killed = threading.Event()
    try:
        if max_address_space:
            resource.setrlimit(resource.RLIMIT_AS, (max_address_space, saved[1]))
        t0 = time.perf_counter()
        try:
            pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
        finally:
            if max_address_space:
                resource.setrlimit(resource.RLIMIT_AS, saved)
    finally:
        os.close(out_fd)

    def kill() -> None:
        killed.set()
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - t0
    finally:
        timer.cancel()
    try:  # anything the process left behind in its session
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    rc = None if killed.is_set() else os.waitstatus_to_exitcode(status)
    return Run(wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, rc, stdout)

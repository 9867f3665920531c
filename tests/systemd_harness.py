"""A real systemd as PID 1 of a private PID + mount + UTS namespace, for tests that run the shipped units.

The host's PID 1 need not be systemd: `unshare` starts /lib/systemd/systemd --system as the new namespace's
PID 1, and `nsenter -t <pid> -p -m systemctl ...` talks to it through its private socket. Everything it does must
stay in the namespace, so before systemd starts the namespace gets:
- tmpfs over /run, /tmp, /var/tmp, /var/log and /var/lib: runtime state, PrivateTmp= folders, StateDirectory=,
  unit logs and any journal vanish with it (a kill -9 leaves nothing behind on the host);
- /proc/sys and /proc/sysrq-trigger read-only, and its own hostname (UTS): no sysctl or hostname reaches the host;
- every unit that the *.wants/ and *.requires/ folders of /etc, /run and /lib pull in (systemd-tmpfiles-setup would
  wipe the host's /tmp, systemd-sysctl apply sysctls, systemd-sysusers add users, journald flush to /var/log ...),
  and a fixed list of units that act on the kernel or the file systems whatever pulls them, masked in
  /run/systemd/system.control: the highest place on the unit path, so /etc cannot override a mask. The targets
  themselves stay, and so do gpuwarden's own units. No generator runs. Booted into an empty target, the manager
  starts nothing until a test asks;
- its own cgroup below the caller's (a cgroup v1 hierarchy or v2), so two managers never share a subtree and
  units stay inside the caller's memory limit; the subtree is removed at teardown.
Every service's standard output and error go to /run/gpuwarden-harness/logs/<unit>.log (a drop-in for all
services): `output(unit)` reads it; no journal is written anywhere. Teardown is SIGKILL to the namespace's PID 1
(it ignores SIGTERM), which ends every process in the namespace, whatever the test did.

Units are seen where systemd looks for them: what a test installs (`install_unit`, `drop_in`: the private
/run/systemd/system) and what is installed on the host (/lib/systemd/system, enabled in /etc/systemd/system by
dpkg; run `daemon_reload()` after installing there). `systemctl(...)`, `show(unit, props)`,
`wait_active(unit)`, `wait_for(unit, predicate)`, `write(path, text)` (a file units can see), `root_path(path)`
(the namespace's file system from the host). Use `with PrivateSystemd() as m:` or the module-scoped
`private_systemd` fixture.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

SYSTEMD = "/lib/systemd/systemd"
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system",
             "/usr/local/lib/systemd/system")
# Units that act on the host's kernel or file systems, masked whatever pulls them (a generator, a mount's own
# dependencies): with no fstab entry for /, remount-fs would still remount the root file system the host shares.
ALWAYS_MASK = (
    "systemd-remount-fs.service", "systemd-fsck-root.service", "systemd-fsck@.service", "systemd-fsckd.service",
    "systemd-fsckd.socket", "systemd-tmpfiles-setup.service", "systemd-tmpfiles-setup-dev.service",
    "systemd-tmpfiles-clean.service", "systemd-tmpfiles-clean.timer", "systemd-sysctl.service",
    "systemd-sysusers.service", "systemd-udevd.service", "systemd-udev-trigger.service",
    "systemd-udev-settle.service", "systemd-journald.service", "systemd-journal-flush.service",
    "systemd-random-seed.service", "systemd-hwdb-update.service", "systemd-update-done.service",
    "ldconfig.service", "systemd-update-utmp.service", "systemd-binfmt.service", "systemd-modules-load.service",
    "systemd-machine-id-commit.service", "systemd-firstboot.service", "systemd-growfs-root.service",
    "systemd-quotacheck.service", "quotaon.service", "systemd-hibernate-resume@.service",
    "systemd-logind.service", "systemd-networkd.service", "systemd-resolved.service", "systemd-timesyncd.service",
    "systemd-pstore.service", "systemd-boot-update.service", "systemd-repart.service", "dbus.service",
    "dbus.socket", "getty@.service", "serial-getty@.service", "console-getty.service",
)
KEEP_PREFIX = "gpuwarden"  # the project's own units are never masked
BOOT_TARGET = "gpuwarden-harness.target"
LOG_DIR = "/run/gpuwarden-harness/logs"
CONSOLE = "/run/gpuwarden-harness/console"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def missing() -> str | None:
    """Why a private systemd cannot be started here (None: it can)."""
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (util-linux)"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} not installed"
    if os.geteuid() != 0:
        return "a private systemd needs root (PID and mount namespaces)"
    return None


def units_to_mask() -> list[str]:
    """Every unit named in a *.wants/ or *.requires/ folder (and what such a link points at), targets and
    gpuwarden's own units left out."""
    names: set[str] = set()
    for base in UNIT_DIRS:
        root = Path(base)
        if not root.is_dir():
            continue
        for folder in root.iterdir():
            if not folder.name.endswith((".wants", ".requires")) or not folder.is_dir():
                continue
            for link in folder.iterdir():
                names.add(link.name)
                if link.is_symlink():
                    names.add(Path(os.readlink(link)).name)
    names.update(ALWAYS_MASK)
    return sorted(n for n in names
                  if "." in n and not n.endswith(".target") and not n.startswith(KEEP_PREFIX) and n != "/dev/null")


def _cgroup_parent() -> tuple[Path, list[Path]]:
    """(the caller's cgroup path, the hierarchies to make the manager's cgroup in). The path is the memory
    controller's (cgroup v1) or the unified one (v2), so the manager's units count against the caller's limit."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        paths[controllers] = path
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # pure cgroup v2
        return Path(paths.get("", "/")), [CGROUP_ROOT]
    hierarchies = [h for h in (CGROUP_ROOT / "systemd", CGROUP_ROOT / "unified") if h.is_dir()]
    return Path(paths.get("memory", paths.get("name=systemd", "/"))), hierarchies


class PrivateSystemd:
    """One private systemd; use as a context manager (or `start()` / `stop()`)."""

    def __init__(self, boot_timeout: float = 60.0, keep: tuple[str | Path, ...] = ()):
        """`keep`: host folders the units must still see where the namespace lays a tmpfs over their parent (a
        checkout or a virtual environment under /tmp or /var/lib); each is bound back in at its own path."""
        self.boot_timeout = boot_timeout
        hidden = sorted({Path(p).resolve() for p in keep if Path(p).resolve().parts[1:2] in (("tmp",), ("var",))})
        self.keep = [str(p) for p in hidden if not any(p != q and p.is_relative_to(q) for q in hidden)]
        self.pid: int | None = None  # PID 1 of the namespace, as the host sees it
        self._unshare: subprocess.Popen | None = None
        self._work = Path(tempfile.mkdtemp(prefix="gpuwarden-systemd-"))
        self._cgroups: list[Path] = []
        self.masked: list[str] = []

    # ---- life cycle ----
    def __enter__(self) -> "PrivateSystemd":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.masked = units_to_mask()
        name = f"gpuwarden-harness-{os.getpid()}-{id(self):x}"
        parent, hierarchies = _cgroup_parent()
        for h in hierarchies:
            _remove_stale(h / parent.relative_to("/"))
            cg = h / parent.relative_to("/") / name
            cg.mkdir(parents=True, exist_ok=True)
            self._cgroups.append(cg)
        script = self._work / "boot.sh"
        script.write_text(_BOOT_SCRIPT)
        log = open(self._work / "manager.log", "wb")
        cgroup_procs = " ".join(shlex.quote(str(c / "cgroup.procs")) for c in self._cgroups)
        self._unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount", "--mount-proc", "--uts",
             "--propagation", "private", "sh", str(script), cgroup_procs, BOOT_TARGET, LOG_DIR, "\n".join(self.keep),
             *self.masked],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)
        log.close()
        try:
            self._wait_boot()
        except BaseException:
            self.stop()
            raise

    def _wait_boot(self) -> None:
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self._unshare.poll() is not None:
                raise RuntimeError(f"the private systemd exited ({self._unshare.returncode}): {self.manager_log()}")
            if self.pid is None:
                self.pid = self._namespace_init()
            if self.pid is not None and self.root_path("/run/systemd/private").exists():
                proc = self.systemctl("is-active", BOOT_TARGET, check=False)
                if proc.stdout.strip() == "active":
                    self._check_masks()
                    return
            time.sleep(0.05)
        raise TimeoutError(f"the private systemd did not boot in {self.boot_timeout}s: {self.manager_log()}")

    def _namespace_init(self) -> int | None:
        """The host PID of the namespace's PID 1 (unshare's only child), once it runs systemd."""
        try:
            children = Path(f"/proc/{self._unshare.pid}/task/{self._unshare.pid}/children").read_text().split()
            if not children:
                return None
            pid = int(children[0])
            return pid if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd" else None
        except (OSError, ValueError):
            return None

    def _check_masks(self) -> None:
        """Refuse to go on if a mask did not take: starting any unit would run it on the host."""
        if not self.masked:
            return
        proc = self.systemctl("show", "-p", "Id", "-p", "LoadState", *self.masked, check=False)
        states = [blk for blk in proc.stdout.split("\n\n") if blk.strip()]
        loose = [s.replace("\n", " ") for s in states if "LoadState=masked" not in s]
        if loose:
            raise RuntimeError(f"units not masked in the private systemd: {loose[:5]}")

    def stop(self) -> None:
        """SIGKILL the namespace's PID 1 (everything in the namespace dies with it), then remove its cgroups."""
        pid = self.pid or (self._namespace_init() if self._unshare else None)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._unshare is not None:
            if self._unshare.poll() is None and pid is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._unshare.pid, signal.SIGKILL)
            try:
                self._unshare.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._unshare.pid, signal.SIGKILL)
                self._unshare.wait(timeout=30)
        for cg in self._cgroups:
            _remove_cgroup(cg)
        self._cgroups.clear()
        self.pid = None
        shutil.rmtree(self._work, ignore_errors=True)

    # ---- helpers ----
    def root_path(self, path: str | Path) -> Path:
        """A path of the namespace's file system, as the host reaches it (its private /run included)."""
        return Path(f"/proc/{self.pid}/root") / str(path).lstrip("/")

    def nsenter(self, *argv: str, check: bool = True, timeout: float = 60.0,
                input: str | None = None) -> subprocess.CompletedProcess:
        """Run a command in the namespace (its PID and mount namespaces)."""
        proc = subprocess.run(["nsenter", "-t", str(self.pid), "-p", "-m", "-u", *argv], capture_output=True,
                              text=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return self.nsenter("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def install_unit(self, source: str | Path, name: str | None = None, reload: bool = True,
                     stand_in: bool = False) -> str:
        """Put a unit (a file, or its text with `name`) into the namespace's /run/systemd/system: on the unit path
        below /etc and above /lib (so the units dpkg puts in /lib and enables in /etc are seen as well), and gone
        with the namespace. `stand_in`: it replaces a host unit of that name (slurmd.service, masked here): it goes
        to /run/systemd/system.control, in place of the mask and above /etc. Returns the unit's name."""
        if isinstance(source, Path) or (name is None and "\n" not in str(source)):
            path = Path(source)
            text, name = path.read_text(), name or path.name
        else:
            text = str(source)
        if name is None:
            raise ValueError("a unit given as text needs a name")
        folder = "/run/systemd/system.control" if stand_in else "/run/systemd/system"
        target = self.root_path(folder) / name
        if target.is_symlink():
            target.unlink()
        target.write_text(text)
        if reload:
            self.daemon_reload()
        return name

    def write(self, path: str | Path, text: str) -> Path:
        """Write a file into the namespace (under its private /run, say: the host's /tmp is not what units see),
        making its folders; returns the host's path to it."""
        target = self.root_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        return target

    def drop_in(self, unit: str, text: str, name: str = "50-test.conf", reload: bool = True) -> None:
        """A drop-in for `unit` in the namespace's /run/systemd/system/<unit>.d/ (added to those in /etc and /lib)."""
        folder = self.root_path("/run/systemd/system") / f"{unit}.d"
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(text)
        if reload:
            self.daemon_reload()

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", *(f"-p{p}" for p in props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def output(self, unit: str) -> str:
        """What the unit's processes wrote to standard output and error so far."""
        try:
            return self.root_path(f"{LOG_DIR}/{unit}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def manager_log(self) -> str:
        """systemd's own messages (its log target is the console, a file in the namespace), and what the boot
        script wrote."""
        text = ""
        for path in (self._work / "manager.log", self.root_path(CONSOLE) if self.pid else None):
            with contextlib.suppress(OSError, TypeError):
                text += path.read_text(errors="replace")[-6000:]
        return text

    def wait_for(self, unit: str, predicate, timeout: float = 30.0, props: tuple[str, ...] = ()) -> dict[str, str]:
        """Poll the unit's properties until predicate(props) holds; TimeoutError with the last ones and the
        unit's output otherwise."""
        props = props or ("ActiveState", "SubState", "Result", "MainPID", "NRestarts", "ExecMainStatus")
        deadline = time.monotonic() + timeout
        while True:
            state = self.show(unit, *props)
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{unit}: {state}\n--- output ---\n{self.output(unit)[-3000:]}\n"
                                   f"--- manager ---\n{self.manager_log()[-2000:]}")
            time.sleep(0.1)

    def wait_active(self, unit: str, timeout: float = 30.0) -> dict[str, str]:
        """Wait until the unit is active; a unit that fails first raises at once, with its output."""
        def done(s: dict[str, str]) -> bool:
            if s.get("ActiveState") == "failed":
                raise RuntimeError(f"{unit} failed: {s}\n--- output ---\n{self.output(unit)[-3000:]}")
            return s.get("ActiveState") == "active"
        return self.wait_for(unit, done, timeout)


@pytest.fixture(scope="module")
def private_systemd():
    """A booted private systemd for one test module (import this fixture into the module); skipped, with the
    reason, where unshare, nsenter, systemd or root are missing."""
    why = missing()
    if why:
        pytest.skip(why)
    with PrivateSystemd() as manager:
        yield manager


def _remove_stale(parent: Path) -> None:
    """Remove the cgroups of managers whose test process was killed before its teardown (named after its PID)."""
    if not parent.is_dir():
        return
    for cg in parent.glob("gpuwarden-harness-*"):
        owner = cg.name.split("-")[2]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _remove_cgroup(cg)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL unshare when the test process dies (killed at a CI timeout, say); unshare's
    --kill-child then SIGKILLs the namespace's PID 1, and with it the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _remove_cgroup(cg: Path) -> None:
    """rmdir a cgroup subtree, leaves first (its processes are gone; the kernel may take a moment to see it)."""
    deadline = time.monotonic() + 10
    while cg.exists() and time.monotonic() < deadline:
        for dirpath, _dirs, _files in sorted(os.walk(cg), key=lambda w: -w[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
        if cg.exists():
            time.sleep(0.05)


# Runs in the new namespaces as (to be) PID 1: private mounts, masks, the empty boot target, then systemd.
# $1: cgroup.procs files to join; $2: the boot target; $3: the log folder; the rest: units to mask.
_BOOT_SCRIPT = r"""
set -eu
for procs in $1; do echo $$ > "$procs"; done
target=$2; logs=$3; keep=$4; shift 4
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
# The folders to keep (one per line) are bound aside before the tmpfs mounts hide them, then bound back in place.
mkdir -p /run/gpuwarden-harness/keep
n=0
printf '%s\n' "$keep" | while IFS= read -r path; do
    [ -n "$path" ] || continue
    n=$((n + 1)); mkdir -p "/run/gpuwarden-harness/keep/$n"; mount --bind "$path" "/run/gpuwarden-harness/keep/$n"
done
for d in /tmp /var/tmp; do mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$d"; done
for d in /var/log /var/lib; do mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$d"; done
n=0
printf '%s\n' "$keep" | while IFS= read -r path; do
    [ -n "$path" ] || continue
    n=$((n + 1)); mkdir -p "$path"; mount --move "/run/gpuwarden-harness/keep/$n" "$path"
done
for p in /proc/sys /proc/sysrq-trigger; do
    [ -e "$p" ] || continue
    mount --bind "$p" "$p"; mount -o remount,bind,ro "$p"
done
hostname gpuwarden-harness
mkdir -p /run/systemd/system /run/systemd/system.control /run/systemd/system/service.d "$logs"
for unit in "$@"; do ln -sf /dev/null "/run/systemd/system.control/$unit"; done
cat > "/run/systemd/system/$target" <<EOF
[Unit]
Description=private test manager (nothing to start)
DefaultDependencies=no
EOF
cat > /run/systemd/system/service.d/50-harness-output.conf <<EOF
[Service]
StandardOutput=append:$logs/%n.log
StandardError=append:$logs/%n.log
EOF
mkdir -p /run/gpuwarden-harness/no-generators
# PID 1 writes its messages to /dev/console (it reopens it, whatever stderr is): a file here, not the host's console.
: > /run/gpuwarden-harness/console
mount --bind /run/gpuwarden-harness/console /dev/console
exec env -i container=other PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    SYSTEMD_GENERATOR_PATH=/run/gpuwarden-harness/no-generators \
    SYSTEMD_ENVIRONMENT_GENERATOR_PATH=/run/gpuwarden-harness/no-generators \
    /lib/systemd/systemd --system --unit="$target" --log-target=console --log-level=info --show-status=no
"""

"""A real Slurm cluster on 127.0.0.1 for the adapter's tests: its own munged (own key and socket), one slurmctld and
several slurmd (`slurmd -N <name>`, each on its own port), plus nodes that are defined but never answer. Everything
lives under one temporary folder; nothing listens on another address; every process started here is stopped at
teardown, also when a test failed.

Debian's packages (slurmctld, slurmd, slurm-client, munge) must be installed: a missing binary fails the fixture
with a message naming it (tests that need the cluster carry `slurm` in their name and never skip)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "sbatch", "scancel")
PACKAGES = "munge slurmctld slurmd slurm-client"
# The slurm.conf settings a test may add (SlurmCluster.settings): the node health check, job prolog/epilog wiring and
# preemption (a low-priority partition whose jobs give way to the normal one's).
SETTINGS = ("HealthCheckProgram", "HealthCheckInterval", "HealthCheckNodeState", "Prolog", "Epilog", "PrologFlags",
            "PrologEpilogTimeout", "SchedulerParameters", "PreemptType", "PreemptMode", "PreemptExemptTime")
START_DEADLINE_S = 120.0  # two loaded cores: slurmctld and a few slurmd take seconds each to come up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(predicate, what: str, timeout_s: float = 120.0, every_s: float = 0.3):
    """`predicate` until it is truthy (its value is returned), else fail naming `what`. Each look may run Slurm's
    tools, so not too often; the default deadline is generous (two loaded cores, slurmctld, several agents) and
    never a measurement."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1 (held open together, so no two are the same)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SlurmCluster:
    """A running cluster: `env` points Slurm's clients at it (SLURM_CONF)."""
    base: Path
    live: tuple[str, ...]  # nodes with a slurmd
    dead: tuple[str, ...]  # defined in slurm.conf, never started
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # More slurm.conf lines, one of SETTINGS each (HealthCheckProgram=/path ...): what a test wires into Slurm itself.
    settings: dict[str, str] = field(default_factory=dict)
    # More options of the default partition "all" ("PriorityTier=10 PreemptMode=OFF"), and more partitions, one
    # "PartitionName=..." line each (the nodes are the live and dead ones: "Nodes=n1,n2"): a preemptible partition
    # overlapping the default one.
    all_options: str = ""
    partitions: tuple[str, ...] = ()

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- setup ---------------------------------------------------------------------------------------------------
    def write(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "munge"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.base / "munge", 0o700)
        ports = _free_ports(1 + len(self.live) + len(self.dead))
        self.ctld_port = ports[0]
        self.node_ports = dict(zip(self.live + self.dead, ports[1:], strict=True))
        nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 "
                          f"RealMemory=100 Features=gb200 State=UNKNOWN" for name, port in self.node_ports.items())
        all_nodes = ",".join(self.node_ports)
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"slurm.conf settings {unknown}: not among {SETTINGS}")
        extra = "".join(f"{key}={value}\n" for key, value in self.settings.items())
        if any(not line.startswith("PartitionName=") or "\n" in line for line in self.partitions):
            raise ValueError(f"partitions {self.partitions}: each one line starting PartitionName=")
        partitions = "".join(f"{line}\n" for line in self.partitions)
        all_options = f" {self.all_options}" if self.all_options else ""
        b = self.base
        self.conf.write_text(f"""\
ClusterName=gwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={b / 'munge' / 'munge.socket'}
StateSaveLocation={b / 'state'}
SlurmdSpoolDir={b / 'spool'}/%n
SlurmctldPidFile={b / 'run' / 'slurmctld.pid'}
SlurmdPidFile={b / 'run'}/slurmd-%n.pid
SlurmctldLogFile={b / 'log' / 'slurmctld.log'}
SlurmdLogFile={b / 'log'}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/linear
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
CommunicationParameters=NoInAddrAny
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=6
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=2
MinJobAge=10
{extra}{nodes}
PartitionName=all Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP{all_options}
{partitions}""")

    def start(self) -> None:
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            pytest.fail(f"Slurm test cluster: {', '.join(missing)} not installed (Debian packages: {PACKAGES}; "
                        f".ci/run installs them)", pytrace=False)
        self.write()
        m = self.base / "munge"
        key = m / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True,
                       timeout=30)
        os.chmod(key, 0o600)
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={m / 'munge.socket'}",
                               f"--key-file={key}", f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}",
                               f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket", self.procs["munged"])
        self.start_ctld(clear=True)
        for name in self.live:
            (self.base / "spool" / name).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{name}", [sys.executable, "-c", REAPER, "slurmd", "-D", "-N", name, "-f",
                                           str(self.conf)])
        self._wait(self._all_idle, f"nodes {', '.join(self.live)} idle in sinfo")

    def start_ctld(self, clear: bool = False) -> None:
        """Starts slurmctld: on a clean state (`clear`), else as its service does (no -R: the saved node states and
        reasons come back, scontrol-set features do not), and waits until every live node is registered again."""
        argv = ["slurmctld", "-D", "-f", str(self.conf)] + (["-c"] if clear else [])
        proc = self._spawn("slurmctld", argv)
        self._wait(self._ctld_answers, "slurmctld to answer (scontrol ping)", proc)
        if not clear:
            self._wait(self._all_responding, "every live node to register again", proc)

    # -- control -------------------------------------------------------------------------------------------------
    def restart_ctld(self) -> None:
        """Stop slurmctld (SIGTERM: it saves its state) and start it again on the saved state."""
        self.stop_ctld()
        self.start_ctld()

    def stop_ctld(self) -> None:
        proc = self.procs.pop("slurmctld", None)
        if proc is not None:
            _end(proc)

    def hang_ctld(self) -> None:
        """slurmctld stops answering but keeps its socket: connections are accepted and never served."""
        os.kill(self.procs["slurmctld"].pid, signal.SIGSTOP)

    def wake_ctld(self) -> None:
        os.kill(self.procs["slurmctld"].pid, signal.SIGCONT)

    def stop_slurmd(self, name: str) -> None:
        """Stop one node's slurmd (slurmctld marks the node not responding after SlurmdTimeout)."""
        proc = self.procs.pop(f"slurmd-{name}", None)
        if proc is not None:
            _end(proc)

    def start_slurmd(self, name: str) -> None:
        """Start one node's slurmd again; the caller waits for what it expects (with a HealthCheckProgram, slurmd
        runs it once before it registers)."""
        self._spawn(f"slurmd-{name}", [sys.executable, "-c", REAPER, "slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)}: rc {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def stop(self) -> None:
        """End everything started here: the jobs (cancelled while slurmctld runs), the slurmds together, then
        slurmctld, munged last; then whatever of a job is still left (slurmstepd detaches from its slurmd): known by
        this cluster's SLURM_CONF in its environment."""
        if "slurmctld" in self.procs:
            try:
                os.kill(self.procs["slurmctld"].pid, signal.SIGCONT)
                subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True, timeout=15)
                self._wait(lambda: not self.jobs(), "the jobs to end", deadline_s=20.0)
            except (OSError, subprocess.TimeoutExpired, RuntimeError):
                pass  # ended below
        slurmds = [self.procs.pop(n) for n in list(self.procs) if n.startswith("slurmd-")]
        _end(*slurmds)
        for name in ("slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _end(proc)
        for pid in self._leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _leftovers(self) -> list[int]:
        """Processes of this cluster's jobs (slurmstepd, the job script and what it started)."""
        mark, me = f"SLURM_CONF={self.conf}".encode(), os.getpid()
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if (entry.name.isdigit() and int(entry.name) != me
                        and mark in (entry / "environ").read_bytes().split(b"\0")):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def jobs(self) -> str:
        """The ids of the jobs in the queue, one a line ("?" when squeue did not answer)."""
        try:
            return subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except subprocess.TimeoutExpired:
            return "?"

    def logs(self) -> str:
        """The tail of every log, for a failure message."""
        out = []
        for path in sorted((self.base / "log").glob("*.log")) + [self.base / "munge" / "munged.log"]:
            if path.exists():
                out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    # -- helpers -------------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.base / "log" / f"{name}.out", "ab")
        try:
            proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def _wait(self, predicate, what: str, proc: subprocess.Popen | None = None,
              deadline_s: float = START_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if predicate():
                return
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"Slurm test cluster: {proc.args[0]} exited ({proc.returncode}) while waiting "
                                   f"for {what}\n{self.logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"Slurm test cluster: timed out waiting for {what}\n{self.logs()}")

    def _ctld_answers(self) -> bool:
        try:
            proc = subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and "UP" in proc.stdout

    def _states(self) -> dict[str, str]:
        """node -> sinfo's long state (`idle`, `drained`, `idle*` when not responding, `unknown`)."""
        try:
            proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True,
                                  text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return {}
        return {name: state.strip() for name, _, state in (line.partition(" ") for line in proc.stdout.splitlines())}

    def _all_idle(self) -> bool:
        states = self._states()
        return all(states.get(n) == "idle" for n in self.live)

    def reset(self, deadline_s: float) -> None:
        """Back as it started: slurmctld up and awake, no job, no reservation, every live node in service with no
        reason, no comment, no Extra and its slurm.conf features only."""
        if "slurmctld" not in self.procs:
            self.start_ctld()
        self.wake_ctld()
        self.scontrol("ping")
        subprocess.run(["scancel", "--user=root"], env=self.env, timeout=30, check=True)
        # A RESUME while a job is completing leaves that job in CG on 22.05: the queue empties first.
        self._wait(lambda: not self.jobs(), "no job left", deadline_s=deadline_s)
        for line in self.scontrol("show", "reservation", "-o", check=False).stdout.splitlines():
            if line.startswith("ReservationName="):
                self.scontrol("delete", line.split()[0])
        for node in self.live:
            self.scontrol("update", f"NodeName={node}", "Comment=", "Extra=", "AvailableFeatures=gb200",
                          "ActiveFeatures=gb200")
            shown = self.scontrol("show", "node", node, "-o").stdout
            if "DRAIN" in shown or "State=DOWN" in shown:
                self.scontrol("update", f"NodeName={node}", "State=RESUME")
        self._wait(self.idle, "every live node idle, no job left", deadline_s=deadline_s)

    def idle(self) -> bool:
        """Every live node idle (answering, not drained, no job), and no job in the queue."""
        return not self.jobs() and self._all_idle()

    def _all_responding(self) -> bool:
        states = self._states()
        return all(states.get(n, "unknown").rstrip("*~#!%$@^-") == states.get(n) and
                   not states.get(n, "unknown").startswith(("unknown", "down")) for n in self.live)


# slurmd starts each job step's slurmstepd detached (it forks, and the middle process exits): the orphan goes to the
# nearest child subreaper among its ancestors, else to init. The test process can be one (the agent's tool runner
# makes itself the subreaper, agent/sources/tools.py, once any test has run a tool), and it never reaps a slurmstepd:
# the zombie keeps its job COMPLETING for ever. So each slurmd runs under this small init of its own, which reaps
# them. It stays in slurmd's process group: a signal to the group reaches slurmd, and this process outlives it only
# to reap.
REAPER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda *_: None)  # the group's signal is slurmd's (a handler is not inherited; SIG_IGN is)
child = subprocess.Popen(sys.argv[1:])
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == child.pid:
        code = os.waitstatus_to_exitcode(status)
        break
sys.exit(code if code >= 0 else 128 - code)
"""


def _end(*procs: subprocess.Popen) -> None:
    """SIGTERM to each process group (SIGCONT first: a stopped slurmctld cannot act on it), SIGKILL to what is left
    after a grace time, and reap. A group is signalled only while its leader is not yet reaped, so its id still
    names it."""
    for sig, wait_s in ((signal.SIGCONT, 0.0), (signal.SIGTERM, 20.0), (signal.SIGKILL, 20.0)):
        left = [p for p in procs if p.poll() is None]
        for p in left:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        for p in left:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A cluster for one test module: n1..n3 and n4..n6 live (the tests publish them into two NVLink domains),
    n7 and n8 defined but never started."""
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), live=("n1", "n2", "n3", "n4", "n5", "n6"),
                           dead=("n7", "n8"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":  # a cluster to try commands against by hand: python tests/slurm_cluster.py DIR
    import sys

    c = SlurmCluster(Path(sys.argv[1]), live=("n1", "n2", "n3", "n4", "n5", "n6"), dead=("n7", "n8"))
    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        c.start()
        print(f"export SLURM_CONF={c.conf}", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.json from the current output instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def scenario_copy(tmp_path: Path):
    """A writable copy of a bundled scenario, for tests that inject a fault by editing it. The recorded tool
    outputs (tools/) are left out unless asked for: a test of a full-level check writes the output it is about."""

    def copy(name: str, with_tools: bool = False) -> Path:
        dst = tmp_path / name
        shutil.copytree(NODES / name, dst, symlinks=True,
                        ignore=None if with_tools else shutil.ignore_patterns("tools"))
        return dst

    return copy


def record_tool(root: Path, tool: str, output: str | None = None, rc: int | None = None, hang: bool = False) -> Path:
    """Write a recorded tool run into a scenario: tools/<tool>.out, .rc, .hang (docs/scenario-format.md)."""
    tools = root / "tools"
    tools.mkdir(exist_ok=True)
    if output is not None:
        (tools / f"{tool}.out").write_text(output)
    if rc is not None:
        (tools / f"{tool}.rc").write_text(f"{rc}\n")
    if hang:
        (tools / f"{tool}.hang").write_text("")
    return root


def run_spec(node, spec, check_timeout_s: float = 0.0, **overrides):
    """One check through the real runner, with config overrides for that check and an optional timeout."""
    from gpuwarden.agent.core import config
    from gpuwarden.agent.node.runner import run_checks
    from gpuwarden.checks import all_specs

    cfg = config.defaults(all_specs())  # every table: a check may read a key of another concern's (shared_keys)
    for key, value in overrides.items():  # a shared key is set where an operator sets it: in its owner's table
        cfg.checks[cfg.shared.get(spec.name, {}).get(key, spec.name)][key] = value
    cfg.agent["check_timeout_s"] = check_timeout_s
    (result,) = run_checks(node, [spec], cfg)
    return result


def exposition(samples) -> str:
    """Passive-check metric samples rendered as /metrics would serve them (through agent/metrics.families),
    after checking each name keeps one label set (families() would otherwise drop the odd sample)."""
    from gpuwarden.agent.daemon.metrics import families
    from prometheus_client import CollectorRegistry, generate_latest

    samples = list(samples)
    labels: dict[str, list[str]] = {}
    for s in samples:
        assert sorted(s.labels) == labels.setdefault(s.name, sorted(s.labels)), f"{s.name}: mixed label sets"

    class Collector:
        def collect(self):
            return families(samples)

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


class PassiveClock:
    """Steps a passive check through time as the daemon does: sample + judge every `interval_s`, the state
    round-tripped through JSON in between (what persistence does to it)."""

    def __init__(self, spec, root: Path, cfg: dict, start: float, interval_s: float):
        import json

        from gpuwarden.agent.node.host import Node

        self._json = json
        self.spec, self.root, self.cfg, self.state, self.t = spec, root, cfg, {}, start
        self.interval_s = interval_s
        self.node = Node.recorded_at(root)

    def tick(self, seconds: float | None = None):
        from gpuwarden.agent.core.passive import step

        self.t += self.interval_s if seconds is None else seconds
        j = step(self.spec, self.node, self.cfg, self.state, self.t)
        self.state = self._json.loads(self._json.dumps(j.state))
        assert self.state == j.state
        return j

    def run(self, seconds: float):
        j = None
        for _ in range(int(seconds / self.interval_s)):
            j = self.tick()
        return j


def edit_nvml(root: Path, change) -> None:
    """Rewrite a scenario's nvml.json through `change(data)`. The mtime moves forward a second each time, so the
    recorded node (which reloads on a new mtime) re-reads it even on filesystems with coarse timestamps."""
    import json
    import os

    path = root / "nvml.json"
    data = json.loads(path.read_text())
    change(data)
    stamp = path.stat().st_mtime_ns + 1_000_000_000
    path.write_text(json.dumps(data))
    os.utime(path, ns=(stamp, stamp))


def append_kmsg(root: Path, template: str, n: int = 1) -> None:
    """Appends `n` records of `template` (with `{seq}` and `{usec}`) to a recorded node's kernel log, each after the
    last on the kernel's clock as well as in sequence, as the kernel writes them. On a recorded node without
    /proc/uptime the newest record of a batch stands for "now": a record stamped before the log's last one is
    judged as logged that long ago, and one the daemon happens to read with the backlog would have ended its hold
    before it was judged."""
    seq = usec = 0
    with open(root / "kmsg") as f:
        for line in f:
            fields = line.split(";", 1)[0].split(",")
            if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
                seq, usec = max(seq, int(fields[1])), max(usec, int(fields[2]))
    with open(root / "kmsg", "a") as f:
        f.write("".join(template.format(seq=seq + i, usec=usec + 1000 * i) + "\n" for i in range(1, n + 1)))


def end_processes(*procs, grace_s: float = 20.0) -> None:
    """SIGTERM to each process still running, then SIGKILL to any that has not exited `grace_s` later: a test's
    servers and agents never outlive it."""
    import subprocess

    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.terminate()
    for p in live:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@contextlib.contextmanager
def host_etc_gpuwarden():
    """Held by a test module for as long as it makes or removes /etc/gpuwarden on this host: the package's
    install and purge (test_deb_package), and the shipped units' ConfigurationDirectory= under a private systemd,
    whose namespace shares the host's /etc (test_systemd_units). An exclusive lock on a file outside any checkout,
    so that two such modules never overlap, whichever workers or checkouts run them: a unit started meanwhile would
    make the folder again after the purge, and a purge would take the folder from under a running unit."""
    import fcntl

    with open("/tmp/gpuwarden-tests.etc-gpuwarden.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    """Polls `predicate` until it is truthy (and returns its value), else fails naming `what`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def promtool_lint(text: str) -> None:
    """`promtool check metrics` finds nothing in an exposition (skipped where the Debian prometheus package is not
    installed; .ci/run installs it)."""
    import shutil
    import subprocess

    if shutil.which("promtool"):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr


@pytest.fixture
def api():
    """A fake Kubernetes API server on 127.0.0.1 for one test (tests/fake_kube_api.py), stopped at the end."""
    from fake_kube_api import FakeKubeApi

    server = FakeKubeApi()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def built_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Debian package, built once per session by packaging/build-deb (skipped where dpkg-buildpackage or
    dh-virtualenv is missing; .ci/run installs them)."""
    import subprocess

    for tool, package in (("dpkg-buildpackage", "dpkg-dev"), ("dh_virtualenv", "dh-virtualenv"),
                          ("dh", "debhelper")):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed (apt install {package})")
    out = tmp_path_factory.mktemp("deb")
    built = subprocess.run([str(ROOT / "packaging" / "build-deb"), str(out)], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-8000:]
    deb = Path(built.stdout.strip().splitlines()[-1])
    assert deb.is_file() and deb.parent == out, built.stdout
    return deb

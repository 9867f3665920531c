"""The udev source: live, the kernel's uevents through pyudev (a real event is provoked where this machine lets us
write a uevent file; skipped where netlink is refused); recorded, the scenario's `udev` file, through the same
fileno()/poll() a consumer uses."""
from __future__ import annotations

import ast
import os
import select
import time
import tomllib

import pytest
from conftest import NODES, ROOT
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.udev import RecordedUdev, UdevEvent, UdevMonitor

GPU = "/sys/devices/pci0000:15/0000:15:01.0/0000:18:00.0"
HCA = "/sys/devices/pci0000:15/0000:15:02.0/0000:1a:00.0/infiniband/mlx5_0"


def wait_events(monitor, want: int, deadline_s: float = 20.0) -> list[UdevEvent]:
    """What a consumer does: select on fileno() (or look now and then without one), then poll()."""
    got: list[UdevEvent] = []
    end = time.monotonic() + deadline_s
    while len(got) < want and time.monotonic() < end:
        fd = monitor.fileno()
        if fd is not None:
            select.select([fd], [], [], max(0.0, end - time.monotonic()))
        else:
            time.sleep(0.05)
        got += monitor.poll()
    return got


def append(root, text: str) -> None:
    with open(root / "udev", "a") as f:
        f.write(text)


def test_recorded_events_appended_after_opening_are_delivered_in_order(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    append(root, f"remove pci {GPU}\n")  # before the monitor: the past, not delivered (as live)
    monitor = Node.recorded_at(root).udev_monitor()
    assert isinstance(monitor, RecordedUdev) and monitor.poll() == []
    append(root, f"remove pci {GPU}\nremove infiniband {HCA}\n")
    events = wait_events(monitor, 2)
    assert events == [UdevEvent("remove", "pci", GPU), UdevEvent("remove", "infiniband", HCA)]
    assert [e.name for e in events] == ["0000:18:00.0", "mlx5_0"]
    assert monitor.poll() == []
    monitor.close()


def test_recorded_partial_lines_garbage_and_other_subsystems(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    monitor = RecordedUdev(root)
    append(root, f"remove pci {GPU}")  # no newline yet: still being written
    assert monitor.poll() == []
    append(root, "\nexplode pci /sys/x\nremove pci\n" + "x" * 5000 + "\nadd block /sys/devices/virtual/block/loop0\n"
           "add net /sys/devices/virtual/net/ib0\n")
    assert monitor.poll() == [UdevEvent("remove", "pci", GPU), UdevEvent("add", "net", "/sys/devices/virtual/net/ib0")]
    assert monitor.malformed == 3  # the unknown action, the short line, the overlong line; block is just not ours
    (root / "udev").write_text(f"add pci {GPU}\n")  # rewritten shorter: read from its start
    assert monitor.poll() == [UdevEvent("add", "pci", GPU)]


def test_recorded_udev_file_that_leads_outside_the_scenario_is_refused(scenario_copy, tmp_path):
    root = scenario_copy("gb200-nvl72-healthy")
    monitor = RecordedUdev(root)
    outside = tmp_path / "outside"
    outside.write_text(f"remove pci {GPU}\n")
    (root / "udev").symlink_to(outside)
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        monitor.poll()


def test_live_monitor_delivers_a_kernel_uevent():
    try:
        monitor = UdevMonitor()
    except SourceError as exc:
        pytest.skip(f"netlink uevents not permitted here: {exc}")
    try:
        assert isinstance(monitor.fileno(), int) and monitor.fileno() >= 0
        try:  # a "change" uevent of the loopback netdev: harmless, and only root can ask for it
            with open("/sys/class/net/lo/uevent", "w") as f:
                f.write("change")
        except OSError as exc:
            pytest.skip(f"cannot provoke a uevent here: {exc.strerror}")
        events = wait_events(monitor, 1)
        seen = [e for e in events if e.subsystem == "net" and e.name == "lo"]
        if not seen:
            pytest.skip("no kernel uevent reached this network namespace")
        assert seen[0].action == "change" and seen[0].sys_path.endswith("/net/lo")
    finally:
        monitor.close()


def test_the_agent_uses_pyudev_and_not_psutil():
    """Every runtime dependency is used by the agent; psutil is the bench's alone (an optional extra)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("psutil") for d in deps["dependencies"])
    assert any(d.startswith("psutil") for d in deps["optional-dependencies"]["bench"])
    imported: dict[str, set[str]] = {}
    for path in [*(ROOT / "agent").rglob("*.py"), *(ROOT / "checks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(path.relative_to(ROOT).as_posix())
    assert "psutil" not in imported
    assert imported["pyudev"] == {"agent/sources/udev.py"}
    for dep, module in (("nvidia-ml-py", "pynvml"), ("prometheus-client", "prometheus_client"), ("pyudev", "pyudev")):
        assert any(d.startswith(dep) for d in deps["dependencies"]) and module in imported, dep


def test_a_bundled_scenario_without_a_udev_file_is_quiet():
    monitor = RecordedUdev(NODES / "h100-hgx-healthy")
    assert monitor.poll() == [] and not os.path.exists(NODES / "h100-hgx-healthy" / "udev")
    monitor.close()


def test_daemon_a_device_removal_wakes_the_poll_that_reads_it(scenario_copy, tmp_path):
    """The IB poll sleeps a minute between quiet looks here; an HCA whose driver goes away is a udev remove, and the
    poll looks at once: the port is reported gone within seconds, not at the next tick."""
    import shutil

    from conftest import wait_for
    from gpuwarden.agent.act.adapters.local import LocalAdapter
    from gpuwarden.agent.core import config
    from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
    from gpuwarden.agent.daemon.metrics import DaemonCollector
    from gpuwarden.agent.state.store import Store
    from gpuwarden.checks import PASSIVE, all_specs

    root = scenario_copy("gb200-nvl72-healthy")
    (root / "udev").write_text("")
    cfg = config.defaults(all_specs())
    cfg.checks["ib_port"]["down_fail_s"] = 0.0
    ib = [s for s in PASSIVE if s.name == "ib_port"]
    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), ib, [], cfg, store, LocalAdapter(tmp_path / "actions.jsonl"),
               DaemonCollector(), DaemonOptions(intervals={"ib_port": 600.0}))
    d.start()
    try:
        first = wait_for(lambda: d.results().get("ib_port") if d.results().get("ib_port") and
                         d.results()["ib_port"].status.value == "ok" else None, what="the first look")
        # The device loop watches from when its monitor is made (as a netlink subscription does): an event written
        # before that is not news. Under load the loop starts after the first look; wait for its first beat.
        wait_for(lambda: "udev" in d._beats, what="the device monitor made")
        shutil.rmtree(root / "sys/class/infiniband/mlx5_2")
        append(root, "remove infiniband /sys/devices/pci0012:00/0012:00:00.0/0012:01:00.0/infiniband/mlx5_2\n")
        found = wait_for(lambda: [f for f in d.results()["ib_port"].findings if f.entity.id == "mlx5_2/1"],
                         what="the removed HCA's port, long before the poll's next tick")
        assert found[0].status.value == "fail" and d.results()["ib_port"].updated > first.updated
    finally:
        d.stop()
        store.close()

"""The IB ports' events: what lets the IB port poll sleep while every port is up. The live source is libibverbs (the
RDMA devices' asynchronous events); a recorded node's stand-in is its port folders watched. The daemon's use of them
through the real loop: tests/test_daemon_idle.py."""
from __future__ import annotations

import os
import time

import pytest
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.daemon.polls import Sleeper
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources import ib_events
from gpuwarden.agent.sources import sysfs as sysfs_mod
from gpuwarden.agent.sources.sysfs import FileSetProbe
from gpuwarden.checks import ib_downtime
from gpuwarden.checks.ib_port import downtime_files


def test_the_live_source_says_why_it_cannot_be_had_on_a_machine_without_rdma_devices():
    # The real libibverbs where it is installed (rdma-core, pulled in by Open MPI here): no RDMA device on this
    # machine, so no event file; the poll then goes on every second. Which reason depends on the kernel.
    with pytest.raises(SourceError) as caught:
        ib_events.open_port_events(["mlx5_0"])
    why = str(caught.value)
    assert any(reason in why for reason in (
        "libibverbs is not installed", "no RDMA device support", "ibv_get_device_list failed",
        "mlx5_0: not among libibverbs' devices")), why


def test_a_recorded_node_watches_its_port_folders(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    node = Node.recorded_at(root)
    files = downtime_files(node.sysfs)
    events = ib_downtime.port_events(node, files)
    try:
        [fd] = events.fds()
        assert not _readable(fd)
        (root / "sys/class/infiniband/mlx5_5/ports/1/state").write_text("1: DOWN\n")
        assert _readable(fd, 5.0)
        events.drain()
        assert not _readable(fd)
        (root / "sys/class/infiniband/mlx5_0/ports/1/counters/link_downed").write_text("3\n")
        assert not _readable(fd)  # a counter is read at the next look, not an event
    finally:
        events.close()


def test_a_recorded_port_folder_that_leads_out_of_the_node_is_not_watched(scenario_copy, tmp_path):
    root = scenario_copy("h100-hgx-healthy")
    ports = root / "sys/class/infiniband/mlx5_5/ports"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (ports / "1").rename(tmp_path / "moved")
    (ports / "1").symlink_to(outside)
    node = Node.recorded_at(root)
    with pytest.raises(SourceError, match="outside the recorded node"):
        node.ib_port_events(["mlx5_5"], ["/sys/class/infiniband/mlx5_5/ports/1"])


class FakeEvents:
    """An event source as the probe sees one (libibverbs' stands outside the project): a pipe per source."""

    def __init__(self, log: list[str], fail: bool = False):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.fail, self.log = fail, log

    def fds(self) -> list[int]:
        return [self.r]

    def drain(self) -> int:
        if self.fail:
            raise SourceError("mlx5_0: reading its events failed: Input/output error")
        try:
            return len(os.read(self.r, 64))
        except BlockingIOError:
            return 0

    def close(self) -> None:
        self.log.append("closed")
        os.close(self.r)
        os.close(self.w)


def test_the_probe_opens_events_once_reads_them_at_each_rearm_and_reopens_them_after_a_failure(scenario_copy,
                                                                                            monkeypatch):
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy"))
    opened: list[FakeEvents] = []
    log: list[str] = []

    def open_events(files):
        opened.append(FakeEvents(log))
        return opened[-1]

    clock = [1000.0]
    monkeypatch.setattr(sysfs_mod.time, "monotonic", lambda: clock[0])
    probe = FileSetProbe(node.sysfs, downtime_files, events=open_events)
    try:
        probe.rearm()
        assert len(opened) == 1 and probe.event_fds() == [opened[0].r]
        os.write(opened[0].w, b"e")
        probe.rearm()  # the sample that an event woke: the event is read, the same source kept
        assert len(opened) == 1 and not _readable(opened[0].r)
        opened[0].fail = True
        with logs.capture() as entries:
            probe.rearm()
        assert probe.event_fds() == [] and log == ["closed"]
        assert any(e["event"] == "change events failed, looking every interval" for e in entries)
        probe.rearm()
        assert len(opened) == 1  # not opened again at once: the files are looked at every interval meanwhile
        clock[0] += sysfs_mod.EVENTS_RETRY_S
        probe.rearm()
        assert len(opened) == 2 and probe.event_fds() == [opened[1].r]
    finally:
        probe.close()
    assert log == ["closed", "closed"]


def test_events_that_cannot_be_had_are_asked_for_again_only_when_the_files_change(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    node = Node.recorded_at(root)
    asked: list[list[str]] = []

    def refuse(files):
        asked.append(files)
        raise SourceError("this kernel has no RDMA device support (ibv_get_device_list: ENOSYS)")

    probe = FileSetProbe(node.sysfs, downtime_files, events=refuse)
    try:
        with logs.capture() as entries:
            for _ in range(3):
                probe.rearm()
        assert len(asked) == 1 and probe.event_fds() == []
        assert [e["error"] for e in entries if e["event"] == "change events unavailable, looking every interval"] == [
            "this kernel has no RDMA device support (ibv_get_device_list: ENOSYS)"]
        (root / "sys/class/infiniband/mlx5_5/ports/2").mkdir()
        (root / "sys/class/infiniband/mlx5_5/ports/2/state").write_text("4: ACTIVE\n")
        probe.rearm()
        assert len(asked) == 2  # a port came: asked again
    finally:
        probe.close()


def test_a_sleeper_wakes_on_the_descriptors_it_watches_and_stops_waiting_on_a_failed_one():
    stop_r, stop_w = os.pipe()
    r, w = os.pipe()
    try:
        sleeper = Sleeper(stop_r)
        sleeper.watch([r])
        assert sleeper.sleep(0.01) is False
        os.write(w, b"x")
        assert sleeper.sleep(5.0) is True
        os.read(r, 1)
        os.close(w)  # the other end gone: readable for ever (POLLHUP)
        w = -1
        assert sleeper.sleep(5.0) is True
        began = time.monotonic()
        assert sleeper.sleep(0.05) is False  # no longer waited on: a timed sleep, not a spin
        assert time.monotonic() - began >= 0.05
        sleeper.watch([])
        sleeper.watch([r])  # watched anew (its owner opened it again): waited on again
        assert sleeper.sleep(5.0) is True
    finally:
        for fd in (stop_r, stop_w, r, w):
            if fd >= 0:
                os.close(fd)


def _readable(fd: int, timeout_s: float = 0.0) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout_s)[0])


def test_events_that_fail_at_their_first_read_leave_the_probe_looking_every_interval(scenario_copy):
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy"))
    log: list[str] = []
    probe = FileSetProbe(node.sysfs, downtime_files, events=lambda files: FakeEvents(log, fail=True))
    try:
        with logs.capture() as entries:
            probe.rearm()  # no exception: the check is not made UNKNOWN by its events
        assert probe.event_fds() == [] and log == ["closed"] and not probe.changed()
        assert any(e["event"] == "change events failed, looking every interval" for e in entries)
    finally:
        probe.close()

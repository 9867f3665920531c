"""What keeps the daemon cheap at idle without making it blind: the kernel-log follower sleeps until the file is
written, a quiet check is not sampled while its change probe sees nothing new (and not judged while its sample is
unchanged), a state change outside a check's durable part is written at stop, not at every poll."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

from conftest import wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.passive import Judgement, PassiveSpec
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.kmsg import KernelLog, KmsgFollower
from gpuwarden.agent.sources.sysfs import FileSetProbe, Sysfs
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import all_specs, ib_downtime

RECORD = "6,{seq},{usec},-;gpuwarden test line {seq}\n"


def test_follower_sleeps_until_the_recorded_log_is_written(tmp_path):
    path = tmp_path / "kmsg"
    path.write_text(RECORD.format(seq=1, usec=1000))
    follower = KmsgFollower(KernelLog(path, live=False, boot_id="b"))
    assert [r.seq for r in follower.poll()] == [1]
    follower.wait(30.0, 30.0)  # arms the inotify watch and returns at once, so nothing written meanwhile is missed
    woke = threading.Event()

    def sleeper():
        follower.wait(30.0, 30.0)
        woke.set()

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    assert not woke.wait(0.3), "a quiet log must not wake the follower"
    with open(path, "a") as f:
        f.write(RECORD.format(seq=2, usec=2000))
    assert woke.wait(10.0), "an append must wake the follower long before its 30 s timeout"
    assert [r.seq for r in follower.poll()] == [2]
    follower.close()


PORT_FILES = ["/sys/class/infiniband/mlx5_0/ports/1/state", "/sys/class/infiniband/mlx5_0/ports/1/counters/link_downed"]


def one_port(root: Path) -> Path:
    """An ACTIVE IB port with no flap yet under `root`, as sysfs shows it."""
    port = root / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "counters/link_downed").write_text("0\n")
    return port


def test_file_set_probe_sees_rewrites_and_unreadable_files(tmp_path):
    port = one_port(tmp_path)
    probe = FileSetProbe(Sysfs(tmp_path), lambda s: PORT_FILES)
    probe.rearm()
    assert not probe.changed()
    (port / "counters/link_downed").write_text("1\n")  # a flap between two polls
    assert probe.changed()
    probe.rearm()
    assert not probe.changed()
    probe.close()
    missing = FileSetProbe(Sysfs(tmp_path), lambda s: ["/sys/class/infiniband/mlx5_9/ports/1/state"])
    missing.rearm()
    assert missing.changed(), "a file that cannot be opened leaves no reference: every look is a change"


class Counting:
    """Wraps a spec's sample, judge and change probe to count calls."""

    def __init__(self, spec: PassiveSpec):
        self.samples = self.judgements = self.probes = 0
        self.spec = replace(spec, sample=self._sample, judge=self._judge,
                            change_probe=self._probe if spec.change_probe else None)
        self._inner = spec

    def _sample(self, *args):
        self.samples += 1
        return self._inner.sample(*args)

    def _judge(self, *args):
        self.judgements += 1
        return self._inner.judge(*args)

    def _probe(self, node):
        probe, counting = self._inner.change_probe(node), self

        class Probe:
            def rearm(self):
                probe.rearm()

            def changed(self):
                counting.probes += 1
                return probe.changed()

            def event_fds(self):
                return probe.event_fds()

            def close(self):
                probe.close()

        return Probe()


def one_check_daemon(root: Path, tmp_path: Path, spec: PassiveSpec, cfg=None, **options) -> tuple[Daemon, Store]:
    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), [spec], [], cfg or config.defaults(all_specs()), store,
               LocalAdapter(tmp_path / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(intervals={spec.name: 0.02}, **options))
    return d, store


def polled_every_interval(spec: PassiveSpec) -> PassiveSpec:
    """The IB port check as it runs where no port events can be had: its files looked at every interval."""
    return replace(spec, change_probe=lambda node: FileSetProbe(
        node.sysfs, ib_downtime.downtime_files, slow=lambda p: p.endswith("/link_downed"), slow_every=5))


def test_a_quiet_ib_poll_only_probes_and_still_sees_a_port_go_down(scenario_copy, tmp_path):
    root = scenario_copy("h100-hgx-healthy")
    counting = Counting(polled_every_interval(ib_downtime.SPEC))
    cfg = config.defaults(all_specs())
    cfg.checks["ib_port"]["down_fail_s"] = 0.1
    d, store = one_check_daemon(root, tmp_path, counting.spec, cfg)
    commits = []
    inner_commit = store.commit
    store.commit = lambda *a, **k: commits.append(1) or inner_commit(*a, **k)
    d.start()
    try:
        wait_for(lambda: d.results().get("ib_port") and d.results()["ib_port"].status.value == "ok",
                 what="the first look")
        wait_for(lambda: store.check("ib_port"), what="the first look written")
        probes = counting.probes
        wait_for(lambda: counting.probes >= probes + 5, what="polls that only probe")
        samples, writes, probes = counting.samples, len(commits), counting.probes
        wait_for(lambda: counting.probes >= probes + 20, what="20 more polls")
        # All ports up and nothing written to their files: the probe answers, no sample, no judgement, no write
        # (a full look comes back every quiet_rejudge_s = 60 s).
        assert counting.samples == samples and len(commits) == writes
        (root / "sys/class/infiniband/mlx5_5/ports/1/state").write_text("1: DOWN\n")
        wait_for(lambda: [f.code for f in d.results()["ib_port"].findings] == ["ib-port-down"],
                 what="the port-down finding")
        assert counting.samples > samples
    finally:
        d.stop()
        store.close()


def test_a_quiet_ib_poll_sleeps_until_a_port_event_and_sees_the_port_go_down(scenario_copy, tmp_path):
    """With the ports' events watched (a recorded node's port folders; live, the devices' events), a quiet poll does
    not look every interval: a port written down wakes it, and the finding comes at once (not at the next look,
    60 s away, nor at the re-judge)."""
    root = scenario_copy("h100-hgx-healthy")
    counting = Counting(replace(ib_downtime.SPEC, event_look_s=60.0))
    cfg = config.defaults(all_specs())
    cfg.checks["ib_port"]["down_fail_s"] = 0.1
    d, store = one_check_daemon(root, tmp_path, counting.spec, cfg)
    d.start()
    try:
        wait_for(lambda: d.results().get("ib_port") and d.results()["ib_port"].status.value == "ok",
                 what="the first look")
        wait_for(lambda: counting.probes >= 1, what="the first probe")
        samples, probes = counting.samples, counting.probes
        time.sleep(0.5)  # 25 intervals of 20 ms: polled every interval, 25 looks
        assert (counting.samples, counting.probes) == (samples, probes)
        (root / "sys/class/infiniband/mlx5_5/ports/1/state").write_text("1: DOWN\n")
        wait_for(lambda: [f.code for f in d.results()["ib_port"].findings] == ["ib-port-down"],
                 what="the port-down finding")
        assert counting.samples > samples
        (root / "sys/class/infiniband/mlx5_5/ports/1/state").write_text("4: ACTIVE\n")
        wait_for(lambda: not d.results()["ib_port"].findings, what="the port back up")
    finally:
        d.stop()
        store.close()


def test_an_unchanged_sample_of_a_quiet_check_is_not_judged_until_rejudge(scenario_copy, tmp_path):
    import time

    root = scenario_copy("h100-hgx-healthy")
    rejudge_s = 0.5
    counting = Counting(replace(ib_downtime.SPEC, change_probe=None, quiet_rejudge_s=rejudge_s))
    d, store = one_check_daemon(root, tmp_path, counting.spec)
    began = time.monotonic()
    d.start()
    try:
        # Sampled every 0.02 s, judged again only once quiet_rejudge_s has run out since the last judgement.
        wait_for(lambda: counting.judgements >= 3 and counting.samples > counting.judgements + 5, timeout_s=60,
                 what="samples left unjudged and later judgements")
        elapsed = time.monotonic() - began
        # Judged samples began at least rejudge_s apart: however slow the machine, never more than this many.
        assert counting.judgements <= elapsed / rejudge_s + 2, (counting.judgements, elapsed)
    finally:
        d.stop()
        store.close()


def test_a_change_outside_the_durable_part_is_written_at_stop(scenario_copy, tmp_path):
    ticks = iter(range(1, 10_000))
    spec = PassiveSpec("ticker", "counts its looks", sample=lambda n, c, s: next(ticks),
                       judge=lambda s, x, c, now: Judgement({"looks": x, "mode": "steady"}), interval_s=0.02,
                       durable=lambda state: state.get("mode"))
    d, store = one_check_daemon(scenario_copy("h100-hgx-healthy"), tmp_path, spec)
    d.start()
    try:
        wait_for(lambda: d.results().get("ticker") and d.results()["ticker"].state["looks"] >= 20, what="20 looks")
        wait_for(lambda: store.check("ticker"), what="the first look written")
        persisted = {c.name: c for c in store.checks()}["ticker"].state
        assert persisted["looks"] < d.results()["ticker"].state["looks"], "only the first look was written"
    finally:
        d.stop()
    final = {c.name: c for c in store.checks()}["ticker"].state
    assert final == d.results()["ticker"].state  # stop() wrote what was held in memory
    assert json.loads(json.dumps(final))["mode"] == "steady"
    store.close()


def test_slow_files_are_looked_at_every_nth_look(tmp_path):
    port = one_port(tmp_path)
    probe = FileSetProbe(Sysfs(tmp_path), lambda s: PORT_FILES, slow=lambda p: p.endswith("link_downed"),
                         slow_every=3)
    probe.rearm()
    (port / "counters/link_downed").write_text("1\n")
    assert [probe.changed() for _ in range(3)] == [False, False, True]  # the counter at the 3rd look
    probe.rearm()
    (port / "state").write_text("1: DOWN\n")
    assert probe.changed()  # the state at once
    probe.close()


def test_a_check_that_does_not_apply_is_asked_again_only_now_and_then(scenario_copy, tmp_path):
    from gpuwarden.agent.core.errors import NotApplicable

    asked = []

    def sample(node, cfg, state):
        asked.append(1)
        raise NotApplicable("no InfiniBand port here")

    spec = PassiveSpec("absent", "never applies", sample=sample, judge=lambda s, x, c, now: Judgement({}),
                       interval_s=0.02)
    retry_s = 30.0
    d, store = one_check_daemon(scenario_copy("h100-hgx-healthy"), tmp_path, spec, skipped_retry_s=retry_s)
    first = time.monotonic()
    d.start()
    try:
        wait_for(lambda: d.results().get("absent"), what="the first look")
        polls = []  # 25 intervals of the check's own 0.02 s pace, counted on the other loops' clock
        wait_for(lambda: polls.append(1) or len(polls) >= 25, what="25 intervals")
        last = time.monotonic()
        assert d.results()["absent"].status.value == "skipped" and "no InfiniBand" in d.results()["absent"].error
        # Asked again only on the skipped_retry_s grid (polls wake on multiples of their interval on the monotonic
        # clock): at most once per grid line crossed since the first look, never at the check's own pace.
        crossed = int(last // retry_s) - int(first // retry_s)
        assert len(asked) <= 1 + crossed, (len(asked), crossed)
    finally:
        d.stop()
        store.close()


XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def test_idle_ticks_leave_quiet_kernel_consumers_alone_and_an_xid_still_lands(scenario_copy, tmp_path):
    """The kernel log's idle tick (an empty batch, so time-based rules advance) is skipped while every consumer's
    state is quiet (nothing held, no event in a window); a new XID is judged at once, and from then on the idle
    ticks judge again (its incident holds and ends by time)."""
    from conftest import append_kmsg
    from gpuwarden.checks import KERNEL_CONSUMERS

    root = scenario_copy("h100-hgx-healthy")
    calls: dict[str, int] = {}

    def counted(consumer):
        def judge(*args):
            calls[consumer.name] = calls.get(consumer.name, 0) + 1
            return consumer.judge(*args)
        return replace(consumer, judge=judge)

    store = Store(tmp_path / "state.db")
    d = Daemon(Node.recorded_at(root), [], [counted(c) for c in KERNEL_CONSUMERS], config.defaults(all_specs()), store,
               LocalAdapter(tmp_path / "actions.jsonl"), DaemonCollector(),
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05))
    d.start()
    try:
        last = max(int(line.split(",")[1]) for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit())
        wait_for(lambda: (d._meta.get("kmsg_cursor") or {}).get("seq") == last, what="the backlog read")
        wait_for(lambda: d._consumers_quiet(), what="the consumers quiet")
        # NVML's XID thread hands the consumers one batch saying this node has no events, then ends.
        wait_for(lambda: not any(t.name == "nvml-xid" and t.is_alive() for t in d._threads), what="NVML's one batch")
        judged = dict(calls)
        time.sleep(0.5)  # ten idle ticks
        assert calls == judged, "a quiet kernel log's idle ticks judged nothing"
        append_kmsg(root, XID79)
        wait_for(lambda: [f.code for f in d.results()["xid"].findings], what="the XID judged")
        assert calls["xid"] > judged["xid"] and not d._consumers_quiet()
        after = calls["xid"]
        wait_for(lambda: calls["xid"] >= after + 3, what="idle ticks judging the held incident again")
    finally:
        d.stop()
        store.close()


def test_a_quiet_kernel_consumer_judges_an_empty_batch_the_same_later(scenario_copy):
    """What the idle tick's skip relies on (KernelConsumer.quiet): on every bundled node, a consumer whose state is
    quiet and whose judgement of the node's whole kernel log holds no finding judges an empty batch a day later the
    same: no finding, a state still quiet. A node with an XID incident or an AER event is not quiet."""
    from gpuwarden.agent.core.kernel_log import parse_kmsg_text
    from gpuwarden.agent.core.passive import KernelBatch
    from gpuwarden.checks import KERNEL_CONSUMERS, pcie_aer, xid

    cfgs = config.defaults(all_specs())
    t0 = 1_760_000_000.0
    seen = set()
    for scenario in ("h100-hgx-healthy", "gb200-nvl72-healthy", "gb200-nvl72-faulty", "h200-vm-1gpu"):
        node = Node.recorded_at(scenario_copy(scenario))
        for consumer in KERNEL_CONSUMERS:
            cfg = cfgs.for_check(consumer.name)
            first = consumer.judge({}, KernelBatch(node.kmsg.records(), [], node.kmsg.boot_id), cfg, t0)
            state = json.loads(json.dumps(first.state))
            if first.findings or not consumer.quiet(state):
                continue
            seen.add(consumer.name)
            later = consumer.judge(state, KernelBatch([], [], node.kmsg.boot_id), cfg, t0 + 86_400)
            assert later.findings == () and consumer.quiet(json.loads(json.dumps(later.state))), (scenario, consumer)
    assert seen == {c.name for c in KERNEL_CONSUMERS}, seen
    records, _ = parse_kmsg_text(XID79.format(seq=1, usec=1000) + "\n", "kmsg")
    held = xid.CONSUMER.judge({}, KernelBatch(records, [], "b"), cfgs.for_check("xid"), t0)
    assert held.state["incidents"] and not xid.CONSUMER.quiet(held.state)
    assert not pcie_aer.kernel_quiet({"version": 1, "devices": {}, "sysfs": {}}), "the history batch not yet taken"
    event = {"counts": {}, "events": [[t0, "fatal", 1]], "last": ""}
    assert not pcie_aer.kernel_quiet({"version": 1, "devices": {}, "sysfs": {}, "kmsg": {"0000:3b:00.0": event}})

"""NVML XID events as the second XID source: the recorded event source (served through pynvml's own event-set
calls and types), the xid judge counting each XID once whichever sources saw it, and the daemon on a recorded node
where an XID is injected by appending to nvml.json."""
from __future__ import annotations

import ast
import copy
import inspect
import json
import time
from pathlib import Path

import pynvml
import pytest
from conftest import ROOT, edit_nvml, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.kernel_log import parse_kmsg_text
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import KernelBatch
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.nvml.events import NvmlXid
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml
from gpuwarden.agent.state.store import Store
from gpuwarden.agent.state.transitions import DEFAULT_POLICY, NodeState
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs, xid
from prometheus_client import generate_latest

EVENT_CALLS = {"nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree"}
SNAPSHOT = {
    "format": 1,
    "gpus": [{"index": i, "uuid": f"GPU-{i}", "pci_bus_id": f"{8 + i:08x}:01:00.0"} for i in range(3)],
    "xid_events": [{"gpu": 2, "xid": 79}, {"gpu": 0, "xid": 13}, {"gpu": 2, "xid": 45}],
}


def nvml(snapshot: dict) -> Nvml:
    n = Nvml(RecordedNvml(snapshot, "test.json"), "test.json")
    n._call("nvmlInit")
    return n


def codes(xids: list[NvmlXid]) -> list[tuple[int | None, int]]:
    return [(x.gpu, x.xid) for x in xids]


# -- the recorded event source ----------------------------------------------------------------------------------
def test_listed_events_are_delivered_once_in_order_with_the_gpu_named():
    with nvml(copy.deepcopy(SNAPSHOT)).xid_events() as events:
        assert events.available and [g.index for g in events.subscribed] == [0, 1, 2] and not events.unsubscribed
        before = time.time()
        got = events.wait(1.0)
        assert codes(got) == [(2, 79), (0, 13), (2, 45)]  # a burst comes back as one batch, in order
        assert got[0].uuid == "GPU-2" and got[0].pci == "000a:01:00.0" and got[0].received_at >= before
        assert events.wait(0.05) == []  # each once


def test_events_appended_to_nvml_json_after_start_are_delivered(tmp_path):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(dict(SNAPSHOT, xid_events=[])))
    n = Nvml.recorded(path)
    with n.xid_events() as events:
        assert events.wait(0.05) == []
        edit_nvml(tmp_path, lambda d: d["xid_events"].append({"gpu": 1, "xid": 48}))
        assert codes(events.wait(2.0)) == [(1, 48)]
        edit_nvml(tmp_path, lambda d: d["xid_events"].extend([{"gpu": 0, "xid": 94}, {"gpu": 0, "xid": 94}]))
        assert codes(events.wait(2.0)) == [(0, 94), (0, 94)]
        assert events.wait(0.05) == []


def test_a_wait_without_events_sleeps_until_its_timeout(tmp_path, monkeypatch):
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(dict(SNAPSHOT, xid_events=[])))
    looks = []
    inner = RecordedNvml._events_view
    monkeypatch.setattr(RecordedNvml, "_events_view", lambda self: looks.append(1) or inner(self))
    with Nvml.recorded(path).xid_events() as events:
        looks.clear()
        started = time.monotonic()
        assert events.wait(0.5) == []
        assert time.monotonic() - started >= 0.5  # not before its timeout
    # It sleeps until the file is written (inotify) or polls every 20 ms where it cannot watch: a handful of
    # looks at most, where a wait that spins would look thousands of times.
    assert 1 <= len(looks) <= 60, len(looks)


def test_a_gpu_that_cannot_subscribe_is_listed_and_the_others_still_work():
    snap = copy.deepcopy(SNAPSHOT)
    snap["gpus"][1]["errors"] = {"nvmlDeviceRegisterEvents": "NOT_SUPPORTED"}
    snap["gpus"][2]["errors"] = {"*": "GPU_IS_LOST"}  # NVML cannot even open it
    snap["xid_events"] = [{"gpu": 1, "xid": 13}, {"gpu": 0, "xid": 31}]
    with nvml(snap).xid_events() as events:
        assert [g.index for g in events.subscribed] == [0]
        assert {i: e.code for i, e in events.unsubscribed.items()} == {1: "NOT_SUPPORTED", 2: "GPU_IS_LOST"}
        assert "GPU 1" in str(events.unsubscribed[1]) and "nvmlDeviceRegisterEvents" in str(events.unsubscribed[1])
        assert codes(events.wait(0.5)) == [(0, 31)]  # the event on the unsubscribed GPU is not delivered


def test_a_node_without_recorded_events_has_none_available():
    snap = {k: v for k, v in copy.deepcopy(SNAPSHOT).items() if k != "xid_events"}
    events = nvml(snap).xid_events()
    assert not events.available and events.closed
    assert "NOT_SUPPORTED" in events.reason and len(events.unsubscribed) == 3


def test_a_lost_gpu_beside_gpus_without_events_leaves_none_available_not_an_error():
    """The faulty GB200 tray: GPU 2 is off the bus (its own FAIL in every GPU check) and the others have no events:
    the node has no XID events to watch, which is not a failure to watch them."""
    snap = {k: v for k, v in copy.deepcopy(SNAPSHOT).items() if k != "xid_events"}
    snap["gpus"][2]["errors"] = {"*": "GPU_IS_LOST"}
    events = nvml(snap).xid_events()
    assert not events.available and events.closed
    assert {i: e.code for i, e in events.unsubscribed.items()} == {0: "NOT_SUPPORTED", 1: "NOT_SUPPORTED",
                                                                   2: "GPU_IS_LOST"}


def test_no_gpu_subscribable_for_a_real_error_is_an_error_not_unavailability():
    snap = copy.deepcopy(SNAPSHOT)
    for gpu in snap["gpus"]:
        gpu["errors"] = {"nvmlDeviceRegisterEvents": "NO_PERMISSION"}
    with pytest.raises(NvmlError) as exc:
        nvml(snap).xid_events()
    assert exc.value.call == "nvmlDeviceRegisterEvents" and exc.value.code == "NO_PERMISSION" and exc.value.device == 0


def test_nvml_errors_become_the_projects_errors_naming_the_call():
    snap = copy.deepcopy(SNAPSHOT)
    snap["errors"] = {"nvmlEventSetCreate": "UNKNOWN"}
    with pytest.raises(NvmlError) as exc:
        nvml(snap).xid_events()
    assert exc.value.call == "nvmlEventSetCreate" and "NVML_ERROR_UNKNOWN" in str(exc.value)

    snap = copy.deepcopy(SNAPSHOT)
    with nvml(snap).xid_events() as events:
        events.wait(0.05)
        snap["errors"] = {"nvmlEventSetWait_v2": "UNKNOWN"}
        with pytest.raises(NvmlError) as exc:
            events.wait(0.05)
        assert exc.value.call == "nvmlEventSetWait_v2" and exc.value.code == "UNKNOWN"

    snap = copy.deepcopy(SNAPSHOT)
    snap["xid_events"] = [{"gpu": 0, "xid": 13, "pid": 7}]
    with nvml(snap).xid_events() as events, pytest.raises(NvmlError) as exc:
        events.wait(0.05)
    assert "test.json: xid_events[0]" in str(exc.value) and "pid" in str(exc.value)


def test_a_lost_gpu_delivers_its_xid_then_fails_the_wait_and_is_left_out_when_resubscribing():
    snap = copy.deepcopy(SNAPSHOT)
    snap["xid_events"] = []
    with nvml(snap).xid_events() as events:
        snap["xid_events"].append({"gpu": 1, "xid": 79})
        snap["gpus"][1]["errors"] = {"*": "GPU_IS_LOST"}
        assert codes(events.wait(0.5)) == [(1, 79)]
        with pytest.raises(NvmlError) as exc:
            events.wait(0.05)
        assert exc.value.gpu_lost and exc.value.call == "nvmlEventSetWait_v2"
        events.subscribe()
        assert [g.index for g in events.subscribed] == [0, 2] and events.unsubscribed[1].gpu_lost
        assert events.wait(0.05) == []  # the 79 is not handed over a second time
        snap["xid_events"].append({"gpu": 2, "xid": 13})
        assert codes(events.wait(0.5)) == [(2, 13)]


def test_a_gpu_lost_though_registered_is_left_out_when_told():
    """NVIDIA's mock NVML lets a lost GPU register and fails every wait: the caller names it, and the next
    subscription goes on without it."""
    snap = copy.deepcopy(SNAPSHOT)
    snap["xid_events"] = []
    with nvml(snap).xid_events() as events:
        snap["gpus"][1]["errors"] = {"nvmlEventSetWait_v2": "GPU_IS_LOST"}
        with pytest.raises(NvmlError) as exc:
            events.wait(0.05)
        assert exc.value.gpu_lost
        events.subscribe()
        assert [g.index for g in events.subscribed] == [0, 1, 2]  # registration alone does not tell
        with pytest.raises(NvmlError):
            events.wait(0.05)
        events.leave_out({1: exc.value})
        events.subscribe()
        assert [g.index for g in events.subscribed] == [0, 2] and events.unsubscribed[1].gpu_lost
        snap["xid_events"].append({"gpu": 2, "xid": 13})
        assert codes(events.wait(0.5)) == [(2, 13)]


def test_a_recorded_list_resumes_where_a_token_says_and_only_on_the_same_list():
    snap = copy.deepcopy(SNAPSHOT)
    first = nvml(snap).xid_events()
    assert codes(first.wait(0.5)) == [(2, 79), (0, 13), (2, 45)]
    token = json.loads(json.dumps(first.resume_token()))  # what the daemon persists
    first.close()
    snap["xid_events"].append({"gpu": 1, "xid": 31})
    again = nvml(snap).xid_events()  # a restart: a new process reads the same file
    again.resume(token)
    assert codes(again.wait(0.5)) == [(1, 31)]
    again.close()
    other = copy.deepcopy(SNAPSHOT)
    other["xid_events"][0]["xid"] = 48  # another list: the token does not fit, nothing is skipped
    elsewhere = nvml(other).xid_events()
    elsewhere.resume(token)
    assert codes(elsewhere.wait(0.5)) == [(2, 48), (0, 13), (2, 45)]
    elsewhere.close()
    assert not hasattr(pynvml, "events_resume_token")  # live NVML has no backlog: no token, nothing persisted


def test_recorded_event_calls_take_and_return_pynvml_types_and_raise_its_errors():
    lib = RecordedNvml(copy.deepcopy(SNAPSHOT))
    lib.nvmlInit()
    event_set = lib.nvmlEventSetCreate()
    assert isinstance(event_set, pynvml.c_nvmlEventSet_t)
    handle = lib.nvmlDeviceGetHandleByIndex(2)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    lib.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # only XID events are recorded
        lib.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypePState, event_set)
    data = lib.nvmlEventSetWait_v2(event_set, 100)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError and data.eventData == 79
    assert lib.nvmlDeviceGetUUID(data.device) == "GPU-2"  # the event's device is a handle NVML accepts
    assert lib.nvmlEventSetWait_v2(event_set, 100).eventData == 45  # GPU 0's 13 is not for this set
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait_v2(event_set, 10)
    lib.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlEventSetWait_v2(event_set, 10)


def test_every_event_call_the_live_wrapper_makes_is_served_by_the_recorded_backend():
    src = (ROOT / "agent" / "sources" / "nvml" / "events.py").read_text()
    called = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("_call", "_dev"):
            name = node.args[0 if node.func.attr == "_call" else 1]
            if isinstance(name, ast.Constant):
                called.add(name.value)
    assert EVENT_CALLS <= called, called
    for name in called:
        assert hasattr(RecordedNvml, name), f"{name} is called live but not recorded"
        real = [p.name for p in inspect.signature(getattr(pynvml, name)).parameters.values()]
        fake = [p.name for p in inspect.signature(getattr(RecordedNvml, name)).parameters.values()][1:]
        assert fake == real, f"{name}: recorded takes {fake}, pynvml takes {real}"


# -- xid: one incident, counted once, whichever sources saw it ---------------------------------------------
CFG = dict(xid.CONSUMER.defaults)
GPU0 = NvmlXid(0, "GPU-0", "0008:01:00.0", 79, 0.0)


def kmsg(*messages: str, seq: int = 100) -> list:
    records, errors = parse_kmsg_text("".join(f"3,{seq + i},{i},-;{m}\n" for i, m in enumerate(messages)), "kmsg")
    assert not errors
    return records


def xid_line(xid: int, bdf: str = "0008:01:00", detail: str = "pid='<unknown>', name=<unknown>, detail") -> str:
    return f"NVRM: Xid (PCI:{bdf}): {xid}, {detail}"


def nv(xid: int, gpu: int = 0) -> NvmlXid:
    return NvmlXid(gpu, f"GPU-{gpu}", f"{8 + gpu:04x}:01:00.0", xid, 0.0)


class Watch:
    """The xid judge driven through time as the daemon does, the state round-tripped through JSON in between."""

    def __init__(self, state: dict | None = None, **cfg):
        self.state, self.t, self.cfg = state or {}, 1000.0, dict(CFG, **cfg)

    def feed(self, records=(), xids=(), source: str | None = None, error: str | None = None):
        self.t += 1
        batch = KernelBatch(list(records), [], "boot-1", nvml_xids=list(xids),
                            source=source or ("nvml" if xids else "kmsg"), nvml_error=error)
        j = xid.judge(self.state, batch, self.cfg, self.t)
        self.state = json.loads(json.dumps(j.state))
        return j

    def finding(self, j, code: str):
        (f,) = [f for f in j.findings if f.code == code]
        return f


def test_kernel_log_only_counts_as_before():
    w = Watch()
    j = w.feed(kmsg(*[xid_line(13, detail="pid=42, name=python3, Graphics Exception")] * 3))
    f = w.finding(j, "13")
    assert f.evidence["count"] == 3 and f.evidence["sources"] == ["kmsg"] and f.evidence["nvml_count"] == 0
    assert f.evidence["pids"] == ["42"] and "Graphics Exception" in f.message


def test_an_xid_seen_only_by_nvml_is_an_incident():
    w = Watch()
    j = w.feed(xids=[GPU0])
    f = w.finding(j, "79")
    assert f.status is Status.FAIL and f.action is Action.REBOOT
    assert f.evidence["sources"] == ["nvml"] and f.evidence["count"] == 1 and f.evidence["first_seq"] is None
    assert "seen by NVML only" in f.message
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in j.metrics}
    assert samples[("gpuwarden_xid_events", (("pci", "0008:01:00.0"), ("xid", "79")))] == 1.0
    assert samples[("gpuwarden_xid_source_events", (("pci", "0008:01:00.0"), ("source", "nvml"), ("xid", "79")))] == 1


@pytest.mark.parametrize("nvml_first", [False, True])
def test_an_xid_seen_by_both_sources_counts_once(nvml_first):
    w = Watch()
    feeds = [lambda: w.feed(kmsg(xid_line(79))), lambda: w.feed(xids=[GPU0])]
    for feed in reversed(feeds) if nvml_first else feeds:
        j = feed()
    f = w.finding(j, "79")
    assert f.evidence["count"] == 1 and f.evidence["sources"] == ["kmsg", "nvml"]
    assert f.evidence["first_seq"] == 100 and "detail" in f.message  # the kernel log's text, whichever came first
    # Later repeats: both sources again, still one per XID.
    for _ in range(4):
        w.feed(kmsg(xid_line(79)))
        j = w.feed(xids=[GPU0])
    assert w.finding(j, "79").evidence["count"] == 5


def test_a_rate_limited_kernel_log_is_made_up_by_nvml():
    w = Watch()
    w.feed(kmsg(*[xid_line(13)] * 2))  # printk's rate limit let two of ten through
    j = w.feed(xids=[nv(13)] * 10)
    f = w.finding(j, "13")
    assert (f.evidence["count"], f.evidence["kmsg_count"], f.evidence["nvml_count"]) == (10, 2, 10)


def test_state_written_before_nvml_was_a_source_still_reads():
    # xid's state as the version without NVML events persisted it: counts were the kernel log's alone.
    old = {"boot_id": "boot-1", "uuids": {}, "incidents": {"0008:01:00.0|13": {
        "pci": "0008:01:00.0", "xid": 13, "count": 4, "first_at": 990.0, "first_seq": 7,
        "first_message": "NVRM: Xid (PCI:0008:01:00): 13, ...", "pids": ["42"], "processes": ["python3"],
        "last_at": 995.0, "last_seq": 10, "last_detail": "Graphics Exception"}}}
    w = Watch(old)
    j = w.feed()  # an idle tick: nothing changes
    f = w.finding(j, "13")
    assert (f.evidence["count"], f.evidence["kmsg_count"], f.evidence["nvml_count"]) == (4, 4, 0)
    j = w.feed(xids=[nv(13)])  # NVML starts after the restart: one new XID, also in the kernel log below
    assert w.finding(j, "13").evidence["count"] == 4
    j = w.feed(kmsg(xid_line(13), seq=11))
    f = w.finding(j, "13")
    assert (f.evidence["count"], f.evidence["kmsg_count"], f.evidence["nvml_count"]) == (5, 5, 1)
    assert f.evidence["first_seq"] == 7 and f.evidence["pids"] == ["42"]


def test_xid45_and_the_policies_apply_to_nvml_xids_alike():
    w = Watch()
    j = w.feed(xids=[nv(45), nv(79)])
    assert w.finding(j, "45").action is Action.NONE  # not solo: follows the 79
    w = Watch(ignore_xids=[13], fail_xids=[31])
    j = w.feed(xids=[nv(13), nv(31)])
    assert [f.code for f in j.findings] == ["31"] and j.findings[0].action >= Action.DRAIN


def test_an_nvml_error_is_unknown_until_nvml_answers_again():
    w = Watch()
    w.feed(xids=[GPU0])
    j = w.feed(source="nvml", error="nvmlEventSetWait_v2 failed: NVML_ERROR_UNKNOWN")
    (unknown,) = [f for f in j.findings if f.status is Status.UNKNOWN]
    assert unknown.code == "nvml-events" and "NVML_ERROR_UNKNOWN" in unknown.message
    assert w.finding(j, "79").evidence["count"] == 1  # the incidents are kept
    j = w.feed(kmsg(xid_line(13, bdf="0009:01:00")))  # kernel-log ticks do not clear it
    assert any(f.code == "nvml-events" for f in j.findings)
    j = w.feed(source="nvml")
    assert not any(f.code == "nvml-events" for f in j.findings) and "nvml_error" not in w.state


# -- the daemon on a recorded node -------------------------------------------------------------------------------


def append_kmsg(root: Path, message: str) -> None:
    seq = max(int(line.split(",")[1]) for line in (root / "kmsg").read_text().splitlines() if line[:1].isdigit())
    with open(root / "kmsg", "a") as f:
        f.write(f"3,{seq + 1},{(seq + 1) * 1000},-;{message}\n")


def add_event(root: Path, gpu: int, xid: int) -> None:
    edit_nvml(root, lambda d: d.setdefault("xid_events", []).append({"gpu": gpu, "xid": xid}))


@pytest.fixture
def daemon(scenario_copy, tmp_path):
    root = scenario_copy("gb200-nvl72-healthy")
    edit_nvml(root, lambda d: d.update(xid_events=[]))  # this node has NVML events, none yet
    store = Store(tmp_path / "state" / "state.db")
    collector = DaemonCollector()
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(all_specs()), store,
               LocalAdapter(tmp_path / "state" / "actions.jsonl"), collector,
               DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, policy=dict(DEFAULT_POLICY, quarantine_after_s=0.5)))
    d.start()
    wait_for(lambda: "xid" in d.results(), what="the first XID judgement")
    yield d, root, collector
    d.stop()
    store.close()


def xid_finding(d, code: str):
    record = d.results().get("xid")  # none before the first judgement
    found = [f for f in record.findings if f.code == code] if record else []
    return found[0] if found else None


def test_daemon_an_nvml_xid_moves_the_node_and_shows_in_metrics(daemon):
    d, root, collector = daemon
    assert d.record.state is NodeState.HEALTHY
    add_event(root, 0, 79)
    wait_for(lambda: d.record.state is NodeState.QUARANTINED, what="the NVML XID 79 to quarantine the node")
    f = xid_finding(d, "79")
    assert f.entity.index == 0 and f.entity.id.startswith("GPU-f1f125ab") and f.evidence["sources"] == ["nvml"]
    text = generate_latest(registry_for(collector)).decode()
    assert 'gpuwarden_xid_events{pci="0008:01:00.0",xid="79"} 1.0' in text
    assert 'gpuwarden_xid_source_events{pci="0008:01:00.0",source="nvml",xid="79"} 1.0' in text
    # The action worker applies intents outside the lock, after the transition: wait for it.
    wait_for(lambda: [a["action"] for a in d.adapter.actions()] == ["cordon", "drain"], what="the actions applied")


def test_daemon_the_same_xid_in_kernel_log_and_nvml_counts_once(daemon):
    d, root, _ = daemon
    append_kmsg(root, "NVRM: Xid (PCI:0009:01:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x1")
    add_event(root, 1, 13)
    wait_for(lambda: (f := xid_finding(d, "13")) and f.evidence["sources"] == ["kmsg", "nvml"],
             what="the XID 13 from both sources")
    # Later XIDs through both sources: once they are counted, the 13 has been looked at again by each source.
    append_kmsg(root, "NVRM: Xid (PCI:000a:01:00): 31, pid=7, name=python3, MMU Fault")
    add_event(root, 0, 94)
    wait_for(lambda: xid_finding(d, "31") and xid_finding(d, "94"), what="the later XIDs")
    f = xid_finding(d, "13")
    assert f.evidence["count"] == 1 and f.evidence["pids"] == ["4242"] and f.entity.index == 1


def test_daemon_a_gpu_off_the_bus_is_left_out_of_the_subscription_at_once(daemon):
    d, root, _ = daemon
    # GPU 0 subscribed first: the NVML thread may subscribe late on a loaded machine, and a GPU lost before it is
    # registered has no event to deliver (its XID 79 would come from the kernel log alone; none is written here).
    add_event(root, 0, 13)
    wait_for(lambda: xid_finding(d, "13"), what="an XID through GPU 0's subscription")
    add_event(root, 0, 79)
    edit_nvml(root, lambda d_: d_["gpus"][0].update(errors={"*": "GPU_IS_LOST"}))  # XID 79: off the bus
    wait_for(lambda: xid_finding(d, "79"), what="the XID 79")
    add_event(root, 2, 31)
    wait_for(lambda: xid_finding(d, "31"), what="an XID on a GPU still subscribed")
    assert xid_finding(d, "79").evidence["count"] == 1 and not xid_finding(d, "nvml-events")


def test_daemon_a_lost_gpu_that_still_registers_is_not_registered_again(daemon, monkeypatch):
    """NVIDIA's mock NVML (and a driver may do the same) accepts the registration of a GPU that fell off the bus and
    fails every wait: the daemon finds the lost GPU by reading it and goes on without it, instead of registering it
    again and again with a growing backoff while xid stays UNKNOWN."""
    d, root, _ = daemon
    registered = []
    inner = RecordedNvml.nvmlDeviceRegisterEvents
    monkeypatch.setattr(RecordedNvml, "nvmlDeviceRegisterEvents",
                        lambda self, h, t, s: registered.append(str(self._index(h))) or inner(self, h, t, s))
    create = RecordedNvml.nvmlEventSetCreate
    monkeypatch.setattr(RecordedNvml, "nvmlEventSetCreate", lambda self: registered.append("|") or create(self))
    add_event(root, 0, 79)
    edit_nvml(root, lambda d_: d_["gpus"][0].update(errors={"nvmlEventSetWait_v2": "GPU_IS_LOST",
                                                            "nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}))
    wait_for(lambda: xid_finding(d, "79"), what="the XID 79")
    add_event(root, 2, 31)
    wait_for(lambda: xid_finding(d, "31") and not xid_finding(d, "nvml-events"),
             what="an XID on GPU 2 through a subscription without GPU 0")
    add_event(root, 1, 13)
    wait_for(lambda: xid_finding(d, "13"), what="one more XID through the same subscription")
    builds = [set(b) for b in "".join(registered).split("|") if b]
    assert builds and "1" in builds[-1] and "0" not in builds[-1]  # the set in use was rebuilt without GPU 0
    assert xid_finding(d, "79").evidence["count"] == 1


def test_daemon_an_nvml_error_is_unknown_then_the_subscription_is_rebuilt(daemon):
    d, root, _ = daemon
    add_event(root, 0, 13)
    wait_for(lambda: xid_finding(d, "13"), what="the XID 13")
    edit_nvml(root, lambda d_: d_.setdefault("errors", {}).update(nvmlEventSetWait_v2="UNKNOWN"))
    unknown = wait_for(lambda: xid_finding(d, "nvml-events"), what="xid UNKNOWN for the wait error")
    assert unknown.status is Status.UNKNOWN and "NVML_ERROR_UNKNOWN" in unknown.message
    edit_nvml(root, lambda d_: d_["errors"].pop("nvmlEventSetWait_v2"))
    # After the backoff the set is rebuilt: the error clears, the incident is counted once.
    wait_for(lambda: not xid_finding(d, "nvml-events"), what="the rebuilt subscription")
    add_event(root, 2, 31)
    wait_for(lambda: xid_finding(d, "31"), what="an XID after the rebuild")
    assert xid_finding(d, "13").evidence["count"] == 1


def start_daemon(root: Path, state: Path) -> tuple[Daemon, Store]:
    store = Store(state / "state.db", lock=True)
    d = Daemon(Node.recorded_at(root), [], list(KERNEL_CONSUMERS), config.defaults(all_specs()), store,
               LocalAdapter(state / "actions.jsonl"), DaemonCollector(), DaemonOptions(kmsg_tick_s=0.01,
                                                                                      idle_tick_s=0.05))
    d.start()
    return d, store


def test_recorded_nvml_xids_are_counted_once_across_restarts(scenario_copy, tmp_path):
    """A scenario that lists NVML XIDs: each is counted once, however often the daemon restarts (it persists how
    far the list was handed over, with the counts)."""
    root = scenario_copy("gb200-nvl72-healthy")
    edit_nvml(root, lambda d_: d_.update(xid_events=[{"gpu": 1, "xid": 13}] * 3))
    for restart in range(3):
        d, store = start_daemon(root, tmp_path / "state")
        try:
            add_event(root, 1, 13)  # one more each run, after the start
            wait_for(lambda d=d, n=4 + restart: (f := xid_finding(d, "13")) and f.evidence["nvml_count"] >= n,
                     what=f"the new XID of run {restart}")
            assert xid_finding(d, "13").evidence["nvml_count"] == 4 + restart  # 4, 5, 6; never 3, 6, 9, 12
        finally:
            d.stop()
            store.close()

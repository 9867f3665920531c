"""The counters a poll reads come from one nvmlDeviceGetFieldValues call per GPU: each field maps back to the counter
the per-counter functions read (the same values on every bundled scenario), and a field that fails on its own is
that counter's error (UNKNOWN with NVML's reason), never a zero and never the whole GPU's."""
from __future__ import annotations

import json

import pynvml
import pytest
from conftest import NODES, PassiveClock, edit_nvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.nvml.bindings import const
from gpuwarden.agent.sources.nvml.fields import ECC_FIELDS, NVLINK_COUNTER_FIELDS, NVLINK_CRC_DATA_FIELDS
from gpuwarden.agent.sources.nvml.links import NVLINK_COUNTERS
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml
from gpuwarden.checks import nvlink_lanes

SCENARIOS = sorted(p.name for p in NODES.iterdir() if (p / "nvml.json").is_file())
T0 = 1_760_000_000.0


class Counting:
    """The recorded NVML with every library call it serves counted by name."""

    def __init__(self, lib: RecordedNvml):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call


def counted(path) -> tuple[Nvml, Counting]:
    backend = Counting(RecordedNvml.from_file(path))
    nvml = Nvml(backend, str(path))
    nvml._call("nvmlInit")
    return nvml, backend


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_field_maps_back_to_the_counter_the_per_counter_calls_read(scenario):
    path = NODES / scenario / "nvml.json"
    snap = json.loads(path.read_text())
    nvml, backend = counted(path)
    for gpu, recorded in zip(nvml.gpus(), snap["gpus"], strict=True):
        if gpu.error is not None:
            continue
        lib, h = backend.lib, gpu.handle
        if "nvlinks" in recorded:
            links = nvml.nvlinks(gpu)
            assert [(e["link"], e["state"], e["errors"]) for e in links] == [
                (e["link"], e["state"], e["errors"]) for e in recorded["nvlinks"]]
            for e in links:  # and what the per-counter functions answer for the same link
                assert e["state"] == lib.nvmlDeviceGetNvLinkState(h, e["link"])
                assert e["errors"] == {name: lib.nvmlDeviceGetNvLinkErrorCounter(h, e["link"], counter)
                                       for name, counter in NVLINK_COUNTERS.items()}
        if "ecc_errors" in recorded:
            got = nvml.ecc_counters(gpu)
            assert got == nvml._ecc_counters_each(gpu)
            assert (got["ecc_mode"], got["ecc_errors"]) == (recorded["ecc_mode"], recorded["ecc_errors"])


def test_one_field_call_per_gpu_per_poll(scenario_copy):
    """Per GPU and NVLink poll: one nvmlDeviceGetFieldValues; no per-link state or per-counter call, but for the data
    CRC count of links without a field of their own (nvml.h has CRC_DATA fields for links 0-11 only)."""
    nvml, backend = counted(NODES / "h100-hgx-healthy" / "nvml.json")
    gpus = nvml.gpus()
    for _ in range(3):  # the first read asks for every link NVML could have, the later ones for the GPU's own
        backend.calls.clear()
        for gpu in gpus:
            assert len(nvml.nvlinks(gpu)) == 18
        no_field = 18 - len([n for n in NVLINK_CRC_DATA_FIELDS if n < 18])
        assert backend.calls.count("nvmlDeviceGetFieldValues") == len(gpus)
        assert backend.calls.count("nvmlDeviceGetNvLinkErrorCounter") == no_field * len(gpus)
        assert "nvmlDeviceGetNvLinkState" not in backend.calls
    backend.calls.clear()
    for gpu in gpus:
        nvml.ecc_counters(gpu)
    assert backend.calls == ["nvmlDeviceGetFieldValues"] * len(gpus)


def test_fields_are_asked_with_their_link_as_scope():
    nvml, backend = counted(NODES / "h100-hgx-healthy" / "nvml.json")
    asked = []
    real = backend.lib.nvmlDeviceGetFieldValues
    backend.lib.nvmlDeviceGetFieldValues = lambda h, ids: asked.append(list(ids)) or real(h, ids)
    nvml.nvlinks(nvml.gpus()[0])
    (ids,) = asked
    assert (const("NVML_FI_DEV_NVLINK_GET_STATE"), 7) in ids
    assert (NVLINK_COUNTER_FIELDS["crc_flit"], 17) in ids
    assert const("NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L3") in ids  # per-link field id, no scope


def unread_on(root, gpu: int, link: int, counter: str, code: str) -> None:
    def change(snap):
        snap["gpus"][gpu]["nvlinks"][link]["unread"] = {counter: code}
    edit_nvml(root, change)


def test_a_counter_nvml_fails_to_read_is_that_counters_unknown_with_the_reason(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    clock = PassiveClock(nvlink_lanes.SPEC, root, dict(nvlink_lanes.SPEC.defaults), T0, 30.0)
    assert clock.tick().findings == ()
    unread_on(root, 2, 4, "crc_flit", "TIMEOUT")
    j = clock.tick()
    (f,) = j.findings
    assert (f.code, f.status, f.entity.kind, f.entity.index, f.entity.link) == (
        "nvlink-counters-unread", Status.UNKNOWN, "nvlink", 2, 4)
    assert "crc_flit (NVML_ERROR_TIMEOUT)" in f.message and f.evidence == {"unread": {"crc_flit": "TIMEOUT"}}
    # The other counters and links were still read and judged: every GPU's totals are exported.
    assert {m.labels["gpu"] for m in j.metrics if m.name == "gpuwarden_nvlink_links_active"} == {str(i) for i in
                                                                                             range(8)}


def test_an_unread_counter_is_not_taken_as_zero(scenario_copy):
    """The counts of a link stay where they were while a counter cannot be read: the next good read covers the
    whole interval and a counter that did not move shows no increase."""
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, lambda s: s["gpus"][1]["nvlinks"][3]["errors"].update(crc_data=500))
    clock = PassiveClock(nvlink_lanes.SPEC, root, dict(nvlink_lanes.SPEC.defaults), T0, 30.0)
    clock.tick()
    unread_on(root, 1, 3, "crc_data", "UNKNOWN")
    assert [f.code for f in clock.tick().findings] == ["nvlink-counters-unread"]
    edit_nvml(root, lambda s: s["gpus"][1]["nvlinks"][3].pop("unread"))
    j = clock.tick()
    assert j.findings == ()  # 500 again: no increase, no CRC finding
    link = clock.state["gpus"][json.loads((root / "nvml.json").read_text())["gpus"][1]["uuid"]]["links"]["3"]
    assert link["counters"]["crc_data"] == 500 and all(sum(w[2:]) == 0 for w in link["window"])


def test_a_counter_nvml_does_not_offer_is_left_out_not_unknown(scenario_copy):
    """A counter NVML answers NOT_SUPPORTED for (NVML drops the DL counters on some GPUs) is absent: no finding, and
    the link's state is still judged."""
    root = scenario_copy("h100-hgx-healthy")

    def drop(snap):
        for gpu in snap["gpus"]:
            for link in gpu["nvlinks"]:
                link["errors"].pop("replay")
        snap["gpus"][5]["nvlinks"][9]["state"] = 0
    edit_nvml(root, drop)
    node = Node.recorded_at(root)
    (gpu5,) = [g for g in node.gpus() if g.index == 5]
    assert all("replay" not in e["errors"] and "unread" not in e for e in node.nvml.nvlinks(gpu5))
    clock = PassiveClock(nvlink_lanes.SPEC, root, dict(nvlink_lanes.SPEC.defaults), T0, 30.0)
    assert [(f.code, f.entity.index, f.entity.link) for f in clock.tick().findings] == [("nvlink-down", 5, 9)]


def test_a_field_that_says_the_gpu_is_lost_loses_the_gpu(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    unread_on(root, 6, 0, "recovery", "GPU_IS_LOST")
    clock = PassiveClock(nvlink_lanes.SPEC, root, dict(nvlink_lanes.SPEC.defaults), T0, 30.0)
    assert [(f.code, f.status, f.entity.index) for f in clock.tick().findings] == [("gpu-lost", Status.FAIL, 6)]


@pytest.mark.parametrize("call, code, what", [
    ("nvmlDeviceGetEccMode", "TIMEOUT", "ECC mode, mode current"),
    ("nvmlDeviceGetTotalEccErrors", "CORRUPTED_INFOROM", "ECC errors, volatile corrected"),
    ("nvmlDeviceGetRemappedRows", "UNKNOWN", "remapped rows, remapped correctable"),
])
def test_an_ecc_field_nvml_fails_to_read_names_its_count(scenario_copy, call, code, what):
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, lambda s: s["gpus"][2].update(errors={call: code}))
    node = Node.recorded_at(root)
    with pytest.raises(NvmlError) as exc:
        node.nvml.ecc_counters(node.gpus()[2])
    assert exc.value.code == code and exc.value.device == 2 and what in str(exc.value)
    assert node.nvml.ecc_counters(node.gpus()[1])["ecc_errors"]["volatile"]["uncorrected"] == 0


def test_a_gpu_without_a_row_remapper_reads_its_ecc_counts(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, lambda s: s["gpus"][2].update(errors={"nvmlDeviceGetRemappedRows": "NOT_SUPPORTED"}))
    node = Node.recorded_at(root)
    got = node.nvml.ecc_counters(node.gpus()[2])
    assert got["remapped_rows"] is None and got["ecc_mode"] == {"current": 1, "pending": 1}


def test_without_field_values_every_counter_is_read_by_its_own_call(scenario_copy):
    """A driver without nvmlDeviceGetFieldValues (NOT_SUPPORTED) still gives every counter, one call each."""
    root = scenario_copy("h100-hgx-healthy")
    want = Node.recorded_at(root)
    want_links = want.nvml.nvlinks(want.gpus()[0])
    want_ecc = want.nvml.ecc_counters(want.gpus()[0])
    edit_nvml(root, lambda s: s["gpus"][0].update(errors={"nvmlDeviceGetFieldValues": "NOT_SUPPORTED"}))
    nvml, backend = counted(root / "nvml.json")
    gpu = nvml.gpus()[0]
    assert nvml.nvlinks(gpu) == want_links and nvml.ecc_counters(gpu) == want_ecc
    assert backend.calls.count("nvmlDeviceGetNvLinkState") >= 18


class Typed:
    """A library whose one field (the memory temperature) comes in the value type given: NVML picks the type."""

    def __init__(self, kind: str | int, value, ret: str = "NVML_SUCCESS"):
        self.kind, self.value, self.ret = kind, value, ret

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for fv in values:
            fv.nvmlReturn = const(self.ret)
            fv.valueType = self.kind if isinstance(self.kind, int) else const(f"NVML_VALUE_TYPE_{self.kind}")
            if isinstance(self.kind, str):
                member = {"DOUBLE": "dVal", "SIGNED_INT": "siVal", "UNSIGNED_LONG_LONG": "ullVal"}[self.kind]
                setattr(fv.value, member, self.value)
        return values


@pytest.mark.parametrize("kind, value", [("DOUBLE", 41.5), ("SIGNED_INT", -3), ("UNSIGNED_LONG_LONG", 2**40)])
def test_a_value_is_read_from_the_member_its_type_names(kind, value):
    from gpuwarden.agent.sources.nvml.fields import FI_MEMORY_TEMP
    from gpuwarden.agent.sources.nvml.gpu import Gpu

    nvml = Nvml(Typed(kind, value), "test")
    assert nvml.field_values(Gpu(0, handle=object()), [("t", FI_MEMORY_TEMP, None)]) == {"t": value}


def test_a_value_type_not_known_and_a_failed_field_are_errors_of_that_field():
    from gpuwarden.agent.sources.nvml.fields import FI_MEMORY_TEMP
    from gpuwarden.agent.sources.nvml.gpu import Gpu

    gpu = Gpu(3, handle=object())
    (err,) = Nvml(Typed(99, 0), "test").field_values(gpu, [("t", FI_MEMORY_TEMP, None)]).values()
    assert isinstance(err, NvmlError) and err.code == "UNKNOWN" and "value type 99" in str(err)
    (err,) = Nvml(Typed("DOUBLE", 0, "NVML_ERROR_TIMEOUT"), "test").field_values(
        gpu, [("t", FI_MEMORY_TEMP, 2)]).values()
    assert (err.code, err.device) == ("TIMEOUT", 3) and "NVML_FI_DEV_MEMORY_TEMP scope 2" in str(err)


def test_the_ecc_field_table_covers_every_count_the_check_reads():
    assert {(g, n) for g, n in ECC_FIELDS if g in ("volatile", "aggregate")} == {
        (c, k) for c in ("volatile", "aggregate") for k in ("corrected", "uncorrected")}


def test_the_field_array_is_read_in_the_layout_the_bindings_declare():
    """field_values reads nvmlFieldValue_t as bytes: the layout must be the one the installed bindings declare."""
    import ctypes

    from gpuwarden.agent.sources.nvml import fields as source

    fv = pynvml.c_nvmlFieldValue_t
    assert source._FV_SIZE == ctypes.sizeof(fv)
    assert (fv.valueType.offset, fv.nvmlReturn.offset, fv.value.offset, fv.value.size) == (24, 28, 32, 8)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_value_that_is_not_a_finite_number_is_an_error_of_that_field(value):
    from gpuwarden.agent.sources.nvml.fields import FI_MEMORY_TEMP
    from gpuwarden.agent.sources.nvml.gpu import Gpu

    (err,) = Nvml(Typed("DOUBLE", value), "test").field_values(Gpu(1, handle=object()),
                                                                 [("t", FI_MEMORY_TEMP, None)]).values()
    assert isinstance(err, NvmlError) and err.code == "UNKNOWN" and "not a finite number" in str(err)


def test_an_answer_that_is_not_the_field_array_is_an_nvml_error():
    from gpuwarden.agent.sources.nvml.fields import FI_MEMORY_TEMP
    from gpuwarden.agent.sources.nvml.gpu import Gpu

    class Short(Typed):
        def nvmlDeviceGetFieldValues(self, handle, fieldIds):
            return super().nvmlDeviceGetFieldValues(handle, fieldIds[:-1])  # one element fewer than asked

    for lib in (Short("UNSIGNED_LONG_LONG", 1), type("Odd", (), {"nvmlDeviceGetFieldValues": lambda s, h, i: 7})()):
        with pytest.raises(NvmlError) as exc:
            Nvml(lib, "test").field_values(Gpu(0, handle=object()), [("a", FI_MEMORY_TEMP, None), ("b", 1, None)])
        assert exc.value.code == "UNKNOWN" and "for 2 fields" in str(exc.value)

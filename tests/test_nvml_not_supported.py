"""What NVML refuses on real boards, through the recorded backend refusing it the same way: per-link NVLink counters
NVML does not offer (fields 102-107, the data CRC counts of links 6-11, NOT_SUPPORTED on H100 and GB200 under driver
550), a row-remapper histogram that answers NOT_SUPPORTED while the remapped-rows flags read, and a GPU with memory in
use whose process list comes back empty (bindings that take the size query's SUCCESS for "no process")."""
import json
from pathlib import Path

import pytest
from conftest import ROOT
from gpuwarden.agent.act import recovery
from gpuwarden.agent.core import config
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.checks import ecc, job_process, peer_p2p
from gpuwarden.checks import job_discovery as discover

NO_CRC_DATA = range(6, 12)  # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L6..L11: fields 102-107


def run_one(node, spec, **overrides):
    cfg = config.defaults([spec])
    cfg.checks[spec.name].update(overrides)
    cfg.agent["check_timeout_s"] = 0.0
    (result,) = run_checks(node, [spec], cfg)
    return result


def edit_nvml(root: Path, edit) -> None:
    snap = json.loads((root / "nvml.json").read_text())
    edit(snap)
    (root / "nvml.json").write_text(json.dumps(snap))


def without_crc_data(snap) -> None:
    """Links 6-11 of every GPU as NVML reads them when the data CRC fields answer NOT_SUPPORTED: no crc_data."""
    for gpu in snap["gpus"]:
        for link in gpu["nvlinks"]:
            if link["link"] in NO_CRC_DATA:
                del link["errors"]["crc_data"]


# -- NVLink counters NVML does not offer ------------------------------------------------------------------------
def test_nvlinks_leaves_out_the_counters_the_recorded_node_refuses(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, without_crc_data)
    node = Node.recorded_at(root)
    links = {e["link"]: e for e in node.nvml.nvlinks(node.gpus()[0])}
    assert len(links) == 18 and all("crc_data" not in links[n]["errors"] for n in NO_CRC_DATA)
    assert all(links[n]["errors"]["crc_data"] == 0 for n in links if n not in NO_CRC_DATA)
    assert all("unread" not in e for e in links.values())  # NOT_SUPPORTED is not a failed read


@pytest.mark.parametrize("name", ["h100-hgx-healthy", "gb200-nvl72-healthy"])
def test_counters_nvml_does_not_offer_are_not_judged_and_said_never_a_crash(scenario_copy, name):
    # The live path reads nvlinks() before and after the copies: both lack crc_data on links 6-11.
    node = Node.recorded_at(_root(scenario_copy, name))
    gpus = node.gpus()
    before = {g.index: node.nvml.nvlinks(g) for g in gpus}
    after = {g.index: node.nvml.nvlinks(g) for g in gpus}
    after[1][7]["errors"]["replay"] += 2
    found = peer_p2p.decide_nvlink(before, after, {g.index: g.entity for g in gpus}, peer_p2p.CHECK.defaults)
    by = {f.code: f for f in found}
    assert set(by) == {"nvlink-errors-during-test", "nvlink-counters-not-supported"}
    rose = by["nvlink-errors-during-test"]
    assert rose.entity.link == 7 and rose.entity.index == 1 and rose.evidence == {
        "crc_flit": 0, "replay": 2, "recovery": 0}  # crc_data: not offered on link 7, so not compared
    note = by["nvlink-counters-not-supported"]
    assert note.status is Status.OK and note.action is Action.NONE and note.entity.kind == "node"
    assert note.evidence["not_supported"] == {str(g.index): {"crc_data": list(NO_CRC_DATA)} for g in gpus}
    assert "GPU 0: crc_data on links 6-11" in note.message and "NOT_SUPPORTED" in note.message


def test_the_check_on_a_node_that_offers_no_data_crc_on_links_6_to_11(scenario_copy):
    root = _root(scenario_copy, "h100-hgx-healthy")
    # after the copies: the same counters, as nvml.json lists them, and a replay on link 7 of GPU 3
    snap = json.loads((root / "nvml.json").read_text())
    after = {str(g["index"]): g["nvlinks"] for g in snap["gpus"]}
    after["3"][7]["errors"]["replay"] = 1
    (root / "tools").mkdir(exist_ok=True)
    (root / "tools" / peer_p2p.NVLINK_AFTER).write_text(json.dumps(after))
    result = run_one(Node.recorded_at(root), peer_p2p.CHECK, bandwidth_method="none")
    assert result.error is None
    codes = sorted(f.code for f in result.findings)
    assert codes == ["nvlink-counters-not-supported", "nvlink-errors-during-test", "p2p-bandwidth-not-measured"]
    (rose,) = [f for f in result.findings if f.code == "nvlink-errors-during-test"]
    assert rose.entity.index == 3 and rose.entity.link == 7 and "replay +1" in rose.message


def test_an_after_reading_with_counters_the_before_reading_lacked_is_no_crash(scenario_copy):
    root = _root(scenario_copy, "h100-hgx-healthy")
    full = json.loads((ROOT / "fixtures/nodes/h100-hgx-healthy/nvml.json").read_text())
    (root / "tools").mkdir(exist_ok=True)
    (root / "tools" / peer_p2p.NVLINK_AFTER).write_text(json.dumps({str(g["index"]): g["nvlinks"]
                                                                    for g in full["gpus"]}))
    result = run_one(Node.recorded_at(root), peer_p2p.CHECK, bandwidth_method="none")
    assert result.error is None and result.status is Status.WARN  # the bandwidth not measured, nothing else
    assert {f.code for f in result.findings} == {"p2p-bandwidth-not-measured", "nvlink-counters-not-supported"}


def _root(scenario_copy, name: str) -> Path:
    root = scenario_copy(name)
    edit_nvml(root, without_crc_data)
    return root


# -- a row-remapper histogram NVML does not report -----------------------------------------------------------------
def test_pending_and_failed_remaps_are_judged_when_only_the_histogram_is_not_supported(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")

    def refuse_histogram(snap):
        for gpu in snap["gpus"]:
            gpu.setdefault("errors", {})["nvmlDeviceGetRowRemapperHistogram"] = "NOT_SUPPORTED"
        snap["gpus"][2]["remapped_rows"].update(correctable=1, pending=True)
        snap["gpus"][5]["remapped_rows"].update(uncorrectable=3, failure=True)

    edit_nvml(root, refuse_histogram)
    result = run_one(Node.recorded_at(root), ecc.CHECK)
    faults = sorted((f.entity.index, f.code, f.status, f.action) for f in result.findings if f.status is not Status.OK)
    assert faults == [(2, "row-remap-pending", Status.FAIL, Action.RESET_GPU),
                      (5, "row-remap-failure", Status.FAIL, Action.SERVICE)]
    assert result.status is Status.FAIL
    notes = [f for f in result.findings if f.code == "row-remap-headroom-unknown"]
    assert sorted(f.entity.index for f in notes) == list(range(8))
    assert all(f.status is Status.OK and "headroom not judged" in f.message for f in notes)


def test_a_histogram_that_fails_otherwise_is_still_an_unknown_gpu(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    edit_nvml(root, lambda snap: snap["gpus"][4].setdefault("errors", {}).update(
        nvmlDeviceGetRowRemapperHistogram="UNKNOWN"))
    result = run_one(Node.recorded_at(root), ecc.CHECK)
    assert [(f.entity.index, f.status) for f in result.findings] == [(4, Status.UNKNOWN)]


# -- an empty process list from a GPU whose memory is in use -------------------------------------------------------
def test_an_empty_process_list_from_a_gpu_with_memory_in_use_is_could_not_look(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")

    def listed_none(snap):
        gpu = snap["gpus"][1]
        gpu["memory_used_bytes"] = gpu["processes"][0]["used_memory_bytes"] + (512 << 20)  # its rank and context
        del gpu["processes"]  # what the bindings hand over when NVML answers the size query with SUCCESS

    edit_nvml(root, listed_none)
    job_process.forget()
    try:
        found = discover.discover(Node.recorded_at(root), [("mlx5_0/1", True)], 100.0)
    finally:
        job_process.forget()
    assert sorted(found.unreadable) == [1]
    assert "could not be listed" in found.unreadable[1] and "MiB of the GPU's memory is in use" in found.unreadable[1]
    assert all(1 not in job.gpu_indices for job in found.jobs)
    # the recovery ladder reads the same map: never "nothing holds it"
    with pytest.raises(recovery.HoldersUnknown, match="could not be listed"):
        recovery.gpu_holders(Node.recorded_at(root), [1])


def test_an_idle_gpu_listing_no_process_is_listed_as_none(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")

    def idle(snap):
        gpu = snap["gpus"][1]
        gpu["memory_used_bytes"] = 600 << 20  # the driver's reserve and one idle context at most
        del gpu["processes"]

    edit_nvml(root, idle)
    node = Node.recorded_at(root)
    assert node.nvml.processes(node.gpus()[1]) == []
    assert recovery.gpu_holders(node, [1]) == {1: []}


def test_memory_info_that_fails_leaves_the_empty_list_unconfirmed(scenario_copy):
    root = scenario_copy("gb200-nvl72-job")

    def lost_figure(snap):
        gpu = snap["gpus"][1]
        del gpu["processes"]
        gpu.setdefault("errors", {})["nvmlDeviceGetMemoryInfo"] = "UNKNOWN"

    edit_nvml(root, lost_figure)
    node = Node.recorded_at(root)
    with pytest.raises(NvmlError, match="nvmlDeviceGetMemoryInfo"):
        node.nvml.processes(node.gpus()[1])


def test_a_recording_keeps_the_memory_in_use_so_its_replay_cannot_look_either(scenario_copy, tmp_path):
    from gpuwarden.agent.node.record import record

    root = scenario_copy("gb200-nvl72-job")

    def listed_none(snap):
        snap["gpus"][1]["memory_used_bytes"] = 67 << 30
        del snap["gpus"][1]["processes"]

    edit_nvml(root, listed_none)
    out = tmp_path / "recorded"
    record(Node.recorded_at(root), out)
    gpu = json.loads((out / "nvml.json").read_text())["gpus"][1]
    assert gpu["memory_used_bytes"] == 67 << 30
    assert gpu["errors"]["nvmlDeviceGetComputeRunningProcesses"] == "UNKNOWN" and "processes" not in gpu
    replay = Node.recorded_at(out)
    with pytest.raises(NvmlError, match="nvmlDeviceGetComputeRunningProcesses"):
        replay.nvml.processes(replay.gpus()[1])

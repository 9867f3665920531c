"""pcie_link on the bundled scenarios (healthy as recorded), on copies edited to downtrain a GPU, NIC or switch link
(flat captures and a nested sysfs tree laid out like /sys/devices/pci...), NVML's view and replay counter, and the
GPU<->NIC affinity from `nvidia-smi topo -m` (pass, fail, tool missing, hang, garbage)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_one
from gpuwarden.checks import pcie_link
from gpuwarden.checks.pcie_link import decide_link
from gpuwarden.checks.pcie_tree import Link, parse_speed, pci_path
from test_parse_nvidia_smi_topo import nic_matrix, pix_pairs

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
POLICY = dict(pcie_link.CHECK.defaults)
H100_GPU1 = Entity("gpu", "GPU-9930d717-21dd-7692-054e-3d0a2bae76b5", 1, "0000:3b:00.0")
DEV = "sys/bus/pci/devices"


def result(root: Path, **cfg):
    return run_one(pcie_link.CHECK, Node.recorded_at(root), {**POLICY, **cfg}, timeout_s=30)


def problems(res):
    return [(f.code, f.status, f.entity.id) for f in res.findings if f.status is not Status.OK]


def edit_nvml(root: Path, index: int, **pcie) -> None:
    path = root / "nvml.json"
    data = json.loads(path.read_text())
    gpu = data["gpus"][index]
    for key, value in pcie.items():
        if key == "clocks_event_reasons":
            gpu[key] = value
        else:
            gpu["pcie"][key] = value
    path.write_text(json.dumps(data))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


# -- bundled scenarios ---------------------------------------------------------------------------------------------
def test_bundled_healthy_scenarios_pass():
    # h100: a recorded `nvidia-smi topo -m` puts a NIC at PIX for every GPU, so affinity is judged and passes.
    h100 = result(NODES / "h100-hgx-healthy")
    assert h100.status is Status.OK and h100.findings == ()
    # GB200: the affinity cannot be read from the topology matrix, so the check says why it did not judge it.
    gb200 = result(NODES / "gb200-nvl72-healthy")
    assert gb200.status is Status.OK and problems(gb200) == []
    (note,) = gb200.findings
    assert note.code == "pcie-affinity-not-checked" and note.status is Status.OK


@pytest.mark.parametrize("sku", ["GB200-NVL72", "GB300-NVL72"])
def test_grace_blackwell_says_why_the_affinity_cannot_be_judged(scenario_copy, sku):
    """On Grace-Blackwell trays every GPU reaches its CPU over NVLink-C2C, so nvidia-smi topo -m reads SYS for every
    GPU-NIC pair (checks/data/thresholds/pcie_link.toml has the sources): said, with the reason, not judged."""
    root = scenario_copy("gb200-nvl72-healthy")
    toml = root / "node.toml"
    toml.write_text(toml.read_text().replace('sku = "GB200-NVL72"', f'sku = "{sku}"'))
    (note,) = result(root).findings
    assert (note.code, note.status, note.action) == ("pcie-affinity-not-checked", Status.OK, Action.NONE)
    assert note.evidence == {"sku": sku, "reason": "gpus-on-nvlink-c2c"}
    assert f"on {sku} the GPUs attach to the Grace CPUs over NVLink-C2C" in note.message
    assert "reads SYS for every GPU-NIC pair" in note.message
    # A configured expectation is still honoured (here: no recorded topology, so that is what it says).
    (configured,) = result(root, gpu_nic_max_distance="SYS").findings
    assert configured.evidence.get("reason") != "gpus-on-nvlink-c2c"


def test_bundled_faulty_scenario_only_reports_its_lost_gpu():
    res = result(NODES / "gb200-nvl72-faulty")
    assert problems(res) == [("gpu-lost", Status.FAIL, "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957")]


# -- flat captures, edited -----------------------------------------------------------------------------------------
def test_gpu_at_x8_is_a_fail_naming_the_gpu_and_bdf(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    write(root / DEV / "0000:3b:00.0/current_link_width", "8")
    res = result(root)
    (f,) = [f for f in res.findings if f.status is not Status.OK]
    assert (f.code, f.status, f.action, f.entity) == ("pcie-downtrained", Status.FAIL, Action.DRAIN, H100_GPU1)
    assert f.evidence["bdf"] == "0000:3b:00.0" and (f.evidence["width"], f.evidence["max_width"]) == (8, 16)
    assert "x8" in f.message and "x16" in f.message and "50%" in f.message


def test_nic_downtrained_and_gen_drop_of_a_nic_always_count(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    write(root / DEV / "0010:03:00.0/current_link_speed", "16.0 GT/s PCIe")
    res = result(root)
    assert problems(res) == [("pcie-downtrained", Status.FAIL, "0010:03:00.0")]
    assert res.findings[0].entity == Entity("pcie", "0010:03:00.0", pci="0010:03:00.0")
    assert "Gen4 x16" in res.findings[0].message and "Gen5 x16" in res.findings[0].message


def test_gpu_generation_is_judged_only_when_it_is_reliable(scenario_copy):
    # GB200 GPUs are idle in the capture and the SKU has no "stable at idle" source: a lower gen is not judged.
    gb = scenario_copy("gb200-nvl72-healthy")
    write(gb / DEV / "0009:01:00.0/current_link_speed", "2.5 GT/s PCIe")
    edit_nvml(gb, 1, gen=1)
    assert problems(result(gb)) == []
    edit_nvml(gb, 1, clocks_event_reasons=0)  # busy: now it counts (sysfs and NVML agree: one finding)
    assert problems(result(gb)) == [("pcie-downtrained", Status.FAIL, "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32")]
    # H100 SXM holds Gen5 at idle (thresholds/pcie_link.toml): judged although the GPU is idle.
    h = scenario_copy("h100-hgx-healthy")
    edit_nvml(h, 1, gen=4)
    res = result(h)
    (f,) = [f for f in res.findings if f.status is not Status.OK]
    assert (f.code, f.entity, f.evidence["source"], f.evidence["idle"]) == ("pcie-downtrained", H100_GPU1, "nvml", True)


def test_nvml_width_and_replays(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    edit_nvml(root, 0, width=4)
    edit_nvml(root, 3, replay=81)
    edit_nvml(root, 2, replay=80)
    res = result(root)
    assert sorted((c, s) for c, s, _ in problems(res)) == [("pcie-downtrained", Status.FAIL),
                                                          ("pcie-replays", Status.WARN)]
    replay = next(f for f in res.findings if f.code == "pcie-replays")
    assert replay.entity.index == 3 and replay.evidence["replay"] == 81 and replay.action is Action.MONITOR
    assert problems(result(root, replay_warn=100)) == [("pcie-downtrained", Status.FAIL,
                                                        "GPU-f1f125ab-e3b5-c66a-ab3f-9862557b394e")]


def test_second_functions_and_virtual_functions_share_the_link(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    shutil.copytree(root / DEV / "0000:1a:00.0", root / DEV / "0000:1a:00.1")
    write(root / DEV / "0000:1a:00.1/current_link_width", "8")  # never read: function 0 speaks for the device
    shutil.copytree(root / DEV / "0000:1a:00.0", root / DEV / "0000:1a:00.2")
    write(root / DEV / "0000:1a:00.2/current_link_width", "0")
    os.symlink("../0000:1a:00.0", root / DEV / "0000:1a:00.2/physfn")
    assert problems(result(root)) == []


def test_ignored_devices_and_unreadable_links(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    write(root / DEV / "0000:3b:00.0/current_link_width", "8")
    write(root / DEV / "0000:bc:00.0/current_link_width", "sixteen")
    res = result(root, ignore_devices=["0000:3b:00.0"])
    assert problems(res) == [("pcie-link-unreadable", Status.UNKNOWN, "0000:bc:00.0")]
    assert res.status is Status.UNKNOWN


def test_nvml_unusable_still_judges_sysfs(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "nvml.json").unlink()
    write(root / DEV / "0008:01:00.0/current_link_width", "8")
    res = result(root)
    assert res.status is Status.FAIL
    assert sorted(problems(res)) == [("pcie-downtrained", Status.FAIL, "0008:01:00.0"),
                                     ("pcie-nvml-unreadable", Status.UNKNOWN, "gb200-rack07-tray03")]


def test_node_without_nvidia_or_mellanox_devices_is_skipped(tmp_path):
    write(tmp_path / "node.toml", 'hostname = "cpu-only"')
    write(tmp_path / DEV / "0000:00:1f.0/vendor", "0x8086")
    write(tmp_path / DEV / "0000:00:1f.0/class", "0x060100")
    res = result(tmp_path)
    assert res.status is Status.SKIPPED and "no NVIDIA or Mellanox" in res.error


# -- nested sysfs: root port -> switch -> GPU and NIC --------------------------------------------------------------
def pci_dev(root: Path, chain: list[str], vendor: str, cls: str, speed="32.0 GT/s PCIe", width="16",
            max_speed="32.0 GT/s PCIe", max_width="16") -> None:
    path = root / "sys/devices/pci0000:15" / Path(*chain)
    for name, value in (("vendor", vendor), ("class", cls), ("current_link_speed", speed),
                        ("current_link_width", width), ("max_link_speed", max_speed), ("max_link_width", max_width)):
        write(path / name, value)
    link = root / DEV / chain[-1]
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(path, link.parent))


RP, USP, DSP0, DSP1 = "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:17:01.0"


@pytest.fixture
def tree(scenario_copy):
    """The H100 scenario with GPU 0 (0000:19:00.0) and its NIC (0000:1a:00.0) moved under a PCIe switch, laid out
    the way real sysfs is (bus/pci/devices/<bdf> links into devices/pci0000:15/...)."""
    root = scenario_copy("h100-hgx-healthy")
    for bdf in ("0000:19:00.0", "0000:1a:00.0"):
        shutil.rmtree(root / DEV / bdf)
    pci_dev(root, [RP], "0x8086", "0x060400")
    pci_dev(root, [RP, USP], "0x1000", "0x060400")
    pci_dev(root, [RP, USP, DSP0], "0x1000", "0x060400")
    pci_dev(root, [RP, USP, DSP1], "0x1000", "0x060400")
    pci_dev(root, [RP, USP, DSP0, "0000:19:00.0"], "0x10de", "0x030200")
    pci_dev(root, [RP, USP, DSP1, "0000:1a:00.0"], "0x15b3", "0x020700")
    return root


def test_nested_tree_healthy_and_path_is_read(tree):
    assert problems(result(tree)) == []
    from gpuwarden.agent.sources.sysfs import Sysfs
    assert [n for n, _ in pci_path(Sysfs(tree), "0000:19:00.0")] == [
        "pci0000:15", RP, USP, DSP0, "0000:19:00.0"]


def test_nested_switch_uplink_at_x8_warns_once(tree):
    write(tree / "sys/devices/pci0000:15" / RP / USP / "current_link_width", "8")
    res = result(tree)
    (f,) = [f for f in res.findings if f.status is not Status.OK]
    assert (f.code, f.status, f.action, f.entity.id) == ("pcie-downtrained", Status.WARN, Action.MONITOR, USP)
    assert f.evidence["upstream"] == RP and f.evidence["role"] == "bridge"


def test_nested_gen4_nic_under_gen5_switch_is_fine_but_gen4_gpu_is_not(tree):
    nic = tree / "sys/devices/pci0000:15" / RP / USP / DSP1 / "0000:1a:00.0"
    write(nic / "max_link_speed", "16.0 GT/s PCIe")  # a Gen4 card in a Gen5 slot: trained at what both do
    write(nic / "current_link_speed", "16.0 GT/s PCIe")
    assert problems(result(tree)) == []
    gpu = tree / "sys/devices/pci0000:15" / RP / USP / DSP0 / "0000:19:00.0"
    write(gpu / "current_link_speed", "16.0 GT/s PCIe")  # H100: generation judged at idle
    res = result(tree)
    (f,) = [f for f in res.findings if f.status is not Status.OK]
    assert f.entity.index == 0 and f.evidence["upstream"] == DSP0 and f.status is Status.FAIL
    # ...unless the slot itself only does Gen4.
    write(tree / "sys/devices/pci0000:15" / RP / USP / DSP0 / "max_link_speed", "16.0 GT/s PCIe")
    assert problems(result(tree)) == []


# -- GPU <-> NIC affinity ------------------------------------------------------------------------------------------
def topo(root: Path, text: str | None = None, rc: int | None = None, hang: bool = False) -> None:
    tools = root / "tools"
    tools.mkdir(exist_ok=True)
    if text is not None:
        (tools / "nvidia-smi-topo-m.out").write_text(text)
    if rc is not None:
        (tools / "nvidia-smi-topo-m.rc").write_text(str(rc))
    if hang:
        (tools / "nvidia-smi-topo-m.hang").write_text("")


def test_affinity_pass_and_a_gpu_without_a_near_nic(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    topo(root, nic_matrix(pix_pairs()))
    assert result(root).findings == ()
    pairs = pix_pairs()
    pairs[1] = ["SYS" if n != 0 else "NODE" for n in range(8)]  # NIC1 gone from GPU 1's switch
    topo(root, nic_matrix(pairs))
    res = result(root)
    (f,) = res.findings
    assert (f.code, f.status, f.action, f.entity) == ("pcie-gpu-nic-affinity", Status.FAIL, Action.DRAIN, H100_GPU1)
    assert f.evidence == {"nearest_nic": "mlx5_0", "distance": "NODE", "expected": "PXB"}
    assert result(root, gpu_nic_max_distance="NODE").findings == ()
    assert result(root, gpu_nic_max_distance="off").findings == ()


def test_affinity_tool_problems(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    topo(root, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", rc=9)
    (f,) = result(root).findings
    assert (f.code, f.status) == ("pcie-affinity-unknown", Status.UNKNOWN) and "couldn't communicate" in f.message
    topo(root, "\x07garbage\n", rc=0)
    assert [f.code for f in result(root).findings] == ["pcie-affinity-unknown"]
    topo(root, (ROOT / "fixtures/tools/nvidia-smi/stas00__nvidia-smi-topo-m__8xH100-NV18.txt").read_text())
    (f,) = result(root).findings
    assert f.status is Status.UNKNOWN and "lists no NIC" in f.message
    topo(root, hang=True)
    (f,) = result(root, topo_timeout_s=0.1).findings
    assert f.status is Status.UNKNOWN and "no answer within 0.1s" in f.message


def test_affinity_config_errors_and_skus_without_a_source(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    res = result(root, gpu_nic_max_distance="NEAR")
    assert res.status is Status.UNKNOWN and "gpu_nic_max_distance" in res.error
    gb = scenario_copy("gb200-nvl72-healthy")  # as a SKU with no source for its GPU<->NIC layout
    (gb / "node.toml").write_text((gb / "node.toml").read_text().replace('"GB200-NVL72"', '"B200-HGX"'))
    topo(gb, nic_matrix(pix_pairs(4)))
    (note,) = result(gb).findings
    assert note.status is Status.OK and "no expectation for SKU B200-HGX" in note.message


# -- pure pieces ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, gts", [("32.0 GT/s PCIe", 32.0), ("2.5 GT/s PCIe", 2.5), ("8 GT/s", 8.0),
                                       ("Unknown", None), ("", None)])
def test_parse_speed(text, gts):
    assert parse_speed(text) == gts


def test_decide_link_uses_the_weaker_end():
    e = Entity("pcie", "x")
    ok = Link("x", "nic", 16.0, 16, 32.0, 16, "up", 16.0, 16)
    assert decide_link(ok, e, True) == []
    slow = Link("x", "gpu", 16.0, 16, 32.0, 16, "up", 32.0, 16)
    assert decide_link(slow, e, False) == []  # generation not judged (idle GPU)
    (f,) = decide_link(slow, e, True)
    assert f.status is Status.FAIL and "50%" in f.message
    (w,) = decide_link(Link("x", "other", 32.0, 1, 32.0, 2), e, True)  # an NVSwitch's management link
    assert w.status is Status.WARN


# -- damaged or partial input: findings win over "does not apply", and "could not look" is never OK -----------------
def lose_every_gpu(root: Path) -> None:
    path = root / "nvml.json"
    data = json.loads(path.read_text())
    for gpu in data["gpus"]:
        gpu["errors"] = {"*": "GPU_IS_LOST"}
    path.write_text(json.dumps(data))


def test_every_gpu_lost_with_no_device_of_ours_in_sysfs_is_a_fail_not_skipped(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")
    lose_every_gpu(root)
    shutil.rmtree(root / DEV)
    write(root / DEV / "0000:00:1f.0/vendor", "0x8086")  # the PCI tree is there, holding nothing of ours
    write(root / DEV / "0000:00:1f.0/class", "0x060100")
    res = result(root)
    assert res.status is Status.FAIL
    assert [(c, s) for c, s, _ in problems(res)] == [("gpu-lost", Status.FAIL)] * 4


def test_findings_yielded_before_not_applicable_decide_the_status():
    from gpuwarden.agent.core.check import CheckSpec
    from gpuwarden.agent.core.errors import NotApplicable
    from gpuwarden.agent.core.model import Finding

    def run(node, cfg):
        yield Finding("odd", "odd-warn", Entity.node("n"), Status.WARN, "a warning", Action.MONITOR)
        raise NotApplicable("the rest does not apply")

    res = run_one(CheckSpec(name="odd", summary="", run=run), None, {}, timeout_s=10)
    assert res.status is Status.WARN and len(res.findings) == 1 and res.error == "the rest does not apply"


def test_gpu_on_the_bus_that_nvml_does_not_count_fails_by_its_address(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    path = root / "nvml.json"
    data = json.loads(path.read_text())
    gone = data["gpus"].pop(1)  # GPU 1, 0000:3b:00.0: NVML no longer counts it
    for i, gpu in enumerate(data["gpus"]):
        gpu["index"] = i
    path.write_text(json.dumps(data))
    res = result(root)
    assert res.status is Status.FAIL
    (f,) = [f for f in res.findings if f.code == "gpu-missing-from-nvml"]
    assert f.entity == Entity("gpu", "0000:3b:00.0", pci="0000:3b:00.0") and f.action is Action.REBOOT
    assert "0000:3b:00.0" in f.message and f.evidence["driver_lists"] is True and gone["uuid"] not in f.message
    assert problems(result(root, ignore_devices=["0000:3b:00.0"])) == []


def test_gpu_missing_while_another_is_unnamed_is_judged_by_count():
    lost = type("Gpu", (), {"pci": None})()
    named = type("Gpu", (), {"pci": "0000:19:00.0"})()
    node = Entity.node("n")
    bus = ["0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0"]
    assert pcie_link.decide_missing(bus[:2], [named, lost], node, lambda b: True) == []  # the lost one may be it
    (f,) = pcie_link.decide_missing(bus, [named, lost], node, lambda b: True)
    assert (f.code, f.entity, f.status) == ("gpu-missing-from-nvml", node, Status.FAIL)
    assert "3 GPUs on the PCI bus, NVML counts 2" in f.message


def test_missing_sys_tree_is_unknown_not_ok(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    shutil.rmtree(root / "sys")
    res = result(root)
    assert res.status is Status.UNKNOWN
    assert problems(res) == [("pcie-sysfs-missing", Status.UNKNOWN, "g021")]

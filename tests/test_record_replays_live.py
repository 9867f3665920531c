"""A node recorded by `gpuwarden record` replays (`preflight --root`) to the verdict its live run gave: each check's
status and action, its findings, and the exit code. The live run is the live code path (a node without a root, as
`preflight` without --root builds): NVML through the recorded backend, the way NVIDIA's mock NVML stands in for GPUs
on a machine without them, and sysfs, /proc and the kernel log under a host folder laid out as the kernel lays them
out, with bus/pci/devices/<bdf> linking into devices/pci<domain>:<bus>/...; tools on PATH."""
import contextlib
import io
import json
import os
from pathlib import Path

import pytest
from conftest import NODES
from gpuwarden.agent.cli.main import main
from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import Action, Status, verdict_exit_code
from gpuwarden.agent.core.sku import sku_from_gpu_name
from gpuwarden.agent.node.host import Node, NodeInfo
from gpuwarden.agent.node.record import record
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources.kmsg import KernelLog
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.agent.sources.tools import ToolRunner
from gpuwarden.checks import ALL

QUICK = [spec for spec in ALL if spec.level == "quick"]  # what preflight runs by default
DEV = "sys/bus/pci/devices"
BOOT_ID = "5b7e0c1a-3f2d-4e9b-8a61-2c4d6e8f0a1b"
KMSG = ("6,1,0,-;Linux version 5.15.0-112-generic (buildd@lcy02-amd64-051)\n"
        "6,2,1042,-;Command line: BOOT_IMAGE=/vmlinuz-5.15.0-112-generic ro\n")
HOST_PROCESSES = [(1, "systemd", ["/sbin/init"]), (2, "kthreadd", [])]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def pci_function(host: Path, chain: list[str], vendor: str, cls: str, width: str | None = "16",
                 max_width: str = "16", speed: str = "32.0 GT/s PCIe", max_speed: str = "32.0 GT/s PCIe",
                 fatal: int | None = None) -> Path:
    """A function at devices/pci0000:<bus>/<chain...>, linked from bus/pci/devices as the kernel links it; `width`
    None: no PCIe link files (a host bridge); `fatal`: its aer_dev_* files, with that many fatal errors."""
    path = host / "sys/devices" / f"pci{chain[0][:7]}" / Path(*chain)
    files = {"vendor": vendor, "device": "0x0000", "class": cls}
    if width is not None:
        files |= {"current_link_speed": speed, "current_link_width": width, "max_link_speed": max_speed,
                  "max_link_width": max_width}
    if fatal is not None:
        files |= {"aer_dev_correctable": "RxErr 0\nTOTAL_ERR_COR 0", "aer_dev_nonfatal": "DLP 0\nTOTAL_ERR_NONFATAL 0",
                  "aer_dev_fatal": f"DLP {fatal}\nTOTAL_ERR_FATAL {fatal}"}
    for name, value in files.items():
        write(path / name, value)
    link = host / DEV / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(path, link.parent))
    return path


def base_host(tmp_path: Path) -> Path:
    """A host's own PCI functions (host bridge, a root port with an NVMe drive below), its process table and boot."""
    host = tmp_path / "host"
    pci_function(host, ["0000:00:00.0"], "0x8086", "0x060000", width=None)
    pci_function(host, ["0000:00:01.0"], "0x8086", "0x060400")
    pci_function(host, ["0000:00:01.0", "0000:01:00.0"], "0x144d", "0x010802", width="4", max_width="4")
    for pid, comm, argv in HOST_PROCESSES:
        write(host / f"proc/{pid}/comm", comm)
        (host / f"proc/{pid}/cmdline").write_text("".join(a + "\0" for a in argv))
    write(host / "proc/sys/kernel/random/boot_id", BOOT_ID)
    (host / "kmsg").write_text(KMSG)
    return host


def h100_profile() -> dict:
    """8x H100 SXM as a recent driver reports them: fabric registration completed with an all-zero cluster UUID
    (docs/scenario-format.md, `fabric`)."""
    snap = json.loads((NODES / "h100-hgx-healthy" / "nvml.json").read_text())
    for gpu in snap["gpus"]:
        gpu["errors"].pop("nvmlDeviceGetGpuFabricInfoV")
        gpu["fabric"] = {"cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": 0, "state": 3,
                         "status": 0, "health_mask": 0}
    return snap


def gb200_profile() -> dict:
    return json.loads((NODES / "gb200-nvl72-healthy" / "nvml.json").read_text())


def live_node(host: Path, snapshot: dict) -> Node:
    """A node on the live path (no root) over `host`, NVML answering `snapshot` through the recorded backend."""
    nvml_json = host.parent / "mock-nvml.json"  # beside the host, not in it: NVML is no file of the node's
    nvml_json.write_text(json.dumps(snapshot))
    name = next(g["name"] for g in snapshot["gpus"] if g.get("name"))
    info = NodeInfo(hostname="mock-node", sku=sku_from_gpu_name(name), boot_id=BOOT_ID,
                    versions={"driver": snapshot["driver_version"]})
    return Node(info, None, Sysfs(host), KernelLog(host / "kmsg", live=False, boot_id=BOOT_ID, name="kmsg"),
                ToolRunner(), lambda: Nvml.recorded(nvml_json))


@pytest.fixture
def tools_on_path(tmp_path, monkeypatch):
    """PATH holding only systemctl, answering that the Fabric Manager unit is inactive (a host without FM running;
    nvidia-smi is not installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text("#!/bin/sh\necho inactive\nexit 3\n")
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def outcome(results) -> dict:
    return {r["check"]: (r["status"], r["action"], sorted((f["code"], f["status"], f["action"], f["entity"]["id"])
                                                          for f in r["findings"])) for r in results}


def live_verdict(node: Node) -> tuple[dict, int]:
    results = run_checks(node, QUICK, config.defaults(QUICK))
    return outcome(r.to_dict() for r in results), verdict_exit_code(results)


def replayed_verdict(root: Path) -> tuple[dict, int]:
    """`gpuwarden preflight --root <recording> --json`: its results and exit code."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["preflight", "--root", str(root), "--json"])
    report = json.loads(out.getvalue())
    assert report["exit_code"] == code
    return outcome(report["results"]), code


def record_and_replay(host: Path, snapshot: dict, out: Path) -> tuple[tuple[dict, int], tuple[dict, int]]:
    live = live_verdict(live_node(host, snapshot))
    assert record(live_node(host, snapshot), out) == []
    return live, replayed_verdict(out)


@pytest.mark.parametrize("profile", [h100_profile, gb200_profile], ids=["h100", "gb200"])
def test_a_host_without_gpus_on_its_bus_replays_to_its_live_verdict(tmp_path, tools_on_path, profile):
    """Mock NVML's GPUs are on no PCI bus: the host's list holds nothing of NVIDIA's. A recording that left the list
    out made pcie_link UNKNOWN (pcie-sysfs-missing) and, on H100, fabric FAIL: a replay that could not tell
    whether NVSwitches are on the bus watched Fabric Manager as required, where live it only warns."""
    (live, live_code), (replayed, replayed_code) = record_and_replay(base_host(tmp_path), profile(), tmp_path / "rec")
    assert replayed == live
    assert replayed_code == live_code == 0
    if profile is h100_profile:
        assert live["fabric"][:2] == (Status.WARN.value, Action.MONITOR.name)
    assert (tmp_path / "rec" / DEV).is_dir()


RP, USP, DSP0, DSP1 = "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:17:01.0"
GPU0, NIC = "0000:19:00.0", "0000:1a:00.0"


def test_gpus_behind_a_pcie_switch_replay_with_the_switch(tmp_path, tools_on_path):
    """GPU 0 and a NIC behind a PCIe switch whose uplink trained at x8, under a root port that logged a fatal AER
    error: live, pcie_link warns of the uplink and pcie_aer of the port. The recording keeps the tree (each function
    where the kernel puts it) and the bridges above the devices, so the replay judges the same links."""
    host = base_host(tmp_path)
    pci_function(host, [RP], "0x8086", "0x060400", fatal=1)
    pci_function(host, [RP, USP], "0x1000", "0x060400", width="8")
    pci_function(host, [RP, USP, DSP0], "0x1000", "0x060400")
    pci_function(host, [RP, USP, DSP1], "0x1000", "0x060400")
    pci_function(host, [RP, USP, DSP0, GPU0], "0x10de", "0x030200", fatal=0)
    pci_function(host, [RP, USP, DSP1, NIC], "0x15b3", "0x020700", fatal=0)
    vf = pci_function(host, [RP, USP, DSP1, "0000:1a:01.2"], "0x15b3", "0x020700", width="0", max_width="0",
                      speed="Unknown", max_speed="Unknown")
    (vf / "physfn").symlink_to(f"../{NIC}")
    out = tmp_path / "rec"
    (live, live_code), (replayed, replayed_code) = record_and_replay(host, h100_profile(), out)
    assert live["pcie_link"][:2] == (Status.WARN.value, Action.MONITOR.name)
    assert ("pcie-downtrained", "warn", "MONITOR", USP) in live["pcie_link"][2]
    assert ("pcie-aer-uncorrectable-history", "warn", "MONITOR", RP) in live["pcie_aer"][2]
    assert replayed == live
    assert replayed_code == live_code
    assert os.readlink(out / DEV / GPU0) == os.readlink(host / DEV / GPU0)
    assert os.readlink(out / DEV / "0000:1a:01.2" / "physfn") == f"../{NIC}"

"""`gpuwarden record` through the recorded sources: what it writes, preflight reads back identically."""
import json
import tomllib

from conftest import NODES
from gpuwarden.agent import config
from gpuwarden.agent.node import Node
from gpuwarden.agent.record import record
from gpuwarden.agent.runner import run_checks
from gpuwarden.checks import ALL


QUICK = [spec for spec in ALL if spec.level == "quick"]  # full-level checks replay tools/, which record leaves out


def findings(root):
    results = run_checks(Node.recorded_at(root), QUICK, config.defaults(QUICK))
    return [(r.check, r.status, [f.to_dict() for f in r.findings]) for r in results]


def test_record_of_a_scenario_replays_to_the_same_verdict(tmp_path):
    src = NODES / "gb200-nvl72-faulty"
    out = tmp_path / "recorded"
    problems = record(Node.recorded_at(src), out)
    assert problems == []
    for name in ("node.toml", "nvml.json", "kmsg"):
        assert (out / name).is_file()
    assert (out / "sys/class/infiniband/mlx5_2/ports/1/state").read_text() == "1: DOWN\n"
    assert (out / "sys/class/infiniband/mlx5_2/device").is_symlink()
    assert (out / "proc/driver/nvidia/gpus/0018:01:00.0/information").exists()
    info = tomllib.loads((out / "node.toml").read_text())
    assert info["hostname"] == "gb200-rack07-tray11" and info["sku"] == "GB200-NVL72"
    assert info["versions"]["gpuwarden"] and info["recorded_at"].endswith("Z")
    # NVML: what the live path read is what was written (a lost GPU keeps only its error).
    snap = json.loads((out / "nvml.json").read_text())
    original = json.loads((src / "nvml.json").read_text())
    assert snap["gpus"][2] == {"index": 2, "errors": {"*": "GPU_IS_LOST"}}
    for key in ("ecc_errors", "remapped_rows", "row_remapper_histogram", "nvlinks", "fabric", "temperature"):
        assert snap["gpus"][1][key] == original["gpus"][1][key]
    assert findings(out) == findings(src)


def test_record_via_cli_writes_a_scenario_preflight_accepts(tmp_path):
    from gpuwarden.agent.cli import main

    out = tmp_path / "bundle"
    assert main(["record", "--root", str(NODES / "h100-hgx-healthy"), "--out", str(out)]) == 0
    assert main(["preflight", "--root", str(out), "--json"]) == 0


def test_live_record_and_preflight_on_this_machine(tmp_path):
    """The live paths (NVML, /sys, /dev/kmsg) on whatever this machine is. Without a GPU driver NVML's own
    error is recorded and replays as the same UNKNOWN; never as healthy."""
    import os

    from gpuwarden.agent.model import Status
    from gpuwarden.agent.sources.kmsg import DEV_KMSG

    live = Node.live()
    out = tmp_path / "bundle"
    problems = record(live, out)
    assert (out / "node.toml").exists() and (out / "nvml.json").exists()
    if os.access(DEV_KMSG, os.R_OK):
        assert (out / "kmsg").stat().st_size > 0
    live_results = {r.check: r for r in run_checks(Node.live(), ALL, config.defaults(ALL))}
    replayed = {r.check: r for r in run_checks(Node.recorded_at(out), ALL, config.defaults(ALL))}
    snap = json.loads((out / "nvml.json").read_text())
    if "nvmlInit" in snap.get("errors", {}):  # no usable driver here
        assert any(p.startswith("nvml:") for p in problems)
        for results in (live_results, replayed):
            assert results["ecc"].status is Status.UNKNOWN and "nvmlInit" in results["ecc"].error
    else:  # a GPU node: what was recorded judges the same as the live node
        assert [g["index"] for g in snap["gpus"]] == list(range(len(snap["gpus"])))
        assert replayed["ecc"].status == live_results["ecc"].status
    assert replayed["ib_port"].status == live_results["ib_port"].status

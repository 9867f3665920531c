"""Faults injected into copies of bundled scenarios: the agent keeps judging what it can and says what it
could not."""
import json

from gpuwarden.agent.core import config
from gpuwarden.agent.core.model import Status, verdict_exit_code
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.checks import ALL


def preflight(root):
    node = Node.recorded_at(root)
    return {r.check: r for r in run_checks(node, ALL, config.defaults(ALL))}


def test_unreadable_kmsg_makes_xid_unknown_not_ok(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    (root / "kmsg").unlink()
    (root / "kmsg").mkdir()  # exists but cannot be read as a file (root ignores permission bits)
    results = preflight(root)
    assert results["xid"].status is Status.UNKNOWN and "kmsg" in results["xid"].error
    assert results["ecc"].status is Status.OK  # the other checks still ran
    assert verdict_exit_code(results.values()) == 2


def test_missing_kmsg_is_unknown(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    (root / "kmsg").unlink()
    results = preflight(root)
    assert results["xid"].status is Status.UNKNOWN and "missing" in results["xid"].error


def test_gpu_lost_on_one_device_others_still_checked(scenario_copy):
    root = scenario_copy("h100-hgx-healthy")
    snap = json.loads((root / "nvml.json").read_text())
    snap["gpus"][5]["errors"] = {"*": "GPU_IS_LOST"}
    snap["gpus"][3]["errors"] = {"nvmlDeviceGetTotalEccErrors": "UNKNOWN"}
    snap["gpus"][6]["remapped_rows"]["pending"] = True
    (root / "nvml.json").write_text(json.dumps(snap))
    ecc = preflight(root)["ecc"]
    by_index = {f.entity.index: f for f in ecc.findings}
    assert sorted(by_index) == [3, 5, 6]
    assert by_index[5].code == "gpu-lost" and by_index[5].status is Status.FAIL
    assert by_index[5].entity.pci  # identity recovered from sysfs even though NVML cannot open the GPU
    assert by_index[3].code == "nvml-error" and by_index[3].status is Status.UNKNOWN
    assert "ECC errors, volatile corrected" in by_index[3].message  # the count NVML failed to read
    assert by_index[6].code == "row-remap-pending"  # GPU 6 was still judged after 3 and 5 failed
    assert ecc.status is Status.FAIL


def test_nvml_unusable_makes_nvml_checks_unknown(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "nvml.json").write_text("{ not json")
    results = preflight(root)
    assert results["ecc"].status is Status.UNKNOWN and "nvml.json" in results["ecc"].error
    assert results["ib_port"].status is Status.OK


def test_malformed_node_toml_names_the_key(scenario_copy):
    import pytest
    from gpuwarden.agent.core.errors import ConfigError

    root = scenario_copy("gb200-nvl72-healthy")
    toml = root / "node.toml"
    toml.write_text('hostnme = "typo"\n' + toml.read_text())
    with pytest.raises(ConfigError, match="hostnme"):
        Node.recorded_at(root)


def test_empty_kmsg_is_unknown_not_ok(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "kmsg").write_text("")
    xid = preflight(root)["xid"]
    assert xid.status is Status.UNKNOWN and "holds no record" in xid.error


def test_malformed_kmsg_lines_do_not_stop_the_check(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")
    with open(root / "kmsg", "a") as f:
        f.write("6,99999,12\n")  # a record cut off mid-header
    xid = preflight(root)["xid"]
    assert xid.status is Status.FAIL and [f.code for f in xid.findings] == ["79"]  # the 63 (information) aged out


def test_node_toml_types_are_checked(scenario_copy):
    import pytest
    from gpuwarden.agent.core.errors import ConfigError

    root = scenario_copy("gb200-nvl72-healthy")
    toml = root / "node.toml"
    text = toml.read_text()
    toml.write_text(text.replace('rack = "rack07"', "rack = 7"))
    with pytest.raises(ConfigError, match="'rack' must be a string"):
        Node.recorded_at(root)
    toml.write_text(text.replace('sku = "GB200-NVL72"', 'sku = "GB200"'))
    with pytest.raises(ConfigError, match="sku 'GB200' is not one of"):
        Node.recorded_at(root)


def test_daemon_only_faults_fail_preflight_too(scenario_copy):
    """A health check built on preflight must see what the daemon sees at its first poll: an NVLink down and an
    unhealthy fabric route are judged in one look by the daemon's own decision (agent/core/passive.py one_look)."""
    from conftest import edit_nvml

    root = scenario_copy("gb200-nvl72-healthy")

    def break_gpu1(data):
        data["gpus"][1]["nvlinks"][5]["state"] = 0
        data["gpus"][1]["fabric"]["health_mask"] = 1 << 4  # route unhealthy

    edit_nvml(root, break_gpu1)
    results = preflight(root)
    (down,) = [f for f in results["nvlink_lanes"].findings if f.status is Status.FAIL]
    assert (down.entity.index, down.entity.link) == (1, 5)
    assert any(f.status is Status.FAIL and f.entity.index == 1 for f in results["fabric"].findings)


# ---------------------------------------------------------------- a scenario cannot read outside itself
SECRET = "s3cr3t-ssh-key-material"


def outside_secret(tmp_path):
    """A 0600 file beside (not inside) the scenario, as a private key on the machine that replays a bundle."""
    secret = tmp_path / "outside" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text(f"4: ACTIVE {SECRET}\n")
    secret.chmod(0o600)
    return secret


def cli_preflight(root, *args):
    import contextlib
    import io

    from gpuwarden.agent.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["preflight", "--root", str(root), "--json", *args])
    return code, out.getvalue() + err.getvalue()


def test_a_symlink_in_sys_to_a_file_outside_is_refused_and_its_content_never_shown(scenario_copy, tmp_path):
    root = scenario_copy("h100-hgx-healthy")
    secret = outside_secret(tmp_path)
    state = root / "sys/class/infiniband/mlx5_5/ports/1/state"
    state.unlink()
    state.symlink_to(secret)
    code, text = cli_preflight(root, "--checks", "ib_port")
    assert SECRET not in text and code == 2
    (f,) = json.loads(text)["findings"]
    assert (f["entity"]["id"], f["code"], f["status"]) == ("mlx5_5/1", "ib-port-unreadable", "unknown")
    assert f"{state}: resolves outside the recorded node" in f["message"]
    # A folder that leads outside is not even listed: the check says it could not look.
    state.unlink()
    (root / "sys/class/infiniband/mlx5_7/ports").rename(root / "ports-aside")
    (root / "sys/class/infiniband/mlx5_7/ports").symlink_to(secret.parent)
    code, text = cli_preflight(root, "--checks", "ib_port")
    assert "id_rsa" not in text and code == 2
    (result,) = json.loads(text)["results"]
    assert result["status"] == "unknown" and "mlx5_7/ports: resolves outside the recorded node" in result["error"]


def test_kmsg_nvml_json_and_tool_outputs_that_lead_outside_are_refused(scenario_copy, tmp_path):
    root = scenario_copy("h100-hgx-healthy", with_tools=True)
    secret = outside_secret(tmp_path)
    for name in ("kmsg", "nvml.json", "tools/nvidia-smi-topo-m.out", "tools/dcgmi-diag-r2.out"):
        (root / name).unlink()
        (root / name).symlink_to(secret)
    code, text = cli_preflight(root, "--level", "full")
    assert SECRET not in text
    results = {r["check"]: r for r in json.loads(text)["results"]}
    assert results["xid"]["status"] == "unknown" and "resolves outside" in results["xid"]["error"]
    assert results["ecc"]["status"] == "unknown" and "resolves outside" in results["ecc"]["error"]
    assert "resolves outside" in json.dumps(results["dcgm_diag"]) and results["dcgm_diag"]["status"] == "unknown"
    assert code == 2


def test_links_inside_the_scenario_still_work(scenario_copy):
    """A recording's own links (an HCA's device -> ../../../bus/pci/devices/...) resolve inside: read as before."""
    root = scenario_copy("h100-hgx-healthy")
    (root / "sys/class/infiniband/mlx5_5/ports/1/state").unlink()
    (root / "sys/class/infiniband/mlx5_5/ports/1/state").symlink_to("../../../mlx5_4/ports/1/state")
    results = preflight(root)
    assert results["ib_port"].status is Status.OK

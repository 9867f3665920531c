"""rdma_loopback: decisions on real perftest outputs, recorded scenarios (pass, each fail, tool missing, hang,
garbage) built from a copy of a bundled scenario, the analyzer, and the live server/client orchestration of
agent/sources/perftest.py against a stand-in ib_write_bw (and the real one where perftest is installed)."""
from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import ToolError, ToolMissing
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.runner import run_one
from gpuwarden.agent.sources.perftest import loopback_pair, tool_name
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.agent.sources.tools import ToolRunner
from gpuwarden.checks import rdma_loopback
from gpuwarden.checks.parse_perftest import parse_perftest

PERFTEST = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "perftest"
AMD_CLIENT = (PERFTEST / "amd-pollara__ib_write_bw-b-a-q4__CLIENT.txt").read_text()  # -b, 779.21 Gb/s
NV_CLIENT = (PERFTEST / "nvidia-gpu-operator-docs__ib_write_bw-a__client__GPUDirect-RoCE__use_cuda_dmabuf.txt"
             ).read_text()  # 92.46 Gb/s best average, unidirectional
NO_DEVICE = (PERFTEST / "local__ib_write_bw-D5__client__no-RDMA-device__rc1.txt").read_text()
LAT = (PERFTEST / "spiderpool__ib_read_lat__client__RoCE-pod__cpu-freq-warnings-interleaved.txt").read_text()
# A work-completion error, in perftest's own message formats (src/perftest_resources.c "Failed status %d: wr_id %d
# syndrom 0x%x", write_bw.c " Failed to complete run_iter_bw function successfully"); hand-assembled.
WC_ERROR = (" Failed status 12: wr_id 0 syndrom 0x81\nscnt=128, ccnt=0\n"
            " Failed to complete run_iter_bw function successfully\n")
POLICY = {**rdma_loopback.CHECK.defaults, "ignore_ports": []}  # ignore_ports: [checks.ib_port]
PORT = Entity("ib_port", "mlx5_0/1", pci="0000:03:00.0")
PORTS = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]  # gb200-nvl72-healthy: four 400 Gb/s NDR ports, all ACTIVE


def decide(text, rc=0, rate=400.0, policy=POLICY, server=None):
    run = parse_perftest(text, "t")
    return rdma_loopback.decide(PORT, run, text, rc, rate, policy, server)


def codes(findings):
    return [(f.code, f.status, f.action) for f in findings]


# -- decide -------------------------------------------------------------------------------------------------------
def test_bidirectional_run_is_judged_against_twice_the_rate():
    assert decide(AMD_CLIENT, rate=400.0) == []  # 779.21 of 800 = 97 %
    (f,) = decide(AMD_CLIENT, rate=800.0)
    assert (f.code, f.status, f.action) == ("rdma-loopback-bw-low", Status.FAIL, Action.DRAIN)
    assert f.evidence["expected_gbps"] == 1600.0 and f.evidence["bidirectional"] is True


def test_low_bandwidth_fails_with_measured_expected_and_fraction():
    (f,) = decide(NV_CLIENT, rate=400.0)
    assert codes([f]) == [("rdma-loopback-bw-low", Status.FAIL, Action.DRAIN)]
    assert f.evidence["measured_gbps"] == 92.46 and f.evidence["expected_gbps"] == 400.0
    assert f.evidence["fraction"] == 0.231 and f.evidence["min_fraction"] == 0.9
    assert "mlx5_0/1" in f.message and "92.5 Gb/s" in f.message
    assert decide(NV_CLIENT, rate=100.0) == []  # the 100 Gb/s RoCE port it was measured on: 92 %
    assert codes(decide(NV_CLIENT, rate=100.0, policy={**POLICY, "min_fraction": 0.95})) == [
        ("rdma-loopback-bw-low", Status.FAIL, Action.DRAIN)]


def test_unknown_rate_and_latency_runs_are_unknown_not_ok():
    (f,) = decide(NV_CLIENT, rate=None)
    assert (f.code, f.status) == ("rdma-loopback-rate-unknown", Status.UNKNOWN) and f.evidence["measured_gbps"] == 92.46
    (f,) = decide(LAT)
    assert (f.code, f.status) == ("rdma-loopback-no-result", Status.UNKNOWN) and "RDMA_Read Latency" in f.message


def test_environment_failure_is_unknown_and_hardware_failure_fails():
    (env,) = decide(NO_DEVICE, rc=1)
    assert codes([env]) == [("rdma-loopback-not-run", Status.UNKNOWN, Action.NONE)]
    assert env.evidence["error"] == "Unable to find the Infiniband/RoCE device"
    (hw,) = decide(WC_ERROR, rc=1, server=" Failed to exchange data between server and clients\n")
    assert codes([hw]) == [("rdma-loopback-failed", Status.FAIL, Action.DRAIN)]
    assert "Failed to complete run_iter_bw function successfully" in hw.message
    assert hw.evidence["server_error"] == "Failed to exchange data between server and clients"
    (broken,) = rdma_loopback.decide(PORT, None, "ib_write_bw: error while loading shared libraries: libibverbs.so.1:"
                                     " cannot open shared object file: No such file or directory\n", 127, 400.0,
                                     POLICY)
    assert (broken.code, broken.status) == ("rdma-loopback-not-run", Status.UNKNOWN)


def test_error_lines_without_a_result_fail_even_with_exit_status_zero():
    (f,) = decide(WC_ERROR, rc=0)
    assert f.code == "rdma-loopback-failed"


def test_client_args():
    cfg = {**POLICY, "roce_gid_index": 3}
    assert rdma_loopback.client_args("mlx5_0", "1", "InfiniBand", None, cfg) == [
        "-d", "mlx5_0", "-i", "1", "--report_gbits", "-F", "-s", "1048576", "-D", "5"]
    assert rdma_loopback.client_args("mlx5_bond_0", "1", "Ethernet", 2, cfg)[-3:] == ["-x", "3", "--use_cuda=2"]


# -- recorded scenarios ---------------------------------------------------------------------------------------------
@pytest.fixture
def node_dir(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "tools").mkdir(exist_ok=True)
    return root


def record(root: Path, hca: str, text: str, rc: int | None = None, suffix: str = "") -> None:
    base = root / "tools" / (tool_name(hca, 1) + suffix)
    base.with_name(base.name + ".out").write_text(text)
    if rc is not None:
        base.with_name(base.name + ".rc").write_text(f"{rc}\n")


def result(root: Path, **cfg):
    return run_one(rdma_loopback.CHECK, Node.recorded_at(root), {**POLICY, **cfg}, timeout_s=30)


def test_scenario_pass(node_dir):
    for hca in PORTS:
        record(node_dir, hca, AMD_CLIENT)
    res = result(node_dir)
    assert (res.status, res.findings, res.error) == (Status.OK, (), None)


def test_scenario_low_bandwidth_on_one_port(node_dir):
    for hca in PORTS:
        record(node_dir, hca, NV_CLIENT if hca == "mlx5_2" else AMD_CLIENT)
    res = result(node_dir)
    (f,) = res.findings
    assert res.status is Status.FAIL and f.entity == Entity("ib_port", "mlx5_2/1", pci="0010:03:00.0")
    assert f.code == "rdma-loopback-bw-low" and f.evidence["rate_gbps"] == 400.0


def test_scenario_port_rate_comes_from_sysfs(node_dir):
    for hca in PORTS:
        record(node_dir, hca, NV_CLIENT)
        (node_dir / f"sys/class/infiniband/{hca}/ports/1/rate").write_text("100 Gb/sec (4X EDR)\n")
    assert result(node_dir).status is Status.OK


def test_scenario_client_failures(node_dir):
    record(node_dir, "mlx5_0", AMD_CLIENT)
    record(node_dir, "mlx5_1", WC_ERROR, rc=1)
    record(node_dir, "mlx5_1", " Failed to exchange data between server and clients\n", rc=1, suffix="-server")
    record(node_dir, "mlx5_2", NO_DEVICE, rc=1)
    record(node_dir, "mlx5_3", "\x00\x17 segfault?\n random bytes \x7f\n")  # garbage, exit 0
    res = result(node_dir)
    by = {f.entity.id: f for f in res.findings}
    assert res.status is Status.FAIL and set(by) == {"mlx5_1/1", "mlx5_2/1", "mlx5_3/1"}
    assert (by["mlx5_1/1"].code, by["mlx5_1/1"].action) == ("rdma-loopback-failed", Action.DRAIN)
    assert "server: Failed to exchange data" in by["mlx5_1/1"].message
    assert (by["mlx5_2/1"].code, by["mlx5_2/1"].status) == ("rdma-loopback-not-run", Status.UNKNOWN)
    assert (by["mlx5_3/1"].code, by["mlx5_3/1"].status) == ("rdma-loopback-no-result", Status.UNKNOWN)


def test_scenario_tool_hang_is_unknown_for_that_port(node_dir):
    for hca in PORTS:
        record(node_dir, hca, AMD_CLIENT)
    (node_dir / "tools" / (tool_name("mlx5_1", 1) + ".hang")).write_text("")
    res = result(node_dir, tool_timeout_s=0.2)
    (f,) = res.findings
    assert res.status is Status.UNKNOWN and f.entity.id == "mlx5_1/1" and f.code == "rdma-loopback-not-run"
    assert "no answer within 0.2s" in f.message


def test_scenario_tool_missing_is_skipped(node_dir):
    res = result(node_dir)
    assert res.status is Status.SKIPPED and "ib_write_bw" in res.error


def test_scenario_without_rdma_device_or_active_port_is_skipped(node_dir):
    for hca in PORTS:
        (node_dir / f"sys/class/infiniband/{hca}/ports/1/state").write_text("1: DOWN\n")
    res = result(node_dir)
    assert res.status is Status.SKIPPED and "no active RDMA port" in res.error
    shutil.rmtree(node_dir / "sys/class/infiniband")
    assert result(node_dir).status is Status.SKIPPED


def test_scenario_ignored_ports_are_not_run(node_dir):
    record(node_dir, "mlx5_0", NV_CLIENT)
    res = result(node_dir, ignore_ports=["mlx5_1/1", "mlx5_2/1", "mlx5_3/1"])
    assert [f.entity.id for f in res.findings] == ["mlx5_0/1"]


def test_scenario_unreadable_port_is_unknown(node_dir):
    for hca in PORTS:
        record(node_dir, hca, AMD_CLIENT)
    (node_dir / "sys/class/infiniband/mlx5_3/ports/1/state").unlink()
    res = result(node_dir)
    (f,) = res.findings
    assert res.status is Status.UNKNOWN and f.check == "rdma_loopback" and f.entity.id == "mlx5_3/1"


def test_bad_min_fraction_is_a_config_error(node_dir):
    res = result(node_dir, min_fraction=90.0)
    assert res.status is Status.UNKNOWN and "min_fraction" in res.error


# -- the GPU nearest an HCA (for --use_cuda) ----------------------------------------------------------------------
class Gpu:
    def __init__(self, index, pci):
        self.index, self.pci = index, pci


class TreeNode:
    def __init__(self, root, gpus):
        self.sysfs, self._gpus = Sysfs(root), gpus

    def gpus(self):
        return self._gpus


def nested_device(root: Path, *chain: str) -> None:
    """sys/devices/pci0000:15/<chain...> and the /sys/bus/pci/devices/<last> link into it, as real sysfs has."""
    path = root / "sys/devices/pci0000:15" / Path(*chain)
    path.mkdir(parents=True, exist_ok=True)
    link = root / "sys/bus/pci/devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(path, link.parent))


def test_nearest_gpu_shares_the_pcie_switch(tmp_path):
    nested_device(tmp_path, "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")  # GPU 0, switch A
    nested_device(tmp_path, "0000:15:02.0", "0000:26:00.0", "0000:27:00.0", "0000:28:00.0")  # GPU 1, switch B
    nested_device(tmp_path, "0000:15:02.0", "0000:26:00.0", "0000:27:01.0", "0000:29:00.0")  # HCA on switch B
    node = TreeNode(tmp_path, [Gpu(0, "0000:18:00.0"), Gpu(1, "0000:28:00.0")])
    assert rdma_loopback.nearest_gpu_index(node, "0000:29:00.0") == 1
    assert rdma_loopback.nearest_gpu_index(node, None) == 0
    flat = TreeNode(Path(__file__).resolve().parent.parent / "fixtures/nodes/h100-hgx-healthy",
                    [Gpu(3, "0000:5d:00.0")])
    assert rdma_loopback.nearest_gpu_index(flat, "0000:5e:00.0") == 0  # flat capture: no path, GPU 0


# -- analyze --------------------------------------------------------------------------------------------------------
def test_analyzer_detects_perftest_outputs_and_reports_the_same_findings():
    (an,) = rdma_loopback.CHECK.analyzers
    for path in PERFTEST.glob("*.txt"):
        text = path.read_text()
        if path.name.endswith(".source.txt"):
            continue
        assert an.detect(text), path.name
        findings, errors = an.analyze(text, path.name)
        assert errors == [] and findings == rdma_loopback.decide(
            findings[0].entity, parse_perftest(text, path.name), text, 0, None, POLICY)
    assert not an.detect("[  12.345] NVRM: Xid (PCI:0000:91:00): 79, GPU has fallen off the bus.\n")
    findings, _ = an.analyze(NV_CLIENT, "nv.txt")
    assert [(f.code, f.status, f.entity.id) for f in findings] == [
        ("rdma-loopback-rate-unknown", Status.UNKNOWN, "mlx5_0")]


def test_gpuwarden_analyze_reads_a_perftest_file(tmp_path):
    from gpuwarden.agent.cli.analyze import analyze_file
    from gpuwarden.checks import by_name

    assert "rdma_loopback" in by_name()
    path = tmp_path / "ib_write_bw.out"
    path.write_text(WC_ERROR)
    res = analyze_file(path)
    assert res.check == "rdma_loopback" and [f.code for f in res.findings] == ["rdma-loopback-failed"]


# -- live orchestration -----------------------------------------------------------------------------------------------
FAKE = r'''#!PYTHON
"""Stand-in ib_write_bw: a server (no host argument) or a client (last argument "localhost")."""
import os, sys, time
state = os.environ["FAKE_PERFTEST_DIR"]
if sys.argv[-1] != "localhost":
    open(os.path.join(state, "server.pid"), "w").write(str(os.getpid()))
    time.sleep(float(os.environ.get("FAKE_LISTEN_AFTER_S", "0")))
    open(os.path.join(state, "listening"), "w").close()
    print("* Waiting for client to connect... *", flush=True)
    time.sleep(float(os.environ.get("FAKE_SERVER_S", "60")))
    sys.exit(0)
with open(os.path.join(state, "clients"), "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
if not os.path.exists(os.path.join(state, "listening")):
    print("Couldn't connect to localhost:%s" % sys.argv[sys.argv.index("-p") + 1])
    print(" Unable to open file descriptor for socket connection Unable to init the socket connection")
    sys.exit(1)
time.sleep(float(os.environ.get("FAKE_CLIENT_S", "0")))
sys.stdout.write(open(os.environ["FAKE_CLIENT_OUT"]).read())
'''


@pytest.fixture
def fake_perftest(tmp_path, monkeypatch):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    exe = bin_dir / "ib_write_bw"
    exe.write_text(FAKE.replace("PYTHON", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "client.out"
    out.write_text(NV_CLIENT)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_PERFTEST_DIR", str(state))
    monkeypatch.setenv("FAKE_CLIENT_OUT", str(out))
    return state


def server_gone(state: Path) -> bool:
    pid = int((state / "server.pid").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_live_client_retries_until_the_server_listens_and_the_server_is_stopped(fake_perftest, monkeypatch):
    monkeypatch.setenv("FAKE_LISTEN_AFTER_S", "0.6")
    start = time.monotonic()
    out = loopback_pair(ToolRunner(), "mlx5_0", 1, ["-d", "mlx5_0", "-i", "1"], 20, attempts=20, startup_s=0.1,
                        retry_delay_s=0.2, server_grace_s=0.3)
    assert out.client.returncode == 0 and out.client.output == NV_CLIENT and out.attempts >= 2
    clients = (fake_perftest / "clients").read_text().splitlines()
    port = out.server.argv[out.server.argv.index("-p") + 1]
    assert clients[-1] == f"-d mlx5_0 -i 1 -p {port} localhost"  # same port for server and client
    assert "Waiting for client to connect" in out.server.output
    assert server_gone(fake_perftest) and time.monotonic() - start < 10


def test_live_client_hang_raises_tool_error_and_kills_the_server(fake_perftest, monkeypatch):
    monkeypatch.setenv("FAKE_CLIENT_S", "60")
    with pytest.raises(ToolError, match="no answer within"):
        loopback_pair(ToolRunner(), "mlx5_0", 1, ["-d", "mlx5_0"], 1.5, startup_s=0.3)
    assert server_gone(fake_perftest)


def test_live_gives_up_after_the_attempts(fake_perftest, monkeypatch):
    monkeypatch.setenv("FAKE_LISTEN_AFTER_S", "60")
    out = loopback_pair(ToolRunner(), "mlx5_0", 1, ["-d", "mlx5_0"], 20, attempts=3, startup_s=0.0,
                        retry_delay_s=0.05)
    assert out.attempts == 3 and out.client.returncode == 1 and server_gone(fake_perftest)
    (f,) = rdma_loopback.decide(PORT, parse_perftest(out.client.output, "c"), out.client.output, 1, 400.0, POLICY)
    assert f.code == "rdma-loopback-not-run"  # our side channel, not the port


def test_live_without_perftest_is_tool_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissing, match="ib_write_bw"):
        loopback_pair(ToolRunner(), "mlx5_0", 1, ["-d", "mlx5_0"], 5)


@pytest.mark.skipif(shutil.which("ib_write_bw") is None, reason="perftest is not installed")
def test_live_real_perftest_without_rdma_device_is_not_run():
    if Path("/sys/class/infiniband").exists() and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    args = rdma_loopback.client_args("mlx5_0", "1", "InfiniBand", None, POLICY)
    out = loopback_pair(ToolRunner(), "mlx5_0", 1, args, 30)
    assert out.client.returncode != 0 and out.server.returncode not in (None, 0)
    (f,) = rdma_loopback.decide(PORT, parse_perftest(out.client.output, "c"), out.client.output,
                                out.client.returncode, 400.0, POLICY, out.server.output)
    assert (f.code, f.status) == ("rdma-loopback-not-run", Status.UNKNOWN)
    assert "Unable to find the Infiniband/RoCE device" in f.message

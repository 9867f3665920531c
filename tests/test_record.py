"""`gpuwarden record` through the recorded sources: what it writes, preflight reads back identically (tool outputs
included: a live tool is a stub on PATH)."""
import contextlib
import io
import json
import shutil
import subprocess
import time
import tomllib
from types import SimpleNamespace

import pytest
from conftest import NODES, ROOT, edit_nvml
from gpuwarden.agent.core import config
from gpuwarden.agent.core.errors import ConfigError, NvmlError, SourceError
from gpuwarden.agent.core.model import Status
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.record import record
from gpuwarden.agent.node.record_tools import _nvlink_after, capture_full
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.agent.sources.dcgm import Dcgm
from gpuwarden.agent.sources.gemm import Gemm, GemmResult
from gpuwarden.agent.sources.tools import ToolRunner
from gpuwarden.checks import ALL, all_specs, burnin, pcie_link
from gpuwarden.checks.fabric_manager import read_fabric_manager

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
    from gpuwarden.agent.cli.main import main

    out = tmp_path / "bundle"
    assert main(["record", "--root", str(NODES / "h100-hgx-healthy"), "--out", str(out)]) == 0
    assert main(["preflight", "--root", str(out), "--json"]) == 0


def test_live_record_and_preflight_on_this_machine(tmp_path):
    """The live paths (NVML, /sys, /dev/kmsg) on whatever this machine is. Without a GPU driver NVML's own
    error is recorded and replays as the same UNKNOWN; never as healthy."""
    import os

    from gpuwarden.agent.core.model import Status
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


# ---------------------------------------------------------------- tools/, proc/<pid>, xid_events
SCENARIOS = ("h100-hgx-healthy", "gb200-nvl72-healthy", "gb200-nvl72-faulty")
HOST = [(1, "systemd", ["/sbin/init"]), (2, "kthreadd", []), (733, "sshd", ["/usr/sbin/sshd", "-D"])]
FM = (48213, "nv-fabricmanager", ["nv-fabricmanager", "-c", "/usr/share/nvidia/nvswitch/fabricmanager.cfg"])
# A start script has Fabric Manager's 15-character comm but runs under its interpreter: not FM.
FM_SCRIPT = (48100, "nv-fabricmanager-start.sh", ["/bin/bash", "/usr/bin/nv-fabricmanager-start.sh"])
SLEEP, CAT = shutil.which("sleep"), shutil.which("cat")


def verdict(root, specs=ALL, check_timeout_s=0.0):
    cfg = config.defaults(specs)
    cfg.agent["check_timeout_s"] = check_timeout_s
    return [(r.check, r.status, r.error, [f.to_dict() for f in r.findings])
            for r in run_checks(Node.recorded_at(root), specs, cfg)]


def write_processes(root, processes):
    """proc/<pid>/comm (the kernel keeps 15 characters) and cmdline (each argument followed by a NUL)."""
    for pid, name, argv in processes:
        d = root / "proc" / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "comm").write_text(name[:15] + "\n")
        (d / "cmdline").write_text("".join(a + "\0" for a in argv))
    return root


def with_live_tools(node):
    """A recorded node whose external tools run live (found on PATH), as on a real node."""
    node.tools = ToolRunner()
    node.dcgm = Dcgm(node.tools)
    return node


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """PATH holding only the stub tools a test writes: fake_bin(name, shell body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))

    def add(name, body):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    return add


@pytest.mark.parametrize("name", SCENARIOS)
def test_rerecording_with_tools_replays_every_check_the_same(scenario_copy, tmp_path, name):
    src = scenario_copy(name, with_tools=True)
    out = tmp_path / "rerecorded"
    assert record(Node.recorded_at(src), out, with_tools=True) == []
    assert verdict(out) == verdict(src)  # every check, full level included, finding for finding
    recorded = {p.name for p in (out / "tools").iterdir()}
    original = {p.name for p in (src / "tools").iterdir()}
    explicit_rc = {p.replace(".out", ".rc") for p in original if p.endswith(".out")}  # an absent .rc reads as 0
    assert recorded - original <= explicit_rc
    # What a check did not run is not recorded: no all-reduce while a GPU is lost.
    unused = {"all_reduce_perf.out", "all_reduce_perf.rc"} if name == "gb200-nvl72-faulty" else set()
    assert original - recorded == unused
    for p in (src / "tools").iterdir():
        if p.name not in unused:
            assert (out / "tools" / p.name).read_bytes() == p.read_bytes()


def test_record_cli_with_tools_gives_the_same_full_preflight_exit(tmp_path):
    from gpuwarden.agent.cli.main import main

    def preflight_full(root, code):
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            assert main(["preflight", "--root", str(root), "--level", "full", "--json"]) == code
        return [(r["check"], r["status"]) for r in json.loads(stdout.getvalue())["results"]]

    for name, code in (("h100-hgx-healthy", 0), ("gb200-nvl72-faulty", 1)):
        out = tmp_path / name
        assert main(["record", "--root", str(NODES / name), "--out", str(out), "--with-tools"]) == 0
        assert preflight_full(out, code) == preflight_full(NODES / name, code)


def test_without_tools_only_the_cheap_tools_are_recorded(scenario_copy, tmp_path):
    out = tmp_path / "rerecorded"
    assert record(Node.recorded_at(scenario_copy("h100-hgx-healthy", with_tools=True)), out) == []
    assert sorted(p.name for p in (out / "tools").iterdir()) == [
        "nvidia-smi-topo-m.out", "nvidia-smi-topo-m.rc", "systemctl-fabricmanager.out", "systemctl-fabricmanager.rc"]
    quick = [spec for spec in ALL if spec.level == "quick"]
    assert verdict(out, quick) == verdict(NODES / "h100-hgx-healthy", quick)  # pcie_link's affinity included


def test_recorded_hangs_are_rerecorded_as_hangs_without_waiting(scenario_copy, tmp_path):
    src = scenario_copy("h100-hgx-healthy", with_tools=True)
    for tool in ("dcgmi-diag-r2", "nvidia-smi-topo-m"):
        for suffix in (".out", ".rc"):
            (src / "tools" / f"{tool}{suffix}").unlink()
        (src / "tools" / f"{tool}.hang").write_text("")
    (src / "tools" / "burnin.json").unlink()
    (src / "tools" / "burnin.hang").write_text("")
    out = tmp_path / "rerecorded"
    start = time.monotonic()
    record(Node.recorded_at(src), out, with_tools=True)
    assert time.monotonic() - start < 20  # neither the tools' timeouts (870 s, 20 s) nor burn-in's hour
    tools = {p.name for p in (out / "tools").iterdir()}
    assert {"dcgmi-diag-r2.hang", "nvidia-smi-topo-m.hang", "burnin.hang"} <= tools
    assert not {"dcgmi-diag-r2.out", "dcgmi-diag-r2.rc", "nvidia-smi-topo-m.out", "burnin.json"} & tools
    specs = [s for s in ALL if s.name in ("dcgm_diag", "burnin")]
    replayed = verdict(out, specs, check_timeout_s=0.3)
    assert replayed == verdict(src, specs, check_timeout_s=0.3)
    assert [(c, s) for c, s, *_ in replayed] == [("burnin", Status.UNKNOWN), ("dcgm_diag", Status.UNKNOWN)]


def test_cheap_tools_run_live_are_recorded_and_replay_the_same(scenario_copy, tmp_path, fake_bin):
    topo = NODES / "h100-hgx-healthy" / "tools" / "nvidia-smi-topo-m.out"
    fake_bin("nvidia-smi", f'[ "$*" = "topo -m" ] || exit 64\nexec {CAT} {topo}')
    fake_bin("systemctl", '[ "$*" = "is-active nvidia-fabricmanager" ] || exit 64\necho inactive\nexit 3')
    src = write_processes(scenario_copy("h100-hgx-healthy"), [*HOST, FM])
    live = with_live_tools(Node.recorded_at(src))
    out = tmp_path / "recorded"
    assert record(live, out) == []
    tools = out / "tools"
    assert (tools / "nvidia-smi-topo-m.out").read_text() == topo.read_text()
    assert (tools / "nvidia-smi-topo-m.rc").read_text() == "0\n"
    assert (tools / "systemctl-fabricmanager.out").read_text() == "inactive\n"
    assert (tools / "systemctl-fabricmanager.rc").read_text() == "3\n"
    specs = [pcie_link.CHECK]
    (live_result,) = run_checks(live, specs, config.defaults(specs))
    assert verdict(out, specs) == [(live_result.check, live_result.status, live_result.error,
                                    [f.to_dict() for f in live_result.findings])]
    first = read_fabric_manager(live, 1.0)  # a node's first look (a later one may answer from the process it saw)
    assert read_fabric_manager(Node.recorded_at(out), 1.0) == first and first.unit == "inactive"


def test_missing_tool_is_recorded_as_missing_and_replays_as_missing(scenario_copy, tmp_path, fake_bin):
    fake_bin("systemctl", "echo active")  # and no nvidia-smi on PATH
    live = with_live_tools(Node.recorded_at(scenario_copy("h100-hgx-healthy")))
    out = tmp_path / "recorded"
    shutil.copytree(NODES / "h100-hgx-healthy", out)  # an earlier recording, with an output this run will not have
    (out / "tools" / "nvidia-smi-topo-m.out").write_text("stale output of an earlier recording\n")
    assert record(live, out) == []
    assert sorted(p.name for p in (out / "tools").iterdir()) == ["systemctl-fabricmanager.out",
                                                                 "systemctl-fabricmanager.rc"]
    specs = [pcie_link.CHECK]
    (live_result,) = run_checks(live, specs, config.defaults(specs))
    ((_, status, _, found),) = verdict(out, specs)
    assert status == live_result.status
    affinity = [f for f in found if f["code"].startswith("pcie-affinity")]
    assert [f["code"] for f in affinity] == [f.code for f in live_result.findings if f.code.startswith("pcie-aff")]
    assert "not installed" in affinity[0]["message"]


def test_tool_killed_at_its_timeout_is_recorded_as_a_hang(scenario_copy, tmp_path, fake_bin):
    fake_bin("systemctl", f"exec {SLEEP} 5")
    live = with_live_tools(Node.recorded_at(scenario_copy("h100-hgx-healthy")))
    cfg = config.defaults(all_specs())
    cfg.checks["fabric"]["tool_timeout_s"] = 0.3
    out = tmp_path / "recorded"
    record(live, out, cfg)
    assert (out / "tools" / "systemctl-fabricmanager.hang").read_text() == ""
    assert not (out / "tools" / "systemctl-fabricmanager.out").exists()
    replayed = read_fabric_manager(Node.recorded_at(out), 0.3)
    assert replayed.unit is None and "no answer within 0.3s" in replayed.unit_error


def test_tool_still_running_when_its_check_timed_out_is_recorded_as_a_hang(scenario_copy, tmp_path, fake_bin):
    fake_bin("dcgmi", f"exec {SLEEP} 3")
    src = scenario_copy("h100-hgx-healthy")
    live = with_live_tools(Node.recorded_at(src))
    cfg = config.defaults(all_specs())
    cfg.agent["check_timeout_s"] = 0.3
    out = tmp_path / "recorded"
    out.mkdir()
    problems = capture_full(live, out, cfg)
    tools = sorted(p.name for p in (out / "tools").iterdir())
    # burnin has no recorded GEMM here, so it asks DCGM's targeted_stress: three dcgmi runs, each cut short.
    assert tools == ["dcgmi-diag-memory.hang", "dcgmi-diag-r2.hang", "dcgmi-diag-targeted_stress.hang"]
    assert sum("recorded as a hang" in p for p in problems) == 3
    time.sleep(3)  # the stubs end now; a late answer must not change the recording
    assert sorted(p.name for p in (out / "tools").iterdir()) == tools


def test_budget_leaves_checks_not_started_unrecorded(scenario_copy, tmp_path):
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy", with_tools=True))
    out = tmp_path / "recorded"
    out.mkdir()
    problems = capture_full(node, out, config.defaults(all_specs()), budget_s=0)
    assert len(problems) == len([s for s in ALL if s.level == "full"])
    assert all("not run" in p and "not recorded" in p for p in problems)
    assert not (out / "tools").exists()


class FakeTorch(Gemm):
    """Live torch as seen by the burn-in, without a GPU: CUDA numbers the GPUs in reverse of NVML's order."""

    def __init__(self):
        super().__init__(None)

    def why_unavailable(self, device="cuda"):
        return ""

    def cuda_device(self, gpu):
        return f"cuda:{7 - gpu.index}"

    def run(self, devices, n, dtype, seconds, seed, parallel=True):
        return {d: SourceError(f"{d}: GEMM failed: RuntimeError: CUDA error: an illegal memory access")
                if d == "cuda:7" else GemmResult(d, 700.0, 40, "ab" * 32, "NVIDIA H100 80GB HBM3", 132)
                for d in devices}


def test_live_burnin_is_recorded_by_nvml_index(scenario_copy, tmp_path):
    src = scenario_copy("h100-hgx-healthy")
    out = tmp_path / "recorded"
    out.mkdir()
    capture_full(Node.recorded_at(src), out, config.defaults(all_specs()), gemm=FakeTorch())
    entries = json.loads((out / "tools" / "burnin.json").read_text())
    assert [e["device"] for e in entries] == [f"cuda:{i}" for i in range(8)]
    assert entries[0] == {"device": "cuda:0", "error": "RuntimeError: CUDA error: an illegal memory access"}
    assert entries[1]["tflops"] == 700.0 and entries[1]["sm_count"] == 132
    cfg = config.defaults([burnin.CHECK]).for_check("burnin")
    live = list(burnin.run(Node.recorded_at(src), cfg, gemm=FakeTorch()))
    shutil.copytree(out / "tools", src / "tools")
    replayed = list(burnin.run(Node.recorded_at(src), cfg))
    assert [(f.code, f.status, f.entity) for f in replayed] == [(f.code, f.status, f.entity) for f in live]
    assert replayed[0].message.startswith("GPU 0") and "cuda:0: GEMM failed: RuntimeError" in replayed[0].message


def test_nvlink_counters_after_the_copies_read_live(tmp_path):
    node = Node.recorded_at(NODES / "gb200-nvl72-faulty")
    live = SimpleNamespace(recorded=False, root=None, gpus=node.gpus, nvml=node.nvml)
    path = tmp_path / "nvlink-after.json"
    assert _nvlink_after(live, path) == []
    after = json.loads(path.read_text())
    snap = json.loads((NODES / "gb200-nvl72-faulty" / "nvml.json").read_text())
    assert after == {str(g["index"]): g["nvlinks"] for g in snap["gpus"] if "*" not in g.get("errors", {})}
    assert list(after) == ["0", "1", "3"]  # not the lost GPU 2


def test_fabric_manager_processes_are_recorded(scenario_copy, tmp_path):
    src = write_processes(scenario_copy("h100-hgx-healthy"), [*HOST, FM, FM_SCRIPT])
    out = tmp_path / "recorded"
    record(Node.recorded_at(src), out)
    assert sorted(p.name for p in (out / "proc").iterdir() if p.name.isdigit()) == ["1", "2", "48100", "48213"]
    assert (out / "proc/2/comm").read_text() == "kthreadd\n"
    assert (out / "proc/48213/comm").read_text() == "nv-fabricmanage\n"
    assert (out / "proc/48213/cmdline").read_bytes() == (src / "proc/48213/cmdline").read_bytes()
    replayed = read_fabric_manager(Node.recorded_at(out), 1.0)
    assert replayed == read_fabric_manager(Node.recorded_at(src), 1.0)
    assert replayed.pids == (48213,)  # the script is not FM, on both


def test_nvswitches_are_recorded_so_a_replay_knows_whose_fabric_manager_it_is(tmp_path):
    from gpuwarden.agent.sources.sysfs import Sysfs
    from gpuwarden.checks.fabric_manager import nvswitches_on_bus

    src = NODES / "h100-hgx-healthy"
    out = tmp_path / "recorded"
    record(Node.recorded_at(src), out)
    switches = nvswitches_on_bus(Sysfs(src))
    assert len(switches) == 4 and nvswitches_on_bus(Sysfs(out)) == switches
    for bdf in switches:
        for name in ("vendor", "device", "class"):
            assert (out / "sys/bus/pci/devices" / bdf / name).read_text() == (
                src / "sys/bus/pci/devices" / bdf / name).read_text()


def test_the_recorded_h200_vm_replays_from_a_new_recording(tmp_path):
    """A recording of the bundled real capture reads back to the same quick verdict (record is idempotent)."""
    src = NODES / "h200-vm-1gpu"
    out = tmp_path / "recorded"
    assert record(Node.recorded_at(src), out) == []
    assert findings(out) == findings(src)


def test_a_table_that_is_not_the_hosts_stays_unknown(scenario_copy, tmp_path):
    src = write_processes(scenario_copy("h100-hgx-healthy"), [(1, "tini", ["/tini"]), (7, "bash", ["bash"])])
    out = tmp_path / "recorded"
    record(Node.recorded_at(src), out)
    for root in (src, out):
        reading = read_fabric_manager(Node.recorded_at(root), 1.0)
        assert reading.pids is None and "not the host's process table (no PID 2" in reading.procs_error


def test_xid_event_support_is_recorded(scenario_copy, tmp_path):
    out = tmp_path / "none"
    record(Node.recorded_at(NODES / "h100-hgx-healthy"), out)
    assert "xid_events" not in json.loads((out / "nvml.json").read_text())  # no key: no event support
    assert not Node.recorded_at(out).xid_events().available

    src = scenario_copy("h100-hgx-healthy")

    def events(data):
        data["xid_events"] = [{"gpu": 3, "xid": 79}]
        data["gpus"][5]["errors"]["nvmlDeviceRegisterEvents"] = "NOT_SUPPORTED"
    edit_nvml(src, events)
    out = tmp_path / "some"
    record(Node.recorded_at(src), out)
    snap = json.loads((out / "nvml.json").read_text())
    assert snap["xid_events"] == [{"gpu": 3, "xid": 79}]
    assert snap["gpus"][5]["errors"]["nvmlDeviceRegisterEvents"] == "NOT_SUPPORTED"
    for root in (src, out):
        with Node.recorded_at(root).xid_events() as sub:
            assert sub.available and sorted(sub.unsubscribed) == [5]
            assert [(x.gpu, x.xid) for x in sub.wait(0.1)] == [(3, 79)]

    edit_nvml(src, lambda data: data.setdefault("errors", {}).update(nvmlEventSetCreate="UNKNOWN"))
    out = tmp_path / "failing"
    record(Node.recorded_at(src), out)
    assert json.loads((out / "nvml.json").read_text())["errors"]["nvmlEventSetCreate"] == "UNKNOWN"
    for root in (src, out):
        with pytest.raises(NvmlError, match="nvmlEventSetCreate"):
            Node.recorded_at(root).xid_events()


def test_rerecording_into_the_scenario_itself_is_refused(scenario_copy):
    src = scenario_copy("h100-hgx-healthy", with_tools=True)
    with pytest.raises(ConfigError, match="re-recorded"):
        record(Node.recorded_at(src), src / ".." / src.name, with_tools=True)
    assert (src / "tools" / "nvbandwidth.out").exists()


def test_device_check_script_parses():
    script = ROOT / "scripts" / "device-check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True)



# ---------------------------------------------------------------- all or nothing
def test_a_library_error_on_one_nvml_call_is_recorded_not_fatal(scenario_copy, tmp_path, monkeypatch):
    """The shipped bindings' NVML_P2P_CAPS_INDEX_READ is the tuple (0,): a call with it fails in ctypes. The call's
    failure is kept in nvml.json; the rest of the node is recorded and replays."""
    from gpuwarden.agent.sources.nvml import links as nvml_source

    monkeypatch.setitem(nvml_source.P2P_CAPS, "read", (0,))
    out = tmp_path / "bundle"
    problems = record(Node.recorded_at(scenario_copy("h100-hgx-healthy")), out)
    assert problems == []
    snap = json.loads((out / "nvml.json").read_text())
    assert all(g["errors"]["nvmlDeviceGetP2PStatus"] == "UNKNOWN" for g in snap["gpus"])
    assert all("ecc_errors" in g for g in snap["gpus"])
    monkeypatch.undo()
    (result,) = run_checks(Node.recorded_at(out), [pcie_link.CHECK], config.defaults([pcie_link.CHECK]))
    assert result.status is Status.OK


def _record_cli(args, fsize=None):
    """`gpuwarden record` in a child process, optionally with a file-size limit (writes past it fail with EFBIG:
    a full disk as far as the recording can tell)."""
    import os
    import resource
    import signal
    import sys

    def limit():
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "record", *args], capture_output=True,
                          text=True, preexec_fn=limit, timeout=120, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def test_a_failed_record_says_why_and_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "bundle"
    proc = _record_cli(["--root", str(NODES / "h100-hgx-healthy"), "--out", str(out)], fsize=4096)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuwarden record: error: ") and "nothing recorded" in last and "too large" in last
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the bundle nor its hidden work folder


def test_a_failed_re_record_keeps_the_earlier_recording(tmp_path):
    out = tmp_path / "bundle"
    assert _record_cli(["--root", str(NODES / "h100-hgx-healthy"), "--out", str(out)]).returncode == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = _record_cli(["--root", str(NODES / "gb200-nvl72-faulty"), "--out", str(out)], fsize=4096)
    assert proc.returncode == 2 and "nothing recorded" in proc.stderr
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_record_refuses_a_folder_that_is_not_a_recording(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match="neither empty nor an earlier recording"):
        record(Node.recorded_at(NODES / "h100-hgx-healthy"), out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["home"]

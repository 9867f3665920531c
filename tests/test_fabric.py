"""fabric (NVML GPU fabric info + Fabric Manager) driven through time on recorded nodes, and the host process table
it reads to find a Fabric Manager that runs outside systemd (the GPU Operator's driver container)."""
import json
import shutil

import pynvml
import pytest
from conftest import edit_nvml, exposition, promtool_lint, record_tool
from gpuwarden.agent.core.errors import ConfigError, NotApplicable, SourceError
from gpuwarden.agent.core.model import Action, Status
from gpuwarden.agent.core.passive import step
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.procs import find_processes
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.checks import fabric
from gpuwarden.checks.fabric import SPEC as CHECK

CFG = dict(CHECK.defaults)
T0 = 1_750_000_000.0
HEALTHY_MASK = 0x1AA  # NVIDIA's mock GB200 profile, and the bundled GB200 scenario
ZERO = "00000000-0000-0000-0000-000000000000"


def set_fabric(root, gpu, **fields):
    edit_nvml(root, lambda data: data["gpus"][gpu]["fabric"].update(fields))


def with_mask(**fields):
    """The healthy mask with some fields replaced (values as in nvml.h)."""
    mask = HEALTHY_MASK
    for name, shift, width, _ in fabric.HEALTH_FIELDS:
        if name in fields:
            mask = (mask & ~(width << shift)) | (fields[name] << shift)
    return mask


class Driver:
    def __init__(self, root, cfg=None):
        self.root, self.cfg, self.state = root, cfg or CFG, {}
        self.node = Node.recorded_at(root)

    def at(self, now, restart=False):
        if restart:
            self.node = Node.recorded_at(self.root)
        j = step(CHECK, self.node, self.cfg, self.state, now)
        self.state = json.loads(json.dumps(j.state))
        assert self.state == j.state
        return j


def codes(j):
    return sorted((f.code, f.entity.index) for f in j.findings)


# ---------------------------------------------------------------- NVML fabric info
def test_health_mask_table_matches_the_installed_nvml_bindings():
    names = {"degraded_bandwidth": "DEGRADED_BW", "route_recovery": "ROUTE_RECOVERY",
             "route_unhealthy": "ROUTE_UNHEALTHY", "access_timeout_recovery": "ACCESS_TIMEOUT_RECOVERY",
             "incorrect_configuration": "INCORRECT_CONFIGURATION", "partition_assigned": "PARTITION_ASSIGNED",
             "gfm_state": "GFM_STATE"}
    prefix = "NVML_GPU_FABRIC_HEALTH_MASK_"
    if not hasattr(pynvml, f"{prefix}SHIFT_DEGRADED_BW"):
        pytest.skip("this nvidia-ml-py predates the health mask constants (the table still comes from nvml.h)")
    for name, shift, width, _ in fabric.HEALTH_FIELDS:
        assert getattr(pynvml, f"{prefix}SHIFT_{names[name]}") == shift
        assert getattr(pynvml, f"{prefix}WIDTH_{names[name]}") == width
    reasons = {"INCORRECT_SYSGUID": "incorrect SysGUID", "INCORRECT_CHASSIS_SN": "incorrect chassis serial number",
               "NO_PARTITION": "no partition", "INSUFFICIENT_NVLINKS": "insufficient NVLinks",
               "INCOMPATIBLE_GPU_FW": "incompatible GPU firmware", "INVALID_LOCATION": "invalid location",
               "GPU_STATE_INVALID": "GPU state invalid"}
    incorrect = next(bad for name, _, _, bad in fabric.HEALTH_FIELDS if name == "incorrect_configuration")
    for const, words in reasons.items():
        meaning = incorrect[getattr(pynvml, f"{prefix}INCORRECT_CONFIGURATION_{const}")][0]
        assert meaning == f"incorrect configuration: {words}"
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED == 2
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE == 1
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INSUFFICIENT_NVLINKS == 5
    assert pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_GPU_STATE_INVALID == 8
    assert pynvml.NVML_GPU_FABRIC_STATE_COMPLETED == fabric.COMPLETED
    assert fabric.decode_health_mask(HEALTHY_MASK) == {
        "degraded_bandwidth": 2, "route_recovery": 2, "route_unhealthy": 2, "access_timeout_recovery": 2,
        "incorrect_configuration": 1, "partition_assigned": 0, "gfm_state": 0}


def test_healthy_gb200_tray(scenario_copy):
    j = Driver(scenario_copy("gb200-nvl72-healthy")).at(T0)
    assert j.findings == ()
    cliques = [m for m in j.metrics if m.name == "gpuwarden_gpu_fabric_clique_info"]
    assert len(cliques) == 4 and {m.labels["cluster_uuid"] for m in cliques} == {"62c4efc6-d460-488d-b7d7-69de49edd641"}
    assert {m.value for m in j.metrics if m.name == "gpuwarden_gpu_fabric_state"} == {3.0}
    assert not any(m.name == "gpuwarden_fabric_manager_up" for m in j.metrics)  # FM runs in the switch trays


def test_registration_not_completed_fails_after_settle_s(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 1, state=2, cluster_uuid=ZERO, clique_id=0, health_mask=0)  # in progress after boot
    d = Driver(root)
    assert d.at(T0).findings == ()
    assert d.at(T0 + 299, restart=True).findings == ()  # the first-seen time survives a restart
    (f,) = d.at(T0 + 300).findings
    assert (f.code, f.status, f.action, f.entity.index) == ("fabric-not-ready", Status.FAIL, Action.DRAIN, 1)
    assert f.evidence["state_name"] == "in progress" and f.evidence["not_ready_seconds"] == 300
    set_fabric(root, 1, state=3, cluster_uuid="62c4efc6-d460-488d-b7d7-69de49edd641", clique_id=32766,
               health_mask=HEALTHY_MASK)
    assert d.at(T0 + 330).findings == () and d.state["not_ready_since"] == {}


def test_completed_with_an_error_status(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 0, status=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action) == ("fabric-error", Status.FAIL, Action.DRAIN)
    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in f.message and f.evidence["status_name"] in f.message


@pytest.mark.parametrize("fields, code, status", [
    ({"route_unhealthy": 1}, "fabric-route-unhealthy", Status.FAIL),
    ({"degraded_bandwidth": 1}, "fabric-degraded-bandwidth", Status.WARN),
    ({"route_recovery": 1}, "fabric-route-recovery", Status.WARN),
    ({"access_timeout_recovery": 1}, "fabric-access-timeout-recovery", Status.WARN),
    ({"incorrect_configuration": 5}, "fabric-incorrect-configuration", Status.FAIL),
    ({"gfm_state": 2}, "fabric-gfm-state", Status.WARN),
])
def test_health_mask_fields(scenario_copy, fields, code, status):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 2, health_mask=with_mask(**fields))
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.entity.index) == (code, status, 2)
    assert f.action is (Action.DRAIN if status is Status.FAIL else Action.MONITOR)
    if code == "fabric-incorrect-configuration":
        assert "insufficient NVLinks" in f.message and f.evidence["value"] == 5


def test_a_gpu_in_another_clique_is_the_odd_one_out(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 3, clique_id=32767)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action, f.entity.index) == ("fabric-clique-mismatch", Status.FAIL, Action.DRAIN, 3)
    assert f.evidence["majority_domain"] == "62c4efc6-d460-488d-b7d7-69de49edd641.32766"
    # A GB200 GPU with a zero cluster UUID is outside the tray's domain too.
    set_fabric(root, 3, clique_id=0, cluster_uuid=ZERO)
    (f,) = Driver(root).at(T0).findings
    assert f.entity.index == 3 and "no NVLink domain" in f.message
    # Two against two: no majority, one finding for the node.
    set_fabric(root, 2, clique_id=0, cluster_uuid=ZERO)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.entity.kind) == ("fabric-clique-mismatch", "node") and len(f.evidence["domains"]) == 2


# ---------------------------------------------------------------- Fabric Manager
FM_ARGV = ["nv-fabricmanager", "-c", "/usr/share/nvidia/nvswitch/fabricmanager.cfg"]  # the GPU Operator's start
HOST = [(1, "systemd", ["/sbin/init"]), (2, "kthreadd", [])]  # kthreadd at PID 2: the host's PID namespace


def record_processes(root, processes):
    """Write a process table into a scenario: proc/<pid>/comm (+ cmdline, NUL-separated, when argv is not None).
    The kernel keeps 15 characters of the name in comm, so "nv-fabricmanager" reads back as "nv-fabricmanage"."""
    for pid, name, argv in processes:
        d = root / "proc" / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "comm").write_text(name[:15] + "\n")
        if argv is not None:
            (d / "cmdline").write_text("".join(a + "\0" for a in argv))
    return root


def hgx_recent_driver(scenario_copy):
    """The H100 scenario as a recent driver reports it: fabric state completed, zero cluster UUID, clique 0."""
    root = scenario_copy("h100-hgx-healthy")

    def change(data):
        for gpu in data["gpus"]:
            gpu["fabric"] = {"cluster_uuid": ZERO, "clique_id": 0, "state": 3, "status": 0, "health_mask": 0}
            gpu["errors"].pop("nvmlDeviceGetGpuFabricInfoV", None)
    edit_nvml(root, change)
    return root


def fm_up(j):
    return [m.value for m in j.metrics if m.name == "gpuwarden_fabric_manager_up"]


def test_hgx_fabric_manager_unit(scenario_copy):
    root = record_processes(hgx_recent_driver(scenario_copy), HOST)  # a host with no nv-fabricmanager process
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    d = Driver(root)
    j = d.at(T0)
    assert j.findings == () and fm_up(j) == [1.0]  # eight GPUs with a zero UUID: no NVLink domain, not a mismatch
    record_tool(root, "systemctl-fabricmanager", "activating\n", 3)  # a restart: grace of settle_s
    j = d.at(T0 + 30)
    assert j.findings == () and fm_up(j) == [0.0]
    (f,) = d.at(T0 + 330).findings
    assert (f.code, f.status, f.action, f.entity.kind) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN,
                                                           "node")
    assert f.evidence["inactive_since"] == T0 + 30 and f.evidence["processes"] == []
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    assert d.at(T0 + 360).findings == () and d.state["fm_inactive_since"] is None
    record_tool(root, "systemctl-fabricmanager", "failed\n", 3)  # failed or inactive: no grace
    (f,) = d.at(T0 + 390).findings
    assert f.code == "fabric-manager-inactive" and f.evidence["systemctl"] == "failed"
    assert "unit is failed and no nv-fabricmanager process on the host" in f.message
    assert Driver(root, {**CFG, "fabric_manager": "off"}).at(T0).findings == ()


def test_gpu_operator_fabric_manager_runs_in_the_driver_container(scenario_copy):
    # No host unit: `systemctl is-active` of a unit that does not exist says "inactive" (exit 3). The driver
    # container's nv-fabricmanager is a host process all the same.
    root = record_processes(hgx_recent_driver(scenario_copy), [*HOST, (48213, "nv-fabricmanager", FM_ARGV)])
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    d = Driver(root)
    j = d.at(T0)
    assert j.findings == () and fm_up(j) == [1.0] and d.state["fm_inactive_since"] is None
    shutil.rmtree(root / "proc" / "48213")  # the driver container restarts: FM is gone
    j = d.at(T0 + 30)
    (f,) = j.findings
    assert (f.code, f.status, f.action) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN) and fm_up(j) == [0.0]
    assert (f.evidence["systemctl"], f.evidence["processes"]) == ("inactive", [])
    record_processes(root, [(50117, "nv-fabricmanager", FM_ARGV)])
    assert d.at(T0 + 60).findings == ()


@pytest.mark.parametrize("process, up", [
    ((48213, "nv-fabricmanager", ["/usr/bin/nv-fabricmanager", "-c", "fabricmanager.cfg"]), True),  # systemd's
    ((48213, "nv-fabricmanager", None), True),  # a recording with comm only
    ((48213, "nv-fabricmanager", []), False),  # a zombie: comm left, no cmdline
    ((48213, "nv-fabricmanager-start.sh", ["/bin/bash", "/usr/bin/nv-fabricmanager-start.sh"]), False),  # same comm
    ((48213, "nvidia-fabricmanager", ["nvidia-fabricmanager"]), False),
])
def test_which_process_is_fabric_manager(scenario_copy, process, up):
    root = record_processes(hgx_recent_driver(scenario_copy), [*HOST, process])
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    j = Driver(root).at(T0)
    assert fm_up(j) == [1.0 if up else 0.0]
    assert [f.code for f in j.findings] == ([] if up else ["fabric-manager-inactive"])


def test_fabric_manager_that_cannot_be_looked_at_is_unknown(scenario_copy):
    root = hgx_recent_driver(scenario_copy)  # no systemctl (no tools/ output), no process table (proc/<pid>)
    d = Driver(root)
    j = d.at(T0)
    (f,) = j.findings
    assert (f.code, f.status, f.action) == ("fabric-manager-unknown", Status.UNKNOWN, Action.NONE) and fm_up(j) == []
    assert "not installed" in f.message and "no process table" in f.message
    assert f.evidence["systemctl"] is None and f.evidence["processes"] is None
    # The unit inactive, but a process table that is not the host's (an agent in a container without hostPID):
    # the GPU Operator's FM would be invisible, so still UNKNOWN, and no not-running clock starts.
    record_processes(root, [(1, "gpuwarden", ["/usr/bin/python3", "-m", "gpuwarden"]), (7, "sleep", ["sleep"])])
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    (f,) = d.at(T0 + 30).findings
    assert (f.code, f.status) == ("fabric-manager-unknown", Status.UNKNOWN)
    assert "unit is inactive" in f.message and "hostPID" in f.message and d.state["fm_inactive_since"] is None


def test_a_fabric_manager_seen_running_answers_alone_until_it_stops(scenario_copy):
    # The GPU Operator's FM, found in the process table at the first look. While that process runs, neither systemctl
    # nor the table is read again: both are made unreadable here, and FM stays up.
    root = record_processes(hgx_recent_driver(scenario_copy), [*HOST, (48213, "nv-fabricmanager", FM_ARGV)])
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    d = Driver(root)
    assert fm_up(d.at(T0)) == [1.0]
    shutil.rmtree(root / "tools")
    shutil.rmtree(root / "proc" / "2")
    for t in (30, 60):
        j = d.at(T0 + t)
        assert j.findings == () and fm_up(j) == [1.0]
    # Its PID now runs another program (the kernel reuses PIDs): no longer FM, and the full look finds neither.
    record_processes(root, [(48213, "sleep", ["sleep", "60"])])
    (f,) = d.at(T0 + 90).findings
    assert (f.code, f.status) == ("fabric-manager-unknown", Status.UNKNOWN) and "not installed" in f.message


def test_the_unit_active_twice_its_process_answers_from_then_on(scenario_copy, monkeypatch):
    from gpuwarden.checks import fabric_manager

    systemd_fm = (48213, "nv-fabricmanager", ["/usr/bin/nv-fabricmanager", "-c", "fabricmanager.cfg"])
    root = record_processes(hgx_recent_driver(scenario_copy), [*HOST, systemd_fm])
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    scans = []
    monkeypatch.setattr(fabric_manager, "find_processes", lambda *a: scans.append(a) or find_processes(*a))
    assert fm_up(Driver(root).at(T0)) == [1.0] and scans == []  # one look (a preflight): systemctl alone, as ever
    d = Driver(root)
    assert fm_up(d.at(T0)) == [1.0] and fm_up(d.at(T0 + 30)) == [1.0] and len(scans) == 1  # the second: its PID
    shutil.rmtree(root / "tools")  # systemctl no longer answers: the process does
    assert fm_up(d.at(T0 + 60)) == [1.0] and fm_up(d.at(T0 + 90)) == [1.0] and len(scans) == 1
    # systemd restarts FM under a new PID: the unit and the table are asked again, and the new PID is kept.
    shutil.rmtree(root / "proc" / "48213")
    record_processes(root, [(50117, *systemd_fm[1:])])
    record_tool(root, "systemctl-fabricmanager", "active\n", 0)
    assert fm_up(d.at(T0 + 120)) == [1.0] and len(scans) == 2
    assert fm_up(d.at(T0 + 150)) == [1.0] and len(scans) == 2
    # A unit whose process the table does not show (comm other than FM's): the unit alone answers, no scan each look.
    shutil.rmtree(root / "proc" / "50117")
    assert fm_up(d.at(T0 + 180)) == [1.0] and len(scans) == 3
    assert fm_up(d.at(T0 + 210)) == [1.0] and fm_up(d.at(T0 + 240)) == [1.0] and len(scans) == 3
    record_tool(root, "systemctl-fabricmanager", "failed\n", 3)  # and a unit that fails is seen at once
    (f,) = d.at(T0 + 270).findings
    assert f.code == "fabric-manager-inactive" and f.evidence["systemctl"] == "failed" and len(scans) == 4


def test_the_process_table_alone_answers_without_systemctl(scenario_copy):
    root = record_processes(hgx_recent_driver(scenario_copy), HOST)  # no tools/: systemctl is not installed
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status) == ("fabric-manager-inactive", Status.FAIL) and "not installed" in f.message
    record_processes(root, [(48213, "nv-fabricmanager", FM_ARGV)])
    j = Driver(root).at(T0)
    assert j.findings == () and fm_up(j) == [1.0]


def test_required_watches_fabric_manager_on_any_sku(scenario_copy):
    gb200 = scenario_copy("gb200-nvl72-healthy")  # not an FM SKU: auto leaves FM alone
    assert fm_up(Driver(gb200).at(T0)) == []
    required = {**CFG, "fabric_manager": "required"}
    (f,) = Driver(gb200, required).at(T0).findings
    assert (f.code, f.status) == ("fabric-manager-unknown", Status.UNKNOWN)
    record_processes(gb200, HOST)
    record_tool(gb200, "systemctl-fabricmanager", "inactive\n", 3)
    (f,) = Driver(gb200, required).at(T0).findings
    assert (f.code, f.status) == ("fabric-manager-inactive", Status.FAIL)
    record_processes(gb200, [(48213, "nv-fabricmanager", FM_ARGV)])
    j = Driver(gb200, required).at(T0)
    assert j.findings == () and fm_up(j) == [1.0]


def test_off_never_looks(scenario_copy):
    root = hgx_recent_driver(scenario_copy)  # neither systemctl nor a process table: auto would be UNKNOWN
    j = Driver(root, {**CFG, "fabric_manager": "off"}).at(T0)
    assert j.findings == () and fm_up(j) == []


def test_applicability(scenario_copy):
    h100 = scenario_copy("h100-hgx-healthy")  # the bundled driver: fabric info NOT_SUPPORTED on every GPU
    record_tool(h100, "systemctl-fabricmanager", "active\n", 0)
    assert Driver(h100).at(T0).findings == ()  # still watches Fabric Manager
    with pytest.raises(NotApplicable):
        Driver(h100, {**CFG, "fabric_manager": "off"}).at(T0)
    gb200 = scenario_copy("gb200-nvl72-healthy")
    edit_nvml(gb200, lambda data: [g["errors"].update(nvmlDeviceGetGpuFabricInfoV="NOT_SUPPORTED")
                                   for g in data["gpus"]])
    with pytest.raises(NotApplicable):
        Driver(gb200).at(T0)
    with pytest.raises(ConfigError):
        Driver(gb200, {**CFG, "fabric_manager": "yes"}).at(T0)


# ---------------------------------------------------------------- whose Fabric Manager: NVSwitches on the PCI bus
NVSWITCHES = ["0000:83:00.0", "0000:84:00.0", "0000:85:00.0", "0000:86:00.0"]  # h100-hgx-healthy's, from its boot log


def without_nvswitches(root):
    """The node as a VM given the GPUs without their NVSwitches sees it: no class 0x0680 function on its bus."""
    for bdf in NVSWITCHES:
        shutil.rmtree(root / "sys/bus/pci/devices" / bdf)
    return root


def test_nvswitches_are_read_from_the_pci_bus(scenario_copy, tmp_path):
    from gpuwarden.checks.fabric_manager import nvswitches_on_bus
    assert nvswitches_on_bus(Sysfs(scenario_copy("h100-hgx-healthy"))) == NVSWITCHES
    assert nvswitches_on_bus(Sysfs(scenario_copy("gb200-nvl72-healthy"))) == []  # the switches are in other trays
    assert nvswitches_on_bus(Sysfs(scenario_copy("h200-vm-1gpu"))) == []
    assert nvswitches_on_bus(Sysfs(tmp_path)) is None  # no PCI device list at all: could not look


def test_a_vm_given_one_gpu_watches_no_fabric_manager(scenario_copy):
    # The real capture: one H200 passed through, fabric state NOT_SUPPORTED, no NVSwitch, no systemctl, no FM.
    root = scenario_copy("h200-vm-1gpu")
    with pytest.raises(NotApplicable, match="no NVSwitch on this system's PCI bus and no GPU in an NVLink fabric"):
        Driver(root).at(T0)
    # Told to, it watches: the process table is the host's (kthreadd at PID 2) and holds no nv-fabricmanager.
    (f,) = Driver(root, {**CFG, "fabric_manager": "required"}).at(T0).findings
    assert (f.code, f.status, f.action) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN)


def test_hgx_without_its_nvswitches_watches_no_fabric_manager(scenario_copy):
    root = record_processes(without_nvswitches(scenario_copy("h100-hgx-healthy")), HOST)  # fabric NOT_SUPPORTED
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    with pytest.raises(NotApplicable, match="not this system's"):
        Driver(root).at(T0)
    # The same node with its switches: FM is this node's, and down.
    for bdf in NVSWITCHES:
        d = root / "sys/bus/pci/devices" / bdf
        d.mkdir()
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x068000\n")
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN)
    assert f.evidence["watched_because"] == f"4 NVSwitch(es) on this system's PCI bus ({', '.join(NVSWITCHES)})"


def test_gpus_in_a_fabric_without_nvswitches_here_warn_never_drain(scenario_copy):
    # A shared-NVSwitch guest (FM in the service VM) or an HGX whose switches are not PCI functions (B200): the GPUs
    # are registered in a fabric, no NVSwitch is on this bus. FM not seen is worth a look, not a drain.
    root = record_processes(without_nvswitches(hgx_recent_driver(scenario_copy)), HOST)
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    d = Driver(root)
    for t in (T0, T0 + 3600):
        j = d.at(t)
        (f,) = j.findings
        assert (f.code, f.status, f.action) == ("fabric-manager-inactive", Status.WARN, Action.MONITOR)
        assert 'fabric_manager = \"off\"' in f.message and 'fabric_manager = \"required\"' in f.message
        assert fm_up(j) == [0.0]
    record_processes(root, [(48213, "nv-fabricmanager", FM_ARGV)])
    j = d.at(T0 + 3630)
    assert j.findings == () and fm_up(j) == [1.0]


def test_an_unreadable_pci_bus_leaves_the_sku_to_decide(scenario_copy):
    root = record_processes(scenario_copy("h100-hgx-healthy"), HOST)
    shutil.rmtree(root / "sys/bus/pci")
    record_tool(root, "systemctl-fabricmanager", "failed\n", 3)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status, f.action) == ("fabric-manager-inactive", Status.FAIL, Action.DRAIN)
    assert "could not be read" in f.evidence["watched_because"]


def test_nvswitches_on_the_bus_watch_fabric_manager_on_any_sku(scenario_copy):
    root = record_processes(scenario_copy("h100-hgx-healthy"), HOST)  # e.g. an HGX A100: SKU unknown here
    (root / "node.toml").write_text((root / "node.toml").read_text().replace('"H100-SXM-HGX"', '"unknown"'))
    record_tool(root, "systemctl-fabricmanager", "inactive\n", 3)
    (f,) = Driver(root).at(T0).findings
    assert (f.code, f.status) == ("fabric-manager-inactive", Status.FAIL)


def test_lost_gpu_is_reported_and_the_others_judged(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")
    set_fabric(root, 0, health_mask=with_mask(route_unhealthy=1))
    assert codes(Driver(root).at(T0)) == [("fabric-route-unhealthy", 0), ("gpu-lost", 2)]



# ---------------------------------------------------------------- the host process table (agent/sources/procs.py)
def test_find_processes_by_truncated_comm_and_argv0(tmp_path):
    record_processes(tmp_path, [*HOST, (300, "nv-fabricmanager", FM_ARGV), (301, "nv-fabricmanager", []),
                                (302, "nv-fabricmanager-start.sh", ["/bin/bash", "nv-fabricmanager-start.sh"])])
    (tmp_path / "proc" / "self").mkdir()  # not a PID
    (p,) = find_processes(Sysfs(tmp_path), "nv-fabricmanager")
    assert (p.pid, p.comm, p.argv0) == (300, "nv-fabricmanage", "nv-fabricmanager")
    assert find_processes(Sysfs(tmp_path), "nvlsm") == []


def test_a_process_table_that_cannot_show_the_host_raises(tmp_path):
    with pytest.raises(SourceError, match="no process table"):
        find_processes(Sysfs(tmp_path), "nv-fabricmanager")
    (tmp_path / "proc").write_text("")  # not a directory
    with pytest.raises(SourceError, match="cannot list"):
        find_processes(Sysfs(tmp_path), "nv-fabricmanager")
    (tmp_path / "proc").unlink()
    record_processes(tmp_path, [(1, "tini", ["/tini"]), (2, "gpuwarden", ["gpuwarden"])])  # a container's own
    with pytest.raises(SourceError, match="PID 2 is 'gpuwarden', not kthreadd"):
        find_processes(Sysfs(tmp_path), "nv-fabricmanager")


# ---------------------------------------------------------------- metrics
def test_metrics_are_lint_clean(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    set_fabric(root, 1, state=2)
    metrics = list(Driver(root).at(T0).metrics)
    h100 = record_processes(hgx_recent_driver(scenario_copy), HOST)
    record_tool(h100, "systemctl-fabricmanager", "inactive\n", 3)
    metrics += Driver(h100).at(T0).metrics
    assert {m.name for m in metrics} == {
        "gpuwarden_gpu_fabric_state", "gpuwarden_gpu_fabric_not_ready_seconds", "gpuwarden_gpu_fabric_clique_info",
        "gpuwarden_fabric_manager_up"}
    text = exposition(metrics)
    assert "gpuwarden_fabric_manager_up 0.0" in text
    promtool_lint(text)

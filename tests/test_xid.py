"""The xid check on real kernel logs: which XIDs are found, on which GPU, with which recommended action."""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.core.kernel_log import parse_log_text
from gpuwarden.agent.core.model import Action, Entity, Status
from gpuwarden.agent.node.host import Node
from gpuwarden.checks.xid import CHECK, analyze_text, collect, decide, parse_gpu_preamble, parse_xid, run
from gpuwarden.checks.xid_catalog import load_catalog
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "fixtures" / "logs" / "kernel"
NODES = ROOT / "fixtures" / "nodes"
DEFAULTS = dict(CHECK.defaults)
N, R, D, G, B = Action.NONE, Action.RESTART_APP, Action.DRAIN, Action.RESET_GPU, Action.REBOOT

# Per log file, the findings in order of first appearance: (xid, pci, action). Written from reading each file
# and NVIDIA's catalogue (63 and 43 are IGNORE: listed as information, action NONE).
EXPECTED: dict[str, list[tuple[int, str, Action]]] = {
    "azurehpc__nhc-health-log-real-sample.txt": [(119, "0002:00:00.0", G)],
    "gpud__dmesg-ctime__xid119-gsp-timeout-with-stack.log": [(119, "0000:9b:00.0", G)],
    "gpud__dmesg-ctime__xid13-and-xid109-ctx-switch-timeout.txt": [(13, "0000:cb:00.0", R), (109, "0000:cb:00.0", G)],
    "gpud__dmesg-ctime__xid45-then-hung-task-nvidia-stack.txt": [(45, "0000:61:00.0", R)],
    "gpud__dmesg-decode-iso__boot-noise-no-xid.log": [],
    "gpud__dmesg-decode-iso__nccl-segfault.log": [],
    "gpud__dmesg-decode-iso__xid13-burst-xid43.log": [(13, "0000:38:00.0", R), (43, "0000:38:00.0", N)],
    "gpud__dmesg-iso__xid48-63-94-with-peermem-noise.log": [(48, "0000:19:00.0", G), (63, "0000:19:00.0", N),
                                                             (94, "0000:19:00.0", R)],
    "gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt": [(79, "0000:91:00.0", B)],
    "gpud__journalctl-short-iso__noise-1.log": [],
    "gpud__journalctl-short-iso__noise-2.log": [],
    "gpud__kmsg-raw__noise-nvswitch.log": [],
    "gpud__kmsg-raw__peermem-with-malformed-last-line.log": [],
    "handmade__kmsg-raw__peermem-TRUNCATED-last-record.log": [],
    "lambdalabs__A100-syslog-xid63-64-94.txt": [(63, "0000:51:00.0", N), (64, "0000:0b:00.0", G),
                                                (94, "0000:0b:00.0", R)],
}
NOISE = [  # boot noise, journalctl noise, NVSwitch open noise, peermem noise, an NCCL segfault
    "gpud__dmesg-decode-iso__boot-noise-no-xid.log",
    "gpud__journalctl-short-iso__noise-1.log",
    "gpud__journalctl-short-iso__noise-2.log",
    "gpud__kmsg-raw__noise-nvswitch.log",
    "gpud__kmsg-raw__peermem-with-malformed-last-line.log",
    "handmade__kmsg-raw__peermem-TRUNCATED-last-record.log",
    "gpud__dmesg-decode-iso__nccl-segfault.log",
]

# embedded_xid_lines_from_docs_and_tests.tsv, row by row: (xid, pci) or None for lines that are not an XID.
TSV = "embedded_xid_lines_from_docs_and_tests.tsv"
TSV_EXPECTED: list[tuple[int, str] | None] = [
    (63, "0000:51:00.0"), (64, "0000:0b:00.0"), (94, "0000:0b:00.0"), (63, "0000:10:1c.0"), (119, "0002:00:00.0"),
    (94, "0000:0f:00.0"), (64, "0000:0f:00.0"), (13, "0000:b5:00.0"), (13, "0002:00:00.0"), (31, "0000:b5:00.0"),
    (13, "0009:01:00.0"), (74, "0003:00:00.0"),
    None, None,  # "NVRM: GPU at PCI:..." preamble and "GPU Board Serial Number"
    (48, "0000:03:00.0"), (149, "0018:01:00.0"), (32, "0000:66:00.0"), (69, "0001:ab:cd.0"), (13, "0002:00:00.0"),
    (119, "0000:00:16.0"),
    None,  # DCGM's negative case "NVRM: Xid PCI:0000:01:00: 43" (no parentheses)
    (149, "0009:01:00.0"), (154, "0009:01:00.0"), (149, "0008:01:00.0"), (154, "0019:01:00.0"), (149, "0009:01:00.0"),
    (149, "0009:01:00.0"), (149, "0008:01:00.0"), (154, "0018:01:00.0"), (154, "0008:01:00.0"), (79, "0000:05:00.0"),
    (149, "0018:01:00.0"), (145, "0018:01:00.0"), (145, "0019:01:00.0"), (149, "0008:01:00.0"), (145, "0019:01:00.0"),
    (149, "0019:01:00.0"), (145, "0008:01:00.0"), (145, "0018:01:00.0"), (149, "0008:01:00.0"), (149, "0018:01:00.0"),
    (149, "0018:01:00.0"),  # truncated mid-register: still XID 149
    (31, "000d:00:00.0"), (48, "000d:00:00.0"),
]


def tsv_rows() -> list[dict[str, str]]:
    with open(KERNEL / TSV, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


@dataclass(frozen=True)
class Gpu:
    """What the NVML source hands the check: index, UUID, canonical PCI address and the entity."""

    index: int
    uuid: str | None
    pci: str | None

    @property
    def entity(self) -> Entity:  # as the NVML source builds it
        return Entity("gpu", self.uuid or self.pci or f"index-{self.index}", self.index, self.pci)


def events(text: str):
    records, _ = parse_log_text(text, "t")
    return collect(records)[0]


# --- every fixture file ------------------------------------------------------------------------------
def test_every_fixture_file_has_expectations_and_a_source():
    logs = {p.name for p in KERNEL.iterdir() if not p.name.endswith(".source.txt")}
    assert logs == set(EXPECTED) | {TSV}
    for name in logs:
        assert (KERNEL / f"{name}.source.txt").is_file(), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_xids_found_in_each_log(name):
    path = KERNEL / name
    findings, _ = analyze_text(path.read_text(encoding="utf-8"), str(path))
    assert [(int(f.code), f.entity.pci, f.action) for f in findings] == EXPECTED[name]
    for f in findings:
        assert f.check == "xid" and f.entity.kind == "gpu"
        assert f.status is (Status.FAIL if f.action >= Action.DRAIN else
                            Status.WARN if f.action > Action.NONE else Status.OK)
        assert f.evidence["source"] == str(path)


def test_tsv_rows_one_by_one():
    rows = tsv_rows()
    assert len(rows) == len(TSV_EXPECTED)
    for row, expected in zip(rows, TSV_EXPECTED, strict=True):
        event = parse_xid(row["line_verbatim"])
        assert (None if event is None else (event.xid, event.pci)) == expected, row["line_verbatim"]


@pytest.mark.parametrize("name", NOISE)
def test_noise_gives_no_xid_at_all(name):
    assert events((KERNEL / name).read_text(encoding="utf-8")) == []


# --- parse_xid / parse_gpu_preamble ------------------------------------------------------------------
@pytest.mark.parametrize("row, pid, process, detail", [
    (0, "4549", None, "Row Remapper: New row marked for remapping, reset gpu to activate."),
    (4, "67769", "nvidia-smi",
     "Timeout waiting for RPC from GSP1! Expected function 76 (GSP_RM_CONTROL) (0x2080014b 0x5)."),
    (6, None, None, "Row Remapper Error: (0x00000002eebc4100) - All reserved rows for bank are remapped"),
    (9, "2079991", "pt_main_thread", "Ch 00000007, intr 00000000."),
    (10, None, None, "Graphics SM Warp Exception on (GPC 0, TPC 3, SM 0): Out Of Range Address"),
    (11, None, None, "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"),  # backticks
    (15, None, None, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 0x00000000 "
                     "0x00000000 0x00000000)"),
    (32, "876767", "ray::WorkerDict", "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 "
                                      "0x00000000 0x00100000 0x00000004)"),
])
def test_parse_xid_fields(row, pid, process, detail):
    event = parse_xid(tsv_rows()[row]["line_verbatim"])
    assert event is not None
    assert (event.pid, event.process, event.detail) == (pid, process, detail)


@pytest.mark.parametrize("message", [
    "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
    "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing",
    "NVRM: Xid PCI:0000:01:00: 43, pid=1814139, name=cuda_assert_64b, Ch 00000018",
    'The Xid 79 indicates that "GPU has fallen off the bus".',
    "NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.",
    "NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
    "NVRM: Xid (PCI:0000:01:00): " + "9" * 5000,
])
def test_not_an_xid(message):
    assert parse_xid(message) is None


def test_gpu_preamble():
    assert parse_gpu_preamble("NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b") == (
        "0000:91:00.0", "GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b")
    assert parse_gpu_preamble(tsv_rows()[12]["line_verbatim"]) == (
        "0000:03:00.0", "GPU-455d8f70-2051-db6c-0430-ffc457bff834")
    assert parse_gpu_preamble("NVRM: GPU Board Serial Number: 1653723052734") is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text().map(lambda t: "NVRM: Xid (PCI:0000:91:00): " + t),
                 st.text().map(lambda t: "NVRM: Xid (" + t), st.text().map(lambda t: "NVRM: GPU at PCI:" + t)))
def test_parse_xid_never_raises(message):
    event = parse_xid(message)
    assert event is None or re.fullmatch(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", event.pci)
    preamble = parse_gpu_preamble(message)
    assert preamble is None or preamble[1].startswith("GPU-")


# --- decide ------------------------------------------------------------------------------------------
def test_burst_of_xid13_is_one_finding_with_a_count():
    path = KERNEL / "gpud__dmesg-decode-iso__xid13-burst-xid43.log"
    findings, _ = analyze_text(path.read_text(encoding="utf-8"), "burst.log")
    assert [x.code for x in findings] == ["13", "43"]  # 43 is information (IGNORE), listed once
    assert (findings[1].status, findings[1].action) == (Status.OK, Action.NONE)
    f = findings[0]
    assert (f.code, f.status, f.action) == ("13", Status.WARN, Action.RESTART_APP)
    assert f.evidence["count"] == 629
    assert (f.evidence["first_line"], f.evidence["last_line"]) == (1, 635)
    assert f.evidence["first_time"] == "2025-01-21T02:21:33,498559+00:00"
    assert f.evidence["bucket"] == "RESTART_APP"
    assert "629 event(s)" in f.message


def test_xid79_names_the_gpu_by_the_uuid_the_driver_printed():
    path = KERNEL / "gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt"
    findings, _ = analyze_text(path.read_text(encoding="utf-8"), "d")
    [f] = findings
    assert f.entity == Entity("gpu", "GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b", None, "0000:91:00.0")
    assert (f.status, f.action) == (Status.FAIL, Action.REBOOT)
    assert f.message.startswith("XID 79 (GPU has fallen off the bus) on GPU GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b "
                                "0000:91:00.0: ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS")
    assert f.message.endswith("recommended: REBOOT")
    assert (f.evidence["first_line"], f.evidence["first_time"]) == (3, 6781741548779)


def test_known_gpu_gives_its_entity():
    text = ("[171167.630899] NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus.\n")
    gpus = [Gpu(0, "GPU-aaaa", "0009:01:00.0"), Gpu(2, "GPU-5f4b2b9c", "0008:01:00.0")]
    findings, _ = analyze_text(text, "k", gpus)
    [f] = findings
    assert f.entity == Entity("gpu", "GPU-5f4b2b9c", 2, "0008:01:00.0")
    assert "on GPU 2 GPU-5f4b2b9c 0008:01:00.0:" in f.message


LOST = ("NVRM: GPU at PCI:0018:01:00: GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957\n"
        "NVRM: Xid (PCI:0018:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")


@pytest.mark.parametrize("nvml_gpu", [
    Gpu(2, "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957", "0018:01:00.0"),  # NVML still knows everything
    Gpu(2, None, "0018:01:00.0"),  # NVML lost the UUID: the driver's preamble supplies it
    Gpu(2, "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957", None),  # NVML lost the address: matched by UUID
])
def test_a_lost_gpu_keeps_its_index_uuid_and_address(nvml_gpu):
    findings, _ = analyze_text(LOST, "k", [Gpu(0, "GPU-other", "0008:01:00.0"), nvml_gpu])
    assert findings[0].entity == Entity("gpu", "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957", 2, "0018:01:00.0")


def test_gpu_unknown_to_nvml_and_driver_is_named_by_its_address():
    text = "NVRM: Xid (PCI:0018:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    findings, _ = analyze_text(text, "k", [Gpu(0, "GPU-other", "0008:01:00.0")])
    assert findings[0].entity == Entity("gpu", "0018:01:00.0", None, "0018:01:00.0")


def test_xid45_solo_is_restart_app():
    findings = decide(events("NVRM: Xid (PCI:0000:61:00): 45, pid=1496200, name=distprovers-gpu, Ch 0000000f\n"),
                      [], load_catalog(), DEFAULTS)
    assert [(f.code, f.status, f.action) for f in findings] == [("45", Status.WARN, Action.RESTART_APP)]


def test_xid45_with_another_xid_on_the_same_gpu_follows_that_xid():
    text = ("NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error\n"
            "NVRM: Xid (PCI:0000:19:00): 45, pid=1248209, name=python3.10, Ch 00000008\n"
            "NVRM: Xid (PCI:0000:61:00): 45, pid=1496200, name=distprovers-gpu, Ch 0000000f\n")
    findings = decide(events(text), [], load_catalog(), DEFAULTS)
    assert [(f.code, f.entity.pci, f.action) for f in findings] == [
        ("48", "0000:19:00.0", Action.RESET_GPU), ("45", "0000:19:00.0", Action.NONE),
        ("45", "0000:61:00.0", Action.RESTART_APP)]
    assert findings[1].status is Status.OK  # accompanied 45: information, follows the 48


def test_xid45_with_an_informational_xid_is_not_solo():
    # 63 alone is information (IGNORE), yet the 45 beside it is a consequence, not a fault of its own.
    text = ("NVRM: Xid (PCI:0000:19:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New row marked\n"
            "NVRM: Xid (PCI:0000:19:00): 45, pid=1, name=p, Ch 00000008\n")
    findings = decide(events(text), [], load_catalog(), DEFAULTS)
    assert [(f.code, f.status, f.action) for f in findings] == [
        ("63", Status.OK, Action.NONE), ("45", Status.OK, Action.NONE)]


# The GB200 XID 154 sequence of leptonai/gpud's kmsg_test.go (TSV rows 22-30).
XID154 = "NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from {} to {}\n"


def test_xid154_takes_the_action_the_driver_names():
    text = XID154.format("0x0 (None)", "0x4 (Drain and Reset)")
    [f] = decide(events(text), [], load_catalog(), DEFAULTS)
    assert (f.code, f.status, f.action) == ("154", Status.FAIL, Action.RESET_GPU)
    text = XID154.format("0x0 (None)", "0x2 (Node Reboot Required)")
    assert decide(events(text), [], load_catalog(), DEFAULTS)[0].action is Action.REBOOT


def test_xid154_latest_change_holds():
    text = (XID154.format("0x0 (None)", "0x1 (GPU Reset Required)")
            + XID154.format("0x1 (GPU Reset Required)", "0x0 (None)"))
    [f] = decide(events(text), [], load_catalog(), DEFAULTS)
    assert (f.status, f.action, f.evidence["count"]) == (Status.OK, Action.NONE, 2)  # recovered: information
    text = (XID154.format("0x0 (None)", "0x3 (Drain P2P)")
            + XID154.format("0x3 (Drain P2P)", "0x2 (Node Reboot Required)"))
    [f] = decide(events(text), [], load_catalog(), DEFAULTS)
    assert (f.action, f.evidence["count"]) == (Action.REBOOT, 2)


def test_xid154_with_unknown_wording_is_monitored():
    [f] = decide(events(XID154.format("0x0 (None)", "0x2a (Something New)")), [], load_catalog(), DEFAULTS)
    assert (f.status, f.action) == (Status.WARN, Action.MONITOR)


def test_uncatalogued_xid_is_monitored():
    text = "NVRM: Xid (PCI:0000:19:00): 999, pid=1, name=p, something new\n"
    [f] = decide(events(text), [], load_catalog(), DEFAULTS)
    assert (f.code, f.status, f.action) == ("999", Status.WARN, Action.MONITOR)
    assert "not in NVIDIA's XID catalogue" in f.message
    assert f.evidence["bucket"] is None


LAMBDA = (KERNEL / "lambdalabs__A100-syslog-xid63-64-94.txt").read_text(encoding="utf-8")


def test_policy_ignore_xids():
    findings = decide(events(LAMBDA), [], load_catalog(), {"ignore_xids": [94], "fail_xids": []})
    assert [f.code for f in findings] == ["63", "64"]
    findings = decide(events(LAMBDA), [], load_catalog(), {"ignore_xids": [63, 94], "fail_xids": []})
    assert [f.code for f in findings] == ["64"]


def test_policy_fail_xids_forces_at_least_drain():
    findings = decide(events(LAMBDA), [], load_catalog(), {"ignore_xids": [], "fail_xids": [63, 94, 64]})
    assert [(f.code, f.status, f.action) for f in findings] == [
        ("63", Status.FAIL, Action.DRAIN),  # IGNORE in the catalogue, forced by policy
        ("64", Status.FAIL, Action.RESET_GPU),  # already above DRAIN: kept
        ("94", Status.FAIL, Action.DRAIN)]
    assert findings[0].message.endswith("recommended: DRAIN (policy fail_xids)")


def test_policy_comes_from_config_as_the_check_declares_it():
    from gpuwarden.agent.core import config
    from gpuwarden.checks import CONSUMER_BY_NAME, all_specs

    assert CHECK.name == "xid" and CHECK.defaults == {"ignore_xids": [], "fail_xids": [], "hold_s": 3600.0}
    # One table for every form: the daemon's consumer reads [checks.xid] too.
    assert CONSUMER_BY_NAME["xid"].defaults == CHECK.defaults
    assert config.defaults(all_specs()).for_check("xid") == CHECK.defaults


KMSG_48_13 = ("6,1,1000000,-;boot\n"
              "3,2,5000000,-;NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=p, An uncorrectable double bit error\n"
              "3,3,95000000,-;NVRM: Xid (PCI:0000:19:00): 13, pid=1, name=p, Graphics Exception\n")


def test_preflight_judges_each_xid_at_the_time_it_was_logged(scenario_copy):
    # The same hold as the daemon: an incident below REBOOT stands hold_s after its last event, on the kernel's clock.
    root = scenario_copy("h100-hgx-healthy")
    (root / "kmsg").write_text(KMSG_48_13)
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "uptime").write_text("100.00 1.00\n")  # both XIDs are recent
    assert [f.code for f in run(Node.recorded_at(root), DEFAULTS)] == ["48", "13"]
    (root / "proc" / "uptime").write_text("3700.00 1.00\n")  # the 48 is 3695 s old, the 13 is 3605 s old
    assert [f.code for f in run(Node.recorded_at(root), DEFAULTS)] == []
    assert [f.code for f in run(Node.recorded_at(root), {**DEFAULTS, "hold_s": 3650.0})] == ["13"]


def test_hold_on_a_recorded_node(scenario_copy):
    root = scenario_copy("gb200-nvl72-faulty")
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "uptime").write_text("99999999.00 1.00\n")  # long after the XIDs were logged
    # The 63 (information) has aged out; the 79 needs a reboot and stands for the boot.
    assert [f.code for f in run(Node.recorded_at(root), DEFAULTS)] == ["79"]


def test_a_reset_reported_by_the_driver_ends_the_incidents_it_clears():
    text = ("NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=p, An uncorrectable double bit error\n"
            "NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=p, GPU has fallen off the bus.\n"
            "NVRM: Xid (PCI:0000:1a:00): 48, pid=1, name=p, An uncorrectable double bit error\n"
            + XID154.replace("0009:01:00", "0000:19:00").format("0x1 (GPU Reset Required)", "0x0 (None)"))
    findings = decide(events(text), [], load_catalog(), DEFAULTS)
    # GPU 19: the 48 is over (a reset clears it), the 79 stands (a reset does not), the 154 is information.
    assert [(f.code, f.entity.pci, f.status) for f in findings] == [
        ("79", "0000:19:00.0", Status.FAIL), ("48", "0000:1a:00.0", Status.FAIL), ("154", "0000:19:00.0", Status.OK)]


MIG_LINES = [  # the driver's MIG forms (open-gpu-kernel-modules kernel_rc.c): GPU instance, and compute instance
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 31, pid=2079991, name=pt_main_thread, Ch 00000007, intr 00000000.",
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:03 GPU-CI:01): 43, pid=1, name=p, Ch 00000008",
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 31, pid=2079992, name=pt_main_thread, Ch 00000007, intr 00000000.",
]


def test_mig_xids_are_read_and_attributed_to_the_physical_gpu():
    e = parse_xid(MIG_LINES[1])
    assert (e.xid, e.pci, e.gpu_instance, e.compute_instance, e.pid) == (43, "0000:3b:00.0", 3, 1, "1")
    gpu = Entity("gpu", "GPU-mig", 4, "0000:3b:00.0")

    @dataclass
    class Ref:
        index: int | None = 4
        uuid: str | None = "GPU-mig"
        pci: str | None = "0000:3b:00.0"
        entity: Entity = gpu

    findings = decide(events("\n".join(MIG_LINES) + "\n"), [Ref()], load_catalog(), DEFAULTS)
    assert [(f.code, f.entity, f.evidence["count"], f.evidence["mig_instances"]) for f in findings] == [
        ("31", gpu, 2, ["GI 5"]), ("43", gpu, 1, ["GI 3 CI 1"])]
    assert "(MIG GI 5)" in findings[0].message


@pytest.mark.parametrize("line", [
    "NVRM: Xid PCI:0000:01:00: 43, pid=1814139, name=cuda_assert_64b, Ch 00000018",  # DCGM's malformed case
    "NVRM: Xid (PCI:0000:01:00 SOMETHING-NEW:1): 43, pid=1, name=p, Ch 00000018",  # a tag not known here
    "NVRM: Xid (PCI:0000:01:00): not-a-number",
])
def test_a_line_that_mentions_an_xid_and_cannot_be_read_is_unknown_never_silence(line):
    records, _ = parse_log_text(f"[  1.0] {line}\n", "dmesg.txt")
    findings = analyze_text(f"[  1.0] {line}\n", "dmesg.txt")[0]
    (f,) = findings
    assert (f.code, f.status, f.action) == ("xid-unreadable", Status.UNKNOWN, Action.NONE)
    assert "dmesg.txt:1" in f.message and f.evidence["lines"][0]["message"] == records[0].message
    # preflight and the daemon say the same (the same judge)
    assert not [f for f in findings if f.status is Status.OK]


# --- run() on recorded nodes -------------------------------------------------------------------------
def test_run_on_the_faulty_gb200_scenario():
    node = Node.recorded_at(NODES / "gb200-nvl72-faulty")
    # The XID 63 was logged ~10 days before the 79 (the newest record stands for "now"): a hold that long keeps it.
    findings = list(run(node, {**DEFAULTS, "hold_s": 1e7}))
    # kmsg: XID 63 on 0009:01:00 (IGNORE: information) and XID 79 on 0018:01:00 after the driver named its UUID.
    assert [(f.code, f.entity.pci, f.entity.id, f.action) for f in findings] == [
        ("63", "0009:01:00.0", "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32", Action.NONE),
        ("79", "0018:01:00.0", "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957", Action.REBOOT)]
    assert findings[0].status is Status.OK and findings[0].entity.index == 1
    assert (findings[1].evidence["first_seq"], findings[1].evidence["first_line"]) == (1920, 48)


@pytest.mark.parametrize("name", ["gb200-nvl72-healthy", "h100-hgx-healthy"])
def test_run_on_healthy_scenarios(name):
    assert list(run(Node.recorded_at(NODES / name), DEFAULTS)) == []


def test_run_lets_an_unreadable_kernel_log_propagate(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    (root / "kmsg").unlink()
    with pytest.raises(SourceError):
        list(run(Node.recorded_at(root), DEFAULTS))


# --- when a held incident ends (Judgement.wake_at: the daemon judges again then) --------------------------------
def test_the_judgement_says_when_its_earliest_held_incident_ends():
    from gpuwarden.agent.core.kernel_log import parse_kmsg_text
    from gpuwarden.agent.core.passive import KernelBatch
    from gpuwarden.checks.xid import CONSUMER

    text = ("3,1,1000,-;NVRM: Xid (PCI:0009:01:00): 48, pid=1, name=p, An uncorrectable double bit error\n"
            "3,2,2000,-;NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
    records, errors = parse_kmsg_text(text, "kmsg")
    assert not errors
    cfg = {**DEFAULTS, "hold_s": 60.0}
    held = CONSUMER.judge({}, KernelBatch(records[:1], [], "b"), cfg, 1000.0)
    assert held.wake_at == 1060.0  # the XID 48 (RESET_GPU) holds hold_s after it was logged (now, here)
    both = CONSUMER.judge(held.state, KernelBatch(records[1:], [], "b"), cfg, 1010.0)
    assert both.wake_at == 1060.0  # the XID 79 (REBOOT) holds until the next boot: no end by time
    later = CONSUMER.judge(both.state, KernelBatch([], [], "b"), cfg, 1061.0)
    assert [f.code for f in later.findings] == ["79"] and later.wake_at is None


# --- a batch is its lines one by one (the judge takes a run of one text's lines as one step) ------------------------
_DRIVER_LINES = (
    "NVRM: Xid (PCI:0000:19:00): 13, pid={pid}, name=p{pid}, Graphics SM Warp Exception",
    "NVRM: Xid (PCI:0000:19:00): 43, pid={pid}, name=train, Ch 00000008",
    "NVRM: Xid (PCI:0000:19:00 GPU-I:0{pid}): 43, pid=7, name=t, Ch 00000001",
    "NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error",
    "NVRM: Xid (PCI:0000:3b:00): 45, pid={pid}, name=<unknown>, Ch 00000010",
    "NVRM: Xid (PCI:0000:19:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
    "NVRM: Xid (PCI:0000:19:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
    "NVRM: GPU at PCI:0000:19:00: GPU-0000000{pid}-c55b-d076-fa0e-d464e4c7e08b",
    "NVRM: Xid PCI:0000:19:00 79 (a form the driver does not print)",
    "pci 0000:19:00.0: enabling device (0000 -> 0002)",
)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.tuples(st.integers(0, len(_DRIVER_LINES) - 1), st.integers(1, 13), st.integers(-50, 50)),
                      max_size=60),
       ignore=st.sampled_from([[], [43], [154]]), fail=st.sampled_from([[], [13]]), hold=st.booleans(),
       timed=st.booleans())
def test_a_batch_is_judged_as_its_lines_one_by_one(lines, ignore, fail, hold, timed):
    """Lines of one text count onto their incident in one step: the incidents, their first and last lines, counts,
    pids (ten at most, in the order seen) and latest times, and the findings are those of judging each line alone,
    in order; a recovery (XID 154 to None) ends incidents where it stands."""
    from gpuwarden.agent.core.kernel_log import parse_kmsg_text
    from gpuwarden.agent.core.passive import KernelBatch
    from gpuwarden.checks.xid import CONSUMER

    usec, text = 10_000_000, []
    for seq, (which, pid, step) in enumerate(lines):
        usec += step * 1000  # now and then earlier than the line before: the latest time is the largest, not the last
        text.append(f"4,{seq},{usec},-;" + _DRIVER_LINES[which].format(pid=pid) + "\n")
    records, errors = parse_kmsg_text("".join(text), "kmsg")
    assert not errors and len(records) == len(lines)
    cfg = {**DEFAULTS, "ignore_xids": ignore, "fail_xids": fail, "hold_s": 1e9}
    event_time = (lambda r: r.usec / 1e6) if timed else None
    whole = CONSUMER.judge({}, KernelBatch(records, [], "b", event_time=event_time), cfg, 5000.0, hold=hold)
    one = CONSUMER.judge({}, KernelBatch([], [], "b", event_time=event_time), cfg, 5000.0, hold=hold)
    for r in records:
        one = CONSUMER.judge(one.state, KernelBatch([r], [], "b", event_time=event_time), cfg, 5000.0, hold=hold)
    assert whole.state == one.state
    assert whole.findings == one.findings

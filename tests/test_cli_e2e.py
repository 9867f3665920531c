"""End to end: the real `gpuwarden` command on every bundled scenario, diffed against a golden JSON.

Refresh the goldens deliberately with `pytest tests/test_cli_e2e.py --update-golden` and review the diff.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import NODES, ROOT
from gpuwarden.checks import ALL

GOLDEN = ROOT / "tests" / "golden"
SCENARIOS = sorted(p.name for p in NODES.iterdir() if (p / "node.toml").exists())
EXPECTED_EXIT = {"h100-hgx-healthy": 0, "gb200-nvl72-healthy": 0, "gb200-nvl72-faulty": 1, "h200-vm-1gpu": 0}
# Real captures of nodes where some full-level checks do not apply (one GPU: no peer; no NIC; no DCGM installed).
SOME_CHECKS_NOT_APPLICABLE = {"h200-vm-1gpu"}


def gpuwarden(*args: str) -> subprocess.CompletedProcess:
    # The real command in a clean process, from the repository root so scenario paths stay relative and
    # the goldens do not depend on where the checkout lives.
    return subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "160"})


def scenario(name: str) -> str:
    return f"fixtures/nodes/{name}"


def normalise(report: dict) -> dict:
    # Durations vary run to run; everything else must be byte-stable.
    for r in report["results"]:
        r["duration_s"] = 0.0
    return report


def test_every_expected_scenario_is_bundled():
    assert set(EXPECTED_EXIT) <= set(SCENARIOS)


@pytest.mark.parametrize("level", ["quick", "full"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_preflight_json_matches_golden(name, level, update_golden):
    proc = gpuwarden("preflight", "--root", scenario(name), "--level", level, "--json")
    assert proc.returncode == EXPECTED_EXIT.get(name, proc.returncode), proc.stderr
    report = normalise(json.loads(proc.stdout))
    assert report["exit_code"] == proc.returncode
    if level == "full" and name not in SOME_CHECKS_NOT_APPLICABLE:  # every check ran on the recorded tool outputs
        assert [r["check"] for r in report["results"]] == [s.name for s in ALL]
        assert not [r["check"] for r in report["results"] if r["status"] == "skipped"]
    golden = GOLDEN / (f"preflight-{name}.json" if level == "quick" else f"preflight-full-{name}.json")
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    if update_golden or not golden.exists():
        if not update_golden and os.environ.get("CI"):
            pytest.fail(f"{golden} is missing; create it with --update-golden and review it")
        golden.write_text(text)
    assert text == golden.read_text(), f"{name}: output differs from {golden} (rerun with --update-golden if intended)"


def test_faulty_gb200_verdict_names_each_fault():
    proc = gpuwarden("preflight", "--root", scenario("gb200-nvl72-faulty"), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    findings = report["findings"]
    xid79 = [f for f in findings if f["check"] == "xid" and f["code"] == "79"]
    assert len(xid79) == 1
    gpu = xid79[0]["entity"]
    assert gpu["kind"] == "gpu" and gpu["index"] == 2 and gpu["id"].startswith("GPU-") and gpu["pci"]
    assert xid79[0]["status"] == "fail" and xid79[0]["action"] == "REBOOT"
    remap = [f for f in findings if f["code"] == "row-remap-pending"]
    assert len(remap) == 1 and remap[0]["entity"]["index"] == 1 and remap[0]["entity"]["pci"]
    down = [f for f in findings if f["code"] == "ib-port-down"]
    assert [f["entity"]["id"] for f in down] == ["mlx5_2/1"]


def test_human_table_names_the_faults():
    proc = gpuwarden("preflight", "--root", scenario("gb200-nvl72-faulty"))
    assert proc.returncode == 1
    rows = [line.split() for line in proc.stdout.splitlines()]
    # check, status, action, code, then the entity: index, UUID and PCI address of the XID 79 GPU.
    assert ["xid", "FAIL", "REBOOT", "79", "GPU", "2", "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957",
            "0018:01:00.0"] in rows
    assert ["ecc", "FAIL", "RESET_GPU", "row-remap-pending", "GPU", "1", "GPU-7f56209f-bfaa-0234-486e-9d778f65ba32",
            "0009:01:00.0"] in rows
    assert ["ib_port", "FAIL", "DRAIN", "ib-port-down", "ib_port", "mlx5_2/1"] in rows
    assert "verdict: FAULT: action needed (exit 1)" in proc.stdout


@pytest.mark.parametrize("name", ["h100-hgx-healthy", "gb200-nvl72-healthy"])
def test_healthy_nodes_pass(name):
    proc = gpuwarden("preflight", "--root", scenario(name))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: PASS" in proc.stdout


def test_version():
    proc = gpuwarden("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("gpuwarden ")


def test_malformed_config_is_a_clear_error_with_exit_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[checks.ecc]\nbanks_low_spares_warn = \"two\"\n")
    proc = gpuwarden("preflight", "--root", scenario("h100-hgx-healthy"), "--config", str(cfg))
    assert proc.returncode == 2
    assert "checks.ecc.banks_low_spares_warn" in proc.stderr and str(cfg) in proc.stderr


def test_unknown_check_name_exits_2():
    proc = gpuwarden("preflight", "--root", scenario("h100-hgx-healthy"), "--checks", "ecc,bogus")
    assert proc.returncode == 2 and "bogus" in proc.stderr


def test_checks_flag_selects(tmp_path):
    proc = gpuwarden("preflight", "--root", scenario("gb200-nvl72-faulty"), "--checks", "ib_port", "--json")
    report = json.loads(proc.stdout)
    assert [r["check"] for r in report["results"]] == ["ib_port"] and proc.returncode == 1


KERNEL_LOGS = ROOT / "fixtures" / "logs" / "kernel"


def test_analyze_json_on_real_kernel_logs():
    xid79 = "fixtures/logs/kernel/gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt"
    noise = "fixtures/logs/kernel/gpud__journalctl-short-iso__noise-2.log"
    truncated = "fixtures/logs/kernel/handmade__kmsg-raw__peermem-TRUNCATED-last-record.log"
    proc = gpuwarden("analyze", "--json", xid79, noise, truncated)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tool"] == "analyze" and report["exit_code"] == 1
    # The noise file and the peermem log hold no XID; the XID 79 log also holds fatal NVSwitch SXids, which analyze
    # reports as preflight and the daemon do (one decision in every mode).
    finding, *sxids = report["findings"]
    assert finding["code"] == "79" and finding["action"] == "REBOOT" and finding["status"] == "fail"
    assert finding["entity"] == {"kind": "gpu", "id": "GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
                                 "pci": "0000:91:00.0"}
    assert sorted((f["check"], f["code"], f["entity"]["id"], f["action"]) for f in sxids) == [
        ("nvswitch_sxid", "sxid-20034", f"0000:0{n}:00.0", "DRAIN") for n in (5, 6, 7)]
    by_file = {r["source"].split(" ")[0]: r for r in report["results"]}
    assert by_file[noise]["status"] == "ok" and by_file[noise]["findings"] == []
    assert by_file[truncated]["notes"] == [
        f"{truncated}:8: malformed kmsg record (no ';' between header and message): '6,3973,2279'"]


def test_analyze_exit_codes():
    warn_only = "fixtures/logs/kernel/gpud__dmesg-ctime__xid45-then-hung-task-nvidia-stack.txt"  # solo XID 45
    assert gpuwarden("analyze", warn_only).returncode == 0
    assert gpuwarden("analyze", "fixtures/logs/kernel/does-not-exist.log").returncode == 2


def test_logs_are_json_lines_when_not_on_a_tty(tmp_path):
    proc = gpuwarden("record", "--root", scenario("gb200-nvl72-healthy"), "--out", str(tmp_path / "r"))
    assert proc.returncode == 0
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert lines and lines[-1]["event"] == "recorded" and lines[-1]["level"] == "info" and "timestamp" in lines[-1]


@pytest.mark.parametrize("path, check, fmt, codes, exit_code", [
    ("fixtures/tools/nccl/dcgm-mock__all_reduce_perf__nccl-tests-2.17plus-format__FAIL-out-of-bounds-wrong1.txt",
     "nccl_allreduce", "nccl-tests", {"nccl-wrong-results"}, 1),
    ("fixtures/tools/dcgmi/stas00__dcgmi-diag-r2__text__FRAGMENT__gpu-memory-fail-gpu0-thermal-warning.txt",
     "dcgm_diag", "dcgmi-diag-text", {"dcgm-memory"}, 1),
    ("fixtures/tools/dcgmi/virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json",
     "dcgm_diag", "dcgmi-diag-json", set(), 0),
    ("fixtures/tools/dcgmi/virtualclient__dcgmi-diag-j__MALFORMED-missing-test_categories.json",
     "analyze", "dcgmi-diag-json", set(), 2),
    # perftest output carries no port rate: the figure is reported, the verdict is "could not judge".
    ("fixtures/tools/perftest/amd-pollara__ib_write_bw-b-a-q4__CLIENT.txt",
     "rdma_loopback", "perftest", {"rdma-loopback-rate-unknown"}, 2),
])
def test_analyze_detects_tool_outputs(path, check, fmt, codes, exit_code):
    proc = gpuwarden("analyze", "--json", path)
    report = json.loads(proc.stdout)
    (result,) = report["results"]
    assert proc.returncode == exit_code, proc.stdout
    assert result["check"] == check and result["source"].endswith(f"({fmt})")
    assert codes <= {f["code"] for f in result["findings"]}


def test_analyze_on_an_unreadable_format_is_undecided(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("lunch at noon\nbring the cables\n")
    proc = gpuwarden("analyze", "--json", str(path))
    assert proc.returncode == 2
    assert "not a format gpuwarden reads" in json.loads(proc.stdout)["results"][0]["error"]


def test_checks_lists_preflight_passive_and_kernel_log_checks_with_their_tables():
    import contextlib
    import io

    from gpuwarden.agent.cli.main import main
    from gpuwarden.checks import ALL, KERNEL_CONSUMERS, PASSIVE

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["checks"]) == 0
    text = out.getvalue()
    for spec in (*ALL, *PASSIVE, *KERNEL_CONSUMERS):
        assert f"[checks.{spec.name}]" in text, spec.name
    # One table per concern, whichever forms it has: preflight, the daemon's poll, the kernel-log consumer.
    for name in ("pcie_aer", "xid", "ecc", "ib_port", "nvswitch_sxid"):
        assert text.count(f"[checks.{name}]") == 1, name
    assert "quick+1s" in text and "quick+kmsg" in text
    assert "xid_watch" not in text and "ecc_watch" not in text and "ib_downtime" not in text


@pytest.mark.parametrize("args", [
    ("analyze", "fixtures/logs/kernel/gpud__dmesg-ctime__xid119-gsp-timeout-with-stack.log"),
    ("preflight", "--root", scenario("gb200-nvl72-faulty"), "--json")])
def test_a_verdict_nobody_reads_ends_with_141_and_no_traceback(args: tuple[str, ...]):
    # The command ends at its verdict without the interpreter's teardown: the output still held in its buffer is
    # written first, and a reader that went away (`gpuwarden ... | head`, here a pipe closed before anything was
    # written) is the shell's SIGPIPE status, whether the verdict fitted in the buffer (analyze) or not (preflight).
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", *args], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_command_writes_a_verdict_longer_than_a_pipe_holds_whole():
    logs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fixtures" / "logs" / "kernel").iterdir()
                  if not p.name.endswith(".source.txt"))
    proc = gpuwarden("analyze", "--json", *logs)
    assert len(proc.stdout) > 1 << 16  # more than a pipe holds: written while the test reads
    report = json.loads(proc.stdout)
    assert len(report["results"]) == len(logs)
    assert proc.returncode == report["exit_code"] == 1

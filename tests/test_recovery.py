"""The quarantine ladder's actions (agent/act/recovery.py) through the node's real sources: NVML of a recorded node for
the processes holding a GPU, the real tool runner for nvidia-smi (a stand-in on PATH that prints nvidia-smi's real
recorded answers, fixtures/tools/nvidia-smi/*gpu-reset*; or a recorded node's tools/), real commands for the reboot
and the ticket hook. Refused while held, refused when the holders could not be read, done per GPU as nvidia-smi
says, ok None (never done) when the tool is missing or does not answer, and every answer bounded."""
from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, record_tool
from gpuwarden.agent.act import recovery
from gpuwarden.agent.act.recovery import HoldersUnknown, StepOutcome, gpu_holders, open_ticket, reboot, reset_gpus
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.sources.nvml import Nvml
from gpuwarden.agent.sources.nvml.recorded import RecordedNvml
from gpuwarden.agent.sources.tools import ToolRunner

SMI = ROOT / "fixtures" / "tools" / "nvidia-smi"
SUCCESS = SMI / "nvsentinel__nvidia-smi-gpu-reset__1gpu__success.txt"
IN_USE = SMI / "nvsentinel__nvidia-smi-gpu-reset__1gpu__in-use-by-another-client.txt"
IN_USE_4 = SMI / "mig-parted__nvidia-smi-gpu-reset__4gpu__in-use-by-another-client.txt"
NOT_SUPPORTED = SMI / "yandex-cloud__nvidia-smi-gpu-reset__2gpu__not-supported-nvlink-active.txt"
MIXED = SMI / "EDITED__nvidia-smi-gpu-reset__2gpu__one-reset-one-in-use.txt"
WAIT_S = 30.0  # generous: a timeout test's tool is ended at its own limit, far below this


def node_of(scenario_copy, bus_ids=None, processes=None, errors=None, name="h100-hgx-healthy"):
    """A recorded 8-GPU node, its GPUs' bus ids set to those a real nvidia-smi answer names (so the answer is used
    verbatim), with processes and NVML errors per GPU index."""
    root = scenario_copy(name)
    path = root / "nvml.json"
    data = json.loads(path.read_text())
    for index, bus in (bus_ids or {}).items():
        data["gpus"][index]["pci_bus_id"] = bus
    for index, procs in (processes or {}).items():
        data["gpus"][index]["processes"] = procs
    for index, errs in (errors or {}).items():
        data["gpus"][index].setdefault("errors", {}).update(errs)
    path.write_text(json.dumps(data))
    return Node.recorded_at(root)


def live_tools(node):
    """The node's NVML stays recorded; its tools run for real (the stand-in nvidia-smi on PATH)."""
    node.tools = ToolRunner()
    return node


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """Writes an executable `nvidia-smi` stand-in onto PATH (nvidia-smi is outside the project). It notes its
    arguments in `args` and then runs `body` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    args = tmp_path / "args"

    def write(body: str) -> Path:
        exe = bin_dir / "nvidia-smi"
        exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {shlex.quote(str(args))}\n{body}\n')
        exe.chmod(0o755)
        return args

    return write


def answer(fixture: Path, rc: int) -> str:
    return f"cat {shlex.quote(str(fixture))}\nexit {rc}"


def ran(args: Path) -> list[str] | None:
    return args.read_text().splitlines() if args.exists() else None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- who holds a GPU ----------------------------------------------------------------------------------------------


def test_holders_are_read_from_nvml_compute_and_graphics(scenario_copy):
    node = node_of(scenario_copy, processes={
        2: [{"pid": 4242, "type": "compute", "used_memory_bytes": 1 << 30},
            {"pid": 77, "type": "graphics", "used_memory_bytes": None}],
        5: [{"pid": 9, "type": "compute", "used_memory_bytes": 0}]})
    assert gpu_holders(node, [0, 2, 2]) == {0: [], 2: [77, 4242]}
    assert node.nvml.processes(node.gpus()[2]) == [
        {"pid": 4242, "type": "compute", "used_memory_bytes": 1 << 30},
        {"pid": 77, "type": "graphics", "used_memory_bytes": None}]


@pytest.mark.parametrize("errors, code", [
    ({"nvmlDeviceGetComputeRunningProcesses": "NOT_SUPPORTED"}, "NOT_SUPPORTED"),
    ({"nvmlDeviceGetGraphicsRunningProcesses": "NOT_SUPPORTED"}, "NOT_SUPPORTED"),
    ({"nvmlDeviceGetComputeRunningProcesses": "NO_PERMISSION"}, "NO_PERMISSION"),
    ({"*": "GPU_IS_LOST"}, "GPU_IS_LOST"),
])
def test_holders_that_could_not_be_read_are_never_none(scenario_copy, errors, code):
    node = node_of(scenario_copy, errors={3: errors})
    with pytest.raises(HoldersUnknown) as exc:
        gpu_holders(node, [1, 3])
    assert "GPU 3" in str(exc.value) and code in str(exc.value) and "GPU 1" not in str(exc.value)
    assert gpu_holders(node, [1]) == {1: []}  # the others are still read


def test_a_gpu_not_on_the_node_cannot_be_looked_at(scenario_copy):
    with pytest.raises(HoldersUnknown, match="GPU 8: not on this node"):
        gpu_holders(node_of(scenario_copy), [8])


def test_a_malformed_recorded_process_list_is_an_error_not_an_empty_list(scenario_copy):
    node = node_of(scenario_copy, processes={1: [{"pid": -1, "type": "compute"}]})
    with pytest.raises(HoldersUnknown, match="GPU 1"):
        gpu_holders(node, [1])


# -- GPU reset ----------------------------------------------------------------------------------------------------


def test_reset_is_refused_while_a_process_holds_a_gpu_and_nvidia_smi_never_runs(scenario_copy, smi):
    args = smi(answer(SUCCESS, 0))
    node = live_tools(node_of(scenario_copy, processes={3: [
        {"pid": 4242, "type": "compute", "used_memory_bytes": 1 << 20},
        {"pid": 4343, "type": "compute", "used_memory_bytes": 1 << 20}]}))
    out = reset_gpus(node, [1, 3], timeout_s=WAIT_S)
    assert out == StepOutcome(False, "not reset: held by running processes: GPU 3 (0000:5d:00.0): PID 4242, 4343")
    assert ran(args) is None


def test_reset_is_refused_when_the_holders_could_not_be_read(scenario_copy, smi):
    args = smi(answer(SUCCESS, 0))
    node = live_tools(node_of(scenario_copy, errors={3: {"nvmlDeviceGetComputeRunningProcesses": "NOT_SUPPORTED"}}))
    out = reset_gpus(node, [3], timeout_s=WAIT_S)
    assert out.ok is None and "could not read which processes hold the GPUs" in out.detail
    assert "GPU 3" in out.detail and "NOT_SUPPORTED" in out.detail
    assert ran(args) is None


class WedgedNvml(RecordedNvml):
    """The NVML library (outside the project) of a wedged driver: the process list never comes back."""

    release = threading.Event()

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self.release.wait()
        return super().nvmlDeviceGetComputeRunningProcesses(handle)


def test_reset_is_not_done_when_nvml_does_not_answer(scenario_copy, smi):
    args = smi(answer(SUCCESS, 0))
    base = node_of(scenario_copy)

    def wedged():
        nvml = Nvml(WedgedNvml.from_file(base.root / "nvml.json"), "wedged")
        nvml._call("nvmlInit")
        return nvml

    node = Node(base.info, base.root, base.sysfs, base.kmsg, ToolRunner(), wedged)
    try:
        assert reset_gpus(node, [0], timeout_s=0.5) == StepOutcome(
            None, "not reset: could not read which processes hold the GPUs: NVML did not answer within 0.5s")
    finally:
        WedgedNvml.release.set()  # the reading thread left behind ends
    assert ran(args) is None


def test_reset_done_as_nvidia_smi_says(scenario_copy, smi):
    args = smi(answer(SUCCESS, 0))
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"}))
    assert reset_gpus(node, [0], timeout_s=WAIT_S) == StepOutcome(True, "reset GPU 0 (0000:1a:00.0)")
    assert ran(args) == ["--gpu-reset", "-i", "00000000:1A:00.0"]


def test_reset_refused_by_another_client(scenario_copy, smi):
    smi(answer(IN_USE, 255))
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"}))
    assert reset_gpus(node, [0], timeout_s=WAIT_S) == StepOutcome(
        False, "not reset: GPU 0 (0000:1a:00.0): In use by another client")


def test_every_gpu_goes_in_one_command_and_each_is_judged(scenario_copy, smi):
    """NVLink peers must be reset in the same command where Fabric Manager does not run (nvidia-smi(1))."""
    args = smi(answer(IN_USE_4, 255))
    buses = {0: "00000000:01:00.0", 1: "00000000:47:00.0", 2: "00000000:81:00.0", 3: "00000000:C2:00.0"}
    node = live_tools(node_of(scenario_copy, bus_ids=buses))
    out = reset_gpus(node, [3, 2, 1, 0], timeout_s=WAIT_S)
    assert out.ok is False
    assert out.detail == "not reset: " + "; ".join(
        f"GPU {i} (0000:{b[9:].lower()}): In use by another client" for i, b in buses.items())
    assert ran(args) == ["--gpu-reset", "-i", ",".join(buses.values())]


def test_not_supported_per_gpu_is_a_failed_reset(scenario_copy, smi):
    smi(answer(NOT_SUPPORTED, 255))
    node = live_tools(node_of(scenario_copy, bus_ids={4: "00000000:8B:00.0", 5: "00000000:8C:00.0"}))
    assert reset_gpus(node, [4, 5], timeout_s=WAIT_S) == StepOutcome(
        False, "not reset: GPU 4 (0000:8b:00.0): Not Supported; GPU 5 (0000:8c:00.0): Not Supported")


def test_partial_failure_names_both_and_is_not_done(scenario_copy, smi):
    smi(answer(MIXED, 255))
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0", 1: "00000000:01:00.0"}))
    assert reset_gpus(node, [0, 1], timeout_s=WAIT_S) == StepOutcome(
        False, "not reset: GPU 1 (0000:01:00.0): In use by another client (reset: GPU 0 (0000:1a:00.0))")


@pytest.mark.parametrize("body, why", [
    # An answer that names no GPU: not taken as a reset, and its first line says why.
    ("echo \"Unable to reset this GPU because it's being used by some other process\"\nexit 255",
     "(exit status 255: Unable to reset this GPU because it's being used by some other process)"),
    ("exit 0", "(exit status 0)"),  # silent success is not a reset nvidia-smi reported
    # A success line for another GPU does not count for this one.
    ("echo 'GPU 00000000:19:00.0 was successfully reset.'\nexit 0",
     "(exit status 0: GPU 00000000:19:00.0 was successfully reset.)"),
])
def test_a_gpu_the_answer_does_not_name_was_not_reset(scenario_copy, smi, body, why):
    smi(body)
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"}))
    assert reset_gpus(node, [0], timeout_s=WAIT_S) == StepOutcome(
        False, f"not reset: GPU 0 (0000:1a:00.0): nvidia-smi did not say it was reset {why}")


def test_nvidia_smi_missing_is_not_done(scenario_copy, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    out = reset_gpus(live_tools(node_of(scenario_copy)), [0], timeout_s=WAIT_S)
    assert out == StepOutcome(None, "not reset: nvidia-smi: not installed (not on PATH)")


def test_nvidia_smi_that_does_not_answer_is_ended_with_its_group_and_not_done(scenario_copy, smi, tmp_path):
    pids = tmp_path / "pids"
    smi(f"sleep 600 &\necho \"$$ $!\" > {shlex.quote(str(pids))}.tmp\nmv {shlex.quote(str(pids))}.tmp "
        f"{shlex.quote(str(pids))}\nwait")
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"}))
    out = reset_gpus(node, [0], timeout_s=5.0)
    assert out.ok is None and out.detail.startswith("reset not confirmed: nvidia-smi: no answer within")
    shell, child = map(int, pids.read_text().split())  # it had started (and backgrounded its child) before the end
    assert gone(shell) and gone(child)  # the whole process group was ended and reaped


def test_a_recorded_node_replays_its_recorded_reset(scenario_copy):
    node = node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"})
    record_tool(node.root, recovery.RESET_NAME, SUCCESS.read_text(), 0)
    assert reset_gpus(node, [0], timeout_s=WAIT_S) == StepOutcome(True, "reset GPU 0 (0000:1a:00.0)")
    record_tool(node.root, recovery.RESET_NAME, IN_USE.read_text(), 255)
    assert reset_gpus(node, [0], timeout_s=WAIT_S).detail == (
        "not reset: GPU 0 (0000:1a:00.0): In use by another client")


def test_a_recorded_hang_and_a_recorded_missing_tool_are_not_done(scenario_copy):
    node = node_of(scenario_copy)
    out = reset_gpus(node, [0], timeout_s=WAIT_S)
    assert out == StepOutcome(None, "not reset: nvidia-smi: not installed (no recorded tools/nvidia-smi-gpu-reset.out)")
    record_tool(node.root, recovery.RESET_NAME, hang=True)
    out = reset_gpus(node, [0], timeout_s=0.3)
    assert out.ok is None and "no answer within" in out.detail and "[recorded hang]" in out.detail


def test_nothing_to_reset_is_refused_not_done(scenario_copy):
    node = node_of(scenario_copy)
    assert reset_gpus(node, [], timeout_s=WAIT_S) == StepOutcome(False, "not reset: no GPU named")
    assert reset_gpus(node, [-1], timeout_s=WAIT_S).ok is False


HUGE_LINE = "python3 -c \"import sys; sys.stdout.write('GPU ' + '0' * (8 << 20))\""
BINARY = "python3 -c \"import sys; sys.stdout.buffer.write(bytes(range(256)) * 8192)\"\nexit 255"
LONG_REASONS = ("python3 -c \"import sys; [print('GPU 00000000:1A:00.0: ' + 'x' * 100000) for _ in range(50)]\"\n"
                "exit 255")
SUCCESS_THEN_JUNK = (f"cat {shlex.quote(str(SUCCESS))}\n"
                     "python3 -c \"import sys; sys.stdout.buffer.write(b'\\xff\\x00' * (2 << 20))\"\nexit 0")


@pytest.mark.parametrize("body, ok", [
    (HUGE_LINE + "\nexit 0", False), (BINARY, False), (LONG_REASONS, False), (SUCCESS_THEN_JUNK, True)])
def test_hostile_answers_are_bounded(scenario_copy, smi, body, ok):
    smi(body)
    node = live_tools(node_of(scenario_copy, bus_ids={0: "00000000:1A:00.0"}))
    out = reset_gpus(node, [0], timeout_s=WAIT_S)
    assert out.ok is ok
    assert len(out.detail) <= recovery.MAX_DETAIL_CHARS + 3 and out.detail.isprintable()
    assert out.detail.startswith("reset GPU 0" if ok else "not reset: GPU 0 (0000:1a:00.0): ")


def test_an_answer_larger_than_the_runner_reads_is_not_done(scenario_copy, smi):
    smi("head -c 70000000 /dev/zero\nexit 0")
    out = reset_gpus(live_tools(node_of(scenario_copy)), [0], timeout_s=WAIT_S)
    assert out.ok is None and "printed more than 64 MiB" in out.detail


# -- reboot -------------------------------------------------------------------------------------------------------


def test_reboot_accepted_means_the_command_said_yes():
    out = reboot([sys.executable, "-c", "print('queued')"], timeout_s=WAIT_S)
    assert out.ok is True and out.detail.startswith("reboot accepted: ")


def test_reboot_refused_names_the_command_and_what_it_said():
    # systemctl's answer when logind refuses an unprivileged caller
    cmd = ["sh", "-c", "echo 'Failed to reboot system via logind: Interactive authentication required.' >&2; exit 1"]
    assert reboot(cmd, timeout_s=WAIT_S) == StepOutcome(
        False, "reboot refused: sh exited with status 1: Failed to reboot system via logind: Interactive "
               "authentication required.")


def test_reboot_command_missing_or_hanging_is_not_done(tmp_path):
    assert reboot([str(tmp_path / "no-such-reboot")], timeout_s=WAIT_S).ok is None
    pid_file = tmp_path / "pid"
    out = reboot(["sh", "-c", f"echo $$ > {shlex.quote(str(pid_file))}; sleep 600"], timeout_s=2.0)
    assert out.ok is None and "no answer within" in out.detail
    assert gone(int(pid_file.read_text()))


@pytest.mark.parametrize("command", [[], "systemctl reboot", ["systemctl", ""], ["sys\0temctl"]])
def test_a_reboot_command_that_is_not_a_list_of_words_is_refused(command):
    out = reboot(command, timeout_s=WAIT_S)
    assert out.ok is False and out.detail.startswith("reboot: no command configured")


# -- service ticket -----------------------------------------------------------------------------------------------

FINDING = {"check": "xid", "code": "xid-79", "entity": {"kind": "gpu", "id": "GPU-566e6f65", "pci": "0000:19:00.0"},
           "message": "GPU has fallen off the bus", "action": "SERVICE", "evidence": {"xid": 79, "count": 1}}
HOOK = ("import json, sys, pathlib\n"
        "data = sys.stdin.buffer.read()\n"
        "pathlib.Path(sys.argv[1]).write_bytes(data)\n"
        "print('TICKET-' + json.loads(data)['code'])\n"
        "print('second line is not the id')\n")


def test_ticket_hook_gets_the_finding_as_json_and_its_first_line_is_the_ticket(tmp_path):
    got = tmp_path / "stdin.json"
    out = open_ticket([sys.executable, "-c", HOOK, str(got)], FINDING, timeout_s=WAIT_S)
    assert out == StepOutcome(True, "TICKET-xid-79")
    assert json.loads(got.read_bytes()) == FINDING


def test_ticket_hook_failing_is_no_ticket(tmp_path):
    out = open_ticket(["sh", "-c", "echo 'queue full' >&2; exit 3"], FINDING, timeout_s=WAIT_S)
    assert out == StepOutcome(False, "no ticket: sh exited with status 3: queue full")
    out = open_ticket(["sh", "-c", "kill -TERM $$"], FINDING, timeout_s=WAIT_S)
    assert out == StepOutcome(False, "no ticket: sh was killed by signal 15")


def test_ticket_hook_that_reads_nothing_and_prints_nothing_still_opened():
    out = open_ticket(["true"], FINDING, timeout_s=WAIT_S)
    assert out == StepOutcome(True, "ticket opened (the hook printed no id)")


def test_ticket_hook_missing_or_hanging_is_not_done(tmp_path):
    assert open_ticket([str(tmp_path / "no-hook")], FINDING, timeout_s=WAIT_S).ok is None
    pid_file = tmp_path / "pid"
    out = open_ticket(["sh", "-c", f"echo $$ > {shlex.quote(str(pid_file))}; sleep 600"], FINDING, timeout_s=2.0)
    assert out.ok is None and "no answer within" in out.detail
    assert gone(int(pid_file.read_text()))


def test_a_large_finding_is_cut_to_its_plain_fields_and_says_so(tmp_path):
    got = tmp_path / "stdin.json"
    big = {**FINDING, "message": "m" * 5000, "evidence": {"lines": ["x" * 1000] * 1000}}
    out = open_ticket([sys.executable, "-c", HOOK, str(got)], big, timeout_s=WAIT_S)
    assert out.ok is True
    sent = got.read_bytes()
    assert len(sent) <= recovery.MAX_TICKET_INPUT
    assert json.loads(sent) == {"check": "xid", "code": "xid-79", "action": "SERVICE", "message": "m" * 1024,
                                "truncated": True}


def test_values_json_cannot_hold_are_sent_as_text(tmp_path):
    got = tmp_path / "stdin.json"
    odd = {**FINDING, "evidence": {"ratio": float("nan"), "peak": float("inf"), "seen": {3}, 7: "seven",
                                   "huge": 10 ** 5000}}
    out = open_ticket([sys.executable, "-c", HOOK, str(got)], odd, timeout_s=WAIT_S)
    assert out.ok is True
    assert json.loads(got.read_bytes())["evidence"] == {
        "ratio": "nan", "peak": "inf", "seen": "{3}", "7": "seven", "huge": "an integer too large to write"}


@pytest.mark.parametrize("script", [
    "import sys; sys.stdout.write('T' * (4 << 20))",  # one huge line
    "import sys; sys.stdout.buffer.write(b'\\x1b[2J\\x00\\xff' * 100000)",  # binary and terminal escapes
])
def test_a_hostile_hook_answer_is_bounded(script):
    out = open_ticket([sys.executable, "-c", script], FINDING, timeout_s=WAIT_S)
    assert out.ok is True
    assert len(out.detail) <= recovery.MAX_ID_CHARS and out.detail.isprintable()

"""Sources on real inputs: the live /dev/kmsg of this machine where readable, real subprocesses, real
dcgmi JSON, and recorded forms of each."""
from __future__ import annotations

import os
import shutil
import sys
import uuid

import pytest
from conftest import ROOT
from gpuwarden.agent.core.errors import ParseError, SourceError, ToolError, ToolMissing
from gpuwarden.agent.sources.dcgm import Dcgm
from gpuwarden.agent.sources.kmsg import DEV_KMSG, KernelLog, KmsgFollower
from gpuwarden.agent.sources.kmsg_cursor import Cursor
from gpuwarden.agent.sources.sysfs import Sysfs
from gpuwarden.agent.sources.tools import ToolRunner

DCGMI = ROOT / "fixtures" / "tools" / "dcgmi"
live_kmsg = pytest.mark.skipif(not os.access(DEV_KMSG, os.R_OK), reason="/dev/kmsg not readable here")


# -- kernel log ---------------------------------------------------------------------------------------
def kmsg_lines(first_seq: int, n: int, boot_text: str = "msg") -> str:
    return "".join(f"6,{s},{s * 1000},-;{boot_text} {s}\n" for s in range(first_seq, first_seq + n))


def test_follower_on_a_growing_file_takes_complete_lines_once(tmp_path):
    path = tmp_path / "kmsg"
    path.write_text(kmsg_lines(1, 3))
    follower = KmsgFollower(KernelLog(path, live=False, boot_id="b1"))
    assert [r.seq for r in follower.poll()] == [1, 2, 3]
    assert follower.poll() == []
    with open(path, "a") as f:
        f.write(kmsg_lines(4, 1) + "6,5,5000,-;half a li")  # the writer is mid-line
    assert [r.seq for r in follower.poll()] == [4]
    with open(path, "a") as f:
        f.write("ne\n")
    (rec,) = follower.poll()
    assert (rec.seq, rec.message) == (5, "half a line")
    assert follower.cursor == Cursor("b1", 5)


def test_follower_resumes_after_its_cursor_and_restarts_on_a_new_boot(tmp_path):
    path = tmp_path / "kmsg"
    path.write_text(kmsg_lines(1, 10))
    resumed = KmsgFollower(KernelLog(path, live=False, boot_id="b1"), Cursor("b1", 7))
    assert [r.seq for r in resumed.poll()] == [8, 9, 10]  # nothing repeated, nothing missed
    other_boot = KmsgFollower(KernelLog(path, live=False, boot_id="b2"), Cursor("b1", 7))
    assert len(other_boot.poll()) == 10  # a cursor from another boot means nothing here


def test_follower_starts_over_when_the_file_is_replaced(tmp_path):
    path = tmp_path / "kmsg"
    path.write_text(kmsg_lines(1, 5))
    follower = KmsgFollower(KernelLog(path, live=False, boot_id=None))
    assert len(follower.poll()) == 5
    path.write_text(kmsg_lines(6, 2))  # shorter than before: rotated
    assert [r.seq for r in follower.poll()] == [6, 7]


def test_unreadable_kernel_log_is_a_source_error_naming_the_file(tmp_path):
    with pytest.raises(SourceError, match="kmsg.*missing"):
        KernelLog(tmp_path / "kmsg", live=False).records()
    (tmp_path / "kmsg").mkdir()
    with pytest.raises(SourceError, match="kmsg"):
        KmsgFollower(KernelLog(tmp_path / "kmsg", live=False)).poll()


@live_kmsg
def test_live_dev_kmsg_reads_this_machines_kernel_log():
    records = KernelLog(DEV_KMSG, live=True).records()
    assert records, "the kernel log since boot is never empty"
    seqs = [r.seq for r in records]
    assert seqs == sorted(seqs) and all(r.usec is not None for r in records)


@live_kmsg
@pytest.mark.skipif(not os.access(DEV_KMSG, os.W_OK), reason="cannot write a marker to /dev/kmsg")
def test_live_follower_sees_a_new_record_exactly_once():
    follower = KmsgFollower(KernelLog(DEV_KMSG, live=True))
    try:
        follower.poll()  # catch up with everything since boot
        marker = f"gpuwarden-test follower marker {uuid.uuid4()}"
        with open(DEV_KMSG, "w") as k:
            k.write(f"<6>{marker}\n")
        seen = [r for r in follower.poll() if marker in r.message]
        assert len(seen) == 1 and seen[0].priority == 6
        assert not [r for r in follower.poll() if marker in r.message]
    finally:
        follower.close()


# -- sysfs ----------------------------------------------------------------------------------------------
def test_sysfs_reads_under_its_root_and_names_the_path(tmp_path):
    (tmp_path / "sys/class/x").mkdir(parents=True)
    (tmp_path / "sys/class/x/value").write_text("0x15b3\n")
    (tmp_path / "sys/class/x/text").write_text("4: ACTIVE")  # captures without the trailing newline
    fs = Sysfs(tmp_path)
    assert fs.read_int("/sys/class/x/value") == 0x15B3
    assert fs.read("/sys/class/x/text") == "4: ACTIVE"
    assert fs.listdir("/sys/class/none") == []
    with pytest.raises(SourceError) as exc:
        fs.read("/sys/class/x/absent")
    assert str(tmp_path / "sys/class/x/absent") in str(exc.value)
    with pytest.raises(SourceError, match="expected an integer"):
        fs.read_int("/sys/class/x/text")


# -- tools ----------------------------------------------------------------------------------------------
def test_tool_runner_runs_real_commands_without_a_shell():
    out = ToolRunner().run("echo", [sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], timeout_s=30)
    assert out.output.strip() == "hi" and out.returncode == 3


def test_tool_runner_times_out_and_reports_missing_tools():
    with pytest.raises(ToolError, match="no answer within 0.5s"):
        ToolRunner().run("sleep", [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    with pytest.raises(ToolMissing, match="not installed"):
        ToolRunner().run("nope", ["gpuwarden-no-such-tool"], timeout_s=5)


def test_recorded_tool_runner_replays_output_rc_and_hang(tmp_path):
    (tmp_path / "dcgmi-diag-r2.out").write_text("some output\n")
    (tmp_path / "dcgmi-diag-r2.rc").write_text("226\n")
    (tmp_path / "nvbandwidth.hang").write_text("")
    tools = ToolRunner(recorded_dir=tmp_path)
    out = tools.run("dcgmi-diag-r2", ["dcgmi", "diag", "-r", "2", "-j"], timeout_s=5)
    assert (out.output, out.returncode) == ("some output\n", 226)
    with pytest.raises(ToolError, match="recorded hang"):
        tools.run("nvbandwidth", ["nvbandwidth"], timeout_s=0.1)
    with pytest.raises(ToolMissing):
        tools.run("all_reduce_perf", ["all_reduce_perf"], timeout_s=1)


# -- dcgm -----------------------------------------------------------------------------------------------
def test_dcgm_diag_reads_real_dcgmi_json(tmp_path):
    shutil.copy(DCGMI / "virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json",
                tmp_path / "dcgmi-diag-r2.out")
    data = Dcgm(ToolRunner(recorded_dir=tmp_path)).diag(2, timeout_s=5)
    categories = data["DCGM GPU Diagnostic"]["test_categories"]
    assert categories[0]["category"] == "Deployment"


def test_dcgm_diag_garbage_and_failures_are_clear_errors(tmp_path):
    text = (DCGMI / "virtualclient__dcgmi-diag-r2-j__DCGM-3.x-schema__1xT4__pass.json").read_text()
    (tmp_path / "dcgmi-diag-r2.out").write_text(text[: len(text) // 2])  # truncated mid-document
    with pytest.raises(ParseError, match="dcgmi-diag-r2.*malformed JSON"):
        Dcgm(ToolRunner(recorded_dir=tmp_path)).diag(2, timeout_s=5)
    (tmp_path / "dcgmi-diag-r2.out").write_text("Error: unable to connect to host engine\n")
    (tmp_path / "dcgmi-diag-r2.rc").write_text("255\n")
    with pytest.raises(ToolError, match="exited 255.*host engine"):
        Dcgm(ToolRunner(recorded_dir=tmp_path)).diag(2, timeout_s=5)
    with pytest.raises(ToolMissing):
        Dcgm(ToolRunner(recorded_dir=tmp_path / "none")).diag(2, timeout_s=5)


def test_tool_output_is_bounded_and_a_recorded_status_must_be_a_number(tmp_path, monkeypatch):
    from gpuwarden.agent.sources import tools as tools_mod

    monkeypatch.setattr(tools_mod, "MAX_OUTPUT_BYTES", 1000)
    with pytest.raises(ToolError, match="printed more than"):
        ToolRunner().run("chatty", [sys.executable, "-c", "print('x' * 5000)"], timeout_s=30)
    (tmp_path / "chatty.out").write_text("y" * 5000)
    with pytest.raises(ToolError, match="printed more than"):
        ToolRunner(recorded_dir=tmp_path).run("chatty", ["chatty"], timeout_s=5)
    (tmp_path / "dcgmi.out").write_text("{}")
    for rc in ("²\n", "1" * 5000, "\xff"):
        (tmp_path / "dcgmi.rc").write_text(rc, errors="surrogateescape")
        with pytest.raises(ToolError, match="not an exit status"):
            ToolRunner(recorded_dir=tmp_path).run("dcgmi", ["dcgmi"], timeout_s=5)


# -- a recorded root is a bundle from another machine: nothing outside it is read -------------------------------
def scenario_with_links(tmp_path):
    root, outside = tmp_path / "scenario", tmp_path / "outside"
    (root / "sys/a").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("secret\n")
    (root / "sys/a/inside").write_text("4: ACTIVE\n")
    (root / "sys/a/escape").symlink_to(outside / "secret")
    (root / "sys/a/relative-escape").symlink_to("../../../outside/secret")
    (root / "sys/a/link-inside").symlink_to("inside")
    (root / "sys/dir-out").symlink_to(outside)
    os.mkfifo(root / "sys/a/fifo")
    return root


def test_sysfs_under_a_recorded_root_refuses_paths_that_resolve_outside(tmp_path):
    sysfs = Sysfs(scenario_with_links(tmp_path))
    assert sysfs.read("/sys/a/inside") == sysfs.read("/sys/a/link-inside") == "4: ACTIVE"
    for path in ("/sys/a/escape", "/sys/a/relative-escape", "/sys/dir-out/secret", "/sys/a/../../../outside/secret"):
        with pytest.raises(SourceError, match="resolves outside the recorded node"):
            sysfs.read(path)
        with pytest.raises(SourceError, match="resolves outside the recorded node"):
            sysfs.open_fd(path)
    with pytest.raises(SourceError, match="dir-out: resolves outside the recorded node"):
        sysfs.listdir("/sys/dir-out")
    with pytest.raises(SourceError, match="not a regular file"):  # a FIFO would block the read for good
        sysfs.read("/sys/a/fifo")
    assert sysfs.listdir("/sys/none") == []


def test_a_scenario_reached_through_a_symlink_is_read_normally(tmp_path):
    root = scenario_with_links(tmp_path)
    (tmp_path / "alias").symlink_to(root)
    assert Sysfs(tmp_path / "alias").read("/sys/a/link-inside") == "4: ACTIVE"


def test_live_root_is_not_confined():
    sysfs = Sysfs("/")
    assert sysfs._inside is None
    assert sysfs.read("/proc/self/comm")  # /proc/self is a link out of /proc: live, that is the kernel's own


def test_recorded_kmsg_and_tool_output_that_lead_outside_are_refused(tmp_path):
    root = scenario_with_links(tmp_path)
    (root / "kmsg").symlink_to(tmp_path / "outside" / "secret")
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        KernelLog(root / "kmsg", live=False).raw_text()
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        KmsgFollower(KernelLog(root / "kmsg", live=False)).poll()
    (root / "tools").mkdir()
    (root / "tools" / "nvbandwidth.out").symlink_to(tmp_path / "outside" / "secret")
    with pytest.raises(ToolError, match="resolves outside the recorded node"):
        ToolRunner(recorded_dir=root / "tools").run("nvbandwidth", ["nvbandwidth"], timeout_s=1)

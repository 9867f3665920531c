"""`gpuwarden analyze` of inputs that may never end: a device (/dev/zero, /dev/urandom), a FIFO whose writer never
closes it, a folder, and `-` (standard input) from a stream that never ends or never writes. Each returns in bounded
time, undecided (exit 2), with an error that names the input; `-` from a finite pipe gives the findings the saved
file gives.

The real command runs in a process of its own (the installed console script, which reads a large first FILE ahead
before the CLI loads), each run with a timeout: a run that never returns fails its test at the timeout, it does not
hang the suite. The timeouts are generous (the 1 GiB of an endless pipe is copied in a few seconds here; a loaded
2-CPU machine may take ten times that) and nothing is timed: a run either returns or it does not."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT
from gpuwarden.agent.cli import analyze as analyze_mod
from gpuwarden.agent.core.model import Status

INSTALLED = Path(sys.executable).parent / "gpuwarden"
COMMAND = [str(INSTALLED)] if INSTALLED.exists() else [sys.executable, "-m", "gpuwarden.agent.cli"]
RUN_TIMEOUT_S = 240  # a run that never returns fails here
KERNEL = ROOT / "fixtures" / "logs" / "kernel"
XID79 = KERNEL / "gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt"
JOB_LOG = ROOT / "fixtures" / "job_logs" / (
    "arctictraining__219__watchdog-stuck-480s-plus-rank2-allgather-timeout-1800s.log")
DCGMI_TEXT = ROOT / "fixtures" / "tools" / "dcgmi" / (
    "stas00__dcgmi-diag-r2__text__FRAGMENT__gpu-memory-fail-gpu0-thermal-warning.txt")
XID_LINE = b"[ 1234.567890] NVRM: Xid (PCI:0000:91:00): 79, pid=1, GPU has fallen off the bus.\n"


def gpuwarden(*args: str, stdin=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], stdin=stdin if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"}, **kw)


def the_error(proc: subprocess.CompletedProcess) -> str:
    """The one result's error, from --json."""
    (result,) = json.loads(proc.stdout)["results"]
    assert result["status"] == "unknown" and not result["findings"], result
    return result["error"]


# ------------------------------------------------------------------------------------ paths that are not files


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_at_once(device):
    proc = gpuwarden("analyze", "--json", device)
    assert proc.returncode == 2, proc.stderr
    error = the_error(proc)
    assert error.startswith(f"{device}: not a regular file (a FIFO, device or folder may never end)"), error
    assert "gpuwarden analyze -" in error  # what to do instead


def test_a_fifo_whose_writer_never_closes_it_is_refused(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    # The writer holds the FIFO open (O_RDWR: its open does not wait for a reader) and writes a driver line, so a
    # reader would get data and then wait for ever for its end.
    writer = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                               "os.write(fd, sys.argv[2].encode())\nprint('open', flush=True)\ntime.sleep(3600)\n",
                               str(fifo), XID_LINE.decode()], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "open\n"
        proc = gpuwarden("analyze", "--json", str(fifo))
        assert proc.returncode == 2, proc.stderr
        assert the_error(proc).startswith(f"{fifo}: not a regular file"), proc.stdout
        # the text report says it too, with the verdict
        text = gpuwarden("analyze", str(fifo))
        assert text.returncode == 2 and "not a regular file" in text.stdout and "UNDECIDED" in text.stdout
    finally:
        writer.kill()
        writer.wait()


def test_a_fifo_with_no_writer_is_refused_without_waiting_for_one(tmp_path):
    fifo = tmp_path / "nobody.fifo"
    os.mkfifo(fifo)  # an open for reading would wait for a writer that never comes
    proc = gpuwarden("analyze", "--json", str(fifo))
    assert proc.returncode == 2 and the_error(proc).startswith(f"{fifo}: not a regular file")


def test_a_folder_is_refused_naming_it(tmp_path):
    proc = gpuwarden("analyze", "--json", str(tmp_path))
    assert proc.returncode == 2
    assert the_error(proc) == f"{tmp_path}: a folder, not a regular file: name the files in it (gpuwarden analyze " \
                              f"{tmp_path}/*)"


def test_a_device_among_files_leaves_the_files_judged(tmp_path):
    proc = gpuwarden("analyze", "--json", "/dev/zero", str(XID79))
    assert proc.returncode == 1  # the FAIL of the saved log; the device is UNKNOWN beside it
    zero, log = json.loads(proc.stdout)["results"]
    assert zero["status"] == "unknown" and "not a regular file" in zero["error"]
    assert log["status"] == "fail" and "79" in {f["code"] for f in log["findings"]}


# ------------------------------------------------------------------------------------ standard input


def test_stdin_that_never_ends_is_undecided_at_the_byte_bound():
    yes = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
    try:
        proc = gpuwarden("analyze", "--json", "-", stdin=yes.stdout)
    finally:
        yes.kill()
        yes.wait()
        yes.stdout.close()
    assert proc.returncode == 2, proc.stderr
    error = the_error(proc)
    assert error.startswith("-: standard input goes on past 1 GiB, the most gpuwarden reads of it"), error
    assert "nothing was judged" in error and "save the log to a file" in error
    assert json.loads(proc.stdout)["results"][0]["source"] == "- (standard input)"


def test_stdin_from_dev_zero_is_undecided_at_the_byte_bound():
    with open("/dev/zero", "rb") as zero:
        proc = gpuwarden("analyze", "-", stdin=zero)
    assert proc.returncode == 2, proc.stderr
    assert "-: standard input goes on past 1 GiB" in " ".join(proc.stdout.split())
    assert "UNDECIDED" in proc.stdout


def test_stdin_whose_writer_never_writes_nor_ends_is_undecided_at_the_deadline():
    """The deadline, in this process: the command's is 300 s. The writer end is held open and silent (what `sleep
    inf | gpuwarden analyze -` or `journalctl -f` between two lines is)."""
    r, w = os.pipe()
    os.write(w, XID_LINE)  # some of a log, then nothing more and no end
    try:
        result = analyze_mod.analyze_stdin(r, deadline_s=1.0)
    finally:
        os.close(r)
        os.close(w)
    assert result.status is Status.UNKNOWN and not result.findings
    assert result.error.startswith(f"-: standard input had not ended after 1 s ({len(XID_LINE)} bytes read)")
    assert result.source == "- (standard input)"


def test_stdin_past_a_bound_of_bytes_is_undecided_whatever_it_holds():
    """The bound counts every byte, a driver line's too: a long log past it is not judged in part."""
    r, w = os.pipe()

    def write() -> None:
        try:
            with open(w, "wb") as out:
                out.write(XID_LINE * 2000)  # 168 KB, then the end
        except BrokenPipeError:  # the reader stopped at its bound and closed its end
            pass

    writer = threading.Thread(target=write)
    writer.start()
    try:
        result = analyze_mod.analyze_stdin(r, max_bytes=64 << 10)
    finally:
        os.close(r)  # the writer gets EPIPE if it is still writing
        writer.join(30)
    assert result.status is Status.UNKNOWN and "goes on past 65536 bytes" in result.error


@pytest.mark.parametrize("path", [XID79, JOB_LOG, DCGMI_TEXT], ids=["kernel-log", "job-log", "dcgmi-text"])
def test_stdin_from_a_finite_pipe_gives_the_findings_of_the_file(path):
    saved = gpuwarden("analyze", "--json", str(path))
    cat = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE)
    try:
        piped = gpuwarden("analyze", "--json", "-", stdin=cat.stdout)
    finally:
        cat.stdout.close()
        cat.wait()
    assert piped.returncode == saved.returncode, (saved.stdout, piped.stdout)
    (want,), (got,) = json.loads(saved.stdout)["results"], json.loads(piped.stdout)["results"]
    assert got["source"] == want["source"].replace(str(path), "-")
    assert got["check"] == want["check"] and got["status"] == want["status"] and got["findings"]
    assert json.dumps(got["findings"]) == json.dumps(want["findings"]).replace(json.dumps(str(path))[1:-1], "-")


def test_stdin_job_log_whose_head_is_the_programs_output_is_found_as_in_the_file(tmp_path):
    """A job log whose first MiB is the program's own lines: its job-log lines are looked for through the whole
    input, which for standard input is read again from its copy."""
    path = tmp_path / "train.log"
    path.write_bytes(b"".join(b"step %d loss 2.%04d\n" % (i, i % 9973) for i in range(70_000)) + JOB_LOG.read_bytes())
    saved = gpuwarden("analyze", "--json", str(path))
    with open(path, "rb") as f:
        cat = subprocess.Popen(["cat"], stdin=f, stdout=subprocess.PIPE)
        try:
            piped = gpuwarden("analyze", "--json", "-", stdin=cat.stdout)
        finally:
            cat.stdout.close()
            cat.wait()
    (want,), (got,) = json.loads(saved.stdout)["results"], json.loads(piped.stdout)["results"]
    assert want["check"] == got["check"] == "job_log" and want["findings"]
    assert json.dumps(got["findings"]) == json.dumps(want["findings"]).replace(str(path), "-")
    assert piped.returncode == saved.returncode


def test_stdin_that_is_a_regular_file_is_read_as_the_file():
    saved = gpuwarden("analyze", "--json", str(XID79))
    with open(XID79, "rb") as f:
        redirected = gpuwarden("analyze", "--json", "-", stdin=f)
    assert redirected.returncode == saved.returncode == 1
    assert json.dumps(json.loads(redirected.stdout)["results"][0]["findings"]) == json.dumps(
        json.loads(saved.stdout)["results"][0]["findings"]).replace(str(XID79), "-")


def test_empty_stdin_is_undecided():
    proc = gpuwarden("analyze", "--json", "-", stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and the_error(proc) == "-: empty file"


def test_stdin_given_twice_is_refused():
    proc = gpuwarden("analyze", "-", str(XID79), "-")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "gpuwarden analyze: error: - (standard input) is given more than once" in proc.stderr


def test_a_file_named_dash_after_double_dash_is_still_standard_input(tmp_path):
    """`--` ends the options, not the meaning of `-`: a file of that name is `./-`. The installed command's
    read-ahead of a large first FILE leaves it alone too."""
    (tmp_path / "-").write_bytes(XID_LINE * 300_000)  # 25 MB: large enough to be read ahead, were it a FILE
    cmd = [*COMMAND, "analyze", "--json", "--", "-"]
    proc = subprocess.run(cmd, input=b"", capture_output=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 2 and json.loads(proc.stdout)["results"][0]["error"] == "-: empty file"
    dot = subprocess.run([*COMMAND, "analyze", "--json", "./-"], capture_output=True, timeout=RUN_TIMEOUT_S,
                         cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert dot.returncode == 1


def test_the_help_states_the_bounds_of_standard_input():
    proc = gpuwarden("analyze", "--help")
    text = " ".join(proc.stdout.split())
    assert f"up to {analyze_mod._size(analyze_mod.STDIN_MAX)} and for {analyze_mod.STDIN_DEADLINE_S:g} s" in text

"""`gpuwarden explain --job ID`'s window of a Slurm job (agent/act/adapters/slurm_job.py): its nodes, start and end,
exit code, steps and output files from `sacct -j ID --json` and `scontrol show job ID`.

Pure tests read the outputs of Slurm 22.05.8 recorded from a real failing two-node job (fixtures/slurm/*-22.05-job-*,
each with its source), through the real tool runner: the recorded answers are replayed by small stand-in programs in
place of sacct and scontrol. A newer-schema sacct document (hand-built, marked so in its source) covers 23.x/24.x.
The `slurm` tests run a real two-node job on the real local cluster (tests/slurm_cluster.py), whose slurm.conf has
no accounting storage: there sacct answers `Slurm accounting storage is disabled` and scontrol is the tool that
answers."""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT
from gpuwarden.agent.act.adapters.slurm_job import (
    SlurmJobError,
    SlurmJobUnknown,
    locate_outputs,
    merge,
    slurm_job,
    slurm_runner,
)
from gpuwarden.agent.act.adapters.slurm_job_records import (
    JobWindow,
    output_files,
    parse_sacct_exit_codes,
    parse_sacct_json,
    parse_scontrol_job,
)
from gpuwarden.agent.core.errors import GpuwardenError, ParseError
from slurm_cluster import poll, slurm_cluster  # noqa: F401  (the fixture)

FIX = ROOT / "fixtures" / "slurm"
WORK = "/tmp/slurm-record/work"  # where the recorded job ran
START, END = 1796559654.0, 1796559655.0  # the recorded job's, as accounting has them (Unix times)
DEADLINE_S = 120.0


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def answer(args: list[str], when: str) -> tuple[int, str, str]:
    """The recorded answer to `args` in the moment `when` names (fixtures/slurm/slurm-22.05-job-tool-errors.json)."""
    calls = json.loads(fixture("slurm-22.05-job-tool-errors.json"))["calls"]
    (c,) = [c for c in calls if c["args"] == args and when in c["when"]]
    return c["rc"], c["stdout"], c["stderr"]


@pytest.fixture
def utc(monkeypatch):
    """The recording's zone: scontrol prints local time."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def standin(tmp_path):
    """standin(sacct={args: (rc, stdout, stderr)}, scontrol={...}) -> a runner (the real one, slurm_runner) whose
    sacct and scontrol are small programs answering each argument list with a recorded answer; `"hang"` for an
    answer never comes."""
    def make(timeout_s: float = 10.0, **tools: dict[tuple[str, ...], tuple[int, str, str] | str]):
        paths = {}
        for tool, answers in tools.items():
            lines = ["#!/bin/sh", 'case "$*" in']
            for i, (args, answer) in enumerate(answers.items()):
                key = shlex.quote(" ".join(args))
                if answer == "hang":
                    lines.append(f"  {key}) exec sleep 600;;")
                    continue
                rc, out, err = answer
                (tmp_path / f"{tool}-{i}.out").write_text(out)
                (tmp_path / f"{tool}-{i}.err").write_text(err)
                lines.append(f"  {key}) cat '{tmp_path}/{tool}-{i}.out'; cat '{tmp_path}/{tool}-{i}.err' >&2; "
                             f"exit {rc};;")
            lines += ["esac", 'echo "stand-in: no recorded answer for: $*" >&2', "exit 2"]
            path = tmp_path / f"standin-{tool}"
            path.write_text("\n".join(lines) + "\n")
            path.chmod(0o755)
            paths[tool] = str(path)
        return slurm_runner(timeout_s=timeout_s, tools=paths)

    return make


SACCT_JSON = ("-j", "1", "--json")
SACCT_CODES = ("-j", "1", "--noheader", "--parsable2", "--format=JobID,ExitCode")
SHOW = ("show", "job", "1")
SACCT_FAILED = {SACCT_JSON: (0, fixture("sacct-22.05-job-failed.json"), ""),
                SACCT_CODES: (0, fixture("sacct-22.05-job-failed-exitcodes.txt"), "")}
# the local cluster, without slurmdbd
SACCT_DISABLED = {SACCT_JSON: answer(["sacct", "-j", "1", "--json"], "accounting_storage/none")}
SCONTROL_FAILED = {SHOW: (0, fixture("scontrol-show-job-22.05-failed.txt"), "")}


# -- sacct --json, 22.05 -----------------------------------------------------------------------------------------
def test_explain_sacct_22_05_gives_the_job_its_steps_and_the_failing_steps_nodes():
    w = parse_sacct_json(fixture("sacct-22.05-job-failed.json"), "1")
    assert (w.name, w.user, w.state, w.nodes) == ("gwfail", "root", "FAILED", ("n1", "n2"))
    assert (w.start, w.end) == (START, END)
    assert [(s.id, s.name, s.state, s.nodes) for s in w.steps] == [
        ("1.batch", "batch", "FAILED", ("n1",)), ("1.0", "ranks.sh", "FAILED", ("n1", "n2"))]
    # What 22.05's JSON says of the exit codes (every one 0:0, recorded): read as it is here, asked again as text
    # by slurm_job (next test).
    assert w.exit_code == "0:0" and {s.exit_code for s in w.steps} == {"0:0"}
    assert parse_sacct_exit_codes(fixture("sacct-22.05-job-failed-exitcodes.txt")) == {
        "1": "3:0", "1.batch": "3:0", "1.0": "3:0"}


def test_explain_sacct_22_05_a_running_job_has_no_end_and_no_exit_code_yet():
    w = parse_sacct_json(fixture("sacct-22.05-job-running.json"), "1")
    # Accounting lags the live job (recorded): still PENDING on its first node while its steps run on both.
    assert (w.state, w.nodes, w.end, w.exit_code) == ("PENDING", ("n1",), None, None)
    assert [(s.id, s.state, s.nodes, s.end, s.exit_code) for s in w.steps] == [
        ("1.batch", "RUNNING", ("n1",), None, None), ("1.0", "RUNNING", ("n1", "n2"), None, None)]


def test_explain_sacct_22_05_a_signalled_step_reads_its_signal():
    w = parse_sacct_json(fixture("sacct-22.05-job-cancelled.json"), "2")
    assert (w.name, w.state, w.nodes) == ("gwcancel", "CANCELLED", ("n3",))
    assert [(s.id, s.state, s.exit_code) for s in w.steps] == [("2.batch", "CANCELLED", "0:15"),
                                                               ("2.0", "CANCELLED", "0:15")]
    assert all(s.failed for s in w.steps)


def test_explain_sacct_22_05_a_job_accounting_does_not_have_is_none_not_an_error():
    assert parse_sacct_json(fixture("sacct-22.05-job-unknown.json"), "999999") is None  # "Nothing found with query"
    assert parse_sacct_json(fixture("sacct-22.05-job-failed.json"), "7") is None  # another job's document


# -- sacct --json, newer Slurm (hand-built from the schema; see its source) ---------------------------------------
def test_explain_sacct_newer_schema_state_lists_number_objects_and_step_ids():
    text = fixture("sacct-24.05-schema-job-failed.json")
    w = parse_sacct_json(text, "4242")
    assert (w.name, w.user, w.state, w.exit_code, w.nodes) == ("train-llm", "alice", "FAILED", "3:0",
                                                               ("gpu07", "gpu08"))
    assert (w.start, w.end) == (1796560000.0, 1796561802.0)
    assert [(s.id, s.state, s.exit_code, s.nodes) for s in w.steps] == [
        ("4242.extern", "COMPLETED", "0:0", ("gpu07", "gpu08")), ("4242.batch", "FAILED", "3:0", ("gpu07",)),
        ("4242.0", "FAILED", "3:0", ("gpu07", "gpu08")), ("4242.1", "CANCELLED", "0:15", ("gpu07",))]
    assert [s.id for s in w.failed_steps] == ["4242.batch", "4242.0", "4242.1"]
    # Times as {set, infinite, number} (the form of squeue's and of later data parsers' times): the same window.
    doc = json.loads(text)
    t = doc["jobs"][0]["time"]
    t["start"], t["end"] = ({"set": True, "infinite": False, "number": t[k]} for k in ("start", "end"))
    doc["jobs"][0]["steps"][2]["nodes"] = {"count": 2, "list": ["gpu07", "gpu08"]}  # no range: the list
    w2 = parse_sacct_json(json.dumps(doc), "4242")
    assert (w2.start, w2.end, w2.steps[2].nodes) == (w.start, w.end, ("gpu07", "gpu08"))


def test_explain_sacct_documents_that_are_not_sacct_s_are_a_clear_error():
    for text, what in (("not json", "not JSON"), ("[]", "not a JSON object"), ('{"jobs": 3}', "no job list"),
                       ('{"errors": [{"error": "Unable to contact slurmdbd"}], "jobs": []}', "accounting not read")):
        with pytest.raises(ParseError, match=what) as info:
            parse_sacct_json(text, "1")
        assert str(info.value).startswith("sacct -j 1 --json: ")


# -- scontrol show job ---------------------------------------------------------------------------------------------
def test_explain_scontrol_22_05_gives_nodes_batch_host_times_and_output_per_node(utc):
    w = parse_scontrol_job(fixture("scontrol-show-job-22.05-failed.txt"), "1")
    assert (w.name, w.user, w.state, w.exit_code, w.nodes, w.batch_host) == ("gwfail", "root", "FAILED", "3:0",
                                                                             ("n1", "n2"), "n1")
    assert (w.start, w.end) == (START, END)  # StartTime=2026-12-06T12:20:54 in UTC: accounting's Unix time
    assert w.stdout == w.stderr == f"{WORK}/gwfail-1-%N.out"  # slurmctld filled %x and %j, left %N
    assert w.stdout_files == (f"{WORK}/gwfail-1-n1.out", f"{WORK}/gwfail-1-n2.out")
    assert w.steps == ()


def test_explain_scontrol_times_are_local_time(monkeypatch):
    text = fixture("scontrol-show-job-22.05-failed.txt")
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        utc = parse_scontrol_job(text, "1")
        monkeypatch.setenv("TZ", "Europe/Berlin")  # December: UTC+1
        time.tzset()
        berlin = parse_scontrol_job(text, "1")
    finally:
        monkeypatch.undo()
        time.tzset()
    # StartTime=2026-12-06T12:20:54 read in UTC is accounting's Unix time (the recording ran in UTC).
    assert utc.start == parse_sacct_json(fixture("sacct-22.05-job-failed.json"), "1").start
    assert utc.start - berlin.start == 3600.0 and utc.end - berlin.end == 3600.0


def test_explain_scontrol_a_running_job_has_no_end_and_no_exit_code(utc):
    w = parse_scontrol_job(fixture("scontrol-show-job-22.05-running.txt"), "1")
    assert (w.state, w.nodes, w.start, w.end, w.exit_code) == ("RUNNING", ("n1", "n2"), START, None, None)


def test_explain_scontrol_records_of_other_jobs_or_junk_are_none():
    assert parse_scontrol_job(fixture("scontrol-show-job-22.05-failed.txt"), "2") is None
    assert parse_scontrol_job("\x00\xff garbage = = =\n" * 1000, "1") is None
    assert parse_scontrol_job("", "1") is None


# -- the two together, through the real runner -------------------------------------------------------------------
def test_explain_both_answer_slurmctld_wins_for_the_job_accounting_gives_the_steps(standin, utc):
    w = slurm_job("1", runner=standin(sacct=SACCT_FAILED, scontrol=SCONTROL_FAILED))
    assert (w.state, w.exit_code, w.nodes, w.batch_host) == ("FAILED", "3:0", ("n1", "n2"), "n1")
    assert (w.start, w.end) == (START, END)
    # 22.05's JSON exit codes of the FAILED steps read 0:0: asked again as text, the real ones.
    assert [(s.id, s.exit_code, s.nodes) for s in w.failed_steps] == [("1.batch", "3:0", ("n1",)),
                                                                     ("1.0", "3:0", ("n1", "n2"))]
    assert w.stdout_files == (f"{WORK}/gwfail-1-n1.out", f"{WORK}/gwfail-1-n2.out")
    assert w.sources == ("sacct -j 1 --json", "sacct -j 1 --noheader --parsable2 --format=JobID,ExitCode",
                         "scontrol show job 1")
    assert w.errors == ()
    assert json.loads(json.dumps(w.to_dict()))["steps"][1]["exit_code"] == "3:0"


def test_explain_slurmctld_forgot_the_job_accounting_still_has_it(standin):
    forgotten = {SHOW: answer(["scontrol", "show", "job", "1"], "MinJobAge")}  # "Invalid job id specified"
    w = slurm_job("1", runner=standin(sacct=SACCT_FAILED, scontrol=forgotten))
    assert (w.state, w.exit_code, w.nodes, w.start, w.end) == ("FAILED", "3:0", ("n1", "n2"), START, END)
    assert (w.stdout, w.stdout_files, w.batch_host) == (None, (), None)  # accounting does not keep them (22.05)
    assert w.errors == ("scontrol show job 1: slurm_load_jobs error: Invalid job id specified",)


def test_explain_no_accounting_scontrol_answers_alone(standin, utc):
    w = slurm_job("1", runner=standin(sacct=SACCT_DISABLED, scontrol=SCONTROL_FAILED))
    assert (w.state, w.exit_code, w.nodes, w.start, w.end) == ("FAILED", "3:0", ("n1", "n2"), START, END)
    assert w.steps == () and w.sources == ("scontrol show job 1",)
    assert w.errors == ("sacct -j 1 --json: Slurm accounting storage is disabled",)


def test_explain_a_job_neither_tool_knows_is_a_clear_error_naming_both(standin):
    unknown = {SHOW: answer(["scontrol", "show", "job", "1"], "MinJobAge")}
    with pytest.raises(SlurmJobUnknown) as info:
        slurm_job("1", runner=standin(sacct=SACCT_DISABLED, scontrol=unknown))
    msg = str(info.value)
    assert msg.startswith("Slurm job 1: not known to Slurm")
    assert "sacct -j 1 --json: Slurm accounting storage is disabled" in msg
    assert "scontrol show job 1: slurm_load_jobs error: Invalid job id specified" in msg
    assert info.value.job_id == "1" and set(info.value.errors) == {"sacct", "scontrol"}
    # Accounting's own "Nothing found" is an unknown job too.
    none_found = {("-j", "999999", "--json"): (0, fixture("sacct-22.05-job-unknown.json"), "")}
    with pytest.raises(SlurmJobUnknown, match="accounting has no such job"):
        slurm_job("999999", runner=standin(sacct=none_found, scontrol={("show", "job", "999999"): answer(
            ["scontrol", "show", "job", "999999"], "never had")}))


def test_explain_slurm_unreachable_is_an_error_not_an_unknown_job(standin):
    down = {SACCT_JSON: answer(["sacct", "-j", "1", "--json"], "slurmdbd stopped")}
    ctld_down = {SHOW: answer(["scontrol", "show", "job", "1"], "slurmctld stopped (SIGTERM)")}
    with pytest.raises(SlurmJobError) as info:
        slurm_job("1", runner=standin(sacct=down, scontrol=ctld_down))
    assert type(info.value) is SlurmJobError
    msg = str(info.value)
    assert msg.startswith("Slurm job 1: could not be read from Slurm")
    assert "Problem talking to the database: Connection refused" in msg
    assert "Unable to contact slurm controller (connect failure)" in msg


def test_explain_a_tool_that_hangs_is_killed_and_named(standin):
    with pytest.raises(SlurmJobError) as info:
        slurm_job("1", runner=standin(timeout_s=1.0, sacct={SACCT_JSON: "hang"}, scontrol={SHOW: "hang"}))
    assert str(info.value).count("no answer within 1s (killed)") == 2


def test_explain_a_bad_job_id_runs_no_tool():
    def runner(tool, args):
        raise AssertionError("ran")

    for bad in ("", "1;rm -rf /", "12 13", "-1", "4242.0", "x" * 100):
        with pytest.raises(SlurmJobError, match="not a Slurm job id"):
            slurm_job(bad, runner=runner)


def test_explain_runner_errors_of_the_project_are_reported_too():
    def runner(tool, args):
        raise GpuwardenError(f"{tool}: not allowed here")

    with pytest.raises(SlurmJobError, match="sacct: not allowed here; scontrol: not allowed here"):
        slurm_job("5", runner=runner)


def test_explain_merge_keeps_the_live_view_of_a_running_job(utc):
    acct = parse_sacct_json(fixture("sacct-22.05-job-running.json"), "1")
    ctl = parse_scontrol_job(fixture("scontrol-show-job-22.05-running.txt"), "1")
    w = merge(acct, ctl)
    assert (w.state, w.nodes, w.start, w.end, w.exit_code) == ("RUNNING", ("n1", "n2"), START, None, None)
    assert [s.id for s in w.steps] == ["1.batch", "1.0"] and not w.failed_steps


# -- output files --------------------------------------------------------------------------------------------------
def test_explain_output_patterns_are_filled_in_as_slurmstepd_does():
    # Observed on the 22.05 test cluster: sbatch --output="o-%u-%x-%j-%A-%a-%n-%t-%s-%N-%%.out" (job 2, "my job"):
    # scontrol showed the path below, and slurmstepd on the batch host (hostname "vm") wrote the file named after it.
    shown = "/w/o-root-my job-2-2-4294967294-%n-%t-%s-%N-%%.out"
    assert output_files(shown, ["vm"]) == ("/w/o-root-my job-2-2-4294967294-0-0-batch-vm-%.out",)
    # --output=j-%J-%j.out: scontrol shows j-%J-1.out, the batch step writes j-1-1.out.
    assert output_files("/w/j-%J-1.out", ["n1"], "1") == ("/w/j-1-1.out",)
    assert output_files("/w/o-%N.out", ["n1", "n2"]) == ("/w/o-n1.out", "/w/o-n2.out")
    assert output_files("/w/o-%3n.out", ["n1", "n2"]) == ("/w/o-000.out", "/w/o-001.out")
    assert output_files("/w/slurm-5.out", ["n1", "n2"]) == ("/w/slurm-5.out",)
    assert output_files("/w/a\\%N.out", ["n1"]) == ("/w/a%N.out",)  # a backslash: taken as it is
    assert output_files(None, ["n1"]) == () and output_files("/w/o-%N.out", []) == ()


def test_explain_locate_outputs_finds_22_05_host_named_files(tmp_path):
    (tmp_path / "gwfail-1-vm.out").write_text("rank 0 on n1\n")
    (tmp_path / "gwfail-2-vm.out").write_text("another job's\n")
    pattern = f"{tmp_path}/gwfail-1-%N.out"
    w = JobWindow("1", "gwfail", "root", "FAILED", "3:0", ("n1", "n2"), 1.0, 2.0, pattern, pattern, "n1", (),
                  ("scontrol show job 1",), output_files(pattern, ["n1", "n2"]), output_files(pattern, ["n1", "n2"]))
    found, missing = locate_outputs(w)
    assert found == (f"{tmp_path}/gwfail-1-vm.out",)
    assert missing == (f"{tmp_path}/gwfail-1-n1.out", f"{tmp_path}/gwfail-1-n2.out")
    (tmp_path / "gwfail-1-n2.out").write_text("rank 2 on n2\n")  # where names are node names: those files
    assert locate_outputs(w) == ((f"{tmp_path}/gwfail-1-n2.out",), (f"{tmp_path}/gwfail-1-n1.out",))


# -- the real cluster ----------------------------------------------------------------------------------------------
RANKS = """#!/bin/sh
echo "rank $SLURM_PROCID on $SLURMD_NODENAME"
sleep 1
[ "$SLURM_PROCID" = 3 ] && exit 3
exit 0
"""
JOB = "#!/bin/sh\nsrun --overcommit --ntasks-per-node=2 ./ranks.sh\nexit $?\n"


@pytest.fixture
def cluster(slurm_cluster):  # noqa: F811
    slurm_cluster.reset(deadline_s=DEADLINE_S)
    yield slurm_cluster
    slurm_cluster.reset(deadline_s=DEADLINE_S)


def _state(cluster, job: str) -> str | None:
    out = cluster.scontrol("show", "job", job, check=False).stdout
    for word in out.split():
        if word.startswith("JobState="):
            return word.partition("=")[2]
    return None


def test_explain_slurm_job_of_a_failed_two_node_job_on_the_real_cluster(cluster, tmp_path):
    config = cluster.scontrol("show", "config").stdout
    assert "accounting_storage/none" in config  # no slurmdbd here: scontrol must answer alone
    (tmp_path / "ranks.sh").write_text(RANKS)
    (tmp_path / "job.sh").write_text(JOB)
    for f in ("ranks.sh", "job.sh"):
        os.chmod(tmp_path / f, 0o755)
    submitted = time.time()
    proc = subprocess.run(["sbatch", "--parsable", "-N2", "-w", "n1,n2", "--job-name=gwfail",
                           "--output=%x-%j-%N.out", "./job.sh"], env=cluster.env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    poll(lambda: _state(cluster, job) == "FAILED", f"job {job} to fail", timeout_s=DEADLINE_S)
    runner = slurm_runner(timeout_s=30.0, slurm_conf=str(cluster.conf))
    w = slurm_job(job, runner=runner)  # MinJobAge=10: read before slurmctld forgets it
    assert (w.job_id, w.name, w.user, w.state, w.exit_code) == (job, "gwfail", "root", "FAILED", "3:0")
    assert (w.nodes, w.batch_host) == (("n1", "n2"), "n1")
    assert w.start is not None and w.end is not None
    assert submitted - 2 <= w.start <= w.end <= time.time() + 2  # whole seconds in local time
    assert w.stdout_files == (f"{tmp_path}/gwfail-{job}-n1.out", f"{tmp_path}/gwfail-{job}-n2.out")
    # Which tool answered: scontrol; sacct is named with what it said.
    assert w.sources == (f"scontrol show job {job}",)
    assert w.errors == (f"sacct -j {job} --json: Slurm accounting storage is disabled",)
    # 22.05's slurmstepd names the batch output after its host's short hostname (every slurmd here runs on this
    # machine): locate_outputs finds that file, the job's own srun names the failed task in it.
    found, missing = locate_outputs(w)
    host = socket.gethostname().split(".")[0]
    assert found == (f"{tmp_path}/gwfail-{job}-{host}.out",) and missing == w.stdout_files
    text = Path(found[0]).read_text()
    assert "srun: error: n2: task 3: Exited with exit code 3" in text
    assert sorted(line for line in text.splitlines() if line.startswith("rank ")) == [
        "rank 0 on n1", "rank 1 on n1", "rank 2 on n2", "rank 3 on n2"]
    # MinJobAge later slurmctld forgets it, and without accounting nothing knows it any more.
    poll(lambda: cluster.scontrol("show", "job", job, check=False).returncode != 0, f"slurmctld to forget {job}",
         timeout_s=DEADLINE_S, every_s=2.0)
    with pytest.raises(SlurmJobUnknown) as info:
        slurm_job(job, runner=runner)
    assert "Invalid job id specified" in str(info.value) and "accounting storage is disabled" in str(info.value)


def test_explain_slurm_job_unknown_to_the_real_cluster(cluster):
    with pytest.raises(SlurmJobUnknown) as info:
        slurm_job("999999", runner=slurm_runner(timeout_s=30.0, slurm_conf=str(cluster.conf)))
    assert str(info.value) == (
        "Slurm job 999999: not known to Slurm: slurmctld forgets a job MinJobAge after it ends, accounting keeps it "
        "only where slurmdbd runs (sacct -j 999999 --json: Slurm accounting storage is disabled; scontrol show job "
        "999999: slurm_load_jobs error: Invalid job id specified)")


def test_explain_slurm_job_with_slurmctld_stopped_or_hung_is_a_bounded_error(cluster):
    cluster.stop_ctld()
    with pytest.raises(SlurmJobError) as info:  # scontrol retries its connection a while, then says so itself
        slurm_job("1", runner=slurm_runner(timeout_s=60.0, slurm_conf=str(cluster.conf)))
    assert type(info.value) is SlurmJobError  # could not ask: not "unknown"
    assert "Unable to contact slurm controller" in str(info.value)
    assert "Slurm accounting storage is disabled" in str(info.value)
    cluster.start_ctld()
    cluster.hang_ctld()  # accepts connections and never answers: scontrol is killed at timeout_s
    try:
        with pytest.raises(SlurmJobError) as info:
            slurm_job("1", runner=slurm_runner(timeout_s=3.0, slurm_conf=str(cluster.conf)))
    finally:
        cluster.wake_ctld()
    assert "scontrol show job 1: no answer within 3s (killed)" in str(info.value)

"""`gpuwarden explain` on the real job-failure logs of fixtures/job_logs/ (each with its .source.txt: where it comes
from and what its thread found). A log whose source names a root cause gets that culprit; the others give a culprit
only where the log itself determines it, and say what they show otherwise."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT
from gpuwarden.agent.jobs.explain import explain
from gpuwarden.agent.jobs.joblog import read_job_log, read_text
from gpuwarden.agent.jobs.node_evidence import NodeEvidence

LOGS = ROOT / "fixtures" / "job_logs"


def _explain(name, nodes=()):
    return explain([read_job_log(LOGS / name)], nodes)


def _root_cause(name):
    return next(line for line in (LOGS / f"{name}.source.txt").read_text().splitlines()
                if line.startswith("root cause:"))


# (file, exit code, culprit kind, culprit fields, cause)
NAMED = [
    # source: "Let's see which node refuses to accept connections. We get the IP address from the error above"
    ("bigscience__jz-slurm-README__broken-network-node-refuses-connections-nccl-warn-connect-refused.log",
     1, "node", {"host": "10.148.3.247"}, "fabric"),
    # source: "We figured one of the gpus had a hardware problem" (no hostname in the log)
    ("bigscience__tr1-13B-chronicles__uncorrectable-ECC-crash-faulty-node-confirmed-by-admins.log",
     1, "gpu", {"host": None, "rank": None}, "hardware"),
    # source: "One of the GPUs crashed" - the failing process is local rank 3 ('[default3]')
    ("bigscience__tr11-176B-chronicles__2022-03-21-one-GPU-crashed-CUDA-unknown-error-default3-prefixed.log",
     1, "gpu", {"local_rank": 3, "host": None}, "hardware"),
    # source: sjeaugey, "`error 12` is a timeout. It means the NICs can't talk to each other." No node or port named.
    ("nccl__733__ib-completion-error12-vendor129-k8s-pod-nic-hardware-issue.log",
     1, "ib_port", {"host": None, "link": ["task-646--1-mhpnk", "172.17.127.143"]}, "fabric"),
    # source: "the NCCL error could be indeed caused by a remote rank crashing"; the crashing rank is not named
    ("nccl__795__socket-broken-pipe-and-connection-closed-by-remote-peer-after-remote-segfault-p4d.log",
     1, "rank", {"host": "10.200.84.247", "rank": None}, "software"),
    # not identified in the thread, but the log determines the link: status 12 (retry exceeded) from one peer
    ("nccl__1814__ib-completion-status12-vendor129-then-status5-vendor249-peer-ip-port.log",
     1, "ib_port", {"host": None, "link": ["hostname-test", "172.36.143.59"]}, "fabric"),
]


def _id(name):
    return name.split("__")[0] + "_" + name.split("__")[1]


@pytest.mark.parametrize("name,code,kind,fields,cause", NAMED, ids=[_id(n[0]) for n in NAMED])
def test_explain_names_the_culprit_a_log_determines(name, code, kind, fields, cause):
    x = _explain(name)
    assert x.exit_code == code, x.summary
    assert x.culprit["kind"] == kind
    for key, value in fields.items():
        assert x.culprit.get(key) == value, (key, x.culprit)
    assert x.cause == cause
    assert x.evidence and all(s.source.endswith(name) and s.line for s in x.evidence if s.step != "a")
    assert x.action


TIME_LIMIT = ("bigscience__meg_ds_zero_gpt2_perf_n16-1999616__slurm-time-limit-cancel-on-batch-host-with-nccl-init-"
              "hfi1-hcas.log")


def test_explain_a_time_limit_is_no_fault_and_the_batch_host_is_not_named():
    name = TIME_LIMIT
    assert "TIME LIMIT" in _root_cause(name) and "not a faulty node" in _root_cause(name)
    x = _explain(name)
    assert x.exit_code == 0 and x.culprit["kind"] == "none" and x.culprit["host"] is None
    assert "time limit" in x.summary and "r6i4n5 is only the host" in x.summary
    assert x.evidence[0].line == 35


UNDECIDED = {
    # every rank shown reached the same work: the rank they waited for is not in the lines
    "basicsr__737__watchdog-allreduce-PG-ID-GUID-default_pg-format.log": "same collective",
    "diffusers__12422__blocking-wait-timeout-TORCH_NCCL_BLOCKING_WAIT.log": "same collective",
    "llamafactory__7396__watchdog-allreduce-PG1-same-seqnum-all-ranks.log": "same collective",
    "ofa__271__watchdog-legacy-format-no-numel-1800000ms-8xV100.log": "same collective",
    "qwen-vl-finetune__194__failure-detected-by-watchdog-PG-status-flightrecorder-disabled.log": "same collective",
    # SeqNums of groups the legacy lines do not name cannot be compared
    "pytorch__118369__watchdog-mixed-seqnums-rank0-vs-rank7-multiple-PGs.log": "cannot be compared",
    # the watchdog thread itself was stuck: not a collective's timeout
    "distrifuser__6__heartbeat-monitor-timed-out-abort-future-timeout-torch2.3.log": "watchdog thread itself",
    "vlm-r1__257__watchdog-stuck-480s-heartbeat-terminal-wrapped-116cols.log": "watchdog thread itself",
    "arctictraining__219__watchdog-stuck-480s-plus-rank2-allgather-timeout-1800s.log": "watchdog thread itself",
    # all three ranks failed in the same second: torchrun's 'root cause' is only the first listed
    "mmsegmentation__3106__torchrun-childfailederror-three-ranks-same-second-sigabrt-single-host.log":
        "only the first in its list",
    # the named remote peer is the reporter's own host (an intra-node proxy socket)
    "nccl-tests__166__socketprogress-connection-closed-by-remote-peer-same-host-proxy-init-failure.log":
        "NCCL warned",
    "nccl__952__service-thread-error-progressing-connect-socket-transport-hostname-anonymised.log": "NCCL warned",
    # status 4 says which side to look at, not what failed
    "nccl-tests__252__ib-completion-error4-vendor81-then-service-thread-closed-2node.log": "ACS or the IOMMU",
    "nccl__302__mpirun-rank-prefixed-ib-hca-list-ring-busIds-then-modify-qp-invalid-argument.log": "ibv_modify_qp",
    "nccl__957__mpirun-timestamp-tagged-cuda-failure-invalid-argument-proxy-connect-some-nodes.log":
        "CUDA failure ('invalid argument') on tomte401",
    "nccl__1610__alltoall-timeout-date-prefixed-subgroup-PG-local-rank0-is-global-rank14.log": "rank 14",
    "uniworld__46__socket-errors-then-abort-complete-rank6-busId-b000-multinode.log": "NCCL operations failed",
}


@pytest.mark.parametrize("name", sorted(UNDECIDED), ids=_id)
def test_explain_names_no_culprit_where_the_log_does_not_determine_one(name):
    assert "root cause identified: no" in (LOGS / f"{name}.source.txt").read_text()
    x = _explain(name)
    assert x.exit_code == 2 and x.culprit["kind"] == "none", x.summary
    assert UNDECIDED[name] in x.summary, x.summary
    assert x.evidence, "the failure's lines are shown"


def test_explain_init_lines_alone_are_no_failure():
    x = _explain("nccl-tests__227__roce-init-lines-irdma-hca-list-and-commInitRank-busId-2node-L40.log")
    assert x.exit_code == 0 and x.cause is None


def test_explain_every_fixture_log_is_covered():
    names = {p.name for p in LOGS.glob("*.log")}
    assert names == {n[0] for n in NAMED} | set(UNDECIDED) | {
        TIME_LIMIT,
        "nccl-tests__227__roce-init-lines-irdma-hca-list-and-commInitRank-busId-2node-L40.log"}


def test_explain_reads_a_terminal_wrapped_log_whole():
    log = read_job_log(LOGS / "vlm-r1__257__watchdog-stuck-480s-heartbeat-terminal-wrapped-116cols.log")
    assert log.wrapped == 116
    beat = [e for e in log.events if e.kind == "heartbeat"]
    assert beat and beat[0].rank == 6 and beat[0].fields["stuck_s"] == 480 and beat[0].line == 1


def test_explain_a_paste_s_line_numbers_are_not_ranks_but_mpirun_s_tag_is():
    paste = read_job_log(LOGS / "llamafactory__7396__watchdog-allreduce-PG1-same-seqnum-all-ranks.log")
    assert sorted({e.rank for e in paste.events}) == [0, 3, 4]
    tagged = read_job_log(LOGS / "nccl__302__mpirun-rank-prefixed-ib-hca-list-ring-busIds-then-modify-qp-invalid-"
                                 "argument.log")
    assert {e.rank for e in tagged.events} == {56}


# ---- the reasoning with node evidence: a two-node job whose rank 3 stalled after an XID 79 on its GPU --------
STALL = (ROOT / "fixtures" / "jobs" / "explain-two-node-stall.log").read_text()


def _xid_on(host, pci, reachable=True):
    finding = {"check": "xid", "code": "79", "status": "FAIL", "action": "RESET_GPU",
               "message": "XID 79 (GPU has fallen off the bus) on GPU 1", "first_at": 1.0, "last_at": 2.0,
               "entity": {"kind": "gpu", "id": "GPU1", "index": 1, "pci": pci, "link": None}, "evidence": {}}
    if not reachable:
        return NodeEvidence.unreachable(host, f"http://{host}:9456/api/v1/findings", "connection refused")
    return NodeEvidence(host, f"http://{host}:9456/api/v1/findings", True, findings=(finding,))


def test_explain_a_hardware_finding_on_the_stalled_rank_s_gpu_names_that_gpu():
    x = explain([read_text(STALL, "job.out")], [_xid_on("node1", None) if False else NodeEvidence(
        "node1", "http://node1:9456", True), _xid_on("node2", "00000000:2A:00.0")])
    assert x.exit_code == 1
    assert x.culprit["kind"] == "gpu" and x.culprit["host"] == "node2" and x.culprit["rank"] == 3
    assert x.culprit["gpu"] == "00000000:2A:00.0" and x.cause == "hardware"
    assert [s.step for s in x.evidence][:2] == ["a", "b"]
    assert "RESET_GPU" in x.action and "--exclude=node2" in x.action
    assert any("rank 3 ran on node2" in s.text and "busId 0000:2a:00.0" in s.text for s in x.evidence)


def test_explain_with_the_node_unreachable_names_the_stalled_rank_and_says_so():
    x = explain([read_text(STALL, "job.out")], [NodeEvidence("node1", "http://node1:9456", True),
                                               _xid_on("node2", None, reachable=False)])
    assert x.exit_code == 1 and x.culprit["kind"] == "rank" and x.culprit["rank"] == 3
    assert x.culprit["host"] == "node2" and x.cause == "unknown"
    assert "Could not reach gpuwarden on: node2 (connection refused)" in x.summary
    assert x.unreachable[0]["host"] == "node2"
    assert x.evidence[0].source == "job.out" and x.evidence[0].line == 9


def test_explain_says_it_saw_no_fault_only_on_a_node_whose_evidence_it_read():
    # Logs alone: nothing was asked of node2, so its silence is not health.
    alone = explain([read_text(STALL, "job.out")])
    assert alone.culprit["host"] == "node2" and "saw no fault" not in alone.action
    assert "findings on that node were not read" in alone.action
    # Only node1's evidence read: still nothing known of node2.
    other = explain([read_text(STALL, "job.out")], [NodeEvidence("node1", "http://node1:9456", True)])
    assert "saw no fault" not in other.action and "not read" in other.action
    # node2 read and clean: now it may say so.
    read = explain([read_text(STALL, "job.out")], [NodeEvidence("node2", "http://node2:9456", True)])
    assert "gpuwarden saw no fault there in the job's window" in read.action


def test_explain_a_finding_on_another_node_than_the_stalled_rank_is_a_conflict():
    x = explain([read_text(STALL, "job.out")], [_xid_on("node1", "0000:18:00.0"), NodeEvidence("node2", "x", True)])
    assert x.exit_code == 2 and x.culprit["kind"] == "none"
    assert "different places" in x.summary and len(x.conflicts) == 2


def test_explain_a_node_finding_alone_names_its_gpu():
    x = explain([], [_xid_on("node2", "0000:2a:00.0")])
    assert x.exit_code == 1 and x.culprit["kind"] == "gpu" and x.culprit["host"] == "node2"


def test_explain_the_one_rank_missing_from_a_collective_is_named():
    lines = STALL.splitlines()[:4] + [
        f"[rank{r}]:[E1206 10:15:02.1 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
        "milliseconds before timing out." for r in (0, 1, 3)]
    x = explain([read_text("\n".join(lines) + "\n", "job.out")])
    assert x.exit_code == 1 and x.culprit["rank"] == 2 and x.culprit["host"] == "node2"


def test_explain_a_desync_report_names_its_lagging_rank():
    text = ("[rank0]:[E1206 10:00:00.1 ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation timeout:"
            " WorkNCCL(SeqNum=183, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600001 "
            "milliseconds before timing out.\n"
            "[rank0]:[E1206 10:00:00.2 ProcessGroupNCCL.cpp:2] [Rank 0] Rank 0\n"
            "To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:\n"
            "  - [7] finished collective #182, but didn't join collective #183 (count from 1)\n")
    x = explain([read_text(text, "desync.log")])
    assert x.exit_code == 1 and x.culprit["kind"] == "rank" and x.culprit["rank"] == 7


def test_explain_srun_s_first_bad_exit_and_a_node_failure():
    x = explain([read_text("srun: error: node7: task 5: Exited with exit code 1\n"
                           "srun: error: node3: tasks 0-3: Killed\n", "srun.err")])
    assert x.exit_code == 1 and x.culprit["rank"] == 5 and x.culprit["host"] == "node7"
    x = explain([read_text("srun: error: Node failure on node9\n"
                           "slurmstepd: error: *** JOB 77 ON node1 CANCELLED AT 2026-12-06T10:00:00 DUE TO NODE "
                           "FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\n", "srun.err")])
    assert x.exit_code == 1 and x.culprit == {**x.culprit, "kind": "node", "host": "node9"}


def test_explain_cli_json_contract(tmp_path):
    log = tmp_path / "job.out"
    log.write_text(STALL)
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "explain", str(log), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["culprit"]) >= {"kind", "host", "rank", "gpu", "port"}
    assert doc["culprit"]["kind"] == "rank" and doc["culprit"]["rank"] == 3
    assert doc["cause"] in ("hardware", "fabric", "software", "unknown")
    assert all(set(e) >= {"source", "line", "text"} for e in doc["evidence"])
    assert doc["action"]


@pytest.mark.parametrize("content", [b"", b"\x00" * 5000, bytes(range(256)) * 400,
                                     b"[rank1]:[E1206 10:15:02.1 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(def"])
def test_explain_hostile_logs_give_no_traceback(tmp_path, content):
    log = tmp_path / "bad.log"
    log.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "explain", str(log)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr


def test_explain_refuses_what_may_never_end(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path / "missing.log"):
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "explain", str(path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and str(path) in proc.stderr and "Traceback" not in proc.stderr


def test_explain_a_10mb_line_is_cut_and_said_so(tmp_path):
    log = tmp_path / "long.log"
    with log.open("wb") as f:
        f.write(b"x" * (10 << 20) + b"\n")
        f.write(b"srun: error: node7: task 5: Exited with exit code 1\n")
    x = explain([read_job_log(log)])
    assert x.exit_code == 1 and x.culprit["host"] == "node7"
    assert any("longer than" in n for n in x.notes)


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")),
                         ids=_id)
def test_analyze_recognises_a_job_log_and_judges_it_as_explain_does(name):
    x = _explain(name)
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "analyze", "--json", str(LOGS / name)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == x.exit_code, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)["results"][0]
    assert result["check"] == "job_log"
    if x.verdict == "culprit":
        assert result["findings"][0]["evidence"]["culprit"] == json.loads(json.dumps(x.culprit))


def test_explain_of_a_1m_line_log_reads_it_to_its_end(tmp_path):
    """Linear and bounded (speed and memory are bench/explain.py's): a 1M-line log with 5 % failure lines is read to
    its last lines, where its stalled rank's line is."""
    log = tmp_path / "big.log"
    with log.open("w") as f:
        subprocess.run([sys.executable, str(ROOT / "bench" / "gen_job_log.py"), "--lines", "1000000", "--mix",
                        "failures"], stdout=f, check=True, timeout=300)
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden.agent.cli", "explain", str(log), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out, err = proc.communicate(timeout=300)
    doc = json.loads(out)
    assert proc.returncode == 1, err
    assert doc["culprit"]["rank"] == 37 and doc["culprit"]["host"] == "gpu005"
    stalled = next(e for e in doc["evidence"] if e["step"] == "b" and "[rank37]" in e["text"])
    assert stalled["line"] > 999_000


@pytest.mark.parametrize("chunk", [61, 997, 4096])
def test_explain_reads_every_log_the_same_whatever_the_chunk_its_lines_are_read_in(chunk, monkeypatch):
    """The reader reads into one buffer chunk after chunk, a partial line carried to the next: the events, their
    lines and the line count are those of one read of the whole file, with lines cut at every place. (A hard-wrapped
    log is told by its first chunk: one shorter than its head is left out.)"""
    from gpuwarden.agent.jobs import joblog

    for path in sorted((ROOT / "fixtures" / "job_logs").glob("*.log")):
        whole = read_job_log(path)
        if whole.wrapped and chunk < path.stat().st_size:
            continue
        with monkeypatch.context() as m:
            m.setattr(joblog, "CHUNK", chunk)
            parts = read_job_log(path)
        assert (parts.lines, parts.events, parts.notes) == (whole.lines, whole.events, whole.notes), path.name


def test_explain_a_long_line_among_chunks_is_cut_and_the_lines_around_it_read(tmp_path, monkeypatch):
    from gpuwarden.agent.jobs import joblog

    log = tmp_path / "long.log"
    stalled = "[rank3]:[E1207 10:00:00.000000 1 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective "
    stalled += "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)"
    log.write_text(f"{stalled}\n" + "x" * 5000 + " Xid tail\n" + f"{stalled.replace('Rank 3', 'Rank 4')}\n")
    with monkeypatch.context() as m:
        m.setattr(joblog, "CHUNK", 300)
        m.setattr(joblog, "LINE_MAX", 1000)
        got = read_job_log(log)
    assert got.lines == 3 and [e.line for e in got.events if e.kind == "watchdog_timeout"] == [1, 3]
    assert any("a line of 5009 bytes, longer than 1000" in n for n in got.notes), got.notes


DESYNC = ("[rank0]:[E1206 10:00:00.2 ProcessGroupNCCL.cpp:2] [Rank 0] Rank 0\n"
          "To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:\n"
          "  - [7] finished collective #182, but didn't join collective #183 (count from 1)\n")


def _read_without_repeats_taken(text, monkeypatch):
    from gpuwarden.agent.jobs import joblog

    with monkeypatch.context() as m:
        m.setattr(joblog, "MADE_MAX", 0)
        return read_text(text, "job.out")


def test_explain_reads_a_repeated_line_as_it_read_it_the_first_time(monkeypatch):
    """A line met before is taken from what it meant then (a flood of one warning costs no parse a line), except the
    lines whose meaning depends on the ones around them (joblog_lines.reads_block): the events are those of a
    reading that parses every line, on each fixture log whole, twice over, followed by its own lines in reverse,
    on shuffled repeats of their lines, and on a desync report met again past its window."""
    import random

    texts = []
    logs = sorted(LOGS.glob("*.log"))
    for path in logs:
        t = path.read_text(errors="replace")
        texts += [t, t + t, t + "\n".join(reversed(t.splitlines())) + "\n"]
    filler = "".join(f"gpu1:1:1 [0] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer {i}\n"
                     for i in range(70))
    texts += [DESYNC + filler + DESYNC.splitlines()[-1] + "\n", DESYNC + filler + DESYNC]
    r = random.Random(7)
    lines = [line for path in logs for line in path.read_text(errors="replace").splitlines()] + DESYNC.splitlines()
    for _ in range(200):
        pick = [r.choice(lines) for _ in range(r.randrange(1, 300))]
        texts.append("\n".join(pick * r.randrange(1, 4)) + "\n")
    for text in texts:
        assert read_text(text, "job.out") == _read_without_repeats_taken(text, monkeypatch), text[:300]


def test_explain_keeps_a_floods_first_lines_and_its_last_in_place():
    """A flood of one kind of line from one process and peer keeps its first KEEP_FIRST lines and its last, the last
    in the place the fourth would have had: whether its lines repeat byte for byte (taken from the memory of
    repeats) or differ where the flood's key does not look (the thread id: parsed each time), and with a second
    flood interleaved."""
    from gpuwarden.agent.jobs.joblog import KEEP_FIRST

    def line(tid: int, peer: str) -> str:
        return f"gpu1:1:{tid} [0] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer {peer}<5000>\n"

    for tid_of in (lambda i: 1, lambda i: i):  # the same bytes each time; a new thread id each time
        text = "".join(line(tid_of(i), "node7") + line(tid_of(i), "node8") for i in range(1, 21))
        events = [(e.fields["peer"], e.line, e.text.split(" ")[0]) for e in read_text(text).events]
        first = [(peer, 2 * i - (peer == "node7"), f"gpu1:1:{tid_of(i)}") for i in range(1, KEEP_FIRST + 1)
                 for peer in ("node7", "node8")]
        last = [("node7", 39, f"gpu1:1:{tid_of(20)}"), ("node8", 40, f"gpu1:1:{tid_of(20)}")]
        assert events == first + last

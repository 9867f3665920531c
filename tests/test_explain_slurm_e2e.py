"""`gpuwarden explain --job ID` end to end on a real Slurm cluster (tests/slurm_cluster.py: a real slurmctld and
real slurmds n1, n2 on 127.0.0.1) with the real agent of each node: `gpuwarden run` speaking for n1 and for n2, each
on its own copy of a recorded GB200 tray (fixtures/nodes/gb200-nvl72-healthy), serving its findings on its
endpoint.

A two-node batch job runs four stand-in ranks (tests/standin_explain_rank.py, 2 a node) that write the NCCL and
ProcessGroupNCCL lines of a job that hung: rank 3, on n2's GPU 1 (busId 0009:01:00.0), stalled (its last completed
NCCL work is the lowest) after an XID 79 on that GPU, appended to n2's recorded kernel log while the job runs and
found by n2's own agent. Then `gpuwarden explain --job ID --json` reads the job's nodes, window and output from Slurm
(scontrol: this cluster has no accounting storage) and asks each node's agent. It must name n2, that GPU and XID 79
from n2's agent; with n2's agent stopped, say it could not reach n2 and still name rank 3 on n2 from the logs.

The cluster keeps ended jobs for Slurm's default MinJobAge (300 s), not the 10 s of the shared test cluster: explain
runs after the job ended, as it does for a failed job. explain runs in a mount namespace of its own whose /etc/hosts
gives the node names n1 and n2 the address 127.0.0.1 (the agents listen there, each on its own port), as a cluster's
resolver gives them their nodes'. Deadlines are generous; nothing is timed."""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from conftest import ROOT
from slurm_cluster import SlurmCluster, poll
from test_slurm_e2e import DEADLINE_S, Agent

# XID 79 on the recorded tray's GPU 1 (0009:01:00.0): rank 3's GPU, the second local rank on n2.
XID79_GPU1 = ("3,{seq},{usec},-;NVRM: Xid (PCI:0009:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
              "the bus.")
GPU1 = "0009:01:00.0"
STANDIN = ROOT / "tests" / "standin_explain_rank.py"


class _Cluster(SlurmCluster):
    """The test cluster with Slurm's default MinJobAge: an ended job stays known to slurmctld for 300 s."""

    def write(self) -> None:
        super().write()
        text = self.conf.read_text()
        assert "MinJobAge=10\n" in text, "tests/slurm_cluster.py's slurm.conf changed: update this"
        self.conf.write_text(text.replace("MinJobAge=10\n", "MinJobAge=300\n"))


@pytest.fixture(scope="module")
def explain_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    cluster = _Cluster(tmp_path_factory.mktemp("slurm"), live=("n1", "n2"), dead=())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(explain_cluster):
    explain_cluster.reset(deadline_s=DEADLINE_S)
    yield explain_cluster
    explain_cluster.reset(deadline_s=DEADLINE_S)


def window(agent: Agent) -> dict | None:
    """The agent's findings over the last hour (GET /api/v1/findings), None while it does not answer."""
    now = time.time()
    url = f"http://127.0.0.1:{agent.port}/api/v1/findings?since={now - 3600}&until={now + 60}"
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def xid79_on_gpu1(agent: Agent) -> bool:
    doc = window(agent) or {}
    return any(f.get("check") == "xid" and (f.get("entity") or {}).get("pci") == GPU1 and "79" in json.dumps(f)
               for f in doc.get("findings", []))


def state(cluster, job: str) -> str | None:
    for word in cluster.scontrol("show", "job", job, check=False).stdout.split():
        if word.startswith("JobState="):
            return word.partition("=")[2]
    return None


def explain(cluster, base: Path, job: str, nodes: str) -> tuple[int, dict, str]:
    """`gpuwarden explain --job JOB --nodes NODES --json` in its own mount namespace, where n1 and n2 are
    127.0.0.1: (exit status, its JSON, its stderr)."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed: explain runs where the node names resolve", pytrace=False)
    hosts = base / "hosts"
    hosts.write_text("127.0.0.1 localhost n1 n2\n")
    argv = [sys.executable, "-m", "gpuwarden.agent.cli", "explain", "--job", job, "--nodes", nodes, "--json",
            "--timeout", "20", "--log-format", "json"]
    script = f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && exec {shlex.join(argv)}"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=cluster.env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"explain printed no JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}") from None
    return proc.returncode, doc, proc.stderr


def test_explain_slurm_e2e_names_the_node_gpu_and_xid_79_then_rank_3_when_its_agent_is_down(cluster, tmp_path):
    agents = [Agent(tmp_path, cluster, node).start() for node in ("n1", "n2")]
    a1, a2 = agents
    try:
        for a in agents:
            poll(lambda a=a: window(a) is not None or a.proc.poll() is not None, f"{a.node}'s agent to answer",
                 timeout_s=DEADLINE_S)
            assert a.proc.poll() is None, a.log.read_text()[-3000:]
        work = tmp_path / "work"
        work.mkdir()
        go = tmp_path / "go"
        (work / "job.sh").write_text(f"#!/bin/sh\nulimit -c 0\nsrun --overcommit --ntasks-per-node=2 "
                                     f"{shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} {shlex.quote(str(go))}"
                                     "\n")
        (work / "job.sh").chmod(0o755)
        proc = subprocess.run(["sbatch", "--parsable", "-N2", "-w", "n1,n2", "--job-name=train", "--output=%x-%j.out",
                               "./job.sh"], env=cluster.env, cwd=work, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        out = work / f"train-{job}.out"
        poll(lambda: out.exists() and out.read_text().count("Init COMPLETE") == 4, "the four ranks' NCCL init",
             timeout_s=DEADLINE_S)
        a2.inject(XID79_GPU1)  # rank 3's GPU falls off the bus while the job runs
        poll(lambda: xid79_on_gpu1(a2), "n2's agent to find XID 79 on GPU 1", timeout_s=DEADLINE_S)
        go.touch()
        poll(lambda: state(cluster, job) == "FAILED", f"job {job} to fail", timeout_s=DEADLINE_S)
        log = out.read_text()
        assert "Exception (either an error or timeout) detected by watchdog" in log, log

        nodes = f"n1:{a1.port},n2:{a2.port}"
        rc, doc, err = explain(cluster, tmp_path, job, nodes)
        assert rc == 1, (doc, err)
        culprit = doc["culprit"]
        assert (culprit["kind"], culprit["host"], culprit["gpu"], culprit["rank"]) == ("gpu", "n2", GPU1, 3), doc
        assert doc["cause"] == "hardware" and doc["unreachable"] == [], doc
        # XID 79 from n2's own agent (its endpoint the source), agreeing with the rank the logs say stalled.
        (node,) = [e for e in doc["evidence"] if e["source"].startswith(f"http://n2:{a2.port}/api/v1/findings")]
        assert node["text"].startswith("gpuwarden on n2: xid 79 FAIL") and GPU1 in node["text"], node
        assert "XID 79 (GPU has fallen off the bus)" in node["text"], node
        assert "rank 3 stalled" in doc["summary"], doc["summary"]
        # The window, the nodes and the log came from Slurm (scontrol: no accounting here).
        assert (doc["job"]["id"], doc["job"]["state"], doc["job"]["nodes"]) == (job, "FAILED", ["n1", "n2"])
        assert doc["job"]["sources"] == [f"scontrol show job {job}"], doc["job"]
        assert doc["logs"] == [str(out)], doc["logs"]

        a2.stop()  # n2's agent down: the node's own evidence cannot be had, the logs still name the stalled rank
        rc, doc, err = explain(cluster, tmp_path, job, nodes)
        assert rc == 1, (doc, err)
        culprit = doc["culprit"]
        assert (culprit["kind"], culprit["rank"], culprit["host"]) == ("rank", 3, "n2"), doc
        assert culprit["gpu"] == GPU1, doc  # from the log's busId of rank 3
        (down,) = doc["unreachable"]
        assert down["host"] == "n2" and "connection refused" in down["error"], down
        assert "Could not reach gpuwarden on: n2" in doc["summary"], doc["summary"]
        assert not any(e["source"].startswith("http://") for e in doc["evidence"]), doc["evidence"]
    finally:
        for a in agents:
            a.stop()

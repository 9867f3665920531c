"""Time from a fault's first sign to the doomed job's action, through the real daemon on the recorded tray that runs
Slurm job 4242 (fixtures/nodes/gb200-nvl72-job), act mode, the local adapter's real SQLite scheduler, production
intervals (the jobs check polls every 10 s; the job is known before the fault, as on a node that has run it a while).

  xid   an XID 79 line appended to the followed kernel log -> the job's requeue recorded by the scheduler
        (the target: within one poll of the detecting check + 1 s; the kernel log is followed, so about 1 s)
  ib    an IB port of the job written down -> the requeue, minus the job's effective IB timeout (3.76 s here:
        NCCL_IB_TIMEOUT=17): the time past the moment the outage doomed the job (target: one 1 s poll + 1 s)

Run: .venv/bin/python bench/job_response.py [--runs N] [--json PATH]
Each run is a fresh daemon on a fresh copy of the tray; the figures are the p50 and the largest of the runs, taken
from outside the daemon (the wall clock around the fault and the scheduler's own record), and the daemon's own
gpuwarden_job_fault_to_action_seconds beside them."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.act.remediation import Settings
from gpuwarden.agent.core import config
from gpuwarden.agent.core.job import JobRef
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs, job_process
from rows import write_rows

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "fixtures" / "nodes" / "gb200-nvl72-job"
XID79 = "NVRM: Xid (PCI:0008:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
TIMEOUT_17 = 4.096e-6 * 2**17 * 7
JOB = JobRef("slurm", "4242", 0)


def _append_kmsg(root: Path, message: str) -> None:
    seq = usec = 0
    for line in (root / "kmsg").read_text().splitlines():
        fields = line.split(";", 1)[0].split(",")
        if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
            seq, usec = max(seq, int(fields[1])), max(usec, int(fields[2]))
    with open(root / "kmsg", "a") as f:
        f.write(f"3,{seq + 1},{usec + 1000},-;{message}\n")


def one(kind: str, work: Path) -> tuple[float, float | None]:
    """(seconds from the fault's first sign to the scheduler's record of the requeue, the daemon's own figure)."""
    root, state = work / "root", work / "state"
    shutil.copytree(SCENARIO, root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    for proc in (root / "proc").glob("1259?"):
        (proc / "environ").write_bytes((proc / "environ").read_bytes() + b"NCCL_IB_TIMEOUT=17\0")
    job_process.forget()
    cfg = config.defaults(all_specs())
    cfg.jobs["on_doomed"] = "requeue"
    cfg.agent["state_dir"] = str(state)
    store = Store(state / "state.db")
    adapter = LocalAdapter(state / "actions.jsonl", node_name="n1")
    d = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), cfg, store, adapter, DaemonCollector(),
               DaemonOptions(remediation=Settings(mode="act", node_name="n1", actions_path=state / "actions.jsonl")))
    d.start()
    try:
        deadline = time.monotonic() + 60
        while not ((r := d.results().get("jobs")) and r.state.get("jobs") and "ib_port" in d.results()):
            if time.monotonic() > deadline:
                raise RuntimeError("the job was not seen within 60 s")
            time.sleep(0.05)
        time.sleep(1.0)
        start = time.time()
        if kind == "xid":
            _append_kmsg(root, XID79)
        else:
            (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
            start += TIMEOUT_17  # the moment the outage doomed the job
        while adapter.job(JOB).state != "pending":
            if time.time() - start > 60:
                raise RuntimeError(f"{kind}: no requeue within 60 s")
            time.sleep(0.005)
        took = time.time() - start
        own = {s.labels.get("action"): s.value for s in d.engine.samples()
               if s.name == "gpuwarden_job_fault_to_action_seconds"}
        return took, own.get("requeue")
    finally:
        d.stop()
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    before = os.getloadavg()
    rows = []
    for kind, target, limit in (("xid", "<= 1 s (the kernel log is followed)", 1.0),
                                ("ib", "<= 2 s past the job's IB timeout (one 1 s poll + 1 s)", 2.0)):
        took, own = [], []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                t, o = one(kind, Path(tmp))
            took.append(t)
            own.append(o)
        p50, worst = statistics.median(took), max(took)
        what = "XID 79 line" if kind == "xid" else "IB port down past the job's NCCL IB timeout"
        print(f"{what} -> the job's requeue: p50 {p50 * 1000:.0f} ms, max {worst * 1000:.0f} ms over {args.runs} runs; "
              f"the daemon's own figure p50 {statistics.median(x for x in own if x is not None) * 1000:.0f} ms")
        rows.append({"measure": f"{what} -> job requeued (local scheduler), max of {args.runs}",
                     "ours": round(worst, 3), "unit": "s", "peer": None, "peer_name": None, "ratio": None,
                     "target": target,
                     "met": worst <= limit, "command": f".venv/bin/python bench/job_response.py --runs {args.runs}",
                     "detail": {"p50_s": round(p50, 3), "runs_s": [round(t, 3) for t in took],
                                "daemon_fault_to_action_s": own}})
    if args.json:
        write_rows(args.json, rows, before, nproc=os.cpu_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())

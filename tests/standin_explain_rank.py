"""A stand-in rank of a two-node PyTorch job (4 ranks, 2 a node) for the explain end-to-end test: run by srun, it
prints what a rank of a job that hung on one GPU prints, in the forms of the real logs in shared/data/job_logs
(NCCL's `Init COMPLETE` line with the rank's host, CUDA device and busId; ProcessGroupNCCL's watchdog timeout and
its `detected by watchdog at work` line, basicsr__737's form), then aborts as the watchdog takes a process down.

Rank 3 (the second node's second GPU) is the one that stalled: its last completed NCCL work is lower than the
others', and its watchdog fires first. Each rank waits for the file named by argv[1] before its failure, so the test
can put the fault on the node while the job runs.

The host is the Slurm node name (SLURMD_NODENAME): NCCL prints gethostname(), and every slurmd of the test cluster
runs on this one machine, under one hostname."""
from __future__ import annotations

import os
import sys
import time

# The recorded GB200 tray's GPU 0 and GPU 1 (0008:01:00.0, 0009:01:00.0), as NCCL prints a busId (its hex digits).
BUS_IDS = ("801000", "901000")
WAIT_S = 300.0


def stamp() -> str:
    """c10's log prefix time: `E626 06:24:44.903881913` (month unpadded, day padded, nanoseconds)."""
    now = time.time_ns()
    t = time.localtime(now // 1_000_000_000)
    return f"E{t.tm_mon}{t.tm_mday:02d} {time.strftime('%H:%M:%S', t)}.{now % 1_000_000_000:09d}"


def main() -> int:
    rank, local = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_LOCALID"])
    host, pid = os.environ["SLURMD_NODENAME"], os.getpid()
    print(f"{host}:{pid}:{pid + 41} [{local}] NCCL INFO comm 0x{0x55d0c0a00000 + rank * 0x1000:x} rank {rank} "
          f"nranks 4 cudaDev {local} busId {BUS_IDS[local]} - Init COMPLETE", flush=True)
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    stalled = rank == 3
    if not stalled:
        time.sleep(1.0)  # the stalled rank's watchdog fires first
    seq, enqueued, completed, ran = (806, 806, 805, 600081) if stalled else (808, 811, 807, 600020 + rank * 10)
    print(f"[rank{rank}]:[{stamp()} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective operation "
          f"timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, "
          f"Timeout(ms)=600000) ran for {ran} milliseconds before timing out.", flush=True)
    print(f"[rank{rank}]:[{stamp()} ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
          f"Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: "
          f"{enqueued}, last completed NCCL work: {completed}.", flush=True)
    sys.stdout.flush()
    os.abort()  # std::terminate: SIGABRT, as the watchdog takes the process down
    return 134


if __name__ == "__main__":
    sys.exit(main())

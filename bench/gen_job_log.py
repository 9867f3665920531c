"""A distributed job's log of N lines, for the explain benchmark: three mixes, each from line forms of the real logs
in fixtures/job_logs/ (the sources are there), written with a seed so a run can be repeated.

- `training`: what a healthy run prints most (iteration/loss lines, tqdm bars, Python warnings), the NCCL init of a
  64-rank job (bootstrap, NET/IB, comm Init COMPLETE per rank), then a failure at the end (rank 37 stalls);
- `nccl-info`: NCCL_DEBUG=INFO of a 64-rank job at full volume: Channel/Ring/Trees/proxy lines and `-> N` error
  chains make up nearly every line (the worst case for a reader that keys on "NCCL");
- `failures`: 5 % of lines are watchdog, progress, socket and IB completion errors (a large job's teardown)."""
from __future__ import annotations

import argparse
import random
import sys

RANKS = 64
PER_NODE = 8


def host(rank: int) -> str:
    return f"gpu{rank // PER_NODE + 1:03d}"


def bus(rank: int) -> str:
    return ("18000", "2a000", "3a000", "5d000", "9a000", "ab000", "ba000", "db000")[rank % PER_NODE]


def init_lines(r: random.Random) -> list[str]:
    out = []
    for rank in range(RANKS):
        h, pid, dev = host(rank), 4000 + rank, rank % PER_NODE
        ip = f"10.1.{rank // PER_NODE}.{10 + rank % PER_NODE}"
        out += [f"{h}:{pid}:{pid} [{dev}] NCCL INFO Bootstrap : Using ib0:{ip}<0>",
                f"{h}:{pid}:{pid + 9} [{dev}] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB "
                f"[2]mlx5_2:1/IB [3]mlx5_3:1/IB ; OOB ib0:{ip}<0>",
                f"{h}:{pid}:{pid + 9} [{dev}] NCCL INFO ncclCommInitRank comm 0x55{rank:04x} rank {rank} nranks "
                f"{RANKS} cudaDev {dev} nvmlDev {dev} busId {bus(rank)} commId 0x7f1c - Init COMPLETE"]
    return out


def training_noise(r: random.Random, i: int) -> str:
    k = r.random()
    if k < 0.5:
        return (f" iteration {i:>8}/ 1000000 | consumed samples: {i * 1024:>12} | elapsed time per iteration (ms): "
                f"{r.uniform(900, 1100):.1f} | learning rate: {r.uniform(1e-5, 1e-4):.3E} | lm loss: "
                f"{r.uniform(1.5, 3):.6E} | loss scale: 65536.0 | grad norm: {r.uniform(0.1, 2):.3f} |")
    if k < 0.8:
        return (f"Epoch 0:  {i % 100:>3}%|{'#' * (i % 30):<30}| {i}/500150 [6:28:43<94:39:17,  1.37it/s, "
                f"loss={r.uniform(1, 3):.3f}]")
    if k < 0.95:
        return (f"[rank{r.randrange(RANKS)}]:/opt/conda/lib/python3.10/site-packages/torch/utils/checkpoint.py:61: "
                "UserWarning: None of the inputs have requires_grad=True. Gradients will be None")
    return f"time (ms) | forward: {r.uniform(300, 400):.2f} | backward: {r.uniform(600, 800):.2f} | optimizer: 44.10"


def nccl_noise(r: random.Random, i: int) -> str:
    rank = r.randrange(RANKS)
    h, pid, dev = host(rank), 4000 + rank, rank % PER_NODE
    k = r.random()
    if k < 0.5:
        return (f"{h}:{pid}:{pid + 9} [{dev}] NCCL INFO Channel {r.randrange(32):02d}/0 : {rank}[{dev}] -> "
                f"{(rank + 1) % RANKS}[{(dev + 1) % PER_NODE}] via P2P/CUMEM/read")
    if k < 0.7:
        return (f"{h}:{pid}:{pid + 9} [{dev}] NCCL INFO Ring {r.randrange(32):02d} : {rank}[{bus(rank)}] -> "
                f"{(rank + 8) % RANKS}[{bus((rank + 8) % RANKS)}] [send] via NET/IB/{r.randrange(4)}")
    if k < 0.85:
        return (f"{h}:{pid}:{pid + 9} [{dev}] NCCL INFO Trees [0] {(rank + 1) % RANKS}/-1/-1->{rank}->"
                f"{(rank - 1) % RANKS} [1] -1/-1/-1->{rank}->{(rank + 1) % RANKS}")
    return f"{h}:{pid}:{pid + 11} [{dev}] NCCL INFO transport/net.cc:{r.randrange(200, 1400)} -> 6"


def failure_line(r: random.Random, i: int) -> str:
    rank = r.randrange(RANKS)
    h, pid, dev = host(rank), 4000 + rank, rank % PER_NODE
    k = r.random()
    if k < 0.3:
        return (f"[rank{rank}]:[E1206 10:15:{i % 60:02d}.{i % 1000000:06d}000 ProcessGroupNCCL.cpp:632] [Rank {rank}] "
                "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=120049, OpType=ALLREDUCE, "
                "NumelIn=16384000, NumelOut=16384000, Timeout(ms)=600000) ran for 600065 milliseconds before "
                "timing out.")
    if k < 0.6:
        return (f"[rank{rank}]:[E1206 10:15:{i % 60:02d}.{i % 1000000:06d}000 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG "
                f"GUID 0(default_pg) Rank {rank}] Exception (either an error or timeout) detected by watchdog at "
                "work: 120049, last enqueued NCCL work: 120051, last completed NCCL work: 120048.")
    if k < 0.8:
        return (f"{h}:{pid}:{pid + 20} [{dev}] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer "
                f"{host(37)}.ib<{40000 + i % 20000}>")
    return (f"{h}:{pid}:{pid + 20} [{dev}] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer "
            f"10.1.4.15<{40000 + i % 20000}> with status=12 opcode=0 len=0 vendor err 129 (Recv)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lines", type=int, required=True)
    p.add_argument("--mix", choices=("training", "nccl-info", "failures"), default="training")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    r = random.Random(args.seed)
    out = sys.stdout
    head = init_lines(r)
    for line in head:
        out.write(line + "\n")
    body = args.lines - len(head) - 4
    for i in range(body):
        if args.mix == "training":
            line = training_noise(r, i)
        elif args.mix == "nccl-info":
            line = nccl_noise(r, i)
        else:
            line = failure_line(r, i) if r.random() < 0.05 else training_noise(r, i)
        out.write(line + "\n")
    for rank in (0, 1, 37, 63):  # rank 37 stalled: its last completed work is behind every other rank's
        done = 120045 if rank == 37 else 120048
        out.write(f"[rank{rank}]:[E1206 10:16:00.000000000 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID "
                  f"0(default_pg) Rank {rank}] Exception (either an error or timeout) detected by watchdog at work: "
                  f"{done + 1}, last enqueued NCCL work: 120051, last completed NCCL work: {done}.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

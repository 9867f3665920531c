"""Rounds and tests the sweep's localisation (agent/fleet/sweep/localise.py) takes to find k bad nodes among N, on
simulated outcomes, against the information-theoretic lower bound ceil(log2 C(N, k)) and against naive pairwise testing.

A round is one step of wall-clock time: disjoint collectives at once, no node (padding included) in two. A test
is one collective, one bit. One group of N nodes is known to fail (the sweep's first round, not counted), two
nodes outside it are known good (padding). A seeded oracle places k bad nodes at random and answers each test:
it fails when it holds a bad node (or both ends of a bad link, for the link table). Every round is checked
disjoint, and every run must name exactly the bad nodes (links) placed, or the bench stops. Prints, per N and k:
the bound, the allowance 1.2 x bound + k, rounds and tests (mean and worst over the seeds) and naive pairwise
testing's; exits 1 when a row's worst case takes more rounds than its allowance.

    .venv/bin/python bench/localise.py [--seeds 200] [--n 16,72,144,288,576,1152] [--k 1,2,3,4] [--links 1,2]
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwarden.agent.fleet.sweep.localise import Localiser  # noqa: E402

SIZES = (16, 72, 144, 288, 576, 1152)  # 16 racks x 72 GPUs' nodes at the top
GOOD = ("good-0", "good-1")


def bound(n: int, k: int) -> int:
    """One-bit tests any sequential search needs in the worst case to tell which k of n are bad."""
    return math.ceil(math.log2(math.comb(n, k)))


def allowance(n: int, k: int) -> float:
    """The most rounds the search may take in its worst case."""
    return 1.2 * bound(n, k) + k


def localise(nodes: list[str], bad: set[str], links: set[frozenset[str]]) -> tuple[int, int]:
    """(tests, rounds) of one search; stops the bench when it names anything but the truth."""
    loc = Localiser([nodes], GOOD)
    while tests := loc.next_round():
        used: set[str] = set()
        for t in tests:
            if used.intersection(t) or len(t) < 2:
                raise SystemExit(f"round {loc.rounds_run}: tests not disjoint or of one node: {tests}")
            used.update(t)
        for t in tests:
            s = set(t)
            loc.record(t, bool(bad & s) or any(link <= s for link in links))
    res = loc.result()
    if res.nodes != bad or res.links != links or res.unresolved:
        raise SystemExit(f"wrong answer for N={len(nodes)}: placed {sorted(bad)} {[sorted(x) for x in links]}, "
                         f"found {sorted(res.nodes)} {[sorted(x) for x in res.links]}, "
                         f"unresolved {sorted(res.unresolved)}")
    return loc.tests_run, loc.rounds_run


def naive_nodes(n: int, bad: set[int]) -> tuple[int, int]:
    """Naive pairwise: every node once in a pair with its neighbour (the last one of an odd N with a good node),
    all in one round; then each node of a failing pair beside a good node of its own (the two outside, and the
    nodes of the pairs that passed), as many a round as there are good nodes. (tests, rounds)."""
    pairs = [(i, i + 1) for i in range(0, n - 1, 2)] + ([(n - 1,)] if n % 2 else [])
    failing = sum(1 for p in pairs if bad.intersection(p))
    suspects = sum(len(p) for p in pairs if bad.intersection(p))
    good = len(GOOD) + (n - suspects)
    return len(pairs) + suspects, 1 + math.ceil(suspects / good) if failing else 1


@dataclass
class Row:
    n: int
    k: int
    tests: list[int]
    rounds: list[int]
    naive_tests: list[int]
    naive_rounds: list[int]

    @property
    def over(self) -> bool:
        """The worst case over the seeds takes more rounds than the allowance."""
        return max(self.rounds) > allowance(self.n, self.k)


def measure(n: int, k: int, seeds: int, links: bool = False) -> Row:
    nodes = [f"n{i:04d}" for i in range(n)]
    row = Row(n, k, [], [], [], [])
    for seed in range(seeds):
        rng = random.Random(f"{n}/{k}/{seed}/{links}")
        if links:
            ends = rng.sample(range(n), 2 * k)  # k links, no two sharing an end
            placed = {frozenset((nodes[ends[2 * i]], nodes[ends[2 * i + 1]])) for i in range(k)}
            t, r = localise(nodes, set(), placed)
            row.naive_tests.append(math.comb(n, 2))
            row.naive_rounds.append(n - 1 if n % 2 == 0 else n)  # a round-robin of all pairs
        else:
            picked = set(rng.sample(range(n), k))
            t, r = localise(nodes, {nodes[i] for i in picked}, set())
            nt, nr = naive_nodes(n, picked)
            row.naive_tests.append(nt)
            row.naive_rounds.append(nr)
        row.tests.append(t)
        row.rounds.append(r)
    return row


def link_bound(n: int, k: int) -> int:
    return math.ceil(math.log2(math.comb(math.comb(n, 2), k)))


def check(sizes, ks, seeds: int, out=None) -> list[Row]:
    """The bad-node table, a row per N and k (printed to `out` when given); the rows returned."""
    rows = []
    for n in sizes:
        for k in ks:
            row = measure(n, k, seeds)
            rows.append(row)
            if out is not None:
                flag = " **over**" if row.over else ""
                print(f"| {n} | {k} | {bound(n, k)} | {allowance(n, k):.1f} | {statistics.mean(row.rounds):.1f} | "
                      f"{max(row.rounds)}{flag} | {statistics.mean(row.tests):.1f} | {max(row.tests)} | "
                      f"{max(row.naive_rounds)} | {statistics.mean(row.naive_tests):.1f} ({max(row.naive_tests)}) |",
                      file=out, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--n", default=",".join(map(str, SIZES)))
    ap.add_argument("--k", default="1,2,3,4")
    ap.add_argument("--links", default="1,2", help="k for the bad-link table ('' for none)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.n.split(",")]
    print(f"bad nodes: one failing group of N, {len(GOOD)} good nodes beside it, {a.seeds} seeds per row; "
          "allowance = 1.2 x bound + k rounds")
    print("|   N | k | bound | allowance | rounds mean | rounds worst | tests mean | tests worst | naive rounds | "
          "naive tests mean (worst) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = check(sizes, [int(x) for x in a.k.split(",")], a.seeds, out=sys.stdout)
    if a.links:
        print(f"\nbad links (no two sharing an end), no bad node; naive: every pair of the N; {a.seeds} seeds")
        print("|   N | links | bound | rounds mean | rounds worst | tests mean | tests worst | naive rounds | "
              "naive tests |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in sizes:
            for k in (int(x) for x in a.links.split(",")):
                row = measure(n, k, a.seeds, links=True)
                print(f"| {n} | {k} | {link_bound(n, k)} | {statistics.mean(row.rounds):.1f} | {max(row.rounds)} | "
                      f"{statistics.mean(row.tests):.1f} | {max(row.tests)} | {row.naive_rounds[0]} | "
                      f"{row.naive_tests[0]} |", flush=True)
    over = [row for row in rows if row.over]
    for row in over:
        print(f"over the allowance: N={row.n} k={row.k}: worst {max(row.rounds)} rounds > "
              f"{allowance(row.n, row.k):.1f}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which node or link made a sweep's group fail: adaptive group testing over further collectives, by parallel
halving.

Defect model. A *bad node* makes every test that contains it fail; a *bad link* (a, b) makes a test fail exactly
when it holds both a and b. A test is one collective over a set of at least two nodes; a single suspect runs with
a node known to be good (*padding*: a node of a group that passed the first round, or, when those are all in
use, a node of the suspect's own group that passed a test). Tests run in *rounds*: within a round no node,
padding included, is in two tests (a node runs one collective at a time). A round is what an operator waits for,
so the search spends tests to save rounds: its depth grows with log2 of the group's size, not with the number of
defects.

The search over each failing group, by rounds: agent/fleet/sweep/localise_search.py.

What it will not do:
- Blame without evidence: a node only after failing beside two different padding nodes, one of them from outside
  the failing groups (or beside the only node outside them, when no other can pad it); a link only after its two
  ends failed together, each of them having passed a test (so neither is a bad node). A group is cleared only by
  a pass of all of it less what was blamed (localise_search.py, step 4).
- Make up an outcome: a test recorded as not decided (`None`: preempted, not started) stops its group; the
  group's nodes not blamed are `unresolved`, as are those of a group stopped by `max_tests`, or by outcomes that
  no set of defects explains (a flaky collective: the search stops rather than blame on them). A pass of part of
  a group clears those nodes as bad nodes but not the links between them and the rest, so an unfinished group
  leaves every node it has not blamed unresolved.
- Localise without a node known to be good: when every group of the first round failed, the fault is as likely
  fleet-wide (a driver, the fabric's core, the test itself) as in any node, so nothing is tested or blamed:
  every failing node is unresolved.

When a round has more single suspects than padding nodes to give them, the rest wait for the next round. Not
told apart by any test here: a bad link with a bad node at one end (every test holding both fails for the node),
and a node with bad links to both of the padding nodes it was tested beside (it is taken for a bad node). Not
seen: a bad link between nodes of different failing groups, or between two nodes of groups that passed. The cost
in rounds and tests, against the information-theoretic bound, is measured by bench/localise.py (bench/README.md).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.fleet.sweep.localise_search import ANY, Group, GroupSearch, Req, Search, SearchStopped


@dataclass(frozen=True)
class Culprits:
    nodes: frozenset[str]  # bad nodes: each failed beside two padding nodes, one from outside the groups
    links: frozenset[frozenset[str]]  # bad links (two nodes each): together they fail, each passed a test; one end
    # may be a padding node from a group that passed
    unresolved: frozenset[str]  # nodes of a failing group not cleared when its search stopped (budget, preemption,
    # no node known good, contradicting outcomes)
    finished: frozenset[int] = frozenset()  # indexes of the failing groups whose remainder was seen to pass


class Localiser:
    """Drive it by rounds: `next_round()` gives disjoint tests, `record()` each one's outcome, until `next_round()`
    returns []; then `result()`. Deterministic: the same inputs and outcomes give the same tests."""

    def __init__(self, failing: Sequence[Sequence[str]], good: Iterable[str], *, max_tests: int | None = None):
        seen: set[str] = set()
        groups = []
        for i, g in enumerate(failing):
            nodes = tuple(dict.fromkeys(str(n) for n in g))
            if seen.intersection(nodes):
                raise ValueError(f"failing group {i} shares nodes with an earlier group: groups run at once, so "
                                 "they are disjoint")
            seen.update(nodes)
            if nodes:
                groups.append(Group(i, nodes))
        if max_tests is not None and max_tests < 0:
            raise ValueError(f"max_tests must be >= 0, not {max_tests}")
        self.good: tuple[str, ...] = tuple(sorted(set(map(str, good)) - seen))
        self.max_tests = max_tests
        self.tests_run = 0
        self.rounds_run = 0
        self._groups = groups
        self._state: dict[int, GroupSearch] = {}
        self._searches: dict[int, Search] = {}
        self._want: dict[int, list[Req]] = {}  # each active group's tests, waiting to run
        self._flight: dict[frozenset[str], tuple[int, int]] = {}  # test -> (group, position in its requests)
        self._answers: dict[int, list] = {}
        if not self.good:
            for grp in groups:
                grp.stopped = True
            return
        outside = frozenset(self.good)
        for grp in groups:
            state = GroupSearch(grp, outside)
            self._state[grp.index] = state
            self._searches[grp.index] = self._search(grp, state)
            self._advance(grp, None)

    # -- driving -------------------------------------------------------------------------------------------
    def next_round(self) -> list[tuple[str, ...]]:
        """The tests to run now, disjoint; [] when the search is over. Record every one before asking again. A
        padded test is (suspect, padding node)."""
        if self._flight:
            raise RuntimeError(f"{len(self._flight)} test(s) of round {self.rounds_run} not recorded yet")
        free = list(self.good)
        used: set[str] = set()
        tests: list[tuple[str, ...]] = []
        for grp in self._groups:
            reqs = self._want.get(grp.index)
            if not reqs:
                continue
            g_used, g_free = set(used), list(free)
            placed = self._place(self._state[grp.index], reqs, g_used, g_free)
            count = sum(p is not None for p in placed)
            if not count:
                continue  # waits for a round with padding to spare
            if self.max_tests is not None and self.tests_run + len(tests) + count > self.max_tests:
                self._end(grp)
                continue
            used, free = g_used, g_free
            self._answers[grp.index] = [None if p is None else (p, None) for p in placed]
            for pos, test in enumerate(placed):
                if test is not None:
                    self._flight[frozenset(test)] = (grp.index, pos)
                    tests.append(test)
        if tests:
            self.tests_run += len(tests)
            self.rounds_run += 1
        elif any(self._want.values()):
            # Nothing could be placed though requests wait: cannot happen with at least one good node (a round
            # with nothing else in it has padding for any request), but never spin.
            for grp in self._groups:
                if self._want.get(grp.index):
                    self._end(grp)
        return tests

    @staticmethod
    def _place(state: "GroupSearch", reqs: list[Req], used: set[str],
               free: list[str]) -> list[tuple[str, ...] | None]:
        """Which of a group's tests run this round, and with which padding: those without padding first (so a
        node of the group taken as padding is not one a test of its own needs), then the padded ones while
        padding lasts; the others wait. Updates `used` and `free`."""
        placed: list[tuple[str, ...] | None] = [None] * len(reqs)
        for i in sorted(range(len(reqs)), key=lambda i: bool(reqs[i].pad)):
            r = reqs[i]
            if used.intersection(r.nodes):
                continue
            pad = None
            if r.pad:
                pad = next((n for n in free if n not in r.avoid), None)
                if pad is not None:
                    free.remove(pad)
                elif r.pad == ANY:
                    pad = next((n for n in state.paddable(r.nodes[0]) if n not in used and n not in r.avoid), None)
                if pad is None:
                    continue
            placed[i] = r.nodes + (pad,) if pad is not None else r.nodes
            used.update(placed[i])
        return placed

    def record(self, test: Sequence[str], failed: bool | None) -> None:
        """The outcome of a test of the current round: True failed, False passed, None no verdict."""
        key = frozenset(test)
        if key not in self._flight:
            raise KeyError(f"not a test of this round, or recorded already: {tuple(test)}")
        gi, pos = self._flight.pop(key)
        answers = self._answers[gi]
        answers[pos] = (answers[pos][0], None if failed is None else bool(failed))
        if any(g == gi for g, _ in self._flight.values()):
            return
        # The round's last outcome for this group.
        grp = next(g for g in self._groups if g.index == gi)
        self._advance(grp, answers)

    def result(self) -> Culprits:
        nodes: set[str] = set()
        links: set[frozenset[str]] = set()
        unresolved: set[str] = set()
        finished = set()
        for grp in self._groups:
            nodes.update(grp.bad)
            links.update(grp.links)
            if grp.finished:
                finished.add(grp.index)
            else:
                blamed = set(grp.bad).union(*grp.links) if grp.links else set(grp.bad)
                unresolved.update(n for n in grp.nodes if n not in blamed)
        return Culprits(frozenset(nodes), frozenset(links), frozenset(unresolved), frozenset(finished))

    # -- internals -----------------------------------------------------------------------------------------
    def _advance(self, grp: Group, answers: list | None) -> None:
        self._want[grp.index] = []
        search = self._searches[grp.index]
        try:
            reqs = search.send(answers) if answers is not None else next(search)
        except StopIteration:
            return
        self._want[grp.index] = reqs

    def _end(self, grp: Group) -> None:
        self._want[grp.index] = []
        grp.stopped = True
        self._searches[grp.index].close()

    @staticmethod
    def _search(grp: Group, state: "GroupSearch") -> Search:
        try:
            yield from state.run()
        except SearchStopped:
            grp.stopped = True

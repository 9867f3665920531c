"""Which node or link made a sweep's group fail: adaptive group testing over further collectives.

Defect model. A *bad node* makes every test that contains it fail; a *bad link* (a, b) makes a test fail exactly
when it holds both a and b. A test is one collective over a set of at least two nodes; a single suspect runs with
a node known to be good (*padding*: a node of a group that passed the first round). Tests run in *rounds*:
within a round no node, padding included, is in two tests (a node runs one collective at a time).

The search, per failing group (independent groups share rounds):

1. Narrow down on the assumption that only nodes are bad: halve the set known (or inferred) to hold a bad node,
   test one half; if it fails, keep it, if it passes, its nodes are cleared and the other half is kept. The
   last split tests the suspect with padding, so a failing last split proves the suspect bad at once.
2. Prove a suspect that was only inferred: the suspect with padding, and in the same round the rest of the group
   without it (3). Fails: a bad node. Passes: the node model was wrong here, there is a bad link: when the rest
   without the suspect passed, the suspect is one end, and the other is found by halving the smallest set seen
   to fail with it, with the suspect attached; otherwise go to 4.
3. Test the group less every bad node found (and one end of each bad link). Passes: every pair of those nodes
   is clean; each left-out link end is then tested with them (less its known partners), a failure halved down to
   a further link, and the left-out ends with each other; the group is done. Fails: something is left; narrow
   down again over its nodes that no test has cleared (1), or, when none is left, over all of it (4).
4. Without inference: from the smallest set seen to fail, test one half, then the other; a failing half is kept;
   when both pass, a link crosses them: find its end in the first half by halving it with the second half
   attached, then its other end by halving the second half with that end attached. Two nodes seen to fail
   together are told apart with padding: either failing alone is a bad node, neither is a link.

What it will not do:
- Blame without evidence: a node is blamed only after failing with padding alone; a link only after its two
  ends failed together, each of them having passed a test (so neither is a bad node). A group is cleared only
  by a pass of all of it less what was blamed (step 3).
- Make up an outcome: a test recorded as not decided (`None`: preempted, not started) stops its group; the
  group's nodes not blamed are `unresolved`, as are those of a group stopped by `max_tests`, or by outcomes that
  no set of defects explains (a flaky collective: the search stops rather than blame on them). A pass of part of
  a group clears those nodes as bad nodes but not the links between them and the rest, so an unfinished group
  leaves every node it has not blamed unresolved.
- Localise without a node known to be good: when every group of the first round failed, the fault is as likely
  fleet-wide (a driver, the fabric's core, the test itself) as in any node, so nothing is tested or blamed:
  every failing node is unresolved.

Not seen by any test: a bad link with a bad node at one end (every test holding both fails for the node), and a
bad link between nodes of different groups or between a group's node and a padding node (padding comes from
groups that passed, so no test of the first round held both ends). The cost in tests and rounds, against the
information-theoretic bound, is measured by bench/localise.py (bench/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Iterable, Sequence


@dataclass(frozen=True)
class Culprits:
    nodes: frozenset[str]  # bad nodes: each failed a test with only padding beside it
    links: frozenset[frozenset[str]]  # bad links (two nodes each): together they fail, each with padding passes
    unresolved: frozenset[str]  # nodes of a failing group not cleared when its search stopped (budget, preemption,
    # no node known good)
    finished: frozenset[int] = frozenset()  # indexes of the failing groups whose remainder was seen to pass


@dataclass(frozen=True)
class _Req:
    """One test a group asks for: `nodes`, plus a padding node when `pad` (then `nodes` is one suspect)."""
    nodes: tuple[str, ...]
    pad: bool = False


# A group's search: yields the tests of its next round (disjoint), receives their outcomes in the same order
# (True failed, False passed, None not decided).
_Search = Generator[list[_Req], list, None]


@dataclass
class _Group:
    index: int
    nodes: tuple[str, ...]
    bad: list[str] = field(default_factory=list)
    links: list[frozenset[str]] = field(default_factory=list)
    finished: bool = False
    stopped: bool = False  # ended without finishing (no verdict, budget)


class _Stop(Exception):
    """A test of this group was not decided: its search ends."""


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
                groups.append(_Group(i, nodes))
        if max_tests is not None and max_tests < 0:
            raise ValueError(f"max_tests must be >= 0, not {max_tests}")
        self.good: tuple[str, ...] = tuple(sorted(set(map(str, good)) - seen))
        self.max_tests = max_tests
        self.tests_run = 0
        self.rounds_run = 0
        self._groups = groups
        self._searches: dict[int, _Search] = {}
        self._want: dict[int, list[_Req]] = {}  # the requests each active group waits to have run
        self._flight: dict[frozenset[str], tuple[int, int]] = {}  # test -> (group, position in its request)
        self._outcomes: dict[int, list] = {}
        if not self.good:
            for grp in groups:
                grp.stopped = True
            return
        for grp in groups:
            search = self._search(grp)
            self._searches[grp.index] = search
            self._advance(grp, search, None)

    # -- driving -------------------------------------------------------------------------------------------
    def next_round(self) -> list[tuple[str, ...]]:
        """The tests to run now, disjoint; [] when the search is over. Record every one before asking again. A
        padded test is (suspect, padding node)."""
        if self._flight:
            raise RuntimeError(f"{len(self._flight)} test(s) of round {self.rounds_run} not recorded yet")
        free = list(self.good)
        tests: list[tuple[str, ...]] = []
        for grp in self._groups:
            reqs = self._want.get(grp.index)
            if not reqs:
                continue
            if self.max_tests is not None and self.tests_run + len(tests) + len(reqs) > self.max_tests:
                self._end(grp)
                continue
            pads = sum(r.pad for r in reqs)
            if pads > len(free):
                continue  # waits for a round with padding to spare
            self._outcomes[grp.index] = [None] * len(reqs)
            for pos, r in enumerate(reqs):
                test = r.nodes + (free.pop(0),) if r.pad else r.nodes
                self._flight[frozenset(test)] = (grp.index, pos)
                tests.append(test)
        if tests:
            self.tests_run += len(tests)
            self.rounds_run += 1
        elif any(self._want.values()):
            # Every waiting group needs more padding than there is: cannot happen with one pad per request
            # and at least one good node, but never spin.
            for grp in self._groups:
                if self._want.get(grp.index):
                    self._end(grp)
        return tests

    def record(self, test: Sequence[str], failed: bool | None) -> None:
        """The outcome of a test of the current round: True failed, False passed, None no verdict."""
        key = frozenset(test)
        if key not in self._flight:
            raise KeyError(f"not a test of this round, or recorded already: {tuple(test)}")
        gi, pos = self._flight.pop(key)
        out = self._outcomes[gi]
        out[pos] = None if failed is None else bool(failed)
        if any(g == gi for g, _ in self._flight.values()):
            return
        # The round's last outcome for this group: undecided ones are None.
        grp = next(g for g in self._groups if g.index == gi)
        self._advance(grp, self._searches[gi], out)

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
    def _advance(self, grp: _Group, search: _Search, outcomes: list | None) -> None:
        self._want[grp.index] = []
        try:
            reqs = search.send(outcomes) if outcomes is not None else next(search)
        except StopIteration:
            return
        self._want[grp.index] = reqs

    def _end(self, grp: _Group) -> None:
        self._want[grp.index] = []
        grp.stopped = True
        self._searches[grp.index].close()

    def _search(self, grp: _Group) -> _Search:
        try:
            yield from _GroupSearch(grp, len(self.good)).run()
        except _Stop:
            grp.stopped = True


class _GroupSearch:
    """The search over one failing group; a generator of its rounds' requests (see the module docstring)."""

    def __init__(self, grp: _Group, pads: int):
        self.grp = grp
        self.pads = pads  # padding nodes a round can have
        self.cleared: set[str] = set()  # seen in a passing test: not a bad node
        self.left_out: set[str] = set()  # bad nodes and one end of each bad link: out of the remainder's test
        self.ends: list[str] = []  # the ends of bad links left out, in the order found
        self.failed: set[frozenset[str]] = set()  # tests seen to fail (padding left out)

    def ask(self, *reqs: _Req):
        """Run these tests (disjoint) in one round; their outcomes, or _Stop for the first undecided one."""
        out = yield list(reqs)
        if out is None or len(out) != len(reqs):
            raise _Stop
        return out

    def one(self, nodes: Sequence[str]):
        """One test of `nodes` (padded when it is a single node); True when it failed."""
        req = _Req((nodes[0],), pad=True) if len(nodes) == 1 else _Req(tuple(nodes))
        out = yield from self.ask(req)
        if out[0] is None:
            raise _Stop
        if out[0]:
            self.failed.add(frozenset(nodes))
        else:
            self.cleared.update(nodes)
        return out[0]

    def pair_fails(self, a: str, b: str):
        """Whether a and b fail together, seen directly: an end found by halving is inferred until then."""
        if frozenset((a, b)) in self.failed:
            return True
        return (yield from self.one([a, b]))

    def blame_node(self, node: str) -> None:
        self.grp.bad.append(node)
        self.left_out.add(node)

    def blame_link(self, kept: str, out: str) -> None:
        self.grp.links.append(frozenset((kept, out)))
        if out not in self.left_out:
            self.left_out.add(out)
            self.ends.append(out)

    def check_ends(self, rest: list[str]):
        """`rest` passed without the link ends left out: test each end with it, less the end's known partners,
        and find any further link from that end (every pair inside `rest` is clean, the end is no bad node)."""
        for end in self.ends:
            while True:
                partners = {n for link in self.grp.links if end in link for n in link} - {end}
                others = [n for n in rest if n not in partners]
                if not others or not (yield from self.one(others + [end])):
                    break
                while len(others) > 1:
                    part = others[:len(others) // 2]
                    others = part if (yield from self.one([end] + part)) else others[len(part):]
                if not (yield from self.pair_fails(end, others[0])):
                    raise _Stop  # the outcomes contradict each other: blame nothing more
                self.grp.links.append(frozenset((end, others[0])))
        # Pairs of left-out ends are in no test yet: all of them at once when none is a known link, else each.
        ends = self.ends
        pairs = [frozenset((a, b)) for i, a in enumerate(ends) for b in ends[i + 1:]]
        unknown = [p for p in pairs if p not in self.grp.links]
        if len(unknown) == len(pairs) > 1:
            if not (yield from self.one(ends)):
                return
        for p in unknown:
            if (yield from self.one(sorted(p, key=ends.index))):
                self.grp.links.append(p)

    def run(self):
        g = self.grp.nodes
        confirm: str | None = None  # a suspect to test with padding, beside the remainder's test
        smallest_failing = list(g)
        stale, blamed = 0, -1
        first = True
        while True:
            # Every other pass of this loop blames something, unless outcomes contradict each other (a flaky
            # collective): then stop rather than go round for ever.
            stale, blamed = (0 if len(self.left_out) > blamed else stale + 1), len(self.left_out)
            if stale > 2:
                raise _Stop
            rest = [n for n in g if n not in self.left_out]
            if not rest:
                self.grp.finished = True
                return
            if first:
                failed, first = True, False  # the sweep's first round saw the group fail
            elif confirm is None:
                failed = yield from self.one(rest)
            else:
                suspect, confirm = confirm, None
                rest.remove(suspect)
                failed = yield from self.confirm(suspect, rest, smallest_failing)
                if failed is None:
                    continue
            if not failed:
                yield from self.check_ends(rest)
                self.grp.finished = True
                return
            smallest_failing = rest
            pool = [n for n in rest if n not in self.cleared]
            if not pool:
                yield from self.link_search(rest)
            else:
                suspect, sure, smallest_failing = yield from self.narrow(pool, rest)
                if sure:
                    self.blame_node(suspect)
                else:
                    confirm = suspect

    def confirm(self, suspect: str, rest: list[str], failing: list[str]):
        """The suspect alone with padding and, in the same round when padding allows, the remainder without it:
        both are needed whatever the first says. Returns whether the remainder failed, or None when the suspect
        is no bad node (the node model was wrong: a link was searched for instead)."""
        alone = _Req((suspect,), pad=True)
        together = (_Req((rest[0],), pad=True) if len(rest) == 1 else _Req(tuple(rest))) if rest else None
        if together is not None and together.pad + 1 > self.pads:
            together = None
        out = yield from self.ask(*([alone] + ([together] if together else [])))
        if out[0] is None:
            raise _Stop
        if not out[0]:
            self.cleared.add(suspect)
            if together is not None and out[1] is False:
                # The remainder passes without it: the suspect is one end of a bad link, the other end in the
                # smallest set seen to fail with it. Halve that with the suspect attached.
                self.cleared.update(rest)
                others = [n for n in failing if n != suspect and n in rest]
                if not others:
                    raise _Stop  # outcomes that contradict each other
                while len(others) > 1:
                    part = others[:len(others) // 2]
                    others = part if (yield from self.one([suspect] + part)) else others[len(part):]
                if not (yield from self.pair_fails(suspect, others[0])):
                    raise _Stop
                self.blame_link(others[0], suspect)
                return False
            yield from self.link_search(failing)
            return None
        self.blame_node(suspect)
        if not rest:
            return False
        if together is None:
            return (yield from self.one(rest))
        if out[1] is None:
            raise _Stop
        if not out[1]:
            self.cleared.update(rest)
        return out[1]

    def narrow(self, pool: list[str], failing: list[str]):
        """Halve `pool` (inferred to hold a bad node) down to one suspect; (suspect, confirmed, smallest failing
        set seen). The node model's inference: a passing half leaves the bad node in the other."""
        while len(pool) > 1:
            half = pool[:len(pool) // 2]
            if (yield from self.one(half)):
                if len(half) == 1:
                    return half[0], True, half
                pool = failing = half
            else:
                pool = pool[len(half):]
        return pool[0], False, failing

    def link_search(self, failing: list[str]):
        """`failing` was seen to fail; find one defect in it without inference, and blame it."""
        s = list(failing)
        while len(s) > 2:
            a, b = s[:len(s) // 2], s[len(s) // 2:]
            if (yield from self.one(a)):
                s = a
                continue
            if (yield from self.one(b)):
                s = b
                continue
            # No bad node in a or b and no link inside either: a link crosses them.
            while len(a) > 1:
                part = a[:len(a) // 2]
                a = part if (yield from self.one(part + b)) else a[len(part):]
            end = a[0]
            while len(b) > 1:
                part = b[:len(b) // 2]
                b = part if (yield from self.one([end] + part)) else b[len(part):]
            if not (yield from self.pair_fails(end, b[0])):
                raise _Stop  # the failure that started this is not seen again: blame nothing
            self.blame_link(end, b[0])
            return
        if len(s) == 1:
            if s[0] not in self.cleared and (yield from self.one(s)):
                self.blame_node(s[0])
            return
        x, y = s
        fx = yield from self.one([x])
        if fx:
            self.blame_node(x)
            return
        fy = yield from self.one([y])
        if fy:
            self.blame_node(y)
        else:
            self.blame_link(x, y)

"""The search over one failing group of a sweep (agent/fleet/sweep/localise.py drives it by rounds, and says what
a test is and what the search will not blame).

The search, per failing group; every failing set of every group advances one level a round:

1. Split: a set seen to fail is halved and *both* halves are tested in the same round (a half of one node beside
   padding). A failing half is split again; a passing half's nodes are no bad nodes, and no link lies inside it.
2. A single node that fails beside padding is a bad node or one end of a bad link to its padding. It is a
   *suspect*: left out of the rest, and looked at once more beside another padding node (one from outside the
   failing groups when the first was not). Failing again, it is a bad node; passing, the link to the first
   padding is bad. A node that had passed a test before and fails beside padding is the end of such a link at
   once.
3. Both halves pass though their union failed: a link crosses them (a in A, b in B), or the failure was flaky.
   A and B are halved, A1 with B1 and A2 with B2 tested in one round, A1 with B2 and A2 with B1 in the next when
   neither failed; a failing union is searched the same way (its two parts each passed alone), down to two nodes
   that fail together and have each passed with others: a bad link. None of the four failing: the outcomes
   contradict each other and the group ends unresolved.
4. Confirm: once no set is left to split, the group less its bad nodes, its suspects and one end of each bad
   link is tested, in the same round as the suspects' second looks (whatever those say, a suspect stays out of
   the rest: a bad node, or a link's end). Passes: the rest is clean; each left-out link end is tested with it
   (less its known partners), a failure halved down to a further link, and the left-out ends with each other.
   Fails: something was hidden (a link across two halves of which one failed for another defect): search that
   remainder (1).
"""
from __future__ import annotations

from dataclasses import field
from typing import Generator, Iterator, Sequence

from gpuwarden.agent.core.records import dataclass

OUT = "out"  # padding from outside the failing groups only
ANY = "any"  # outside first, else a node of the same group that passed a test


@dataclass(frozen=True)
class Req:
    """One test a group asks for: `nodes`, plus a padding node when `pad` (then `nodes` is one suspect), not one
    of `avoid`."""
    nodes: tuple[str, ...]
    pad: str = ""
    avoid: frozenset[str] = frozenset()


# A test as run (padding included) and its outcome (True failed, False passed, None not decided).
Ran = tuple[tuple[str, ...], "bool | None"]
# A group's search yields the tests it wants run next and receives, for each, how it ran, or None when it did not
# run this round (no padding to spare: it waits for the next).
Search = Generator[list[Req], list["Ran | None"], None]


@dataclass
class Group:
    index: int
    nodes: tuple[str, ...]
    bad: list[str] = field(default_factory=list)
    links: list[frozenset[str]] = field(default_factory=list)
    finished: bool = False
    stopped: bool = False  # ended without finishing (no verdict, budget, contradiction)


class SearchStopped(Exception):
    """This group's search ends unfinished: a test not decided, or outcomes that contradict each other."""


# A task of one group's search: yields the tests it wants run together (one round), receives them as run.
_Task = Generator[list[Req], list[Ran], object]


class GroupSearch:
    """The search over one failing group (see the module docstring): a generator of its rounds' requests, many
    tasks (one per failing set, crossing pair of sets, suspect to prove) advancing side by side."""

    def __init__(self, grp: Group, outside: frozenset[str]):
        self.grp = grp
        self.outside = outside  # padding nodes from outside the failing groups
        self.cleared: set[str] = set()  # seen in a passing test: not a bad node
        self.bad: set[str] = set()
        self.left_out: set[str] = set()  # bad nodes and one end of each bad link: out of the remainder's test
        self.ends: list[str] = []  # the ends of bad links left out, in the order found
        self.failed: set[frozenset[str]] = set()  # tests seen to fail (padding included)
        self.passed: list[frozenset[str]] = []  # tests seen to pass: no link inside any of them
        self.blames = 0
        self.suspects: dict[str, str] = {}  # node -> the padding it failed beside; looked at again (step 2)
        self.last_test: tuple[str, ...] = ()  # the remainder's test as run
        self._spawned: list[_Task] = []

    # -- tests -------------------------------------------------------------------------------------------
    def paddable(self, suspect: str) -> Iterator[str]:
        """Nodes of this group that may pad `suspect` when the outside ones are all in use: seen to pass, and no
        known link to it."""
        partners = self.partners(suspect)
        return (n for n in self.grp.nodes
                if n in self.cleared and n != suspect and n not in self.bad and n not in partners)

    def partners(self, node: str) -> frozenset[str]:
        return frozenset(n for link in self.grp.links if node in link for n in link if n != node)

    def req(self, nodes: Sequence[str], pad: str = ANY) -> Req:
        """A test of `nodes`; a single node with padding, never one of its known link partners."""
        return Req((nodes[0],), pad, self.partners(nodes[0])) if len(nodes) == 1 else Req(tuple(nodes))

    def note(self, ran: Ran) -> Ran:
        test, out = ran
        if out is None:
            raise SearchStopped
        if out:
            self.failed.add(frozenset(test))
        else:
            self.cleared.update(n for n in test if n not in self.outside)
            self.passed.append(frozenset(test))
        return ran

    def ask(self, *reqs: Req):
        """Run these tests, alone in this group (each in the first round with padding for it); how they ran."""
        task = self._gather(list(reqs))
        return (yield from self.parallel(task))

    def one(self, nodes: Sequence[str], pad: str = ANY):
        """One test of `nodes` (padded when it is a single node); True when it failed."""
        ran = yield from self.ask(self.req(nodes, pad))
        return ran[0][1]

    @staticmethod
    def _gather(reqs: list[Req]) -> _Task:
        ran = yield reqs
        return ran

    def parallel(self, *tasks: _Task):
        """Run tasks side by side, until none is left (tasks add tasks through spawn). A task yields the tests it
        wants next and gets them back, as run, once every one has run: each runs in the first round that has
        padding for it. Returns what the first task returned."""
        queue = list(tasks)
        first = tasks[0] if tasks else None
        returned = None
        # each live task: itself, the tests it asked for, how those ran so far (None: not yet)
        live: list[tuple[_Task, list[Req], list[Ran | None]]] = []

        def send(task: _Task, value) -> None:
            nonlocal returned
            try:
                reqs = task.send(value)
            except StopIteration as stop:
                if task is first:
                    returned = stop.value
                return
            live.append((task, reqs, [None] * len(reqs)))

        while True:
            queue += self._spawned
            self._spawned = []
            while queue:
                send(queue.pop(0), None)
                queue += self._spawned
                self._spawned = []
            if not live:
                return returned
            wanted = [(k, i) for k, (_, reqs, ran) in enumerate(live) for i in range(len(reqs)) if ran[i] is None]
            answers = yield [live[k][1][i] for k, i in wanted]
            for (k, i), answer in zip(wanted, answers, strict=True):
                if answer is not None:
                    live[k][2][i] = self.note(answer)
            done = [entry for entry in live if all(r is not None for r in entry[2])]
            live = [entry for entry in live if any(r is None for r in entry[2])]
            for task, _, ran in done:
                send(task, ran)

    def spawn(self, task: _Task) -> None:
        self._spawned.append(task)

    # -- blame -------------------------------------------------------------------------------------------
    def blame_node(self, node: str) -> None:
        if node in self.cleared:
            raise SearchStopped  # it passed a test before: the outcomes contradict each other
        if node in self.bad:
            return
        self.grp.bad.append(node)
        self.bad.add(node)
        self.left_out.add(node)
        self.blames += 1

    def blame_link(self, kept: str, out: str) -> None:
        link = frozenset((kept, out))
        if link in self.grp.links:
            return
        if any(link <= p for p in self.passed):
            raise SearchStopped  # the two passed a test together
        self.grp.links.append(link)
        self.blames += 1
        if out not in self.left_out:
            self.left_out.add(out)
            self.ends.append(out)

    # -- tasks -------------------------------------------------------------------------------------------
    def search(self, failing: Sequence[str]) -> _Task:
        return self.split(list(failing)) if len(failing) > 1 else self.single(failing[0])

    def split(self, s: list[str]) -> _Task:
        """`s` was seen to fail: test both halves at once."""
        halves = [s[:len(s) // 2], s[len(s) // 2:]]
        out = yield [self.req(h) for h in halves]
        for half, (test, failed) in zip(halves, out, strict=True):
            if not failed:
                continue
            if len(half) > 1:
                self.spawn(self.split(half))
            else:
                self.suspect(half[0], test)
        if not any(failed for _, failed in out):
            self.spawn(self.cross(halves[0], halves[1]))

    def suspect(self, node: str, test: tuple[str, ...]) -> None:
        """`node` failed beside one padding node: a bad node, or a link between the two. It is left out of the
        remainder's test, and looked at once more beside another padding node in the same round (step 2)."""
        pad = next(n for n in test if n != node)
        if node in self.cleared:
            self.blame_link(pad, node)  # it passed a test before, so it is no bad node, nor is its padding
        else:
            self.suspects[node] = pad

    def single(self, node: str) -> _Task:
        """A group (or remainder) of one node seen to fail: beside padding it is a suspect; passing, the failure
        was not seen again."""
        ran = yield [self.req([node], OUT)]
        (test, failed), = ran
        if not failed:
            raise SearchStopped
        self.suspect(node, test)

    def second_look(self, node: str, first: str) -> _Task:
        """`node` failed beside `first`: beside another padding node (one from outside the groups when `first`
        was not), failing again it is a bad node; passing, the link to `first` is bad."""
        avoid = self.partners(node) | {first}
        pad = ANY if first in self.outside else OUT
        if self.outside <= avoid and (pad == OUT or not any(n not in avoid for n in self.paddable(node))):
            # No other node to pad it with: beside one from outside it is a bad node unless that very link is
            # bad, which no test here can tell; beside one of its own group, it cannot be told.
            if pad == OUT:
                raise SearchStopped
            self.blame_node(node)
            return
        ran = yield [Req((node,), pad, avoid)]
        if ran[0][1]:
            self.blame_node(node)
        else:
            self.blame_link(first, node)

    def cross(self, a: list[str], b: list[str]) -> _Task:
        """`a` and `b` each passed alone (no bad node, no link inside either) and together failed: a link crosses
        them. Halve both; the unions of halves, two diagonals of two disjoint tests."""
        if len(a) == 1 and len(b) == 1:
            self.blame_link(a[0], b[0])
            return
        ha = [a[:len(a) // 2], a[len(a) // 2:]] if len(a) > 1 else [a]
        hb = [b[:len(b) // 2], b[len(b) // 2:]] if len(b) > 1 else [b]
        if len(ha) == 2 and len(hb) == 2:
            rounds = [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]
        else:
            rounds = [[(i, j)] for i in range(len(ha)) for j in range(len(hb))]
        for pairs in rounds:
            out = yield [Req(tuple(ha[i] + hb[j])) for i, j in pairs]
            found = False
            for (i, j), (_, failed) in zip(pairs, out, strict=True):
                if failed:
                    self.spawn(self.cross(ha[i], hb[j]))
                    found = True
            if found:
                return  # a link missed in the other unions shows in the remainder's test (step 4)
        raise SearchStopped  # no union failed again: the failure that started this was not seen again

    # -- the whole group -----------------------------------------------------------------------------------
    def run(self):
        group = list(self.grp.nodes)
        failing = group  # seen to fail in the sweep's first round
        rest: list[str] = []
        while failing:
            before = self.blames
            yield from self.parallel(self.search(failing))
            # The suspects are left out of the remainder whatever their second look says: a bad node is left out,
            # and so is the end of a bad link. So the remainder's test runs beside the second looks.
            rest = [n for n in group if n not in self.left_out and n not in self.suspects]
            looks = [self.second_look(n, pad) for n, pad in self.suspects.items()]
            self.suspects = {}
            failed = yield from self.parallel(self.confirm(rest), *looks)
            if self.blames == before:
                raise SearchStopped  # a set seen to fail, and nothing in it to blame
            failing = rest if failed else []
            if len(failing) == 1:
                # alone beside padding it failed: a suspect, looked at again beside another padding node
                self.suspect(rest[0], self.last_test)
                failing, rest = [], []
                yield from self.parallel(*(self.second_look(n, pad) for n, pad in self.suspects.items()))
                self.suspects = {}
        yield from self.check_ends(rest)
        self.grp.finished = True

    def confirm(self, rest: list[str]) -> _Task:
        """The group less what was blamed or is suspect: whether it failed."""
        if not rest:
            return False
        ran = yield [self.req(rest, OUT)]
        (self.last_test, failed), = ran
        return failed

    def seen_pass(self, nodes: Sequence[str]) -> bool:
        s = frozenset(nodes)
        return any(s <= p for p in self.passed)

    def pair_fails(self, a: str, b: str):
        """Whether a and b fail together, seen directly: an end found by halving is inferred until then."""
        if frozenset((a, b)) in self.failed:
            return True
        return (yield from self.one([a, b]))

    def check_ends(self, rest: list[str]):
        """`rest` passed without the link ends left out: test each end with it, less the end's known partners,
        and find any further link from that end (every pair inside `rest` is clean, the end is no bad node)."""
        for end in self.ends:
            while True:
                partners = self.partners(end)
                others = [n for n in rest if n not in partners]
                if not others or self.seen_pass(others + [end]) or not (yield from self.one(others + [end])):
                    break
                while len(others) > 1:
                    part = others[:len(others) // 2]
                    others = part if (yield from self.one([end] + part)) else others[len(part):]
                if not (yield from self.pair_fails(end, others[0])):
                    raise SearchStopped  # the outcomes contradict each other: blame nothing more
                self.blame_link(others[0], end)
        # Pairs of left-out ends are in no test yet: all of them at once when none is a known link, else each.
        ends = self.ends
        pairs = [frozenset((a, b)) for i, a in enumerate(ends) for b in ends[i + 1:]]
        unknown = [p for p in pairs if p not in self.grp.links]
        if len(unknown) == len(pairs) > 1:
            if not (yield from self.one(ends)):
                return
        for p in unknown:
            if (yield from self.one(sorted(p, key=ends.index))):
                a, b = sorted(p, key=ends.index)
                self.blame_link(a, b)

"""The circuit breaker: may this node be cordoned now, or have too many nodes of the cluster, or of its NVLink
domain, been drained by gpuwarden within the window for one more to be a node fault rather than a common cause?

The fleet view is the scheduler's (`SchedulerAdapter.nodes()`): the nodes whose drain reason is ours and when it
was set. Agents on many nodes read the same view and so reach the same verdict without a coordinator.

Defaults (`BreakerPolicy()`), and why:
- `cluster_share = 0.10` within `window_s = 600`. A node fails about once in 490 days, so a cluster of 128 NVL72
  racks (2,304 nodes) loses about 4.7 nodes a day, 0.03 in ten minutes: 10 % of it (230 nodes) draining in ten
  minutes is never independent node faults but a common cause (a driver or firmware rollout, a check that
  misjudges, a fabric manager or storage outage), which draining nodes does not fix and which must not empty the
  fleet. NVSentinel trips at 50 % in 5 minutes; half a fleet gone is too late to stop.
- `domain_share = 0.25`: an NVL72 domain is one rack of 18 nodes sharing one NVLink fabric, kept with 2 spares
  (16-node slices). Up to 4 of its nodes may be drained in the window (two more than its spares, so the ordinary
  case of a bad node while another is in repair still acts); a fifth is a rack-level event (NVSwitch tray, power
  shelf, cooling, the rack's fabric manager) that node drains cannot fix and a person must look at. Independent
  faults make 5 of 18 nodes within ten minutes vanishingly rare (about 5e-21).
- `min_nodes = 1`: one node at a time is always allowed, so one-node and tiny clusters (where any share rounds
  down to zero) still act on a real fault.

The rule: a node counts as drained by us within the window when its reason is ours, it is not a spare (a spare is
held out of service on purpose, not for a fault), and its reason was set at or after max(now - window_s,
reset_at); a drain of ours whose start the scheduler does not give counts too (could not tell is not "old").
Drains by anyone else (an administrator, NHC) never count: they are not ours to brake. The node asking counts
as one more unless it is already among them. A group's size n is every node the scheduler lists in it, spares and
nodes out of service included (the cluster: all of them; a domain: the nodes that published it, so a node with no
published domain counts in the cluster's share only). The limit of a group of n nodes is max(min_nodes,
floor(share * n)). A new node is allowed when the count, itself included, is within the limit of its cluster and
of its domain; a node already drained by us is allowed when it is among the first `limit` of them by the time
their drain began (then by name).

That rank is only as stable as the scheduler's reason time, and Slurm moves it whenever the reason changes (our
cordon's reason becomes the quarantine's), so a node's place can change under it. The remediation engine therefore
never asks for it: it judges its node out of the fleet, as one more on top of the others' drains, before its cordon
and again after the cordon lands, and does not judge the later steps of a node already out of service
(docs/remediation.md, "Why the order of drains does not matter"). A moving start only keeps a node counted longer,
the side that refuses more.
"""
from __future__ import annotations

import math
from typing import Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView

_EPS = 1e-9  # share * n computed in floating point: 0.29 * 100 is 28.999999999999996, and the limit is 29


@dataclass(frozen=True)
class BreakerPolicy:
    cluster_share: float = 0.10  # at most this share of all nodes drained by us within window_s
    domain_share: float = 0.25  # and at most this share of one NVLink domain's nodes
    window_s: float = 600.0
    min_nodes: int = 1  # a cordon is always allowed while fewer than this many are drained in the window

    def __post_init__(self) -> None:
        for name in ("cluster_share", "domain_share"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"breaker {name} must be a number from 0 to 1, not {value!r}")
        if not _is_real(self.window_s) or not 0.0 < self.window_s <= 7 * 86400:
            raise ValueError(f"breaker window_s must be a number of seconds above 0 and at most a week, "
                             f"not {self.window_s!r}")
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int) or not 0 <= self.min_nodes <= 10**6:
            raise ValueError(f"breaker min_nodes must be a whole number from 0, not {self.min_nodes!r}")


@dataclass(frozen=True)
class BreakerVerdict:
    allow: bool
    reason: str  # one line for the log and `status`
    cluster: tuple[int, int]  # (drained by us within the window, counting this node; nodes in the cluster)
    domain: tuple[int, int] | None  # same for the node's domain (None: domain unknown)


def limit(share: float, nodes: int, policy: BreakerPolicy) -> int:
    """How many nodes of a group of `nodes` may be drained by us within the window."""
    return max(policy.min_nodes, math.floor(share * nodes + _EPS))


def judge(fleet: Sequence[NodeView], node: str, domain: str | None, now: float, policy: BreakerPolicy,
          reset_at: float | None = None) -> BreakerVerdict:
    """May `node` (of NVLink domain `domain`, None when unknown) be cordoned at `now`?"""
    if not _is_real(now):
        raise ValueError(f"breaker: now must be a finite time, not {now!r}")
    since = now - policy.window_s
    if reset_at is not None and _is_real(reset_at):
        since = max(since, reset_at)
    views = {v.name: v for v in fleet if v.name != node}  # one view per name; the node itself is judged below
    counted = [v for v in views.values() if _drained_by_us(v, since)]
    me = _start(fleet, node, since)  # None: not drained by us within the window (it would be one more)

    verdict_cluster = _group(counted, me, len(views) + 1, policy.cluster_share, policy)
    verdict_domain = None
    if domain is not None:
        members = [v for v in counted if v.domain == domain]
        size = sum(1 for v in views.values() if v.domain == domain) + 1
        verdict_domain = _group(members, me, size, policy.domain_share, policy)

    over = []
    if not verdict_cluster[0]:
        over.append(f"cluster {_said(verdict_cluster)}")
    if verdict_domain is not None and not verdict_domain[0]:
        over.append(f"NVLink domain {domain} {_said(verdict_domain)}")
    window = f"within {policy.window_s:g} s"
    if over:
        return BreakerVerdict(False, f"breaker open: {'; '.join(over)} drained by gpuwarden {window}: a common "
                                     f"cause, not a node fault; `gpuwarden breaker reset` once it is understood",
                              verdict_cluster[1], verdict_domain[1] if verdict_domain else None)
    said = f"cluster {_said(verdict_cluster)}"
    said += f", NVLink domain {domain} {_said(verdict_domain)}" if verdict_domain else ", NVLink domain unknown"
    return BreakerVerdict(True, f"breaker closed: {said} drained by gpuwarden {window}", verdict_cluster[1],
                          verdict_domain[1] if verdict_domain else None)


# A group's verdict: (allowed, (count, size), limit, rank of the node among the drained when already one of them)
_Group = tuple[bool, tuple[int, int], int, int | None]


def _group(counted: list[NodeView], me: tuple[float, str] | None, size: int, share: float,
           policy: BreakerPolicy) -> _Group:
    cap = limit(share, size, policy)
    count = len(counted) + 1
    if me is None:
        return count <= cap, (count, size), cap, None
    # Already drained by us: its place among the drained, earliest first, then by name (every agent ranks the same
    # way, so exactly `cap` of them go on). Unknown starts are taken as earliest, the side that refuses more.
    rank = 1 + sum(1 for v in counted if (_order(v), v.name) < me)
    return rank <= cap, (count, size), cap, rank


def _said(g: _Group) -> str:
    allowed, (count, size), cap, rank = g
    text = f"{count} of {size} (limit {cap})"
    if rank is not None and not allowed:
        text += f", this node drained {_ordinal(rank)}"
    return text


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _drained_by_us(v: NodeView, since: float) -> bool:
    if not v.ours or v.spare:
        return False
    return v.reason_since is None or not _is_real(v.reason_since) or v.reason_since >= since


def _order(v: NodeView) -> float:
    return v.reason_since if v.reason_since is not None and _is_real(v.reason_since) else -math.inf


def _start(fleet: Sequence[NodeView], node: str, since: float) -> tuple[float, str] | None:
    """The node's own place key when its drain of ours counts in the window; None when it does not."""
    mine = [v for v in fleet if v.name == node]  # the last view of a name wins, as for every other node
    return (_order(mine[-1]), node) if mine and _drained_by_us(mine[-1], since) else None


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

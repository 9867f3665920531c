"""Spare hot-swap in the NVLink domain: which spare replaces a failed node, whether its slice must move (and to
which domains), and whether a repaired node refills its domain's pool or goes straight back to service.

On NVL72 a rack of 18 nodes is one NVLink domain: a job's slice cannot span racks at NVLink speed, so a failed
node is replaced by a spare **of the same rack**. The default keeps 2 spares per domain (`SparePolicy()`), after
NVIDIA's slice-size analysis: at 2 % node unavailability on 128 racks, 16-node slices serve 2,037 nodes, 18-node
slices 1,602 (any failure breaks the slice), 8-node 2,043 but half the NVLink reach.

The rules, all over the scheduler's fleet view (`SchedulerAdapter.nodes()`), so every agent computes the same:
- **Healthy spare**: held in its domain's pool (`spare`), not quarantined, and the scheduler can reach it (its
  service is neither DOWN nor UNKNOWN: could not tell is not healthy).
- **Order to try**: by name, digits compared as numbers (`n2` before `n10`). The order is the same on every
  agent; the scheduler is the arbiter when two agents reach for the same spare (`take_spare` is atomic there),
  and the loser takes the next.
- **The slice must move** when the failed node's domain has no healthy spare left. Its size is taken as the
  domain's size less the spares it is kept with (`per_domain`: 16 of 18), the slice the pool was sized for.
- **Hosts**: the other domains (published, known) whose free nodes, their healthy spares plus in-service nodes
  the scheduler knows to be idle (`jobs == 0`; unknown is not idle), number at least the slice's size. Listed
  best fit first (fewest free nodes that still fit, then by name), so large empty domains stay whole for large
  slices.
- **Back in the pool**: a repaired node refills its domain's pool while that domain holds fewer than
  `per_domain` healthy spares (itself not counted); otherwise, or when its domain is unknown, it returns to
  service.
"""
from __future__ import annotations

from typing import Sequence

from gpuwarden.agent.core.records import dataclass
from gpuwarden.agent.core.scheduler import NodeView, Service

_UNREACHABLE = (Service.DOWN, Service.UNKNOWN)


@dataclass(frozen=True)
class SparePolicy:
    per_domain: int = 2  # spares kept per NVLink domain (NVIDIA's slice sizing for NVL72: 16 of 18 in use)

    def __post_init__(self) -> None:
        n = self.per_domain
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1024:
            raise ValueError(f"spares per_domain must be a whole number from 0 to 1024, not {self.per_domain!r}")


@dataclass(frozen=True)
class SwapPlan:
    domain: str | None
    candidates: tuple[str, ...]  # spares of the failed node's domain, in the order to try
    slice_must_move: bool  # True when the domain has no spare left
    hosts: tuple[str, ...]  # domains that could host the slice instead (when it must move)
    reason: str


def plan_swap(fleet: Sequence[NodeView], failed: str, policy: SparePolicy) -> SwapPlan:
    """What replaces `failed` in its slice: spares of its NVLink domain to try in order, or where the slice can go."""
    views = _by_name(fleet)
    me = views.get(failed)
    if me is None:
        return SwapPlan(None, (), False, (), f"{failed} is not in the scheduler's view: no domain, no spare to take")
    if me.domain is None:
        return SwapPlan(None, (), False, (), f"{failed} has no published NVLink domain: no spare to take (publish "
                                             f"its domain: `gpuwarden topology`)")
    if me.spare:
        left = healthy_spares(views.values(), me.domain, exclude=failed)
        return SwapPlan(me.domain, (), False, (), f"{failed} is a spare of {me.domain}: nothing to replace; "
                                                  f"{len(left)} healthy spare(s) left there")
    candidates = healthy_spares(views.values(), me.domain, exclude=failed)
    if candidates:
        return SwapPlan(me.domain, candidates, False, (), f"{len(candidates)} healthy spare(s) of {me.domain} for "
                                                          f"{failed}, first {candidates[0]}")
    need = slice_size(views.values(), me.domain, policy)
    hosts = _hosts(views.values(), me.domain, need)
    where = f"domains that could host it: {', '.join(hosts)}" if hosts else "no domain has that many free nodes"
    return SwapPlan(me.domain, (), True, hosts, f"no healthy spare left in {me.domain}: the slice of {failed} "
                                                f"({need} nodes) must move; {where}")


def wants_back_in_pool(fleet: Sequence[NodeView], node: str, policy: SparePolicy) -> bool:
    """A repaired node returns to its domain's pool (True) or straight to service (False)."""
    views = _by_name(fleet)
    me = views.get(node)
    if me is None or me.domain is None:
        return False
    return len(healthy_spares(views.values(), me.domain, exclude=node)) < policy.per_domain


def healthy_spares(fleet, domain: str, exclude: str | None = None) -> tuple[str, ...]:
    """The healthy spares of `domain`, in the order to try (every agent and adapter uses this one order)."""
    return tuple(sorted((v.name for v in fleet if v.spare and v.domain == domain and v.name != exclude
                         and not v.quarantined and v.service not in _UNREACHABLE), key=name_order))


def slice_size(fleet, domain: str, policy: SparePolicy) -> int:
    """The nodes a slice of `domain` needs: the domain's size less the spares it is kept with (at least 1)."""
    return max(1, sum(1 for v in fleet if v.domain == domain) - policy.per_domain)


def name_order(name: str) -> tuple:
    """Sort key: runs of digits compare as numbers (node2 < node10), the rest as text; one pass, linear, and no
    conversion to int (a hostile name of thousands of digits costs no more than its length)."""
    parts: list[tuple] = []
    run, digits = "", False
    for ch in name:
        is_digit = "0" <= ch <= "9"
        if run and is_digit != digits:
            parts.append(_part(run, digits))
            run = ""
        digits = is_digit
        run += ch
    if run:
        parts.append(_part(run, digits))
    return tuple(parts), name  # the name itself settles ties such as n01 / n1


def _part(run: str, digits: bool) -> tuple:
    if not digits:
        return (0, run)
    value = run.lstrip("0")
    return (1, len(value), value)  # as numbers: fewer significant digits is smaller, then digit by digit


def _hosts(fleet, failed_domain: str, need: int) -> tuple[str, ...]:
    free: dict[str, int] = {}
    for v in fleet:
        if v.domain is None or v.domain == failed_domain:
            continue
        free.setdefault(v.domain, 0)
        if v.quarantined or v.service in _UNREACHABLE:
            continue
        if v.spare or (v.service is Service.IN_SERVICE and v.jobs == 0):
            free[v.domain] += 1
    return tuple(d for d, n in sorted(free.items(), key=lambda kv: (kv[1], name_order(kv[0]))) if n >= need)


def _by_name(fleet: Sequence[NodeView]) -> dict[str, NodeView]:
    return {v.name: v for v in fleet}  # a name listed twice: the last view wins, as in the breaker

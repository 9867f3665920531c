"""The Slurm adapter's spare pool: a spare is a node drained with SPARE_REASON in an NVLink domain; taking one claims it
with a reservation `gpuwarden_spare_<spare>_for_<failed node>` (slurmctld refuses a reservation that overlaps another on
the same node, so two agents never take the same spare), records whom it stands in for in its Comment, resumes it and
releases the claim. A mixin of SlurmAdapter (agent/act/adapters/slurm.py)."""
from __future__ import annotations

import time

from gpuwarden.agent.act.adapters.slurm_hostlist import MAX_NAME, _check_domain, _check_node, valid_name
from gpuwarden.agent.act.adapters.slurm_json import SLURM_NOT_RESPONDING, _Node
from gpuwarden.agent.act.adapters.slurm_tools import SlurmTools
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import REASON_PREFIX, SPARE_REASON, Busy, Refused, Service, Transient

log = logs.get_logger("gpuwarden.adapter.slurm")

CLAIM_PREFIX = "gpuwarden_spare_"  # reservation name: the exclusive claim on one spare while it is taken ...
CLAIM_FOR = "_for_"  # ... and the failed node it is taken for: `gpuwarden_spare_<spare>_for_<node>`
RECORD_PREFIX = f"{REASON_PREFIX} spare for "  # the taken spare's Comment: which failed node it replaces
MAX_RESERVATIONS = 100_000
_CLAIM_TAKEN = ("duplicate reservation name", "overlaps", "busy")


class _ClaimTaken(Refused):
    """Another agent holds the claim on this spare."""


def claim_name(spare: str, for_node: str) -> str:
    """The claim reservation on `spare` while it is taken for `for_node`: the name says whose claim it is."""
    return f"{CLAIM_PREFIX}{spare}{CLAIM_FOR}{for_node}"


def _record_of(comment: str) -> tuple[str | None, str]:
    """(the failed node a taken spare stands in for, the rest of the Comment) from a Comment."""
    if not comment.startswith(RECORD_PREFIX):
        return None, comment
    head, sep, rest = comment[len(RECORD_PREFIX):].partition(";")
    name = head.strip()
    return (name if valid_name(name, MAX_NAME) else None), rest.strip() if sep else ""


class SpareClaims(SlurmTools):
    """Listing, taking and returning spares."""

    user: str
    claim_ttl_s: float

    def spares(self, domain: str) -> list[str]:
        _check_domain(domain)
        # A spare recorded for a failed node is promised to that node's retried take, so it is not offered.
        return [n.view.name for n in self._fleet() if self._is_spare(n, domain) and _record_of(n.comment)[0] is None]

    def return_to_pool(self, node: str, domain: str) -> None:
        _check_domain(domain)
        n = self._get(node)
        if n.view.reason and not n.view.ours and n.view.reason != SLURM_NOT_RESPONDING:
            raise Refused(f"{node}: {self._held(n)}; not taken into the spare pool over it")
        self.publish_domain(node, domain)
        fleet = self._fleet()
        self._forget_swaps(fleet, node)
        n = self._find(fleet, node)
        record, rest = _record_of(n.comment)
        if record is not None:  # its own record of standing in for another node: obsolete once back in the pool
            self._set_comment(node, rest)
        if not (n.drain and n.view.reason == SPARE_REASON):
            self._scontrol("return to pool", ["update", f"NodeName={node}", "State=DRAIN", f"Reason={SPARE_REASON}"])
            log.info("node returned to the spare pool", node=node, domain=domain)

    def take_spare(self, domain: str, for_node: str) -> str | None:
        _check_domain(domain)
        _check_node(for_node)
        fleet = self._fleet()
        claimed = self._own_claims(for_node)
        held = self._find(fleet, for_node).held
        # An earlier take for this node that did not finish is carried on: the spare recorded for it (a record for a
        # node back in service is from an earlier swap), or the spare its claim still holds.
        for n in fleet:
            recorded = held and _record_of(n.comment)[0] == for_node
            if not (recorded or n.view.name in claimed):
                continue
            if recorded and not self._is_spare(n, None):  # taken already: a retried call
                self._release(n.view.name, for_node)
                return n.view.name
            try:
                taken = self._take(n, for_node)
            except _ClaimTaken:
                if recorded:  # promised to this node, claimed by another: wait until that claim is released or ends
                    raise Busy(f"{n.view.name}: claimed by another agent; retry when the claim ends") from None
                continue
            if taken is not None:
                return taken
        for n in fleet:
            if n.view.name not in claimed and self._is_spare(n, domain) and _record_of(n.comment)[0] is None:
                try:
                    taken = self._take(n, for_node)
                except _ClaimTaken:
                    log.info("spare claimed by another agent", spare=n.view.name, domain=domain)
                    continue
                if taken is not None:
                    return taken
        return None

    # -- the parts ---------------------------------------------------------------------------------------------
    def _take(self, n: _Node, for_node: str) -> str | None:
        """Claim `n`, check it is still a spare, record whom it stands in for, resume it, release the claim. None
        when it stopped being a spare before the claim; _ClaimTaken when another node's claim holds it."""
        spare = n.view.name
        start = time.monotonic()
        self._claim(spare, for_node)
        try:
            now = self._get(spare)  # read after the claim: what was seen before it may be stale
            record = _record_of(now.comment)[0]
            if not self._is_spare(now, None) or record not in (None, for_node):
                log.info("spare gone before it was claimed", spare=spare, reason=now.view.reason)
                return None
            if record is None:
                self._set_comment(spare, f"{RECORD_PREFIX}{for_node}", keep=now.comment)
            if time.monotonic() - start + self.timeout_s >= self.claim_ttl_s:
                raise Transient(f"{spare}: the claim ran out before the spare could be resumed")
            self._resume(now)
            log.info("spare taken into service", spare=spare, for_node=for_node)
            return spare
        finally:
            self._release(spare, for_node)

    def _claim(self, spare: str, for_node: str) -> None:
        """Creates the claim on `spare` for `for_node`, or renews this node's own claim that an earlier call left
        (the agent died, or slurmctld went away, before the release). _ClaimTaken when another node's claim holds
        the spare."""
        claim = claim_name(spare, for_node)
        try:
            self._scontrol("claim spare", ["create", "reservation", f"ReservationName={claim}", f"Nodes={spare}",
                                           f"Users={self.user}", "StartTime=now",
                                           f"Duration={int(self.claim_ttl_s // 60)}", "Flags=IGNORE_JOBS"])
            return
        except Refused as exc:
            if not any(m in str(exc).lower() for m in _CLAIM_TAKEN):
                raise
            taken = str(exc)
        # 22.05 answers a second reservation on the node with "overlaps" before it looks at the name, so whose claim
        # is in the way is asked by renewing this node's own: slurmctld refuses to renew a name it does not have, or
        # one that would overlap another node's claim (an update is checked like a creation).
        try:
            self._scontrol("renew claim", ["update", f"ReservationName={claim}",
                                           f"EndTime=now+{int(self.claim_ttl_s)}"])
        except Refused:
            raise _ClaimTaken(taken) from None
        log.info("carrying on with this node's own claim left by an earlier take", spare=spare, for_node=for_node)

    def _own_claims(self, for_node: str) -> list[str]:
        """The spares whose claim for `for_node` an earlier take left behind (`scontrol show reservation -o`, one
        reservation a line)."""
        out = self._run("scontrol", ["show", "reservation", "-o"], "show reservations")
        found = []
        for line in out.splitlines()[:MAX_RESERVATIONS]:
            name = nodes = None
            for token in line[:8192].split():
                key, _, value = token.partition("=")
                if key == "ReservationName":
                    name = value
                elif key == "Nodes":
                    nodes = value
            if name and nodes and valid_name(nodes, MAX_NAME) and name == claim_name(nodes, for_node):
                found.append(nodes)
        return found

    def _release(self, spare: str, for_node: str) -> None:
        try:
            self._scontrol("release claim", ["delete", f"ReservationName={claim_name(spare, for_node)}"])
        except Refused as exc:  # not there (released before, or its time ran out)
            if "not found" not in str(exc).lower() and "invalid" not in str(exc).lower():
                raise

    def _forget_swaps(self, fleet: list[_Node], node: str) -> None:
        """`node` is back (in service or in the pool): the records of spares taken for it are done with."""
        for n in fleet:
            record, rest = _record_of(n.comment)
            if record == node:
                self._set_comment(n.view.name, rest)

    def _set_comment(self, node: str, text: str, keep: str = "") -> None:
        """Sets the Comment; an operator's comment (`keep`, not ours) stays after ours."""
        _, rest = _record_of(keep)
        value = f"{text}; {rest}" if text and rest else text
        self._scontrol("comment", ["update", f"NodeName={node}", f"Comment={value}"])

    @staticmethod
    def _is_spare(n: _Node, domain: str | None) -> bool:
        return (n.view.spare and n.drain and n.responding and n.view.service is Service.DRAINED
                and (domain is None or n.view.domain == domain))

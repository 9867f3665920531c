"""The Slurm adapter: carries the engine's decisions to slurmctld with `scontrol`, reads the fleet back with
`sinfo --json` (and `squeue` for one node's jobs), Slurm 22.05 and newer.

What it writes, and so what it owns:
- a node's Reason (drain): `gpuwarden: <finding>`, `gpuwarden: quarantine: <finding>`, or SPARE_REASON for a
  spare held out of service. Only a node drained with a reason that starts with REASON_PREFIX is ever resumed;
  an administrator's or NHC's drain is never undone (`Refused`), and never overwritten.
- a node feature `gpuwarden_domain_<domain>` (the NVLink domain, what users select with --constraint), and the
  same domain in the node's Extra (`gpuwarden_domain=<domain>`, an operator's own Extra kept after it): features
  set by scontrol are forgotten when slurmctld restarts, Extra is kept in its saved state, so the domain (and with
  it the spare pool) is known at once after a restart, and the next publish puts the feature back.
- while taking a spare: a reservation `gpuwarden_spare_<spare>_for_<failed node>` as the claim (slurmctld refuses
  a reservation that overlaps another on the same node, so two agents never take the same spare; the name says
  whose claim it is, so a retried take carries on with its own), and the spare's Comment
  `gpuwarden: spare for <node>` so a retried take returns the spare already taken.
docs/slurm.md explains each choice and the 22.05 behaviours handled here."""
from __future__ import annotations

import dataclasses
import math
import os
import pwd
from typing import Sequence

from gpuwarden.agent.act.adapters.slurm_hostlist import _check_domain, _check_node
from gpuwarden.agent.act.adapters.slurm_job_actions import JobActions
from gpuwarden.agent.act.adapters.slurm_json import (
    DOMAIN_FEATURE_PREFIX,
    QUARANTINE_PREFIX,
    SLURM_NOT_RESPONDING,
    _Node,
    extra_domain,
    extra_with_domain,
)
from gpuwarden.agent.act.adapters.slurm_spares import SpareClaims
from gpuwarden.agent.act.adapters.slurm_tools import MAX_REASON, SlurmTools, _clean
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import REASON_PREFIX, NodeView, Refused

log = logs.get_logger("gpuwarden.adapter.slurm")


def reason_text(reason: str, quarantine: bool = False) -> str:
    """The Reason the adapter writes for `reason`: REASON_PREFIX, `quarantine:` when held for recovery, the
    finding cleaned and cut to MAX_REASON characters."""
    body = _clean(reason)
    if body.startswith(REASON_PREFIX):
        body = body[len(REASON_PREFIX):].lstrip()
    if body.startswith("quarantine:"):
        body = body[len("quarantine:"):].lstrip()
    head = QUARANTINE_PREFIX if quarantine else REASON_PREFIX
    body = body or ("held for recovery" if quarantine else "drained")
    return f"{head} {body}"[:MAX_REASON].rstrip()


class SlurmAdapter(SpareClaims, JobActions, SlurmTools):
    """Slurm through its command-line tools. `slurm_conf` (or SLURM_CONF in the environment) names the cluster;
    each tool call is bounded by `timeout_s` and ended with its process group when it runs out. The node's state
    here; the spare pool in slurm_spares.py, the job actions in slurm_job_actions.py, the tool calls in
    slurm_tools.py, the reading of sinfo's and squeue's JSON in slurm_json.py."""
    name = "slurm"

    def __init__(self, *, timeout_s: float = 10.0, scontrol: str = "scontrol", sinfo: str = "sinfo",
                 squeue: str = "squeue", scancel: str = "scancel", slurm_conf: str | None = None,
                 claim_ttl_s: float | None = None):
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= 3600):
            raise ValueError(f"timeout_s: {timeout_s!r} is not in (0, 3600]")
        self.timeout_s = float(timeout_s)
        self.tools = {"scontrol": scontrol, "sinfo": sinfo, "squeue": squeue, "scancel": scancel}
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = str(slurm_conf)
        # A claim outlives every step of a take (five tool calls) with room to spare; an agent that died holding
        # one blocks that spare only this long. Reservations are kept to the minute.
        ttl = claim_ttl_s if claim_ttl_s is not None else max(120.0, 8 * self.timeout_s)
        self.claim_ttl_s = float(math.ceil(ttl / 60.0) * 60)
        try:
            self.user = pwd.getpwuid(os.getuid()).pw_name  # the claim reservation's only user
        except KeyError:
            self.user = str(os.getuid())

    # -- reading -----------------------------------------------------------------------------------------------
    def nodes(self) -> Sequence[NodeView]:
        return [n.view for n in self._fleet()]

    def state_and_reason(self, node: str) -> tuple[str, str]:
        """(sinfo's long state, lower-case; the reason, "" when none) of this one node, read cheaply: every node of a
        cluster may ask this each HealthCheckInterval, so it is one single-node request (`sinfo -n` with one name),
        not the whole node list the other calls read (`sinfo --json` ignores --nodes on 22.05). Refused when
        slurmctld does not know the node."""
        out = self._run("sinfo", ["-h", "-N", "-n", node, "-o", "%T %E"], "this node's state")
        line = out[:8192].partition("\n")[0].strip()
        if not line:
            raise Refused(f"{node}: slurmctld does not know this node (give --node, or check SLURMD_NODENAME)")
        state, _, reason = line.partition(" ")
        reason = reason.strip()
        return state.lower(), "" if reason == "none" else reason

    def node(self, node: str) -> NodeView:
        n = self._get(node)
        if n.view.jobs is None and n.responding:
            out = self._run("squeue", ["--noheader", f"--nodelist={node}", "--format=%i",
                                       "--states=RUNNING,COMPLETING,SUSPENDED,CONFIGURING,STOPPED"])
            jobs = sum(1 for line in out.splitlines()[:1_000_000] if line.strip())
            return dataclasses.replace(n.view, jobs=jobs)
        return n.view

    # -- acting ------------------------------------------------------------------------------------------------
    def cordon(self, node: str, reason: str) -> None:
        self._drain(node, reason_text(reason), "cordon")

    def drain(self, node: str, reason: str) -> None:
        # Slurm's DRAIN already lets running jobs finish and starts no new ones: cordon and drain are one update.
        self._drain(node, reason_text(reason), "drain")

    def quarantine(self, node: str, reason: str) -> None:
        self._drain(node, reason_text(reason, quarantine=True), "quarantine")

    def resume(self, node: str) -> None:
        fleet = self._fleet()
        n = self._find(fleet, _check_node(node))
        if not n.held:  # in service (Slurm marks a node NOT_RESPONDING after a RESUME until it answers a ping)
            self._forget_swaps(fleet, node)
            return
        if not n.view.ours:
            raise Refused(f"{node}: {self._held(n)}; only a drain of gpuwarden's is resumed")
        self._resume(n)
        self._forget_swaps(fleet, node)

    def publish_domain(self, node: str, domain: str) -> None:
        feature = DOMAIN_FEATURE_PREFIX + _check_domain(domain)
        n = self._get(node)
        available = tuple(f for f in n.available if not f.startswith(DOMAIN_FEATURE_PREFIX)) + (feature,)
        active = tuple(f for f in n.active if not f.startswith(DOMAIN_FEATURE_PREFIX)) + (feature,)
        # An Extra too long to read is an operator's, and is not written over (the feature alone is published).
        stored = n.extra is None or extra_domain(n.extra)[0] == domain
        if sorted(available) == sorted(n.available) and sorted(active) == sorted(n.active) and stored:
            return
        # Both lists in one update: 22.05 refuses an AvailableFeatures that no longer holds an active feature. Extra
        # in the same update: the domain survives a slurmctld restart there.
        extra = [] if stored else [f"Extra={extra_with_domain(n.extra or '', domain)}"]
        self._scontrol("publish domain", ["update", f"NodeName={node}", f"AvailableFeatures={','.join(available)}",
                                          f"ActiveFeatures={','.join(active)}", *extra])
        log.info("published NVLink domain", node=node, domain=domain)

    def _drain(self, node: str, text: str, action: str) -> None:
        n = self._get(node)
        if n.drain and (n.view.reason == text or (n.view.quarantined and action != "quarantine")):
            return  # done, or held for recovery already: a late cordon does not undo a quarantine
        if n.view.reason and not n.view.ours and n.view.reason != SLURM_NOT_RESPONDING:
            if action == "quarantine":
                raise Refused(f"{node}: {self._held(n)}; not taken over for recovery")
            log.info("node already held out by someone else; left as it is", node=node, reason=n.view.reason)
            return
        self._scontrol(action, ["update", f"NodeName={node}", "State=DRAIN", f"Reason={text}"])
        log.info("node drained", node=node, action=action, reason=text)

    def _resume(self, n: _Node) -> None:
        try:
            self._scontrol("resume", ["update", f"NodeName={n.view.name}", "State=RESUME"])
        except Refused as exc:
            # 22.05 refuses RESUME of a node that is not drained or down: fine when it is in service by now.
            if "invalid node state" not in str(exc).lower() or self._get(n.view.name).held:
                raise

    @staticmethod
    def _held(n: _Node) -> str:
        return f"held out by someone else (Reason={n.view.reason!r})"

"""What a transition of the node's state asks the remediation engine to do: one intent per action, each with what
carrying it out needs. Pure: the daemon turns its transitions into intents with it, and the fleet simulator turns the
simulated nodes' transitions the same way."""
from __future__ import annotations

from typing import Any

from gpuwarden.agent.core.model import Action, Finding, Status
from gpuwarden.agent.state.transitions import NodeState, Transition

Intent = tuple[str, str, dict[str, Any]]  # (idempotency key, action, detail)


def fault_findings(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status is Status.FAIL and f.action >= Action.DRAIN]


def transition_intents(t: Transition, active: list[Finding], domain: str | None, swap: bool,
                       boot_id: str | None) -> list[Intent]:
    """The transition's intents, each with what carrying it out needs (the GPUs to reset, the boot a reboot leaves,
    the finding a ticket carries), and a spare's swap when the node is quarantined in a known domain (`swap`: the
    remediation's setting). `active`: the node's findings now. The key is the transition itself: a crash between
    commit and carrying out finds the same key again."""
    base = {"at": t.at, "from": t.frm.value, "to": t.to.value, "reason": t.reason}
    worst = worst_fault(active)
    actions = list(t.actions)
    if "drain" in actions and domain and swap and t.to is NodeState.QUARANTINED:
        actions.append("take_spare")
    out: list[Intent] = []
    for a in actions:
        detail = dict(base)
        if a == "reset_gpu":
            detail["gpus"] = fault_gpus(active)
        elif a == "reboot":
            detail["boot_id"] = boot_id
        elif a in ("ticket", "cordon", "drain"):  # the ticket's input; the scheduler's reason names it
            detail["finding"] = worst.to_dict() if worst else None
        elif a in ("take_spare", "return_to_pool"):
            detail["domain"] = domain
        out.append((f"{t.at:.6f}:{t.frm.value}->{t.to.value}:{a}", a, detail))
    return out


def worst_fault(findings: list[Finding]) -> Finding | None:
    faults = fault_findings(findings)
    return max(faults, key=lambda f: f.action) if faults else None


def fault_gpus(findings: list[Finding]) -> list[int]:
    """The GPUs (by index) of the faults a reset would act on."""
    return sorted({f.entity.index for f in fault_findings(findings)
                   if f.entity.kind == "gpu" and f.entity.index is not None})

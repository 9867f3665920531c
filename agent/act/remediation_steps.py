"""The remediation engine's recovery steps on this node (agent/act/recovery.py: GPU reset, reboot, ticket), each
bounded by step_timeout_s and its outcome made the intent's. A mixin of Engine (agent/act/remediation.py)."""
from __future__ import annotations

from typing import Any, Mapping

from gpuwarden.agent.act.remediation_base import EngineState
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.scheduler import Busy

log = logs.get_logger("gpuwarden.remediation")


class RecoverySteps(EngineState):
    """reset_gpu, reboot and ticket intents."""

    # -- the recovery steps on this node -----------------------------------------------------------------------
    def _recovery_step(self, action: str, detail: Mapping[str, Any], key: str) -> str:
        timeout = self.settings.step_timeout_s
        if action == "reset_gpu":
            if self.hooks.fault_clear():
                return "already clear: the fault cleared before the reset"
            gpus = [int(g) for g in detail.get("gpus", [])]
            return self._run_step("reset_gpus", self.node, gpus, timeout)
        if action == "reboot":
            before, now_boot = detail.get("boot_id"), getattr(getattr(self.node, "info", None), "boot_id", None)
            if before and now_boot and before != now_boot:
                return f"done: rebooted (boot {before} -> {now_boot})"
            if self.adapter is not None:
                jobs = self.adapter.node(self.settings.node_name).jobs
                if jobs:  # the drain lets work finish: a reboot now would kill it
                    raise Busy(f"{jobs} job(s) still running on the node; the reboot waits for the drain")
            log.warning("rebooting the node", command=list(self.settings.reboot_command), reason=detail.get("reason"))
            return self._run_step("reboot", list(self.settings.reboot_command), timeout)
        if not self.settings.ticket_command:
            return "done: no ticket command configured ([remediation.ladder] ticket_command); waiting for repair"
        finding = {"finding": detail.get("finding"), "node": self.settings.node_name, "domain": self.domain,
                   "reason": detail.get("reason", ""), "idempotency_key": key}
        return self._run_step("open_ticket", list(self.settings.ticket_command), finding, timeout)

    def _run_step(self, name: str, *args: Any) -> str:
        return _step_outcome(getattr(self._recovery, name)(*args))


def _step_outcome(outcome: Any) -> str:
    ok = getattr(outcome, "ok", None)
    text = str(getattr(outcome, "detail", ""))[:500]
    if ok is True:
        return f"done: {text}" if text else "done"
    if ok is False:
        return f"failed: {text}"
    return f"failed: could not run: {text}"  # never taken as done: the ladder's next step follows

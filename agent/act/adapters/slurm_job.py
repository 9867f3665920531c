"""A Slurm job's window, as `gpuwarden explain --job ID` reads it: the job's nodes, start and end, state and exit code,
each step's (the failing step's nodes among them), and the files its output went to, from `sacct -j ID --json`
(accounting, kept after the job ends) and `scontrol show job ID` (slurmctld's live view, forgotten MinJobAge after
the end). Either may not answer (a cluster without slurmdbd says `Slurm accounting storage is disabled`): what the
one that answers says is used, what the other said is kept with it, and a job neither can read is an error naming
both. The tools run as the Slurm adapter runs them (no shell, a process group of their own, killed at timeout_s).

Where both answer, slurmctld's view of the job itself wins: on 22.05 the accounting record lags the live job (a
running job recorded as PENDING on its first node only) and `sacct --json` reports every plain exit as return code
0 (a FAILED job and its steps all `SUCCESS`, 0; `sacct --format=ExitCode` says 3:0), so those are asked again as
text. The steps come from accounting only: slurmctld keeps no step after it ends.

The tools' outputs are read in agent/act/adapters/slurm_job_records.py.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuwarden.agent.act.adapters.slurm import SlurmAdapter
from gpuwarden.agent.act.adapters.slurm_job_records import (
    JobWindow,
    _after_tool,
    _fill,
    parse_sacct_exit_codes,
    parse_sacct_json,
    parse_scontrol_job,
)
from gpuwarden.agent.core.errors import GpuwardenError, ToolError
from gpuwarden.agent.core.scheduler import AdapterError

# (tool, args) -> its stdout; raises the adapter's Transient or Refused (or a GpuwardenError) when it did not answer.
Runner = Callable[[str, list], str]

MAX_DIR_ENTRIES = 100_000  # entries of an output folder looked at for 22.05's host-named files
_JOB_ID = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,9})?")  # 4242, or an array task 4242_7


class SlurmJobError(GpuwardenError):
    """Slurm could not be asked about the job, or gave nothing readable: `errors` holds what each tool said."""

    def __init__(self, job_id: str, errors: Mapping[str, str], what: str = "could not be read from Slurm"):
        self.job_id, self.errors = job_id, dict(errors)
        said = "; ".join(self.errors.values())
        super().__init__(f"Slurm job {job_id}: {what}" + (f" ({said})" if said else ""))


class SlurmJobUnknown(SlurmJobError):
    """Slurm answered, and does not know the job: never submitted, or forgotten by slurmctld (MinJobAge after its
    end) on a cluster whose accounting does not have it."""


# -- the tools ------------------------------------------------------------------------------------------------------
def slurm_runner(timeout_s: float = 10.0, slurm_conf: str | None = None,
                 tools: Mapping[str, str] | None = None) -> Runner:
    """The Slurm adapter's way of running a read-only tool, with sacct among its tools (the adapter itself never asks
    accounting). `tools`: another program for a tool ({"sacct": "/opt/slurm/bin/sacct"})."""
    adapter = SlurmAdapter(timeout_s=timeout_s, slurm_conf=slurm_conf)
    adapter.tools.update({"sacct": "sacct", **(tools or {})})
    return adapter.read


def slurm_job(job_id: str, *, runner: Runner | None = None, timeout_s: float = 10.0) -> JobWindow:
    """The window of Slurm job `job_id` (`4242`, or an array task `4242_7`) from sacct and scontrol, each bounded by
    timeout_s. Raises SlurmJobUnknown when the tools that answered do not know the job, SlurmJobError when neither
    could be asked; both name the job and what each tool said."""
    ident = str(job_id).strip()
    if not _JOB_ID.fullmatch(ident):
        raise SlurmJobError(ident[:40], {}, "not a Slurm job id (digits, or an array task as 4242_7)")
    run = runner or slurm_runner(timeout_s)
    errors: dict[str, str] = {}
    unknown: list[str] = []
    acct: JobWindow | None = None
    ctl: JobWindow | None = None
    try:
        acct = parse_sacct_json(_ask(run, "sacct", ["-j", ident, "--json"]), ident)
        if acct is None:
            errors["sacct"] = f"sacct -j {ident} --json: accounting has no such job"
            unknown.append("sacct")
        elif _exit_codes_suspect(acct):
            acct = _with_text_exit_codes(acct, run, ident, errors)
    except GpuwardenError as exc:
        errors["sacct"] = str(exc)
    try:
        ctl = parse_scontrol_job(_ask(run, "scontrol", ["show", "job", ident]), ident)
        if ctl is None:
            errors["scontrol"] = f"scontrol show job {ident}: slurmctld lists no such job"
            unknown.append("scontrol")
    except GpuwardenError as exc:
        errors["scontrol"] = str(exc)
        if "invalid job id" in str(exc).lower():  # slurmctld's answer for a job it does not have (any more)
            unknown.append("scontrol")
    if acct is None and ctl is None:
        if unknown:
            raise SlurmJobUnknown(ident, errors, "not known to Slurm: slurmctld forgets a job MinJobAge after it "
                                                 "ends, accounting keeps it only where slurmdbd runs")
        raise SlurmJobError(ident, errors)
    return merge(acct, ctl, tuple(errors.values()))


def _ask(run: Runner, tool: str, args: list[str]) -> str:
    try:
        return run(tool, args)
    except AdapterError as exc:
        raise ToolError(f"{tool} {' '.join(args)}: {_after_tool(str(exc), tool)}") from None


def _exit_codes_suspect(w: JobWindow) -> bool:
    """A FAILED job or step whose JSON exit code reads 0:0: what 22.05's `sacct --json` writes for every plain exit."""
    return any(x.state == "FAILED" and x.exit_code == "0:0" for x in (w, *w.steps))


def _with_text_exit_codes(w: JobWindow, run: Runner, ident: str, errors: dict[str, str]) -> JobWindow:
    args = ["-j", ident, "--noheader", "--parsable2", "--format=JobID,ExitCode"]
    try:
        codes = parse_sacct_exit_codes(_ask(run, "sacct", args))
    except GpuwardenError as exc:
        errors["sacct exit codes"] = str(exc)
        return _replace(w, exit_code=None, steps=tuple(_replace(s, exit_code=None) for s in w.steps))  # not known
    return _replace(w, exit_code=codes.get(w.job_id) if w.ended else None,
                    steps=tuple(_replace(s, exit_code=codes.get(s.id) if s.end is not None else None)
                                for s in w.steps),
                    sources=w.sources + (f"sacct {' '.join(args)}",))


def _replace(obj: Any, **changes: Any) -> Any:
    return dataclasses.replace(obj, **changes)


def merge(acct: JobWindow | None, ctl: JobWindow | None, errors: tuple[str, ...] = ()) -> JobWindow:
    """One window from accounting's and slurmctld's: slurmctld's view of the job where it has one (live, and right
    about exit codes on 22.05), accounting's steps, each gap filled from the other."""
    if acct is None and ctl is None:
        raise ValueError("nothing to merge")
    if acct is None or ctl is None:
        w = acct or ctl
        return _replace(w, errors=errors)
    return JobWindow(
        job_id=ctl.job_id, name=ctl.name or acct.name, user=ctl.user or acct.user, state=ctl.state or acct.state,
        exit_code=ctl.exit_code if ctl.state else acct.exit_code, nodes=ctl.nodes or acct.nodes,
        start=_first(ctl.start, acct.start), end=_first(ctl.end, acct.end) if ctl.ended or not ctl.state else None,
        stdout=ctl.stdout, stderr=ctl.stderr, batch_host=ctl.batch_host or acct.batch_host, steps=acct.steps,
        sources=acct.sources + ctl.sources, stdout_files=ctl.stdout_files, stderr_files=ctl.stderr_files,
        errors=errors)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def locate_outputs(window: JobWindow) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the job's output files that exist here, the ones named that do not), stdout's first. Slurm 22.05's
    slurmstepd fills %N with its host's short hostname, not the Slurm node name: where no node's name gives a file,
    the files of the path's folder that match it with anything in place of %N are taken (the job id slurmctld
    filled in keeps them to this job's)."""
    found: list[str] = []
    missing: list[str] = []
    for pattern, files in ((window.stdout, window.stdout_files), (window.stderr, window.stderr_files)):
        present = [f for f in files if Path(f).is_file()]
        if not present and pattern and "%N" in pattern and "\\" not in pattern:
            present = _host_named(pattern, window.nodes, window.job_id)
        found += [f for f in present if f not in found]
        missing += [f for f in files if f not in present and f not in missing and f not in found]
    return tuple(found), tuple(missing)


def _host_named(pattern: str, nodes: tuple[str, ...], job_id: str) -> list[str]:
    folder = Path(pattern).parent
    shape = re.compile("".join(".+?" if part == "%N" else re.escape(_fill(part, "", 0, job_id))
                               for part in re.split(r"(%N)", Path(pattern).name)))
    out: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_DIR_ENTRIES or len(out) >= max(1, len(nodes)):
                    break
                if shape.fullmatch(entry.name) and entry.is_file():
                    out.append(str(folder / entry.name))
    except OSError:
        return []
    return sorted(out)

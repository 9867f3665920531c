"""The mpirun launcher, where no scheduler runs: `mpirun --hostfile <one per group> -np N --map-by ppr:R:node
--tag-output`, in a process group of its own, ended (SIGTERM, then SIGKILL) past its time."""
from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuwarden.agent.fleet.sweep.launch import (
    INT_GRACE_S,
    KILL_WAIT_S,
    MAX_LINE,
    POLL_S,
    Launcher,
    Run,
    finish_run,
    live_runs,
    signal_group,
    start_run,
    wait_all,
)
from gpuwarden.agent.fleet.sweep.model import EXITED, LAUNCH_ERROR, TIMEOUT, GroupRun


class MpirunLauncher(Launcher):
    """Each group as one mpirun over a hostfile of its nodes (no scheduler): `host slots=R` lines."""
    name = "mpirun"
    stopped_detail = "the sweep was stopped; mpirun was ended"

    def __init__(self, *, ranks_per_node: int = 1, extra_args: Sequence[str] = (), mpirun: str = "mpirun",
                 workdir: Path, env: Mapping[str, str] | None = None) -> None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node}: at least 1")
        self.ranks_per_node, self.extra_args, self.mpirun = ranks_per_node, list(extra_args), mpirun
        self.workdir = Path(workdir)
        self.env = {**os.environ, **env} if env is not None else None
        super().__init__()

    def argv(self, hostfile: Path, nodes: Sequence[str], argv: Sequence[str]) -> list[str]:
        cmd = [self.mpirun, "--hostfile", str(hostfile), "-np", str(len(nodes) * self.ranks_per_node),
               "--map-by", f"ppr:{self.ranks_per_node}:node", "--tag-output"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")  # Open MPI refuses root without it (containers, admin nodes)
        return cmd + [*self.extra_args, *argv]

    def run_groups(self, groups: Sequence[Sequence[str]], argv: Sequence[str], timeout_s: float) -> list[GroupRun]:
        """One mpirun per group, all at once, in group order; returns when every one ended."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        runs = self._batch(groups, lambda batch, i: f"{batch}.{i}")
        for r in runs:
            if r.ended is not None:
                continue
            hostfile = self.workdir / f"hostfile-{os.getpid()}-{r.name}"
            hostfile.write_text("".join(f"{n} slots={self.ranks_per_node}\n" for n in r.nodes))
            start_run(r, self.argv(hostfile, r.nodes, argv), self.env)
        try:
            while True:
                live = live_runs(runs)
                if not live:
                    break
                late = [r for r in live if time.monotonic() > r.launched + timeout_s and r.ended is None]
                for r in late:
                    r.ended = TIMEOUT
                    r.detail = f"ran past its time limit of {timeout_s:g} s; mpirun was ended"
                if late:
                    self._end(late)
                time.sleep(POLL_S)
        finally:
            self._done(runs)
        results = []
        for r in runs:
            result = finish_run(r)
            if result.ended == EXITED and result.returncode not in (0, None) and not _ranks_ran(result):
                result = GroupRun(result.nodes, result.output, result.stderr, result.returncode, LAUNCH_ERROR,
                                  result.duration_s, None, _launch_detail(result.stderr, result.output))
            results.append(result)
            (self.workdir / f"hostfile-{os.getpid()}-{r.name}").unlink(missing_ok=True)
        return results

    def _end(self, runs: Sequence[Run]) -> None:
        """SIGTERM to mpirun's group (mpirun passes it to its ranks and their daemons), SIGKILL after a grace."""
        for r in runs:
            signal_group(r, signal.SIGTERM)
        wait_all(runs, INT_GRACE_S)
        for r in runs:
            signal_group(r, signal.SIGKILL)
        wait_all(runs, KILL_WAIT_S)


_TAGGED = re.compile(r"^\[[0-9]{1,9},[0-9]{1,9}\]<std(?:out|err)>:", re.MULTILINE)


def _ranks_ran(run: GroupRun) -> bool:
    """Some rank printed (mpirun --tag-output's label): the program ran; else mpirun failed to start it."""
    return _TAGGED.search(run.output) is not None or _TAGGED.search(run.stderr) is not None


def _launch_detail(stderr: str, output: str) -> str:
    """mpirun's own message: the first line of words in its stderr (its boxes are drawn with dashes)."""
    for line in (stderr + "\n" + output).splitlines():
        if line.strip() and not line.startswith("---"):
            return line.strip()[:MAX_LINE]
    return "mpirun exited before any rank ran"

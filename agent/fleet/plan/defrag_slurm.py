"""The defrag advisor's Slurm reader: the jobs of `squeue --json`, the nodes of `sinfo --json` and each partition's
PreemptMode from `scontrol show partition -o`, checked as untrusted input (a ConfigError naming the source)."""
from __future__ import annotations

import json

from gpuwarden.agent.act.adapters.slurm_hostlist import MAX_HOSTS, expand_hostlist, valid_name
from gpuwarden.agent.act.adapters.slurm_json import job_state_words, parse_sinfo_json, slurm_flag, slurm_number
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.scheduler import Refused, Transient
from gpuwarden.agent.fleet.plan.defrag_model import Job, Node

MAX_FILE = 64 << 20  # squeue --json of a full queue on a large cluster stays well under this
MAX_JOBS = 500_000
MAX_ELAPSED_S = 10 * 366 * 86400.0  # a start time further back than this is not believed
MAX_PARTITIONS = 10_000
# PreemptMode words that take a job off its nodes (SUSPEND keeps it in the node's memory; GANG time-slices it).
_FREEING_MODES = frozenset({"REQUEUE", "CANCEL"})


def parse_squeue_json(text: str, source: str, now: float) -> list[Job]:
    """The jobs of `squeue --json` (Slurm 22.05's shape; newer shapes where they differ only in how a number or a
    state is written). Raises ConfigError naming `source` on anything that is not that."""
    if len(text) > MAX_FILE:
        raise ConfigError(f"{source}: more than {MAX_FILE >> 20} MiB; not read")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{source}: not JSON ({str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: not squeue --json output (not a JSON object)")
    errors = doc.get("errors")
    if isinstance(errors, list) and errors:
        first = errors[0] if isinstance(errors[0], dict) else {}
        what = str(first.get("error") or first.get("description") or "error")[:200]
        raise ConfigError(f"{source}: squeue reports an error ({what}): slurmctld not reached?")
    entries = doc.get("jobs")
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: not squeue --json output (no \"jobs\" list)")
    if len(entries) > MAX_JOBS:
        raise ConfigError(f"{source}: more than {MAX_JOBS} jobs; not read")
    jobs: dict[str, Job] = {}
    hosts = 0
    for i, entry in enumerate(entries):
        where = f"{source}: jobs[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: not an object")
        jid = slurm_number(entry.get("job_id"))
        if jid is None or jid != int(jid) or jid >= 1 << 32:
            raise ConfigError(f"{where}: job_id {str(entry.get('job_id'))[:40]!r} is not a job id")
        jid_s = str(int(jid))
        if jid_s in jobs:
            raise ConfigError(f"{where}: job {jid_s} listed twice")
        states = job_state_words(entry.get("job_state"))
        if not states:
            raise ConfigError(f"{where}: job {jid_s} has no job_state")
        nodes_text = entry.get("nodes")
        if not isinstance(nodes_text, str) and nodes_text is not None:
            raise ConfigError(f"{where}: job {jid_s}: nodes is not a hostlist")
        try:
            nodes = tuple(dict.fromkeys(expand_hostlist(nodes_text or "", MAX_HOSTS - hosts)))
        except ValueError as exc:
            raise ConfigError(f"{where}: job {jid_s}: nodes {nodes_text[:80]!r}: {exc}") from None
        hosts += len(nodes)
        partition = entry.get("partition", "")
        if not isinstance(partition, str) or len(partition) > 1024:
            raise ConfigError(f"{where}: job {jid_s}: partition is not a name")
        qos = entry.get("qos", "")
        start = slurm_number(entry.get("start_time"))
        elapsed = 0.0
        if "RUNNING" in states or "SUSPENDED" in states:
            if start is None:
                raise ConfigError(f"{where}: job {jid_s} is {states[0].lower()} with no start_time (a number)")
            elapsed = max(0.0, now - start)
            if elapsed > MAX_ELAPSED_S:
                raise ConfigError(f"{where}: job {jid_s}: start_time {start:.0f} is more than ten years before now")
            suspended = slurm_number(entry.get("suspend_time"))
            if "SUSPENDED" in states and suspended is not None and suspended >= start:
                elapsed = max(0.0, suspended - start)  # its work stopped growing when it was suspended
        state = "COMPLETING" if "COMPLETING" in states else states[0]
        jobs[jid_s] = Job(jid_s, partition, nodes, state, slurm_flag(entry.get("batch_flag"), False),
                          slurm_flag(entry.get("requeue"), False), qos[:256] if isinstance(qos, str) else "", elapsed)
    return list(jobs.values())


def parse_partitions(text: str, source: str) -> dict[str, set[str]]:
    """partition -> its PreemptMode words, from `scontrol show partition -o` (one partition a line, Key=Value)."""
    if len(text) > MAX_FILE:
        raise ConfigError(f"{source}: more than {MAX_FILE >> 20} MiB; not read")
    out: dict[str, set[str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) >= MAX_PARTITIONS:
            raise ConfigError(f"{source}: more than {MAX_PARTITIONS} partitions; not read")
        name = mode = None
        for token in line[:65536].split():
            key, eq, value = token.partition("=")
            if key == "PartitionName" and eq:
                name = value
            elif key == "PreemptMode" and eq:
                mode = value
        if not name or not valid_name(name, 256) or mode is None:
            raise ConfigError(f"{source}:{number}: not a `scontrol show partition -o` line (PartitionName=, "
                              f"PreemptMode=)")
        out[name] = {w for w in mode.upper().split(",")[:16] if w}
    return out


def nodes_from_sinfo(text: str, source: str) -> list[Node]:
    """The nodes of `sinfo --json` (agent/act/adapters/slurm_json.py's reading: state, spare, NVLink domain); a
    ConfigError that starts with `source` otherwise."""
    try:
        parsed = parse_sinfo_json(text)
    except (Transient, Refused) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return [Node(n.view.name, n.view.domain, n.view.service, n.view.spare, n.view.reason) for n in parsed]


def preemptible_partitions(modes: dict[str, set[str]]) -> frozenset[str]:
    """The partitions whose PreemptMode takes a job off its nodes (REQUEUE or CANCEL)."""
    return frozenset(p for p, words in modes.items() if words & _FREEING_MODES)

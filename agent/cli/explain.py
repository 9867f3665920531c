"""`gpuwarden explain`: name the node, GPU, IB port or rank behind a failed distributed job, from its logs and from
gpuwarden's own evidence on its nodes (their daemons' /api/v1/findings, saved stores, or Prometheus).

Exit codes: 1 a culprit is named, 0 the logs show no failure (a time limit is not a fault), 2 undecided or bad
input (no log could be read and no node answered, a bad time, a job Slurm does not know)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from gpuwarden.agent.cli.flags import log_flags
from gpuwarden.agent.core import logs
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.jobs.explain import Explanation, explain
from gpuwarden.agent.jobs.joblog import read_job_log
from gpuwarden.agent.jobs.node_evidence import fetch_nodes

DEFAULT_WINDOW_S = 24 * 3600.0  # --nodes without --since and without a job: the last day
MARGIN_S = 300.0  # the window around a job's start/end (a fault seen just before the job's collectives stopped)
_STEPS = {"a": "node", "b": "stall", "c": "peers", "d": "first", "map": "where", "s": "symptom"}


DESCRIPTION = ("Read a failed distributed job's logs (PyTorch ProcessGroupNCCL watchdog, NCCL WARN/INFO, "
               "torchrun, srun/slurmstepd) and gpuwarden's findings on the job's nodes inside the job's window, "
               "and name what failed it: a GPU, an InfiniBand port or link, an NVLink, a node or a rank, each "
               "step of the reasoning with its file and line. A hardware finding on the stalled rank's GPU or "
               "port outranks the rest; where the evidence conflicts it says so and names no culprit.")
EPILOG = ("examples:\n"
          "  gpuwarden explain --job 4242                     nodes, window and logs from Slurm\n"
          "  gpuwarden explain train.log --nodes gpu01,gpu02 --since 2026-12-06T10:00Z\n"
          "  gpuwarden explain rank*.log --evidence ./gpu02-record\n"
          "  gpuwarden explain train.log --prometheus http://prom:9090 --nodes gpu01,gpu02 --json\n\n"
          "exit codes:\n"
          "  0  the logs show no failure (also a job that reached its time limit)\n"
          "  1  a culprit is named\n"
          "  2  undecided, or bad input")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="*", type=Path, metavar="LOG", help="the job's log files (stdout/stderr, per rank "
                   "or per node); with --job, Slurm's StdOut/StdErr files are read too")
    p.add_argument("--job", metavar="ID", help="a Slurm job: its nodes, start, end and output files (sacct, scontrol)")
    p.add_argument("--nodes", metavar="A,B", help="the job's nodes (host or host:port of their gpuwarden endpoint)")
    p.add_argument("--since", metavar="T", help="the window's start: Unix time or ISO 8601 (default: the job's start)")
    p.add_argument("--until", metavar="T", help="the window's end (default: the job's end, or now)")
    p.add_argument("--evidence", action="append", type=Path, default=[], metavar="DIR",
                   help="a saved state store, a `gpuwarden record` folder, or a folder of them (repeatable)")
    p.add_argument("--prometheus", metavar="URL", help="read the nodes' gpuwarden series from this Prometheus")
    p.add_argument("--port", type=int, default=9456, help="the nodes' gpuwarden endpoint port (default 9456)")
    p.add_argument("--https", action="store_true", help="ask the nodes' endpoints over TLS")
    p.add_argument("--ca", type=Path, metavar="FILE", help="the CA that signed the endpoints' certificates")
    p.add_argument("--basic-auth", metavar="USER:FILE", help="basic auth for the endpoints: user and a file holding "
                   "the password")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds per node (default 5)")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    log_flags(p)


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_format or "auto", args.log_level or "warning")
    try:
        return _run(args)
    except GpuwardenError as exc:
        print(f"gpuwarden explain: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    paths = list(args.logs)
    nodes = [n.strip() for n in (args.nodes or "").split(",") if n.strip()]
    since, until = parse_time(args.since, "--since"), parse_time(args.until, "--until")
    job_info: dict[str, Any] | None = None
    if args.job:
        # at use, as each source of evidence below: a log read alone loads none of them (100 of 160 ms of its
        # start); Slurm's adapter +18 ms to `explain LOG` (python -X importtime, least of three)
        from gpuwarden.agent.act.adapters.slurm_job import locate_outputs, slurm_job

        window = slurm_job(str(args.job))
        job_info = {"id": window.job_id, "state": window.state, "exit_code": window.exit_code,
                    "nodes": list(window.nodes), "start": window.start, "end": window.end,
                    "sources": list(window.sources)}
        notes += list(getattr(window, "errors", ()) or ())
        nodes = nodes or list(window.nodes)
        since = since if since is not None else (window.start - MARGIN_S if window.start else None)
        until = until if until is not None else (window.end + MARGIN_S if window.end else None)
        found, missing = locate_outputs(window)
        paths += [Path(f) for f in found if Path(f) not in paths]
        notes += [f"job {window.job_id}'s output {f} is not readable from here" for f in missing]
    if not paths and not nodes and not args.evidence:
        print("gpuwarden explain: give the job's logs, --job, --nodes or --evidence", file=sys.stderr)
        return 2
    now = time.time()
    until = until if until is not None else now
    since = since if since is not None else until - DEFAULT_WINDOW_S
    if since > until:
        print(f"gpuwarden explain: --since is after --until ({since} > {until})", file=sys.stderr)
        return 2
    logs = [read_job_log(p) for p in paths]
    evidence = _node_evidence(args, nodes, since, until)
    if paths and all(log.error for log in logs) and not any(e.reachable for e in evidence):
        for log in logs:
            print(f"gpuwarden explain: {log.error}", file=sys.stderr)
        return 2
    x = explain(logs, evidence, nodes)
    doc = to_json(x, since, until, nodes, [str(p) for p in paths], job_info, notes)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(x, doc))
    return x.exit_code


def _node_evidence(args: argparse.Namespace, nodes: Sequence[str], since: float, until: float) -> list[Any]:
    out: list[Any] = []
    auth = _auth(args.basic_auth)
    if args.evidence:
        # at use: +68 ms to `explain LOG` (the node's sources and NVML with it; python -X importtime, least of 3)
        from gpuwarden.agent.jobs.evidence_saved import read_dirs

        out += read_dirs(list(args.evidence), since, until)
    if args.prometheus:
        # at use: +26 ms to `explain LOG` (http.client, ssl; python -X importtime, least of three)
        from gpuwarden.agent.jobs.prometheus_evidence import query_prometheus

        out += query_prometheus(args.prometheus, list(nodes), since, until, timeout_s=max(args.timeout, 10.0),
                                auth=auth, ca_file=args.ca)
    elif nodes:
        have = {e.host for e in out}
        ask = [n for n in nodes if n not in have]
        if ask:
            out += fetch_nodes(ask, since, until, port=args.port, tls=args.https, ca_file=args.ca, auth=auth,
                               timeout_s=args.timeout)
    return out


def _auth(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    user, sep, file = text.partition(":")
    if not sep or not user or not file:
        raise GpuwardenError(f"--basic-auth {text!r}: give USER:FILE (a file holding the password)")
    try:
        return user, Path(file).read_text().strip()
    except OSError as exc:
        raise GpuwardenError(f"--basic-auth: cannot read the password file {file}: {exc.strerror}") from exc


def parse_time(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise GpuwardenError(f"{flag} {text!r}: not a Unix time or an ISO 8601 time") from None
    return t.timestamp()  # a time without a zone is local time, as `date` prints it


def to_json(x: Explanation, since: float, until: float, nodes: Sequence[str], logs: Sequence[str],
            job: dict[str, Any] | None, notes: Sequence[str]) -> dict[str, Any]:
    doc = x.to_dict()
    doc["notes"] = list(notes) + doc["notes"]
    doc["window"] = {"since": since, "until": until}
    doc["nodes"] = list(nodes)
    doc["logs"] = list(logs)
    doc["job"] = job
    return doc


def render(x: Explanation, doc: dict[str, Any]) -> str:
    c = x.culprit
    lines = []
    if x.verdict == "culprit":
        fields = ", ".join(f"{k} {c[k]}" for k in ("host", "rank", "gpu", "port") if c.get(k) is not None)
        lines.append(f"culprit: {c['kind']}{' (' + fields + ')' if fields else ''} - cause: {x.cause}")
    elif x.verdict == "no-failure":
        lines.append("no failure")
    else:
        lines.append(f"undecided - cause: {x.cause}")
    lines.append(f"  {x.summary}")
    if x.evidence:
        lines.append("evidence:")
        for s in x.evidence:
            where = f"{s.source}:{s.line}" if s.line is not None else s.source
            lines.append(f"  [{_STEPS.get(s.step, s.step)}] {where}: {s.text}")
    if x.conflicts:
        lines.append("conflicting:")
        lines += [f"  - {w}" for w in x.conflicts]
    if x.action:
        lines.append(f"what to do: {x.action}")
    for u in x.unreachable:
        lines.append(f"could not reach gpuwarden on {u['host']}: {u['error']}")
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines) + "\n"

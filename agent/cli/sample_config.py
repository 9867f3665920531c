"""The commented default configuration that ships as /etc/gpuwarden/gpuwarden.toml, written from the code's own
defaults (agent/core/config.py and every check's spec), so the file cannot drift from what the loader does.

Every key is there, commented out, with its default; a line above each table says what it is for, and a key's
comment is taken from the same key's comment in docs/configuration.md when it has one.
`python -m gpuwarden.agent.cli.sample_config [docs/configuration.md] > packaging/gpuwarden.toml`
"""
from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

from gpuwarden.agent.core import config
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs

TABLES: dict[str, str] = {
    "agent": "What preflight runs and how, where the daemon keeps its state and serves /metrics, logging.",
    "remediation": "What the daemon does about a fault (docs/remediation.md): nothing but log intents until "
                   'mode = "act".',
    "remediation.breaker": "The circuit breaker: no more cordons once this share of the fleet or of one NVLink "
                           "domain is drained within window_s.",
    "remediation.spares": "Spare nodes of an NVLink domain, swapped in for a quarantined node.",
    "remediation.ladder": "The recovery steps of a quarantined node: GPU reset, reboot, retest, service ticket.",
    "remediation.local": "Keyword arguments of the local (embedded) adapter, e.g. timeout_s.",
    "remediation.slurm": 'Keyword arguments of the Slurm adapter, e.g. scontrol = "/usr/bin/scontrol", timeout_s.',
    "remediation.kubernetes": "Keyword arguments of the Kubernetes adapter, e.g. kubeconfig, timeout_s.",
    "jobs": "What is done to a job whose collectives a fault on this node has doomed (docs/jobs.md); nothing is "
            'carried out while [remediation] mode = "dry-run".',
    "topology": "This node's NVLink domain (docs/topology.md).",
    "sweep": "gpuwarden sweep: multi-node NCCL collectives over idle nodes, their criteria and where verdicts go "
             "(docs/sweep.md).",
    "sweep.baselines": '"<SKU>/<nodes>" = { latency_p95_us = .., busbw_gbps = .. }: baselines that win over the '
                       "bundled table.",
}
HEADER = """\
# gpuwarden configuration (TOML). Every key below is commented out and shows its default: uncomment a key to change
# it. Order: built-in defaults < this file (or the one named with --config) < command-line flags.
# An unknown key, a wrong type or a value out of range is an error naming the key: preflight exits 2.
# `gpuwarden checks` lists every check with its keys; docs: /usr/share/doc/gpuwarden/docs/configuration.md.
# `systemctl reload gpuwarden` makes the daemon re-read it (a bad file is logged and the running config kept); where
# it listens, its state folder, the textfile and the [remediation] set-up (mode, adapter) take a restart.
"""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"no TOML for {value!r}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")


def _split_comment(line: str) -> tuple[str, str]:
    """`key = value  # comment` -> (`key = value`, `comment`); a # inside a string is not a comment."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def doc_comments(text: str) -> dict[str, str]:
    """{"checks.xid.hold_s": "an incident below ..."}: each key's comment in the ```toml blocks of a page, its
    continuation lines (an indented # line under it) joined."""
    comments: dict[str, str] = {}
    table, last, inside = "", "", False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```toml"
            continue
        if not inside:
            continue
        body, comment = _split_comment(line)
        if body.startswith("["):
            table, last = body.strip("[] "), ""
        elif "=" in body and body[:1].isalpha():
            last = f"{table}.{body.split('=', 1)[0].strip()}"
            if comment:
                comments[last] = comment
        elif not body and comment and line[:1].isspace() and last:
            comments[last] = (comments.get(last, "") + " " + comment).strip()
    return comments


def _wrap(text: str, width: int = 116) -> list[str]:
    # Whole words only: a long path or URL in a comment stays on one line.
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def _table(name: str, values: dict[str, Any], about: str, comments: dict[str, str]) -> Iterator[str]:
    yield ""
    yield from (f"# {line}" for line in _wrap(about))
    yield f"[{name}]"
    nested = {k: v for k, v in values.items() if isinstance(v, dict)}
    for key, value in values.items():
        if key in nested:
            continue
        comment = comments.get(f"{name}.{key}")
        if comment:
            yield from (f"# {line}" for line in _wrap(comment))
        yield f"#{key} = {toml_value(value)}"
    for key, value in nested.items():
        yield from _table(f"{name}.{key}", value, TABLES.get(f"{name}.{key}", ""), comments)


def render(docs: Path | None = None) -> str:
    comments = doc_comments(docs.read_text()) if docs is not None and docs.exists() else {}
    cfg = config.defaults(all_specs())
    summaries: dict[str, str] = {}
    for spec in [*all_specs(), *PASSIVE, *KERNEL_CONSUMERS]:
        summaries.setdefault(spec.name, getattr(spec, "summary", ""))
    out = [HEADER.rstrip("\n")]
    for section in ("agent", "remediation", "jobs", "topology", "sweep"):
        out += _table(section, getattr(cfg, section), TABLES[section], comments)
    for name in sorted(cfg.checks):
        borrowed = cfg.shared.get(name, {})
        about = f"The {name} check: {summaries.get(name) or name}."
        if borrowed:
            about += " It also reads " + ", ".join(f"{owner}.{key}" for key, owner in borrowed.items()) + "."
        if not cfg.checks[name]:
            about += " No keys."
        out += _table(f"checks.{name}", cfg.checks[name], about, comments)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.stdout.write(render(Path(argv[0]) if argv else None))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

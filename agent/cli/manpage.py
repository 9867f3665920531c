"""gpuwarden(1) in roff, written from the command's own argparse parser: every subcommand with its description, its
options and their help, its examples, and the exit codes, so the manual cannot drift from `gpuwarden --help`.

`python -m gpuwarden.agent.cli.manpage > gpuwarden.1` (the Debian package does this when it is built).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from typing import Iterator

from gpuwarden.agent.cli import main as cli
from gpuwarden.agent.cli.flags import EXIT_CODES

FILES: tuple[tuple[str, str], ...] = (
    ("/etc/gpuwarden/gpuwarden.toml", "The configuration (TOML): every key, commented out, shows its default. Read by "
                                      "every command that takes --config when no other file is named; "
                                      "gpuwarden checks lists each check's keys."),
    ("/var/lib/gpuwarden/", "The daemon's state: the SQLite store with the node record, the kernel log cursor, the "
                            "downtime accumulators and the journal of remediation intents. Made by systemd "
                            "(StateDirectory=)."),
    ("/lib/systemd/system/gpuwarden.service", "The daemon (gpuwarden run), enabled when the package is installed."),
    ("/lib/systemd/system/gpuwarden-preflight.service", "The boot preflight, ordered before the scheduler's node "
                                                        "daemon; enabled by the operator."),
    ("/usr/share/gpuwarden/", "Prometheus alerting rules and scrape configuration, the Grafana dashboard, the Slurm "
                              "wiring."),
    ("/usr/share/doc/gpuwarden/", "README.md and the documentation (docs/*.md): configuration, daemon, remediation, "
                                  "Slurm, Kubernetes, install."),
)
SEE_ALSO = ("systemctl(1)", "systemd.service(5)", "slurm.conf(5)", "prometheus(1)", "nvidia-smi(1)", "dcgmi(1)")


def escape(text: str) -> str:
    """Text as roff reads it literally: a backslash is \\e, a hyphen the minus \\- (so options can be copied and
    searched), a character beyond ASCII its \\[uXXXX] name, and a line that would start with a control character
    (. or ') is guarded by \\&."""
    out = []
    for ch in text.replace("\\", "\\e").replace("-", "\\-"):
        out.append(ch if ord(ch) < 128 else f"\\[u{ord(ch):04X}]")
    lines = "".join(out).split("\n")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in lines)


def _quote(text: str) -> str:
    """A macro argument: escaped, double quotes doubled, in quotes."""
    return '"' + escape(text).replace('"', '""') + '"'


def _block(text: str) -> Iterator[str]:
    """An epilog or description: paragraphs split by blank lines; a paragraph whose lines are indented (examples,
    tables) keeps its lines, any other is filled by the formatter."""
    for para in text.strip("\n").split("\n\n"):
        lines = para.split("\n")
        first, rest = lines[0], lines[1:]
        if rest and all(line.startswith(" ") for line in rest) and first.endswith(":"):
            yield ".PP"
            yield escape(first[:1].upper() + first[1:])
            yield ".RS 2"
            yield ".nf"
            yield from (escape(line.strip() if len(line) - len(line.lstrip()) <= 2 else line[2:]) for line in rest)
            yield ".fi"
            yield ".RE"
        elif all(line.startswith(" ") for line in lines):
            yield ".RS 2"
            yield ".nf"
            yield from (escape(line[2:]) for line in lines)
            yield ".fi"
            yield ".RE"
        else:
            yield ".PP"
            yield escape(" ".join(line.strip() for line in lines))


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def _option(parser: argparse.ArgumentParser, action: argparse.Action) -> Iterator[str]:
    formatter = parser._get_formatter()
    if action.option_strings:
        names = ", ".join(f"\\fB{escape(name)}\\fR" for name in action.option_strings)
        args = formatter._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
        head = names + (f" \\fI{escape(args)}\\fR" if args else "")
    else:
        head = f"\\fI{escape(formatter._format_args(action, action.dest))}\\fR"
    yield ".TP"
    yield head
    yield escape(_help(parser, action)) or "\\&"


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().removeprefix("usage: ").split())


def _command(name: str, summary: str, parser: argparse.ArgumentParser) -> Iterator[str]:
    yield f".SS {_quote(name)}"
    yield escape(summary[:1].upper() + summary[1:]) + "."
    yield ".PP"
    yield f"\\fB{escape(_usage(parser))}\\fR"
    if parser.description and parser.description.rstrip(".").lower() != summary.rstrip(".").lower():
        yield from _block(parser.description)
    options = [a for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]
    if options:
        yield ".PP"
        yield "Options:"
        for action in options:
            yield from _option(parser, action)
    if parser.epilog:
        yield from _block(parser.epilog)
    for sub_name, sub_summary, sub in _subcommands(parser):
        yield from _command(f"{name} {sub_name}", sub_summary, sub)


def render(parser: argparse.ArgumentParser | None = None, version: str | None = None,
           date: str | None = None) -> str:
    """The whole page. `date` defaults to SOURCE_DATE_EPOCH's day (a reproducible build), else today."""
    parser = parser or cli._parser()
    version = version or metadata.version("gpuwarden")
    if date is None:
        epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
        date = time.strftime("%Y-%m-%d", time.gmtime(int(epoch) if epoch.isdigit() else None))
    out = [
        f'.TH GPUWARDEN 1 "{escape(date)}" "gpuwarden {escape(version)}" "User Commands"',
        ".nh",  # no hyphenation: options and paths are copied from the page
        ".ad l",
        ".SH NAME",
        "gpuwarden \\- GPU node health agent for rack\\-scale GPU clusters",
        ".SH SYNOPSIS",
        ".B gpuwarden",
        "\\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
        ".br",
        ".B gpuwarden",
        "[\\fB\\-\\-version\\fR] [\\fB\\-h\\fR]",
        ".SH DESCRIPTION",
    ]
    out += _block(parser.description or "")
    out += [".PP", "Each command prints its options with \\fB\\-\\-help\\fR."]
    out += [".SH COMMANDS"]
    for name, summary, sub in _subcommands(parser):
        out += _command(name, summary, sub)
    out += [".SH OPTIONS"]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            out += _option(parser, action)
    out += [".SH EXIT STATUS", "Of \\fBpreflight\\fR and \\fBanalyze\\fR (usable as a Slurm HealthCheckProgram, "
                               "Prolog or Epilog):"]
    for code, meaning in EXIT_CODES:
        out += [".TP", f"\\fB{escape(code)}\\fR", escape(meaning)]
    out += [".PP", "The other commands exit 0 when done and non\\-zero on an error (2 for bad flags or a bad "
                   "configuration); \\fBtopology\\fR's codes are listed with the command."]
    if parser.epilog and parser.epilog.startswith("examples:\n"):
        out += [".SH EXAMPLES"]
        out += [line for line in _block(parser.epilog.split("\n\n")[0]) if line != "Examples:"][1:]
    out += [".SH FILES"]
    for path, what in FILES:
        out += [".TP", f"\\fI{escape(path)}\\fR", escape(what)]
    out += [".SH SEE ALSO", ", ".join(f"\\fB{escape(page.split('(')[0])}\\fR({page.split('(')[1]}" for page in SEE_ALSO)
            + ".", ".PP", "/usr/share/doc/gpuwarden/README.md and /usr/share/doc/gpuwarden/docs/."]
    return "\n".join(out) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

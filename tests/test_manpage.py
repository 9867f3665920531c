"""gpuwarden(1) as agent/cli/manpage.py writes it from the argparse parser: every subcommand and option is in it, the
roff is escaped (hyphens, backslashes, leading dots), groff renders it without a warning, and its exit codes are the
README's. Also the --help texts it is made from: a description per command, the exit codes where they matter."""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess

import pytest
from conftest import ROOT
from gpuwarden.agent.cli import main as cli
from gpuwarden.agent.cli import manpage
from gpuwarden.agent.cli.flags import EXIT_CODES

# Every flag as it was when the page was first written from the parser: help texts may change, flags may not.
FLAGS = {
    "preflight": {"--root", "--checks", "--json", "--config", "--check-timeout", "--level", "--budget", "--log-format",
                  "--log-level"},
    "analyze": {"--json", "--log-format", "--log-level"},
    "record": {"--out", "--root", "--with-tools", "--config", "--budget", "--log-format", "--log-level"},
    "run": {"--root", "--state-dir", "--listen", "--config", "--web.config.file", "--textfile", "--log-format",
            "--log-level"},
    "status": {"--state-dir", "--json"},
    "breaker reset": {"--state-dir"},
    "topology": {"--root", "--config", "--node-name", "--publish", "--slurm-conf", "--slurm-yaml", "--block-sizes",
                 "--json", "--state-dir", "--log-format", "--log-level"},
    "checks": set(),
}


def commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) for every subcommand, nested ones (breaker reset) included, with the parent first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from commands(sub, f"{prefix}{name} ")


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


@pytest.fixture(scope="module")
def page() -> str:
    return manpage.render(date="2026-01-02", version="9.8.7")


def test_every_subcommand_and_option_is_in_the_page(page):
    found = dict(commands(cli._parser()))
    assert set(FLAGS) <= set(found)
    for name, sub in found.items():
        assert f'.SS "{manpage.escape(name)}"' in page, name
        for flag in options(sub):
            assert f"\\fB{manpage.escape(flag)}\\fR" in page, (name, flag)
        for action in sub._actions:
            if action.help and action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                text = sub._get_formatter()._expand_help(action)
                assert manpage.escape(text) in page, (name, action.dest)
        if sub.description:
            first = sub.description.split("\n\n")[0].split()
            assert manpage.escape(" ".join(first)) in page, name
    for flag in options(cli._parser()):
        assert manpage.escape(flag) in page


def test_flags_are_as_they_were():
    found = dict(commands(cli._parser()))
    for name, flags in FLAGS.items():
        assert options(found[name]) == flags, name
    assert [a.dest for a in found["analyze"]._actions if not a.option_strings] == ["files"]


def test_escape():
    assert manpage.escape("--check-timeout") == "\\-\\-check\\-timeout"
    assert manpage.escape("a\\b") == "a\\eb"
    assert manpage.escape(".SH not a macro\n'also not") == "\\&.SH not a macro\n\\&'also not"
    assert manpage.escape("NAME[,NAME…]") == "NAME[,NAME\\[u2026]]"
    assert manpage.escape("x.y 'z'") == "x.y 'z'"  # only a line's first character is a control character


def test_the_roff_is_escaped(page):
    requests = {".TH", ".SH", ".SS", ".TP", ".PP", ".RS", ".RE", ".nf", ".fi", ".B", ".br", ".nh", ".ad"}
    for line in page.splitlines():
        if line.startswith((".", "'")):
            assert line.split()[0] in requests, line  # a text line never starts with a control character
        assert not re.search(r"(?<!\\)-", line), line  # every hyphen is \- (a minus: options copy and search)
        assert line.isascii(), line
        assert not re.search(r"\\(?![-e&fB\[RIs(\"])", line), line  # a backslash only starts an escape


def test_sections_and_exit_codes_match_the_readme(page):
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "OPTIONS", "EXIT STATUS", "EXAMPLES", "FILES",
                    "SEE ALSO"):
        assert f"\n.SH {section}\n" in page
    table = re.findall(r"(?m)^\| ([0-9][0-9, ]*) \| (.+) \|$", (ROOT / "README.md").read_text())
    readme = [(code.strip(), meaning.replace("`", "").strip()) for code, meaning in table][:len(EXIT_CODES)]
    assert readme == list(EXIT_CODES)
    status = page.split(".SH EXIT STATUS\n", 1)[1].split("\n.SH ", 1)[0]
    for code, meaning in EXIT_CODES:
        assert f".TP\n\\fB{manpage.escape(code)}\\fR\n{manpage.escape(meaning)}\n" in status
    files = page.split(".SH FILES\n", 1)[1]
    assert "/etc/gpuwarden/gpuwarden.toml" in files and "/var/lib/gpuwarden" in files


def test_groff_renders_it_without_warnings(page):
    if not shutil.which("groff"):
        pytest.skip("groff not installed (apt install groff-base)")
    out = subprocess.run(["groff", "-man", "-Tutf8", "-ww"], input=page, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    text = re.sub(r".\x08", "", out.stdout)  # overstrike bold and underline
    assert "gpuwarden preflight [-h] [--root DIR]" in " ".join(text.split())
    assert "--web.config.file FILE" in text


def test_help_reads_well():
    parser = cli._parser()
    for name, sub in commands(parser):
        assert sub.description and sub.description[0].isupper(), name  # a description line per command
        help_text = sub.format_help()
        assert "usage: gpuwarden" in help_text
    found = dict(commands(parser))
    for name in ("preflight", "analyze"):
        epilog = found[name].format_help().split("exit codes:\n", 1)[1]
        for code, meaning in EXIT_CODES:
            assert re.search(rf"(?m)^  {re.escape(code)} +{re.escape(meaning)}$", epilog), (name, code)
    assert "examples:" in parser.format_help()

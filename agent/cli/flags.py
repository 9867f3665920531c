"""What several commands' options share: the log flags, the --config help, the exit-code epilog of `preflight` and
`analyze`, and `options()`, which hands a command's parsed flags to the code below the CLI as that code's own
record (no argparse below agent/cli/)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

if TYPE_CHECKING:  # the parser's module loads with the parser (cli.main), not with analyze's read-ahead
    import argparse

T = TypeVar("T")

# Exit codes of `preflight` and `analyze`: the --help epilogs and the man page's EXIT STATUS are written from this
# table (the README's table says the same; tests/test_manpage.py holds them together).
EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("0", "every check passed, or only warned"),
    ("1", "a fault that needs action (at least one FAIL)"),
    ("2", "could not decide: a check could not look (UNKNOWN), or the command was wrong (bad config or flags)"),
    ("130, 143", "interrupted by SIGINT, SIGTERM: no verdict; every tool it had started was ended first"),
)
CONFIG_HELP = "TOML config (default: /etc/gpuwarden/gpuwarden.toml if present; see gpuwarden(1), FILES)"


def exit_codes_epilog(codes: Sequence[tuple[str, str]] = EXIT_CODES) -> str:
    """The "exit codes:" part of a --help epilog: each code, and what it means."""
    width = max(len(code) for code, _ in codes)
    return "exit codes:\n" + "\n".join(f"  {code:<{width}}  {meaning}" for code, meaning in codes)


def log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=("auto", "json", "console"),
                   help="auto: console on a terminal, JSON lines otherwise (default: [agent] log_format, auto)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="log level (default: [agent] log_level, info)")


def options(args: argparse.Namespace, record: type[T]) -> T:
    """The flags of `args` that `record` (a dataclass of the code that runs the command) has fields for."""
    given: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(record)  # type: ignore[arg-type]
                             if hasattr(args, f.name)}
    return record(**given)

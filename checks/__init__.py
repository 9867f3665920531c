"""The checks, one concern a module: checks/<name>.py declares `CONCERN = Concern(...)` (agent/core/check.py) and holds
the decision logic of its parts. A module that declares none (parse_*, xid_catalog, fabric_manager, ...) is a helper.

The concerns are found here, not listed: each module's CONCERN statement is read from its file without importing it
(a literal, read with ast), so a quick preflight imports only the checks it runs and those whose table its config file
sets (tests/test_cli_startup.py), not the burn-in, NCCL, RDMA or DCGM code. Adding a check is adding its module
(docs/writing-a-check.md).

Order matters twice: Concern.order is the order of the report, and `gpuwarden analyze` asks the checks' analyzers in
that order which one reads a file (the kernel-log reader of `xid` is the fallback, asked last). The daemon's polls and
kernel-log consumers keep their own order (poll_order, kernel_order). NAMES, PREFLIGHT_NAMES and CONCERNS are known
at import; ALL, PASSIVE, KERNEL_CONSUMERS and the modules themselves load on first use.
"""
from __future__ import annotations

import ast
import importlib
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from gpuwarden.agent.core.check import Concern
from gpuwarden.agent.core.passive import one_look

if TYPE_CHECKING:  # pragma: no cover
    from gpuwarden.agent.core.check import CheckSpec
    from gpuwarden.agent.core.passive import KernelConsumer, PassiveSpec

_DECLARATION = "\nCONCERN = Concern("
LEVELS = ("quick", "full", None)


def declared(path: str) -> Concern | None:
    """The Concern a module's file declares, read without importing it; None for a helper module. ValueError names the
    file when the statement is not `CONCERN = Concern(key=literal, ...)` ending in a line `)`, or its concern is not
    named after the module."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    at = text.find(_DECLARATION)
    if at < 0:
        return None
    end = text.find("\n)", at)
    try:
        if end < 0:
            raise ValueError("no line ')' ends it")
        call = ast.parse(text[at + 1:end + 2]).body[0].value  # type: ignore[attr-defined]
        if call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("give every field as key=literal")
        concern = Concern(**{k.arg: ast.literal_eval(k.value) for k in call.keywords})
    except (SyntaxError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: CONCERN = Concern(...): {exc}") from None
    name = os.path.basename(path).removesuffix(".py")
    if concern.name != name:
        raise ValueError(f"{path}: the concern is named '{concern.name}'; a concern is named after its module")
    if concern.level not in LEVELS or bool(concern.level) != bool(concern.look):
        raise ValueError(f"{path}: concern '{name}': a preflight level (quick, full) goes with a look, and only then")
    return concern


def discover(paths: Iterable[str]) -> tuple[tuple[Concern, ...], tuple[str, ...]]:
    """(every concern declared in the package's folders, in report order; every module name there)."""
    found: list[Concern] = []
    modules: list[str] = []
    for folder in paths:
        for entry in sorted(os.listdir(folder)):
            if entry.endswith(".py") and entry != "__init__.py":
                modules.append(entry.removesuffix(".py"))
                concern = declared(os.path.join(folder, entry))
                if concern is not None:
                    found.append(concern)
    found.sort(key=lambda c: c.order)
    for key in ("order", "poll_order", "kernel_order"):
        taken = [getattr(c, key) for c in found if key == "order" or getattr(c, key.removesuffix("_order"))]
        if len(taken) != len(set(taken)):
            raise ValueError(f"gpuwarden.checks: two concerns share one {key} ({sorted(taken)})")
    return tuple(found), tuple(modules)


CONCERNS, _SUBMODULES = discover(__path__)
NAMES: tuple[str, ...] = tuple(c.name for c in CONCERNS)  # every [checks.<name>] table
PREFLIGHT_NAMES: tuple[str, ...] = tuple(c.name for c in CONCERNS if c.level)
BY_CONCERN: dict[str, Concern] = {c.name: c for c in CONCERNS}
_preflight_forms: dict[str, CheckSpec] = {}


def _module(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


def part(concern: Concern, which: str) -> Any:
    """A concern's part ("look", "poll", "kernel"), importing the module that holds it. KeyError: it has none."""
    where = getattr(concern, which)
    if not where:
        raise KeyError(f"{concern.name}.{which}")
    module, _, attr = where.rpartition(".")
    return getattr(_module(module or concern.name), attr)


def modules_of(concern: Concern) -> tuple[str, ...]:
    """The modules holding a concern's parts, its own first."""
    return tuple(dict.fromkeys([concern.name, *(w.rpartition(".")[0] or concern.name
                                                for w in concern.parts().values())]))


def preflight_form(name: str) -> CheckSpec:
    """The preflight form of a concern (KeyError: it has none), importing its modules only."""
    spec = _preflight_forms.get(name)
    if spec is None:
        concern = BY_CONCERN[name]
        look = part(concern, "look")
        if not hasattr(look, "run"):  # the daemon's poll, judged in one look
            look = one_look(look)
        if look.name != name:
            raise KeyError(name)
        spec = _preflight_forms.setdefault(name, look)
    return spec


def chosen(names: Sequence[str], level: str) -> list[CheckSpec]:
    """What a preflight runs: the checks named, whatever their level, in the order named; else every check of the
    level (quick, or full: quick and full) in the order of the report. ValueError names an unknown check."""
    unknown = [n for n in names if n not in PREFLIGHT_NAMES]
    if unknown:
        raise ValueError(f"unknown check '{unknown[0]}' (known: {', '.join(PREFLIGHT_NAMES)})")
    if not names:
        names = [c.name for c in CONCERNS if c.level == "quick" or (c.level and level == "full")]
    return [preflight_form(n) for n in names]


def forms(names: Iterable[str]) -> list[CheckSpec | PassiveSpec | KernelConsumer]:
    """Every form of the named concerns, and of the concerns whose keys they read (shared_keys): what the config
    needs to know their tables. Only their modules are imported. KeyError for a name that is not a concern."""
    out: list[Any] = []
    todo, done = list(names), set()
    while todo:
        name = todo.pop(0)
        if name in done:
            continue
        done.add(name)
        concern = BY_CONCERN[name]
        found = [preflight_form(name)] if concern.level else []
        found += [part(concern, which) for which in ("look", "poll", "kernel") if getattr(concern, which)]
        for spec in found:
            if spec.name == name and all(spec is not s for s in out):
                out.append(spec)
        todo.extend(owner for s in out for owner in (getattr(s, "shared_keys", None) or {}).values())
    return out


def all_specs() -> tuple[CheckSpec | PassiveSpec | KernelConsumer, ...]:
    """Every form of every check. A concern's forms share its name and so its one [checks.<name>] table: the
    preflight `xid`, the daemon's `xid` kernel-log consumer and `analyze` read the same keys (agent/core/config.py)."""
    return (*_table("ALL"), *_table("PASSIVE"), *_table("KERNEL_CONSUMERS"))


def by_name() -> dict[str, CheckSpec]:
    return {spec.name: spec for spec in _table("ALL")}


def log_readers() -> tuple[KernelConsumer, ...]:
    """The kernel-log consumers `gpuwarden analyze` reads a saved kernel log with, in report order."""
    return tuple(part(c, "kernel") for c in CONCERNS if "kernel-log" in c.analyze)


def _table(name: str) -> Any:
    # A name in globals() wins: one a test replaced, or one built already.
    return globals()[name] if name in globals() else __getattr__(name)


def __getattr__(name: str) -> Any:
    # The full tables, built on first use and then kept as plain attributes (so a test may replace them).
    if name == "ALL":
        value: Any = tuple(preflight_form(n) for n in PREFLIGHT_NAMES)
    elif name == "PASSIVE":
        value = tuple(part(c, "poll") for c in sorted((c for c in CONCERNS if c.poll), key=lambda c: c.poll_order))
    elif name == "KERNEL_CONSUMERS":
        value = tuple(part(c, "kernel")
                      for c in sorted((c for c in CONCERNS if c.kernel), key=lambda c: c.kernel_order))
    elif name == "CONSUMER_BY_NAME":
        value = {c.name: c for c in _table("KERNEL_CONSUMERS")}
    elif name in _SUBMODULES:
        return _module(name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value

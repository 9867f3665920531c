"""The structure docs/architecture.md describes holds in the code: its package picture is the one the import graph
draws now, `lint-imports` keeps every contract of pyproject.toml, no module imports itself through others (no import
cycle), no module is over 400 lines, every import inside a function says beside it why it is there, and the wheel
lists every package on disk."""
from __future__ import annotations

import ast
import difflib
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

SOURCES = ("agent", "checks")
MAX_LINES = 400  # issue 27: no module over 400 lines (`wc -l`: blank lines and docstrings count)
# The reason a function imports at use (a measured cost it saves, or a module that may not be installed).
REASON = re.compile(r"\d ?ms\b|optional dependency|not installed", re.IGNORECASE)


def _draw():
    spec = importlib.util.spec_from_file_location("draw_architecture", ROOT / "docs" / "draw_architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


draw = _draw()


@pytest.fixture(scope="module")
def graph():
    return draw.graph()


def _files() -> list[Path]:
    return [p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _file_of(module: str) -> str:
    """agent/x/y.py (or agent/x/y/__init__.py) for gpuwarden.agent.x.y."""
    top, *rest = module.removeprefix("gpuwarden.").split(".")
    base = ROOT.joinpath(top, *rest)
    return _rel(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))


def test_the_committed_picture_is_what_the_import_graph_draws_now():
    committed = draw.committed(draw.DOC.read_text())
    assert committed is not None, f"docs/architecture.md has lost its markers {draw.BEGIN!r} ... {draw.END!r}"
    fresh = draw.render()
    diff = "\n".join(list(difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "committed", "code",
                                               lineterm="", n=0))[:60])
    if committed != fresh:
        pytest.fail("docs/architecture.md's package picture is stale (a package, a module or an import changed): "
                    "run `.venv/bin/python docs/draw_architecture.py` and commit the result\n" + diff, pytrace=False)


def test_lint_imports_keeps_every_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    run = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    m = re.search(r"Contracts: (\d+) kept, (\d+) broken", out)
    if not (run.returncode == 0 and m and (int(m[1]), int(m[2])) == (len(contracts), 0)):
        pytest.fail(f"lint-imports (exit {run.returncode}) must keep all {len(contracts)} contracts of "
                    f"pyproject.toml [tool.importlinter]:\n{out[-6000:]}", pytrace=False)


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):  # the outside packages import nothing in the graph: no cycle through them
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_no_import_cycle_among_the_modules(graph):
    problems = []
    for comp in _cycles(graph):
        members = set(comp)
        problems.append(f"a cycle of {len(comp)} modules: {', '.join(comp)}; their imports of each other:")
        for a in comp:
            for b in sorted(set(graph.find_modules_directly_imported_by(a)) & members):
                lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
                problems.append(f"    {a} -> {b} ({_file_of(a)}:{','.join(map(str, lines))})")
    if problems:
        pytest.fail("import cycles (TYPE_CHECKING imports left out); break each by moving what both need down a "
                    "layer:\n" + "\n".join(problems), pytrace=False)


def test_no_module_over_400_lines():
    over = sorted(((n, _rel(p)) for p in _files() if (n := p.read_bytes().count(b"\n")) > MAX_LINES), reverse=True)
    if over:
        pytest.fail(f"{len(over)} modules over {MAX_LINES} lines (`wc -l`); split each where its concept splits:\n"
                    + "\n".join(f"    {path}: {n} lines" for n, path in over), pytrace=False)


def _comment(line: str) -> str:
    return line.split("#", 1)[1] if "#" in line else ""


def _comments_above(lines: list[str], lineno: int) -> list[str]:
    """The comment-only lines directly above line `lineno` (1-based), nearest last."""
    out, i = [], lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        out.insert(0, lines[i])
        i -= 1
    return out


def _type_checking(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)


def _imports_at_use(tree: ast.AST, lines: list[str]):
    """(import, the text where its reason may stand) for each import inside a function, not under TYPE_CHECKING.

    The reason stands on the import's own lines, or in the comment lines directly above it or above the run of
    imports it belongs to (one comment for a group), or, for a run that opens a `try:` body (the optional-dependency
    idiom), on the `try:` line or the comments above it."""

    def lists(node: ast.AST):
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                yield name, value
        for handler in getattr(node, "handlers", []):
            yield "handler", handler.body
        for case in getattr(node, "cases", []):
            yield "case", case.body

    def walk(node: ast.AST, in_function: bool):
        for name, stmts in lists(node):
            if name == "body" and _type_checking(node):
                continue
            for k, stmt in enumerate(stmts):
                if isinstance(stmt, (ast.Import, ast.ImportFrom)) and in_function:
                    first = k
                    while first > 0 and isinstance(stmts[first - 1], (ast.Import, ast.ImportFrom)):
                        first -= 1
                    text = lines[stmt.lineno - 1:stmt.end_lineno] + _comments_above(lines, stmts[first].lineno)
                    if first == 0 and name == "body" and isinstance(node, ast.Try):
                        text += [lines[node.lineno - 1], *_comments_above(lines, node.lineno)]
                    yield stmt, " ".join(_comment(t) for t in text)
                inner = in_function or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                yield from walk(stmt, inner)

    yield from walk(tree, False)


def test_every_import_inside_a_function_says_why():
    """Issue 27: an import inside a function only where a measured import-time reason is written beside it (a figure
    in ms, from `python -X importtime`), or where the module is an optional dependency; every other goes to the top."""
    bare = []
    for path in _files():
        src = path.read_text()
        for stmt, reason in _imports_at_use(ast.parse(src), src.splitlines()):
            if not REASON.search(reason):
                bare.append(f"    {_rel(path)}:{stmt.lineno}: {ast.unparse(stmt)[:90]}")
    if bare:
        pytest.fail(f"{len(bare)} imports inside a function with no reason beside them: move each to the top of "
                    "its module, or write on its line or the comment line(s) directly above it what it saves, "
                    "measured (`# at use: +N ms to ... (python -X importtime)`), or `# optional dependency: ...`:\n"
                    + "\n".join(bare), pytrace=False)


def test_the_wheel_lists_every_package_on_disk():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    folders = cfg["package-dir"]  # installed name -> folder
    on_disk = {".".join([installed, *init.parent.relative_to(ROOT / top).parts])
               for installed, top in folders.items() for init in (ROOT / top).rglob("__init__.py")}
    missing, extra = sorted(on_disk - listed), sorted(listed - on_disk)
    if missing or extra:
        pytest.fail("pyproject.toml [tool.setuptools] packages must list every folder with an __init__.py under "
                    f"{' and '.join(f'{t}/' for t in folders.values())} (a package left out is missing from the "
                    "wheel):" + (f"\n    not listed: {', '.join(missing)}" if missing else "")
                    + (f"\n    listed but not on disk: {', '.join(extra)}" if extra else ""), pytrace=False)

"""The examples in README.md and docs/ work as typed, and the output they show is what the commands print.

Runs, in a temporary copy of the repository whose `.venv/bin/gpuwarden` and `.venv/bin/python` are this test
run's own:
- every ```sh block of README.md, and every ```sh block of docs/*.md marked `<!-- doc-test: run -->`, with bash,
  expecting exit 0 or the status a `<!-- doc-test: exit=N -->` marker names. Setup steps that install packages
  or create a venv (`apt-get …`, `python3 -m venv …`, `.venv/bin/pip install …`) are left out; what follows their
  `&&` runs. A README block marked `<!-- doc-test: covered by: tests/FILE.py::TEST -->` (an install on the
  machine itself) is not run: the named test, which must exist, carries out its steps. The
  suite's own command (`.venv/bin/python -m pytest`) runs with `--collect-only`, not the whole suite inside itself.
  The only other liberty: a `127.0.0.1:PORT` gets a free port and `/tmp/...` a folder of the test's own, so two
  runs at once do not meet. A block that starts a daemon in the background has it ended with the block's process
  group at the end, whatever happened.
- every block marked `<!-- doc-test: output of: COMMAND -->` is compared with what COMMAND prints: a JSON excerpt
  key by key and value by value (`…` or `...` for elided values, keys, list entries or a string's tail); a table
  row by row, each shown row (its head line, and its message where one is shown) against the real rows in order,
  whitespace ignored and `…` / `...` standing for any text. An abridged example is checked for what it shows, not
  for what it leaves out.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 180  # generous: a loaded machine; a block that hangs still ends the test
MARKER = re.compile(r"^<!-- doc-test: (.*) -->$")
SETUP = ("python3 -m venv ", ".venv/bin/pip install ", "apt-get ")
VOLATILE = {"duration_s"}  # run to run: compared by type only
ELISION = re.compile(r"…|\.\.\.")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str  # the doc-test marker right above the fence ("" when none)

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.match(prev)
            out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:end]), m.group(1) if m else ""))
            i = end + 1
        else:
            i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
# A README block that changes the machine itself (installs a package, starts a system service) is not run here: its
# marker `covered by: tests/FILE.py::TEST` names the test that carries out the same steps (checked below).
COVERED = [b for b in ALL if b.marker.startswith("covered by:")]
RUNNABLE = [b for b in ALL if b.lang == "sh" and (b.path.name == "README.md" or b.marker.startswith("run"))
            and b not in COVERED]
OUTPUTS = [b for b in ALL if b.marker.startswith("output of:")]


# -- a copy of the repository with this run's gpuwarden ---------------------------------------------------------
@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("docs") / "repo"
    shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", ".pytest_cache", "*.egg-info", "build", "device-check-out"))
    bin_dir = dst / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    installed = Path(sys.executable).parent / "gpuwarden"
    _script(bin_dir / "python", f'exec {sys.executable} "$@"')
    if installed.exists():  # the console script pip installed: the very entry point a user runs
        (bin_dir / "gpuwarden").symlink_to(installed)
    else:
        _script(bin_dir / "gpuwarden", f'exec {sys.executable} -m gpuwarden.agent.cli "$@"')
    return dst


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWARDEN", "PYTEST"))}
    env.update(PATH=f"{repo / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", COLUMNS="120", LC_ALL="C.UTF-8")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runnable_text(block: Block, scratch: Path) -> str:
    """The block as it runs here: setup steps dropped, its own ports and /tmp folders swapped for private ones."""
    lines = []
    for line in block.text.splitlines():
        parts = [p for p in line.split(" && ") if not p.lstrip().startswith(SETUP)]
        if not parts:
            continue
        cmd = " && ".join(parts)
        if re.fullmatch(r"\.venv/bin/python -m pytest( .*)?", cmd.strip()):
            cmd += " --collect-only -q -p no:cacheprovider"
        lines.append(cmd)
    text = "\n".join(lines)
    for listen in re.findall(r"--listen (\S+)", text):
        assert listen.startswith("127.0.0.1:"), f"{block.where()}: an example listens on {listen}, not 127.0.0.1"
    for port in sorted(set(re.findall(r"127\.0\.0\.1:(\d+)", text))):
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{_free_port()}")
    return text.replace("/tmp/", f"{scratch}/")


def run_shell(text: str, repo: Path) -> subprocess.CompletedProcess:
    """bash -c TEXT in its own process group; when bash is done, what it left running in the group (a daemon started
    with `&`) is ended. Output goes to files, so a background process holding them open cannot stall the test."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["bash", "-c", text], cwd=repo, env=_env(repo), stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _end_group(proc.pid)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode in (-signal.SIGTERM, -signal.SIGKILL):
        pytest.fail(f"timed out after {BLOCK_TIMEOUT_S} s:\n{text}\n--- stdout\n{stdout[-3000:]}\n"
                    f"--- stderr\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(text, proc.returncode, stdout, stderr)


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    # Give the daemon its orderly stop, then make sure.
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- comparing shown output with real output --------------------------------------------------------------------
def wild(pattern: str, text: str) -> bool:
    """`pattern` with each `…` / `...` standing for any text (possibly none) matches the whole of `text`."""
    pieces = ELISION.split(pattern)
    if len(pieces) == 1:
        return pattern == text
    first, *middle, last = pieces
    if not text.startswith(first) or len(text) < len(first) + len(last) or not text.endswith(last):
        return False
    at, stop = len(first), len(text) - len(last)
    for piece in middle:
        found = text.find(piece, at, stop)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def rows(text: str) -> list[tuple[str, str]]:
    """A table's logical rows: (head line, its indented continuation lines joined), whitespace removed (columns and
    wrapping differ with the terminal's width)."""
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        squeezed = "".join(line.split())
        if line[0].isspace() and out:
            out[-1] = (out[-1][0], out[-1][1] + squeezed)
        else:
            out.append((squeezed, ""))
    return out


def table_differences(shown: str, real: str) -> list[str]:
    real_rows, at, missing = rows(real), 0, []
    for head, message in rows(shown):
        hit = next((i for i in range(at, len(real_rows)) if wild(head, real_rows[i][0])
                    and (not message or wild(message, real_rows[i][1]))), None)
        if hit is None:
            missing.append(f"{head} / {message or '(message not shown)'}")
        else:
            at = hit + 1
    return missing


def lenient_json(text: str):
    """An excerpt as JSON: a bare `...` / `…` (outside strings) becomes the string "…" (anything / more)."""
    out, i, in_str = [], 0, False
    while i < len(text):
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif text.startswith("...", i) or c == "…":
            out.append('"…"')
            i += 2 if c == "." else 0
        else:
            out.append(c)
        i += 1
    return json.loads("".join(out))


def json_differences(shown, real, path: str = "$") -> list[str]:
    if shown == "…":
        return []
    if isinstance(shown, dict):
        if not isinstance(real, dict):
            return [f"{path}: shown an object, real {real!r}"]
        out = [] if "…" in shown or set(shown) == set(real) else [
            f"{path}: shown keys {sorted(shown)}, real {sorted(real)}"]
        for key, value in shown.items():
            if key == "…":
                continue
            if key not in real:
                out.append(f"{path}.{key}: shown, not in the real output")
            elif key in VOLATILE:
                if type(value) is not type(real[key]):
                    out.append(f"{path}.{key}: shown {value!r}, real {real[key]!r} (another type)")
            else:
                out += json_differences(value, real[key], f"{path}.{key}")
        return out
    if isinstance(shown, list):
        if not isinstance(real, list):
            return [f"{path}: shown a list, real {real!r}"]
        items = [s for s in shown if s != "…"]
        if len(items) == len(shown) and len(shown) != len(real):
            return [f"{path}: shown {len(shown)} entries, real {len(real)} (mark elided ones with …)"]
        at = 0
        for n, item in enumerate(items):
            hit = next((i for i in range(at, len(real)) if not json_differences(item, real[i])), None)
            if hit is None:
                near = real[at] if at < len(real) else None
                return [f"{path}[{n}]: no real entry matches {json.dumps(item)[:300]}",
                        *json_differences(item, near, f"{path}[{n}]~")]
            at = hit + 1
        return []
    if isinstance(shown, str) and isinstance(real, str):
        return [] if wild(shown, real) else [f"{path}: shown {shown!r}, real {real!r}"]
    return [] if shown == real and type(shown) is type(real) else [f"{path}: shown {shown!r}, real {real!r}"]


# -- the tests ------------------------------------------------------------------------------------------------
def test_the_docs_have_examples_to_check():
    assert len([b for b in RUNNABLE if b.path.name == "README.md"]) >= 4
    assert {b.path.name for b in OUTPUTS} >= {"README.md", "output.md"}


def test_ci_runs_the_readmes_test_command_verbatim():
    """The README's command that runs the suite is a line of .ci/run as typed: what a new user runs is what CI runs."""
    (command,) = [line for b in RUNNABLE if b.path.name == "README.md" for line in b.text.splitlines()
                  if "-m pytest" in line]
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text().splitlines()
    assert command in ci


@pytest.mark.parametrize("block", COVERED, ids=lambda b: b.where())
def test_a_block_not_run_here_names_the_test_that_runs_its_steps(block):
    target = block.marker.removeprefix("covered by:").strip()
    path, sep, name = target.partition("::")
    assert sep and path.startswith("tests/") and (ROOT / path).is_file(), f"{block.where()}: no test file in {target}"
    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), f"{block.where()}: no {target}"


def test_shown_output_is_marked_for_checking():
    """A block that looks like output of the CLI (a report table or a report's JSON) carries an output marker, so
    no example drifts from the real output unchecked."""
    for b in ALL:
        first = b.text.lstrip().splitlines()[0] if b.text.strip() else ""
        looks_like_output = first.startswith(("gpuwarden preflight:", "gpuwarden analyze:", "CHECK ")) or (
            b.lang == "json" and '"tool"' in b.text)
        if looks_like_output:
            assert b.marker.startswith("output of:"), f"{b.where()}: shown output with no doc-test output marker"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where())
def test_example_runs_as_typed(block, repo, tmp_path):
    expected = int(m.group(1)) if (m := re.search(r"\bexit=(\d+)", block.marker)) else 0
    text = runnable_text(block, tmp_path)
    assert text.strip(), f"{block.where()}: nothing left to run"
    proc = run_shell(text, repo)
    assert proc.returncode == expected, (
        f"{block.where()} exited {proc.returncode}, the docs say {expected}:\n{text}\n--- stdout\n"
        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_daemon_example_reaches_metrics_and_status(repo, tmp_path):
    """The README's daemon example prints the node state from /metrics and from `gpuwarden status`."""
    (block,) = [b for b in RUNNABLE if "gpuwarden run " in b.text and b.path.name == "README.md"]
    proc = run_shell(runnable_text(block, tmp_path), repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r'^gpuwarden_node_state\{state="\w+"\} 1\.0$', proc.stdout, re.M), proc.stdout
    assert re.search(r"^node state: \w+ since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("block", OUTPUTS, ids=lambda b: b.where())
def test_shown_output_is_the_real_output(block, repo, tmp_path):
    command = block.marker.removeprefix("output of:").strip()
    proc = run_shell(command, repo)
    assert proc.stdout.strip(), f"{block.where()}: `{command}` printed nothing (exit {proc.returncode}):\n" \
                                f"{proc.stderr[-3000:]}"
    if block.lang == "json":
        diffs = json_differences(lenient_json(block.text), json.loads(proc.stdout))
    else:
        diffs = table_differences(block.text, proc.stdout)
    assert not diffs, (f"{block.where()}: the shown output of `{command}` differs from the real one "
                       "(whitespace ignored, … elides):\n  " + "\n  ".join(diffs)
                       + f"\n--- real output\n{proc.stdout[-6000:]}")


# -- the comparison itself ----------------------------------------------------------------------------------------
def test_wild_matches_elisions_only():
    assert wild("GPU-d31f83c1-…0018:01:00.0", "GPU-d31f83c1-7f20-f9ad-e7a7-a6207a05c957 0018:01:00.0".replace(" ", ""))
    assert wild("a…b…c", "abc") and wild("…", "") and wild("x...", "xyz")
    assert not wild("a…b", "ab_c") and not wild("ab…ba", "aba") and not wild("REBOOT", "SERVICE")


def test_json_excerpt_comparison_catches_a_wrong_value():
    real = {"action": "SERVICE", "results": [{"check": "xid", "duration_s": 0.004}, {"check": "ecc"}]}
    assert json_differences(lenient_json('{"action": "SERVICE", "results": [{"check": "xid", "duration_s": 1.5}, '
                                         '...]}'), real) == []
    assert json_differences(lenient_json('{"action": "REBOOT", "…": "…"}'), real) == [
        "$.action: shown 'REBOOT', real 'SERVICE'"]
    assert json_differences(lenient_json('{"action": "SERVICE"}'), real)  # a key left out without saying so
    assert json_differences(lenient_json('{"action": "SERVICE", "results": [{"check": "ecc"}]}'), real)


def test_table_comparison_catches_a_wrong_row():
    real = "CHECK STATUS\nxid   FAIL   REBOOT 79 GPU 2\n      XID 79 on GPU 2; recommended:\n      REBOOT\n"
    assert table_differences("xid FAIL REBOOT 79 GPU …\n   XID 79 … recommended: REBOOT\n", real) == []
    assert table_differences("xid FAIL DRAIN 79 GPU 2\n", real)
    assert table_differences("xid FAIL REBOOT 79 GPU 2\n   XID 79 … recommended: NONE\n", real)

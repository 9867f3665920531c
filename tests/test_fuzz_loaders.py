"""Fuzzing the config and scenario loaders with mutations of real files: the config (defaults < file), a scenario's
node.toml and nvml.json. Only the project's errors may come out (ConfigError, SourceError / NvmlError), never a
traceback; a preflight over a damaged nvml.json says why each check could not look, never "internal error".
Bounded: a fixed number of reproducible examples per loader, each under a 20 s alarm (tests/deadline.py)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from conftest import NODES, ROOT
from deadline import deadline as alarm
from gpuwarden.agent.core import config
from gpuwarden.agent.core.errors import GpuwardenError
from gpuwarden.agent.node.host import Node, NodeInfo
from gpuwarden.agent.node.runner import run_checks
from gpuwarden.checks import ALL, all_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("GPUWARDEN_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# A real config: every block of docs/configuration.md that sets keys, as an operator would copy them.
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text()
CONFIG_SEED = "\n".join(block.split("```", 1)[0] for block in CONFIG_DOC.split("```toml\n")[1:2])
NODE_TOML = (NODES / "gb200-nvl72-faulty" / "node.toml").read_bytes()
NVML_JSON = (NODES / "gb200-nvl72-faulty" / "nvml.json").read_bytes()


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """A real file, damaged the ways files get damaged: bytes replaced or flipped, cut, lines repeated, huge or
    non-ASCII numbers, deep nesting, invalid UTF-8, NUL bytes."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "repeat", "number", "nest", "utf8", "nul", "replace"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "repeat":
            end = data.find(b"\n", at)
            line = data[at:end + 1 if end >= 0 else len(data)]
            data[at:at] = line * draw(st.integers(2, 50))
        elif kind == "number":
            data[at:at] = draw(st.sampled_from([b"9" * 5000, b"1e999", b"-1", b"nan", b"inf", "\u00b2".encode(),
                                                "\u0661\u0662".encode(), b"0x" + b"f" * 40]))
        elif kind == "nest":
            depth = draw(st.integers(100, 5000))
            # where a value starts (after "key": in JSON, "key = " in TOML), so the parser descends into it
            value_at = max(data.find(b": ", at), data.find(b"= ", at))
            at = value_at + 2 if value_at >= 0 else at
            data[at:at] = draw(st.sampled_from([b"[" * depth, b"{\"a\":" * depth, b"{a = " * depth]))
        elif kind == "utf8":
            data[at:at] = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        elif kind == "nul":
            data[at:at] = b"\x00"
        else:
            data[at:at + 1] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@FUZZ
@given(text=mutated(CONFIG_SEED.encode()))
def test_fuzz_config_loader(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "gpuwarden.toml"
    path.write_bytes(text)
    with alarm(20):
        try:
            cfg = config.load(all_specs(), path, explicit=True)
        except GpuwardenError:
            return
    # What loads is within its bounds: every number finite (the loader refuses inf and NaN).
    for table in (cfg.agent, *cfg.checks.values()):
        for value in table.values():
            if isinstance(value, float):
                assert value == value and value not in (float("inf"), float("-inf"))


@FUZZ
@given(text=mutated(NODE_TOML))
def test_fuzz_node_toml_loader(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("node") / "node.toml"
    path.write_bytes(text)
    with alarm(20):
        try:
            info = NodeInfo.from_toml(path)
        except GpuwardenError:
            return
    assert isinstance(info.hostname, str)


_SCENARIOS: dict[str, Path] = {}


@FUZZ
@given(text=mutated(NVML_JSON))
def test_fuzz_nvml_json_through_a_preflight(tmp_path_factory, text):
    """A damaged nvml.json in a scenario: each quick check is judged or says why it could not look; no check ever
    crashes ("internal error") and nothing but the project's errors leaves the loader."""
    root = _SCENARIOS.get("root")
    if root is None:
        root = _SCENARIOS["root"] = tmp_path_factory.mktemp("scenario") / "tray"
        shutil.copytree(NODES / "gb200-nvl72-faulty", root, ignore=shutil.ignore_patterns("tools"))
    (root / "nvml.json").write_bytes(text)
    quick = [s for s in ALL if s.level == "quick"]
    with alarm(20):
        results = run_checks(Node.recorded_at(root), quick, config.defaults(all_specs()))
    for r in results:
        # A Python exception's repr ("RecursionError('maximum recursion…')") is a crash wearing a message.
        assert not (r.error or "").startswith("internal error"), (r.check, r.error)
        assert not re.search(r"\b[A-Z][A-Za-z]*Error\(", r.error or ""), (r.check, r.error)

"""Mutation fuzzing of every parser of tool output and kernel logs, seeded from the real outputs in fixtures/:
characters replaced, bytes flipped (and decoded as `analyze` decodes a file), the text cut short, lines repeated,
dropped or swapped, numbers of thousands of digits, digits that are not ASCII ("²", "١٢٣"), NUL bytes and long
lines. Only ParseError may leave a parser; each input is read within a generous deadline (a backtracking pattern
needs hours, not seconds); what comes back is sane: every number finite and bounded, every line it names inside
the input.

The suite runs a bounded, reproducible number of examples per parser. For a long run by hand (new random
examples each time), see "Fuzzing" in bench/README.md: GPUWARDEN_FUZZ_EXAMPLES=20000 raises the count."""
from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
from deadline import MIB, deadline
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import parse_kmsg_text, parse_log_text
from gpuwarden.checks.parse_dcgmi_diag import parse_dcgmi_diag_json
from gpuwarden.checks.parse_dcgmi_diag_text import parse_dcgmi_diag_text
from gpuwarden.checks.parse_nccl_tests import parse_nccl_tests
from gpuwarden.checks.parse_nvbandwidth import parse_nvbandwidth
from gpuwarden.checks.parse_nvidia_smi_topo import parse_topo_matrix
from gpuwarden.checks.parse_perftest import last_error_line, parse_perftest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
_LONG_RUN = os.environ.get("GPUWARDEN_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(_LONG_RUN or 200), deadline=None, derandomize=not _LONG_RUN, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_INT = 1 << 64  # past any count, id, size or cursor a parser may return (a kmsg seq is a u64)


def seeds(folder: str, pattern: str) -> list[Path]:
    return sorted(p for p in (FIXTURES / folder).glob(pattern) if not p.name.endswith(".source.txt"))


def _perftest(text: str, source: str) -> Any:
    last_error_line(text)
    return parse_perftest(text, source)


# parser -> (the function, the real outputs its inputs start from)
TARGETS: dict[str, tuple[Callable[[str, str], Any], list[Path]]] = {
    "nccl-tests": (parse_nccl_tests, seeds("tools/nccl", "*.txt")),
    "perftest": (_perftest, seeds("tools/perftest", "*.txt")),
    "dcgmi-diag-json": (parse_dcgmi_diag_json, seeds("tools/dcgmi", "*.json")),
    "dcgmi-diag-text": (parse_dcgmi_diag_text, seeds("tools/dcgmi", "*.txt")),
    "nvbandwidth": (parse_nvbandwidth, seeds("tools/nvbandwidth", "*.txt")),
    "nvidia-smi-topo": (parse_topo_matrix, seeds("tools/nvidia-smi", "*topo-m*.txt")),
    "kernel-log-text": (parse_log_text, seeds("logs/kernel", "*[a-z]")),
    "kmsg": (parse_kmsg_text, seeds("nodes", "*/kmsg") + seeds("logs/kernel", "*kmsg-raw*")),
}
SEEDS = {name: [p.read_text() for p in paths] for name, (_, paths) in TARGETS.items()}

# What a damaged capture or a hostile file puts in: separators, signs, the characters the formats hang on, and
# digits str.isdigit accepts but int() refuses or reads as another number.
ODD = ["\x00", "\r", "\n", "\t", " ", "|", "+", "-", ":", ";", ",", ".", "#", "[", "]", "(", ")", "=", "e", "N/A",
       "²", "١٢٣", "\u00a0", "\ufeff", "\u2028", "\x1b[1m", "é", "NVRM: Xid (PCI:0000:18:00): 79, ", "1e999", "nan",
       "-1", "Fail", "Pass", "GPU", "GPU0: Fail", "SUM x ", "#bytes", "\ufffd"]


_NUMBER = re.compile(r"[0-9]++(?:\.[0-9]++)?+")
_GAP = re.compile(r"(?<=\S)[ \t]++(?=\S)")  # the blanks between two words of a line


def spot(draw: st.DrawFn, text: str, pattern: re.Pattern[str]) -> tuple[int, int]:
    """Where to mutate: the span of one match of `pattern` (a number, a gap between words), or any point."""
    spans = [m.span() for m in pattern.finditer(text)]
    if not spans or draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(text)))
        return at, at
    return draw(st.sampled_from(spans))


@st.composite
def mutated(draw: st.DrawFn, target: str) -> str:
    text = draw(st.sampled_from(SEEDS[target]))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["huge", "long", "digits", "replace", "flip", "cut", "repeat", "drop", "swap",
                                     "nul"]))
        if kind == "huge":  # a number past every bound: int() refuses over 4,300 digits, float() gives inf
            start, end = spot(draw, text, _NUMBER)
            digits = draw(st.sampled_from(["9", "1", "0"])) * draw(st.sampled_from([400, 5000, 19, 21, 310, 4301]))
            exponent = draw(st.sampled_from(["", "", "e999", "e-999", ".5"]))
            text = text[:start] + digits + exponent + text[end:]
        elif kind == "long":  # a long run between two words: where a backtracking pattern takes hours
            start, _ = spot(draw, text, _GAP)
            piece = draw(st.sampled_from([" ", "a ", " a", "a", "9", " :", "@", "-", "[ ", ". ", "(", "1, ", "\t"]))
            text = text[:start] + piece * draw(st.integers(5_000, 60_000)) + text[start:]
        elif kind == "digits":  # str.isdigit says yes to these, int() refuses some and reads others as numbers
            start, end = spot(draw, text, _NUMBER)
            text = text[:start] + draw(st.sampled_from(["²", "١٢٣", "٣", "൬", "𝟗", "½"])) + text[start + 1:]
        elif kind == "replace":
            at = draw(st.integers(0, len(text)))
            piece = draw(st.sampled_from(ODD) | st.text(max_size=8))
            text = text[:at] + piece + text[at + draw(st.integers(0, 8)):]
        elif kind == "flip":  # one bit of the UTF-8 bytes, decoded as analyze decodes a file
            raw = bytearray(text.encode())
            if raw:
                raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
            text = raw.decode(errors="replace")
        elif kind == "cut":
            text = text[:draw(st.integers(0, len(text)))]
        elif kind in ("repeat", "drop", "swap"):
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if kind == "repeat":
                lines[i:i + 1] = [lines[i]] * draw(st.integers(2, 200))
            elif kind == "drop":
                del lines[i]
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        else:
            at = draw(st.integers(0, len(text)))
            text = text[:at] + "\x00" * draw(st.integers(1, 4)) + text[at:]
    return text


def check_sane(value: Any, lines: int, where: str = "result", depth: int = 0) -> None:
    """Every number finite and bounded, every line number inside the input, all the way down."""
    assert depth < 12, f"{where}: nested deeper than any parse result"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, float):
        assert math.isfinite(value), f"{where} = {value}"
    elif isinstance(value, int):
        assert -MAX_INT < value < MAX_INT, f"{where} has {len(str(abs(value)))} digits"
    elif isinstance(value, ParseError):
        assert value.line is None or 1 <= value.line <= lines + 1, f"{where}: line {value.line} of {lines}"
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            check_sane(getattr(value, f.name), lines, f"{where}.{f.name}", depth + 1)
            if f.name == "line" and isinstance(getattr(value, f.name), int):
                assert 0 <= getattr(value, f.name) <= lines + 1, f"{where}.line outside the input"
    elif isinstance(value, dict):
        for k, v in value.items():
            check_sane(k, lines, f"{where} key", depth + 1)
            check_sane(v, lines, f"{where}[{k!r}]"[:200], depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            check_sane(v, lines, f"{where}[{i}]", depth + 1)
    else:
        raise AssertionError(f"{where}: unexpected {type(value).__name__} in a parse result")


def parse_checked(target: str, text: str) -> None:
    parse, _ = TARGETS[target]
    lines = text.count("\n") + 1
    with deadline():
        try:
            result = parse(text, "fuzz")
        except ParseError as err:
            check_sane(err, lines, "the ParseError")
            return
    check_sane(result, lines)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_has_real_outputs_to_start_from(target):
    assert SEEDS[target], f"no real output of {target} under fixtures/"
    for text in SEEDS[target]:
        parse_checked(target, text)


def _fuzz(target: str) -> Callable[[], None]:
    @FUZZ
    @given(text=mutated(target))
    def run(text: str) -> None:
        parse_checked(target, text)

    return run


test_fuzz_nccl_tests = _fuzz("nccl-tests")
test_fuzz_perftest = _fuzz("perftest")
test_fuzz_dcgmi_diag_json = _fuzz("dcgmi-diag-json")
test_fuzz_dcgmi_diag_text = _fuzz("dcgmi-diag-text")
test_fuzz_nvbandwidth = _fuzz("nvbandwidth")
test_fuzz_nvidia_smi_topo = _fuzz("nvidia-smi-topo")
test_fuzz_kernel_log_text = _fuzz("kernel-log-text")
test_fuzz_kmsg = _fuzz("kmsg")


# A 1 MiB line of each shape that makes a backtracking pattern retry from every split point, put into every real
# output of every parser: each must be read (or refused with ParseError) within the deadline.
LONG_LINES = {
    "spaces-inside": "a" + " " * MIB + "b",
    "word": "a" * MIB,
    "digits": "9" * MIB,
    "word-pairs": "a " * (MIB // 2),
    "colons": " a :" * (MIB // 4),
    "at-signs": "[" + "a@" * (MIB // 2) + "]x",
    "brackets": "[ " * (MIB // 2),
    "dots": ". " * (MIB // 2),
    "dashes": "+-" + "-" * MIB + " x",
    "pipes": "|" + " " * MIB + "|",
    "commas": "1, " * (MIB // 3),
    "nul": "\x00" * MIB,
}


@pytest.mark.parametrize("shape", sorted(LONG_LINES))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_1mib_line_in_a_real_output_is_read_in_linear_time(target, shape):
    text = SEEDS[target][0]
    middle = text.find("\n", len(text) // 2) + 1
    parse_checked(target, text[:middle] + LONG_LINES[shape] + "\n" + text[middle:])

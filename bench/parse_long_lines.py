"""Time of every tool-output and kernel-log parser on one 10 MiB line of each shape that makes a backtracking
pattern retry from every split point, put into a real output of that parser (fixtures/). The parsers are linear:
each figure is one pass over the line. Prints the median of 3 runs per parser and shape, and the worst shape.

    .venv/bin/python bench/parse_long_lines.py [--mib 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gpuwarden.agent.core.errors import ParseError  # noqa: E402
from test_fuzz_parsers import SEEDS, TARGETS  # noqa: E402  (the parsers and the real outputs the fuzzing uses)


def shapes(size: int) -> dict[str, str]:
    return {
        "spaces-inside": "a" + " " * size + "b",
        "device-line": "#  Rank  0 Group  0 Pid  1 on h device  0 [0x19] a" + " " * size + "b",
        "word": "a" * size,
        "digits": "9" * size,
        "word-pairs": "a " * (size // 2),
        "param-pairs": " Spare : x" + " a" * (size // 2),
        "at-signs": "[" + "a@" * (size // 2) + "]x",
        "brackets": "[ " * (size // 2),
        "band": "+- a" + " " * size + "b",
        "legend": "  PIX  = a" + " " * size + "b",
        "nvb-device": "Device 1: a" + " " * size + "b",
        "nul": "\x00" * size,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=10)
    size = ap.parse_args().mib << 20
    print(f"one {size >> 20} MiB line in a real output; median of 3 runs, ms")
    for target, (parse, _) in sorted(TARGETS.items()):
        text = SEEDS[target][0]
        middle = text.find("\n", len(text) // 2) + 1
        figures = {}
        for shape, line in shapes(size).items():
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                try:
                    parse(text[:middle] + line + "\n" + text[middle:], "bench")
                except ParseError:
                    pass
                runs.append(time.perf_counter() - start)
            figures[shape] = statistics.median(runs) * 1000
        worst = max(figures, key=figures.get)
        print(f"{target:18} worst {figures[worst]:7.1f} ({worst}); " +
              ", ".join(f"{k} {v:.0f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()

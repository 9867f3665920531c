"""The found lines of a saved kernel log made rows, and the runs of their texts: the steps of Python for each line
that remained after the line search, where a log is dense in the lines the checks read (1M lines, 10 % of them XIDs:
the readers' findall and loop, and the xid judge's three passes over a batch, were most of analyze's time).

Where the package was built with its C part (agent/core/_log_rows.c), `native` is that module: dmesg_rows makes a
dmesg part's rows (agent/node/kernel_scan_lines.py reads the lines it defers with the pattern), text_runs a batch's
runs. Otherwise text_runs below, and the pattern for every line, give the same answers (tests/test_log_rows_native.py
compares both)."""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

try:  # the same in C (agent/core/_log_rows.c), where the package was built with it
    from gpuwarden.agent.core import _log_rows as native
except ImportError:  # built without a C compiler: the code below, and the pattern, with the same answers
    native = None


def text_runs(texts: list[Hashable]) -> dict[Hashable, tuple[int, int, int]]:
    """Each text of ``texts`` -> (its count, its first index, its last index), in the order each first appears."""
    if native is not None:
        return native.text_runs(texts)
    return python_text_runs(texts)


def python_text_runs(texts: Sequence[Hashable]) -> dict[Hashable, tuple[int, int, int]]:
    """text_runs in Python, a pass of C each: a Counter (in the order each text first appears), the last index of
    each from zip, the first from zip over the reversed list."""
    counts = Counter(texts)
    n = len(texts)
    last = dict(zip(texts, range(n), strict=True))
    first = dict(zip(reversed(texts), range(n - 1, -1, -1), strict=True))
    return {text: (count, first[text], last[text]) for text, count in counts.items()}

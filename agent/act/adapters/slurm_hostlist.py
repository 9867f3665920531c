"""Slurm's names: a single node or domain name as the adapter accepts it, and the hostlists that name many
(`n[1-3,5]`, `r[1-2]n[01-02]`), expanded as `scontrol show hostnames` does, with the count known before a name is
made."""
from __future__ import annotations

from typing import Any

from gpuwarden.agent.core.scheduler import Refused

MAX_NAME = 64  # a node name longer than this is not one (hostnames: 63)
MAX_DOMAIN = 100


def valid_name(name: Any, limit: int) -> bool:
    """A single Slurm name: letters, digits, `.`, `_`, `-` (no hostlist: `n[1-9]` or `a,b` would name many)."""
    return (isinstance(name, str) and 0 < len(name) <= limit and name[0] != "-"
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in name))


def _check_node(node: str) -> str:
    if not valid_name(node, MAX_NAME):
        raise Refused(f"{node!r}: not a single Slurm node name (letters, digits, '.', '_', '-')")
    return node


def _check_domain(domain: str) -> str:
    if not valid_name(domain, MAX_DOMAIN):
        raise Refused(f"{domain!r}: not usable as a node feature (letters, digits, '.', '_', '-'; at most "
                      f"{MAX_DOMAIN})")
    return domain


MAX_HOSTS = 100_000  # names one hostlist may stand for (a job on more nodes than this is not one)
MAX_HOSTLIST = 1 << 20  # characters of one hostlist


# -- hostlists (squeue's node lists) -----------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at {i}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at {i}")
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' not closed")
    parts.append(text[start:])
    return parts


def _ranges(body: str, limit: int) -> tuple[list[tuple[int, int, int]], int]:
    """The ranges of one bracket (`1-3,5,07-09`): (low, high, width) each, and how many numbers they hold."""
    out, count = [], 0
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        hi = hi if dash else lo
        if not (lo.isascii() and lo.isdigit() and hi.isascii() and hi.isdigit()) or len(lo) > 9 or len(hi) > 9:
            raise ValueError(f"bad range {item!r}")
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"range {item!r} runs backwards")
        count += b - a + 1
        if count > limit:
            raise ValueError(f"stands for more than {limit} names")
        out.append((a, b, len(lo) if len(lo) > 1 and lo[0] == "0" else 0))
    return out, count


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """The node names of a Slurm hostlist as `scontrol show hostnames` gives them: `n[1-3,5]`, `a,b`, `n[01-03]`,
    `r[1-2]n[1-2]` (each bracket a factor, left to right). The count is known before any name is made, so a short
    hostile list (`n[0-999999999]`) is refused, not expanded; the work is linear in the text and the names. Raises
    ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError("not a string")
    if len(text) > MAX_HOSTLIST:
        raise ValueError(f"longer than {MAX_HOSTLIST} characters")
    text = text.strip()
    if not text:
        return []
    names: list[str] = []
    for entry in _split_top(text):
        if not entry:
            raise ValueError("empty name between commas")
        # prefix [r] literal [r] ... ; Slurm refuses text after the last bracket, so does this
        pieces: list[Any] = []
        rest, total = entry, 1
        while "[" in rest:
            head, _, tail = rest.partition("[")
            body, close, rest = tail.partition("]")
            if not close:
                raise ValueError(f"{entry!r}: '[' not closed")
            ranges, count = _ranges(body, limit)
            total *= count
            if total + len(names) > limit:
                raise ValueError(f"stands for more than {limit} names")
            pieces += [head, ranges]
        if rest and pieces:
            raise ValueError(f"{entry!r}: text after the last ']'")
        pieces.append(rest)
        expanded = [""]
        for piece in pieces:
            if isinstance(piece, str):
                expanded = [e + piece for e in expanded]
            else:
                expanded = [e + str(n).zfill(w) for e in expanded for a, b, w in piece for n in range(a, b + 1)]
        for name in expanded:
            if not valid_name(name, MAX_NAME):
                raise ValueError(f"{name[:80]!r}: not a node name")
        names += expanded
    return names

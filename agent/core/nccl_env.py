"""NCCL's settings that decide how long a collective survives a silent InfiniBand rail, and which rails a job uses.
Pure: figures in, figures out, each with its source.

From the NCCL user guide, Environment Variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html):
- NCCL_IB_TIMEOUT: "The timeout is computed as 4.096 us * 2 ^ timeout"; "The default value used by NCCL is 20
  (since 2.23; it was 18 since 2.14, and 14 before that)"; "Setting a value of 0 or >= 32 will result in an
  infinite timeout value."
- NCCL_IB_RETRY_CNT: "The default value is 7"; "the total time spent waiting for a response is the product of
  NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT" (20 and 7: about 30 s; 18: 7.5 s; 14: 0.5 s).
- NCCL_IB_HCA: a comma-separated list of `name[:port]`; a name matches every device it prefixes unless the list
  starts with `=`; a list starting with `^` excludes instead (NCCL's parseStringList / matchIfList).
- Settings also come from files: NCCL_CONF_FILE (else ~/.nccl.conf) and /etc/nccl.conf, each `NAME=value` a line;
  the environment wins over a file, the user's file over /etc/nccl.conf.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Mapping, Sequence

from gpuwarden.agent.core.job import Figure
from gpuwarden.agent.core.records import dataclass

IB_TIMEOUT_UNIT_S = 4.096e-6  # the InfiniBand Local Ack Timeout's unit (IB spec vol. 1, 12.7.34)
DEFAULT_RETRY_CNT = 7
# The default NCCL_IB_TIMEOUT by the NCCL release that introduced it, newest first.
DEFAULT_IB_TIMEOUT: tuple[tuple[tuple[int, int, int], int], ...] = (((2, 23, 0), 20), ((2, 14, 0), 18),
                                                                   ((0, 0, 0), 14))
# Without the job's NCCL version, the newest default is assumed: the longest wait. A job is then ended later than it
# could be, never while its collectives could still ride the outage out.
UNKNOWN_VERSION_EXPONENT = 20
MAX_EXPONENT = 31  # "Values can be 0-31"
GUIDE = "NCCL env.html"
_VERSION = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,4})")
_SETTING = re.compile(r"^\s*([A-Z][A-Z0-9_]{0,127})\s*=\s*(.*?)\s*$")


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """"2.21.5" (or "2.21.5+cuda12.4", "2.21.5-1") -> (2, 21, 5); None for anything else."""
    m = _VERSION.match(text or "")
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def default_ib_timeout(version: tuple[int, int, int] | None) -> tuple[int, str]:
    """NCCL_IB_TIMEOUT's default for the job's NCCL release, and the words that say why."""
    if version is None:
        return UNKNOWN_VERSION_EXPONENT, (f"NCCL's newest default {UNKNOWN_VERSION_EXPONENT} assumed (the job's NCCL "
                                          "version is not known; 20 since 2.23, 18 since 2.14, 14 before: "
                                          f"{GUIDE}): the longest wait")
    for since, exponent in DEFAULT_IB_TIMEOUT:
        if version >= since:
            shown = ".".join(map(str, version))
            era = f"since {since[0]}.{since[1]}" if since != (0, 0, 0) else "before 2.14"
            return exponent, f"the default of NCCL {shown} ({exponent} {era}: {GUIDE})"
    raise AssertionError("unreachable: the oldest default starts at 0.0.0")


def effective_timeout_s(exponent: int, retries: int) -> float:
    """How long NCCL's IB transport waits on a silent peer before it fails the collective: 4.096 us x 2^exponent,
    times the retries (NCCL's guide; 0 retries is one timeout). An exponent of 0 or 32 and up never times out."""
    if exponent <= 0 or exponent >= 32:
        return math.inf
    return IB_TIMEOUT_UNIT_S * (2 ** exponent) * max(1, retries)


def riding_out(outage_s: float, retries: int) -> int | None:
    """The smallest NCCL_IB_TIMEOUT whose effective timeout (with `retries`) is longer than an outage of `outage_s`;
    None when even the largest finite one is not."""
    for exponent in range(1, MAX_EXPONENT + 1):
        if effective_timeout_s(exponent, retries) > outage_s:
            return exponent
    return None


def settings_in_files(texts: Iterable[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """NCCL's config files, most important first, as [(where, text)]: {NAME: (value, where)}, the first file that
    sets a name winning (NCCL sets each only if not already set)."""
    out: dict[str, tuple[str, str]] = {}
    for where, text in texts:
        for line in text.splitlines()[:4096]:
            if line.lstrip().startswith("#"):
                continue
            m = _SETTING.match(line[:4096])
            if m and m[1].startswith("NCCL_") and m[1] not in out:
                out[m[1]] = (m[2], where)
    return out


def _int_setting(name: str, env: Mapping[str, tuple[str, str]]) -> tuple[int | None, str | None]:
    """A setting as an integer, and where it was set (None, None: not set; None, why: set to what NCCL cannot read)."""
    if name not in env:
        return None, None
    value, where = env[name]
    try:
        return int(value.strip(), 0), f"{name}={value} ({where})"
    except ValueError:
        return None, f"{name}={value!r} ({where}) is not a number"


@dataclass(frozen=True)
class IbTimeout:
    exponent: Figure
    retries: Figure
    effective_s: Figure


def ib_timeout(settings: Mapping[str, tuple[str, str]], version: tuple[int, int, int] | None) -> IbTimeout:
    """The job's NCCL_IB_TIMEOUT, NCCL_IB_RETRY_CNT and the wait they give, from its settings ({NAME: (value,
    where)}: the environment and NCCL's files) and its NCCL version."""
    exponent, said = _int_setting("NCCL_IB_TIMEOUT", settings)
    default_exp, default_why = default_ib_timeout(version)
    if exponent is None:
        exp_fig = Figure(default_exp, default_why if said is None else f"{said}: {default_why}")
        exponent = default_exp
    else:
        exp_fig = Figure(exponent, said or "")
    retries, said_r = _int_setting("NCCL_IB_RETRY_CNT", settings)
    if retries is None:
        ret_fig = Figure(DEFAULT_RETRY_CNT, (f"{said_r}: " if said_r else "") + f"NCCL's default ({GUIDE})")
        retries = DEFAULT_RETRY_CNT
    elif not 0 <= retries <= 7:
        # The queue pair's retry count is a 3-bit field: values past 7 are outside what NCCL documents (0-7).
        ret_fig = Figure(retries, f"{said_r}, outside NCCL's documented 0-7; taken as given")
    else:
        ret_fig = Figure(retries, said_r or "")
    seconds = effective_timeout_s(exponent, retries)
    if math.isinf(seconds):
        why = f"NCCL_IB_TIMEOUT {exponent}: infinite ({GUIDE}: 0 or >= 32 never times out)"
    else:
        why = (f"4.096 us x 2^{exponent} x {max(1, retries)} retr{'y' if max(1, retries) == 1 else 'ies'}"
               f" = {seconds:.3g} s ({GUIDE})")
    return IbTimeout(exp_fig, ret_fig, Figure(seconds, why))


@dataclass(frozen=True)
class HcaFilter:
    """NCCL_IB_HCA parsed: (name, port or None) entries, matched as prefixes unless `exact`; `exclude` inverts."""

    entries: tuple[tuple[str, int | None], ...]
    exact: bool
    exclude: bool


def parse_ib_hca(text: str) -> HcaFilter:
    spec = text.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    entries = []
    for item in spec.split(",")[:256]:
        name, sep, port = item.strip().partition(":")
        if not name:
            continue
        entries.append((name[:64], int(port) if sep and port.strip().isdigit() else None))
    return HcaFilter(tuple(entries), exact, exclude)


def hca_matches(f: HcaFilter, port_name: str) -> bool:
    """Whether NCCL with this NCCL_IB_HCA may use the port "mlx5_0/1"."""
    device, _, num = port_name.partition("/")
    port = int(num) if num.isdigit() else None
    hit = any((device == name if f.exact else device.startswith(name)) and (want is None or want == port)
              for name, want in f.entries)
    return hit != f.exclude


def job_ports(settings: Mapping[str, tuple[str, str]], ports: Sequence[tuple[str, bool]]
              ) -> tuple[tuple[str, ...], str]:
    """The IB ports ("mlx5_0/1") the job's NCCL may use, and why: NCCL_IB_HCA's, else every port that is up (what
    NCCL would pick from). `ports`: (name, up) of this node's ports."""
    if "NCCL_IB_HCA" in settings:
        value, where = settings["NCCL_IB_HCA"]
        f = parse_ib_hca(value)
        chosen = tuple(name for name, _ in ports if hca_matches(f, name))
        return chosen, f"NCCL_IB_HCA={value} ({where})"
    return tuple(name for name, up in ports if up), "every port up when the job was seen (no NCCL_IB_HCA)"

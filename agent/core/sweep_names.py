"""What a sweep (agent/fleet/sweep/sweep.py) and a node's daemon reading its verdict (checks/nccl_sweep.py) agree on:
the check's name, the format of the verdict and report files, and what a node name may be (it names a file)."""
from __future__ import annotations

import re
from typing import Any

CHECK_NAME = "nccl_sweep"
FORMAT = 1  # of the verdict and report files
MAX_NAME = 255
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def valid_name(name: Any) -> bool:
    """A node name usable as a file name and a scheduler name: letters, digits, '.', '_', '-' (no '/', no '..')."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and name not in (".", "..")

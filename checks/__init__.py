"""The checks. Each module holds one check's decision logic and exposes CHECK (a CheckSpec)."""
from __future__ import annotations

from gpuwarden.agent.check import CheckSpec

from . import ecc, ib_port, xid

ALL: tuple[CheckSpec, ...] = (xid.CHECK, ecc.CHECK, ib_port.CHECK)


def by_name() -> dict[str, CheckSpec]:
    return {spec.name: spec for spec in ALL}

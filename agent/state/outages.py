"""This node's InfiniBand port outage history, as the daemon keeps it (the ib_port check's state in its store), for
the NCCL settings check outside the daemon's own memory: `gpuwarden preflight` and `gpuwarden jobs` on a node whose
daemon runs, and the daemon's jobs poll itself. Read-only: never creates, locks or waits on the database."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwarden.agent.state.store_errors import StoreError

IB_CHECK = "ib_port"


def read_ib_state(state_dir: str | Path) -> tuple[dict[str, Any] | None, str]:
    """(the ib_port check's state, where it came from), or (None, why there is none)."""
    db = Path(state_dir) / "state.db"
    if not db.exists():
        return None, f"{db}: no daemon state here (no port outage history)"
    # at use: the store and sqlite3, ~15 ms of import (-X importtime); a quick preflight loads the jobs check on every
    # node, and needs them only where a job uses the network and a daemon's store is there (tests/test_cli_startup.py)
    from gpuwarden.agent.state.store import Store
    try:
        store = Store(db, readonly=True)
    except StoreError as exc:
        return None, f"{db}: {exc}"
    try:
        record = store.check(IB_CHECK)
    except StoreError as exc:
        return None, f"{db}: cannot read the port history: {exc}"
    finally:
        store.close()
    if record is None:
        return None, f"{db}: the daemon has no port history (no InfiniBand ports, or not looked at yet)"
    return dict(record.state), f"{db} (the daemon's ib_port history)"

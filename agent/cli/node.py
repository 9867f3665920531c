"""The node a command looks at: this machine, or a recorded one (a folder written by `gpuwarden record`)."""
from __future__ import annotations

from pathlib import Path

from gpuwarden.agent.node.host import Node


def node(root: Path | None) -> Node:
    return Node.recorded_at(root) if root is not None else Node.live()


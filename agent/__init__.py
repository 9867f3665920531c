"""gpuwarden: a node-level GPU health agent. Everything that is not a check lives in this package."""

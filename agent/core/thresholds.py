"""Per-SKU thresholds: checks/data/thresholds/<check>.toml holds one table per SKU (with the source of each
figure in comments); a value set in the config file wins over the table."""
from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Mapping

from gpuwarden.agent.core.errors import ConfigError


@lru_cache(maxsize=None)
def sku_table(check: str) -> dict[str, dict[str, Any]]:
    """All SKU sections of one check's threshold file ({} when the check has none)."""
    # The checks package's folder, found without importing it (and without importlib.resources, which loads
    # zipfile, bz2 and lzma for every command).
    (folder,) = find_spec("gpuwarden.checks").submodule_search_locations
    resource = Path(folder) / "data" / "thresholds" / f"{check}.toml"
    if not resource.is_file():
        return {}
    try:
        return tomllib.loads(resource.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"thresholds/{check}.toml: invalid TOML: {exc}") from None


def threshold(check: str, key: str, sku: str, cfg: Mapping[str, Any]) -> float | None:
    """The figure to judge by: `cfg[key]` when configured (> 0), else the SKU table's, else None (unknown SKU
    and nothing configured: the caller must not pretend to know)."""
    configured = cfg.get(key, 0) or 0
    if configured > 0:
        return float(configured)
    value = sku_table(check).get(sku, {}).get(key)
    return float(value) if value is not None else None

"""Which SKU a node is, from the GPU product name NVML reports."""
from __future__ import annotations

KNOWN_SKUS = ("H100-SXM-HGX", "H200-SXM-HGX", "B200-HGX", "GB200-NVL72", "GB300-NVL72", "unknown")

# Order matters: "GB200" contains "B200", so the Grace-Blackwell names are tried first.
_NAME_TO_SKU = (
    ("GB300", "GB300-NVL72"),
    ("GB200", "GB200-NVL72"),
    ("B200", "B200-HGX"),
    ("H200", "H200-SXM-HGX"),
    ("H100", "H100-SXM-HGX"),
)


def sku_from_gpu_name(name: str | None) -> str:
    upper = (name or "").upper()
    for needle, sku in _NAME_TO_SKU:
        if needle in upper:
            return sku
    return "unknown"

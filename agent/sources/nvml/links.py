"""The NVML reads of a GPU's links: its NVLinks (state and error counters, one field read), its NVSwitch fabric, its
PCIe link and its peer-to-peer status to every other GPU. Mixed into Nvml (agent/sources/nvml/__init__.py), whose
_call and _dev make the library calls."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

import pynvml
from gpuwarden.agent.core.errors import NvmlError
from gpuwarden.agent.sources.nvml.bindings import GPU_FABRIC_INFO_V2, GpuFabricInfoV2, const
from gpuwarden.agent.sources.nvml.fields import NVLINK_COUNTER_FIELDS, NVLINK_CRC_DATA_FIELDS, NVLINK_STATE_FIELD
from gpuwarden.agent.sources.nvml.gpu import Gpu

NVLINK_COUNTERS = {
    "replay": const("NVML_NVLINK_ERROR_DL_REPLAY"),
    "recovery": const("NVML_NVLINK_ERROR_DL_RECOVERY"),
    "crc_flit": const("NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    "crc_data": const("NVML_NVLINK_ERROR_DL_CRC_DATA"),
}
# Peer-to-peer capabilities NVML reports per ordered GPU pair (nvmlGpuP2PCapsIndex_t).
P2P_CAPS = {
    "nvlink": const("NVML_P2P_CAPS_INDEX_NVLINK"),
    "read": const("NVML_P2P_CAPS_INDEX_READ"),
    "write": const("NVML_P2P_CAPS_INDEX_WRITE"),
    "atomics": const("NVML_P2P_CAPS_INDEX_ATOMICS"),
}
P2P_STATUS_NAMES: dict[int, str] = {
    const(n): n[len("NVML_P2P_STATUS_"):] for n in dir(pynvml)
    if n.startswith("NVML_P2P_STATUS_") and n != "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED"  # the bindings' typo alias
}
P2P_STATUS_CODES: dict[str, int] = {v: k for k, v in P2P_STATUS_NAMES.items()}
NVLINK_RELEARN_EVERY = 20  # every 20th read asks for every link again (a link the driver offers late is seen)

_ABSENT = object()


@functools.lru_cache(maxsize=8)
def nvlink_fields(links: tuple[int, ...]) -> tuple[tuple[Any, int, int | None], ...]:
    """The field read of nvlinks() for these links: (key, field id, scope) of each link's state and counters. The
    same few link sets are read every poll (all links at a relearn, else the GPU's own), so it is built once."""
    fields: list[tuple[Any, int, int | None]] = []
    for link in links:
        fields.append(((link, "state"), NVLINK_STATE_FIELD, link))
        fields += [((link, name), fid, link) for name, fid in NVLINK_COUNTER_FIELDS.items()]
        if link in NVLINK_CRC_DATA_FIELDS:
            fields.append(((link, "crc_data"), NVLINK_CRC_DATA_FIELDS[link], None))
    return tuple(fields)  # shared by every caller through the cache: not to be changed


class LinkReads:
    """Nvml's link reads (each raises NvmlError as the other reads do)."""

    def nvlinks(self, gpu: Gpu) -> list[dict[str, Any]]:
        """Every NVLink the GPU has: {"link", "state", "errors": {counter: count}}, read in one field call. A link
        NVML answers NOT_SUPPORTED / INVALID_ARGUMENT for is one the SKU does not have: left out. A counter NVML
        does not offer (NOT_SUPPORTED) is left out of "errors"; one it failed to read is in "unread" with NVML's error
        name (a lost GPU raises).
        The data CRC count of a link without a field of its own (12 and up) is the one count read by its own call;
        where NVML has no field values at all (NOT_SUPPORTED), every value is."""
        every = gpu._links is None or not gpu._links or gpu._link_reads % NVLINK_RELEARN_EVERY == 0
        links = tuple(range(const("NVML_NVLINK_MAX_LINKS"))) if every else gpu._links
        gpu._link_reads += 1
        try:
            got = self.field_values(gpu, nvlink_fields(links))
        except NvmlError as exc:
            if not exc.not_supported:
                raise
            got = {}  # no field values on this GPU or driver: each value by its own call below
        out = []
        for link in links:
            try:
                state = got[(link, "state")] if got else int(self._dev(gpu, "nvmlDeviceGetNvLinkState", link))
            except NvmlError as exc:
                state = exc
            if isinstance(state, NvmlError):
                # Links a SKU does not have answer NOT_SUPPORTED / INVALID_ARGUMENT: not a fault.
                if state.not_supported or state.code == "INVALID_ARGUMENT":
                    continue
                raise state
            entry: dict[str, Any] = {"link": link, "state": int(state), "errors": {}}
            for name in NVLINK_COUNTERS:
                value: Any = got.get((link, name), _ABSENT)
                if value is _ABSENT:
                    try:
                        value = int(self._dev(gpu, "nvmlDeviceGetNvLinkErrorCounter", link, NVLINK_COUNTERS[name]))
                    except NvmlError as exc:
                        value = exc
                if isinstance(value, NvmlError):
                    if value.gpu_lost:
                        raise value  # the GPU's fact, not one counter's
                    if not value.not_supported:
                        entry.setdefault("unread", {})[name] = value.code
                    continue
                entry["errors"][name] = int(value)
            out.append(entry)
        if every:
            gpu._links = tuple(e["link"] for e in out)
        return out

    def fabric_info(self, gpu: Gpu) -> dict[str, Any]:
        info = GpuFabricInfoV2(version=GPU_FABRIC_INFO_V2)
        self._dev(gpu, "nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info))
        return {
            "cluster_uuid": _uuid_text(bytes(info.clusterUuid)),
            "clique_id": int(info.cliqueId),
            "state": int(info.state),
            "status": int(info.status),
            "health_mask": int(info.healthMask),
        }

    def pcie_link(self, gpu: Gpu) -> dict[str, int]:
        """Current vs maximum PCIe generation and width (max = what GPU and slot both support), and the
        replay counter (link-level retransmissions: a marginal link shows them before it downtrains)."""
        return {
            "gen": int(self._dev(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")),
            "max_gen": int(self._dev(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")),
            "width": int(self._dev(gpu, "nvmlDeviceGetCurrPcieLinkWidth")),
            "max_width": int(self._dev(gpu, "nvmlDeviceGetMaxPcieLinkWidth")),
            "replay": int(self._dev(gpu, "nvmlDeviceGetPcieReplayCounter")),
        }

    def p2p_status(self, gpu: Gpu, peer: Gpu) -> dict[str, str]:
        """NVML's peer-to-peer status from `gpu` to `peer` per capability: "OK" or why not
        (e.g. NOT_SUPPORTED for NVLink on a pair that only reaches over PCIe)."""
        if peer.handle is None:
            raise peer.error or NvmlError("nvmlDeviceGetP2PStatus", "UNKNOWN", peer.index, "no device handle")
        out = {}
        for name, cap in P2P_CAPS.items():
            code = int(self._call("nvmlDeviceGetP2PStatus", gpu.handle, peer.handle, cap, device=gpu.index))
            out[name] = P2P_STATUS_NAMES.get(code, f"CODE_{code}")
        return out

    def p2p_matrix(self, gpu: Gpu) -> dict[str, dict[str, str]]:
        """p2p_status from `gpu` to every other GPU NVML can open, keyed by the peer's index."""
        return {str(peer.index): self.p2p_status(gpu, peer) for peer in self.gpus()
                if peer.index != gpu.index and peer.handle is not None}


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

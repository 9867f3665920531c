"""NVIDIA's XID catalogue (data/xid_catalog.csv, from NVIDIA's Xid-Catalog.xlsx) mapped onto our action
ladder: the resolution bucket of each XID decides the recommended action."""
from __future__ import annotations

import csv
import io
import re
from functools import lru_cache
from pathlib import Path

from gpuwarden.agent.core.model import Action
from gpuwarden.agent.core.records import dataclass

CATALOG_FILE = "data/xid_catalog.csv"

# NVIDIA's "Resolution Bucket - Immediate Action" -> our ladder (NONE < MONITOR < RESTART_APP < DRAIN <
# RESET_GPU < REBOOT < SERVICE). A bucket missing here (or empty) falls back to MONITOR.
BUCKET_ACTIONS: dict[str, Action] = {
    "IGNORE": Action.NONE,  # NVIDIA: "No Action required" (informational, e.g. XID 63 row remap event)
    "RESTART_APP": Action.RESTART_APP,  # only the application; "RESET_GPU or RESTART_BM is not deemed necessary"
    "RESET_GPU": Action.RESET_GPU,  # the GPU keeps the fault until reset; a reboot is not needed
    "RESTART_BM": Action.REBOOT,  # "Restart bare metal": the node must be rebooted (e.g. XID 79 off the bus)
    "RESTART_VM": Action.REBOOT,  # the VM owning the GPU restarts; from inside that VM it is a reboot
    "CONTACT_SUPPORT": Action.SERVICE,  # no software remedy is named: the vendor must look at the hardware
    "CHECK_MECHANICALS": Action.SERVICE,  # check seating and connections: hands on the hardware
    "UPDATE_SWFW": Action.DRAIN,  # the driver/firmware must be updated first: take the node out of service
    "CHECK_UVM": Action.RESTART_APP,  # reset only if UVM/vGPU is in use, else ignore; the app restart covers both
    "WORKFLOW_XID_48": Action.RESET_GPU,  # DBE: "Solo: RESET_GPU" (with 63/64: drain and reset, same hammer)
    "WORKFLOW_XID_45": Action.RESTART_APP,  # solo: the app was torn down; with other XIDs xid.py follows those
    "WORKFLOW_NVLINK_ERR": Action.DRAIN,  # XID 74: a human decides after decoding the registers
    "WORKFLOW_NVLINK5_ERR": Action.DRAIN,  # XID 144-150: decoded via the 144-150 table, by a human for now
    "XID_154": Action.MONITOR,  # the real action is in the message: see recovery_action()
}

# XID 154: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)". The codes are
# NVML's nvmlDeviceGpuRecoveryAction_t; the catalogue lists the texts None, Drain P2P, Drain and Reset,
# GPU Reset Required, Node Reboot Required.
RECOVERY_ACTIONS: dict[int, tuple[str, Action]] = {
    0: ("None", Action.NONE),  # the GPU is usable again by a new process
    1: ("GPU Reset Required", Action.RESET_GPU),  # terminate the GPU processes, reset the GPU
    2: ("Node Reboot Required", Action.REBOOT),  # the OS may be left inconsistent: reboot
    3: ("Drain P2P", Action.DRAIN),  # quiesce peer-to-peer traffic; the driver then names the next action
    4: ("Drain and Reset", Action.RESET_GPU),  # NVML: "Drain P2P and Reset Gpu": the reset is what clears it
    5: ("Recover IMEX Domain", Action.DRAIN),  # a fabric-level recovery an operator runs
    6: ("Bus Reset", Action.RESET_GPU),  # reset the GPU's PCIe bus: a GPU reset at the bus level
    7: ("System Reboot", Action.REBOOT),
}
_RECOVERY_BY_TEXT = {text.lower(): action for text, action in RECOVERY_ACTIONS.values()}
_RECOVERY_TO = re.compile(r"\bto (0x[0-9a-fA-F]{1,8}|\d{1,8})(?: \(([^)]*)\))?")


@dataclass(frozen=True)
class XidInfo:
    xid: int
    name: str  # NVIDIA's mnemonic, e.g. ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS
    bucket: str  # NVIDIA's resolution bucket, e.g. RESTART_BM
    action: Action
    description: str  # e.g. "GPU has fallen off the bus"
    investigatory_action: str


def bucket_action(bucket: str) -> Action:
    return BUCKET_ACTIONS.get(bucket.strip(), Action.MONITOR)


def recovery_action(detail: str) -> Action | None:
    """The action an XID 154 message names ("... to 0x1 (GPU Reset Required)"); None if unrecognised."""
    m = _RECOVERY_TO.search(detail)
    if not m:
        return None
    # The driver's words first; the number where a newer driver prints a text we do not know yet.
    by_text = _RECOVERY_BY_TEXT.get((m[2] or "").strip().lower())
    if by_text is not None:
        return by_text
    known = RECOVERY_ACTIONS.get(int(m[1], 16) if m[1].startswith("0x") else int(m[1]))
    return known[1] if known else None


def _one_line(text: str) -> str:
    return " ".join(text.split())  # cells carry embedded newlines ("... /\nROBUST_CHANNEL_GR_...")


def parse_catalog(text: str) -> dict[int, XidInfo]:
    out: dict[int, XidInfo] = {}
    for row in csv.DictReader(io.StringIO(text)):
        xid = int(row["xid"])
        bucket = row["severity_or_resolution"].strip()
        out[xid] = XidInfo(xid, _one_line(row["name"]), bucket, bucket_action(bucket),
                           _one_line(row["description"]), row["investigatory_action"].strip())
    return out


@lru_cache(maxsize=1)
def load_catalog() -> dict[int, XidInfo]:
    """The bundled catalogue, by XID number (read once per process)."""
    # Beside this module in the installed package (importlib.resources would cost `analyze` ~5 ms of imports).
    return parse_catalog((Path(__file__).parent / CATALOG_FILE).read_text(encoding="utf-8"))

"""The bundled XID catalogue and its mapping onto the action ladder."""
from __future__ import annotations

import csv
import io
import re
from importlib.resources import files

import pytest
from gpuwarden.agent.core.model import Action
from gpuwarden.checks.xid_catalog import (
    BUCKET_ACTIONS,
    RECOVERY_ACTIONS,
    XidInfo,
    bucket_action,
    load_catalog,
    recovery_action,
)


def _rows() -> list[dict[str, str]]:
    text = files("gpuwarden.checks").joinpath("data/xid_catalog.csv").read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


def test_every_row_loads():
    rows = _rows()
    catalog = load_catalog()
    assert len(rows) == 172  # NVIDIA's "Xids" sheet: XIDs 1..172, one row each
    assert sorted(catalog) == [int(r["xid"]) for r in rows] == list(range(1, 173))
    for row in rows:
        info = catalog[int(row["xid"])]
        assert isinstance(info, XidInfo) and isinstance(info.action, Action)
        assert info.name and "\n" not in info.name
        assert info.bucket == row["severity_or_resolution"].strip()
        assert info.action is bucket_action(info.bucket)


def test_every_bucket_in_the_catalogue_is_mapped_deliberately():
    # A refreshed catalogue with a new bucket must make someone decide its action, not default silently.
    buckets = {r["severity_or_resolution"].strip() for r in _rows()} - {""}
    assert buckets <= set(BUCKET_ACTIONS), buckets - set(BUCKET_ACTIONS)


@pytest.mark.parametrize("xid, bucket, action", [
    (79, "RESTART_BM", Action.REBOOT),  # fallen off the bus
    (48, "WORKFLOW_XID_48", Action.RESET_GPU),  # double-bit ECC
    (63, "IGNORE", Action.NONE),  # row remap event (informational)
    (13, "RESTART_APP", Action.RESTART_APP),  # graphics engine exception
    (119, "RESET_GPU", Action.RESET_GPU),  # GSP RPC timeout
    (95, "RESET_GPU", Action.RESET_GPU),  # uncontained memory error
    (94, "RESTART_APP", Action.RESTART_APP),  # contained memory error
    (64, "RESET_GPU", Action.RESET_GPU),  # remapping failure
    (45, "WORKFLOW_XID_45", Action.RESTART_APP),  # solo: preemptive cleanup
    (74, "WORKFLOW_NVLINK_ERR", Action.DRAIN),
    (149, "WORKFLOW_NVLINK5_ERR", Action.DRAIN),
    (54, "CHECK_MECHANICALS", Action.SERVICE),
    (1, "CONTACT_SUPPORT", Action.SERVICE),
    (78, "UPDATE_SWFW", Action.DRAIN),
    (151, "RESTART_VM", Action.REBOOT),
    (159, "CHECK_UVM", Action.RESTART_APP),
    (154, "XID_154", Action.MONITOR),  # the real action comes from the message
    (162, "", Action.MONITOR),  # no bucket in the catalogue
])
def test_catalogue_actions(xid, bucket, action):
    info = load_catalog()[xid]
    assert (info.bucket, info.action) == (bucket, action)


def test_names_and_descriptions_are_single_line():
    catalog = load_catalog()
    assert catalog[13].name == "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY"
    assert catalog[79].description == "GPU has fallen off the bus"
    assert catalog[62].description == "Internal micro-controller halt (newer drivers)"


def test_catalogue_is_read_once():
    assert load_catalog() is load_catalog()


def test_unknown_bucket_is_monitor():
    assert bucket_action("SOMETHING_NEW") is Action.MONITOR
    assert bucket_action("") is Action.MONITOR


def test_data_file_ships_with_its_provenance():
    data = files("gpuwarden.checks").joinpath("data")
    source = data.joinpath("xid_catalog.csv.source.txt").read_text(encoding="utf-8")
    assert "Xid-Catalog.xlsx" in source and "7f70ce9684be0c9d98a367770341ccc1d8bca4465cebe42dab7e23d57df5d5a5" in source


# --- XID 154: the driver names the recovery action ------------------------------------------------------
@pytest.mark.parametrize("detail, action", [
    # the catalogue's own example (XID 154 trigger_conditions)
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", Action.REBOOT),
    # leptonai/gpud kmsg_test.go GB200 sequence
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)", Action.RESET_GPU),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x3 (Drain P2P)", Action.DRAIN),
    ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", Action.NONE),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Some Future Wording)", Action.REBOOT),  # by number
    ("GPU recovery action changed from 0x0 (None) to 0x2a (Some Future Wording)", None),
    ("GPU recovery action changed", None),
    ("", None),
])
def test_recovery_action_from_message(detail, action):
    assert recovery_action(detail) is action


def test_every_recovery_text_the_catalogue_lists_is_mapped():
    row = next(r for r in _rows() if r["xid"] == "154")
    # The cell quotes each text with doubled quotes: ""None"", ""Drain P2P"", ...
    listed = re.findall(r'""([^"]+)""', row["trigger_conditions"].split("expected values of the text are:")[1])
    assert listed == ["None", "Drain P2P", "Drain and Reset", "GPU Reset Required", "Node Reboot Required"]
    texts = {text for text, _ in RECOVERY_ACTIONS.values()}
    assert set(listed) <= texts

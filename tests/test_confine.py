"""Reads under a recorded node resolve each directory once for a short while (agent/sources/confine.py): the same
files are refused or read as when every path was resolved in full."""
from __future__ import annotations

import os

import pytest
from gpuwarden.agent.core.errors import SourceError
from gpuwarden.agent.sources import confine
from gpuwarden.agent.sources.sysfs import Sysfs


def test_a_directory_turned_into_a_link_out_is_refused_once_its_resolution_is_stale(tmp_path, monkeypatch):
    root, outside = tmp_path / "node", tmp_path / "outside"
    (root / "sys/a").mkdir(parents=True)
    outside.mkdir()
    (root / "sys/a/state").write_text("4: ACTIVE\n")
    (outside / "state").write_text("secret\n")
    sysfs = Sysfs(root)
    assert sysfs.read("/sys/a/state") == "4: ACTIVE" and sysfs.read_bytes("/sys/a/state") == b"4: ACTIVE\n"
    assert sysfs.listdir("/sys/a") == ["state"]
    os.rename(root / "sys/a", root / "sys/was-a")
    (root / "sys/a").symlink_to(outside)
    fresh = Sysfs(root)  # the resolutions are the source's own: another one resolves anew
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        fresh.read("/sys/a/state")
    monkeypatch.setattr(confine, "DIR_TTL_S", 0.0)
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        sysfs.read("/sys/a/state")
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        sysfs.listdir("/sys/a")


def test_names_resolving_would_change_are_resolved_in_full(tmp_path):
    root = tmp_path / "node"
    (root / "sys/a/b").mkdir(parents=True)
    (root / "sys/a/b/state").write_text("x\n")
    (root / "sys/a/link").symlink_to("b/state")
    sysfs = Sysfs(root)
    assert sysfs.read("/sys/a/b/../b/state") == sysfs.read("/sys/a/link") == "x"
    with pytest.raises(SourceError, match="not a regular file"):
        sysfs.read("/sys/a/b/..")
    with pytest.raises(SourceError, match="resolves outside the recorded node"):
        sysfs.read("/sys/a/../../..")

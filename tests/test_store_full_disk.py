"""A full disk under the real `gpuwarden run`: its state folder on a 2 MiB tmpfs in a mount namespace of its own,
filled to a real ENOSPC while XIDs keep coming. `gpuwarden status` says the store is failing (exit 2, the error,
since when) though nothing can be written; the failed write is retried after the documented backoff (1 s doubling
to 30 s), not at every observation; once space is free the pending state is written and `status` is back to 0."""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import append_kmsg, end_processes, wait_for
from test_store_damage import GPU13, SEEN_S, XID13, Agent

FEED_S = 8.0  # XIDs come this long while the disk is full, one every FEED_EVERY_S
FEED_EVERY_S = 0.05


@pytest.fixture
def small_disk(tmp_path):
    """(the folder as the namespace sees it, the namespace's holder process): a 2 MiB tmpfs mounted on it in a mount
    namespace of its own, which ends with the holder (nothing is left mounted on the host)."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("a real full disk needs root, unshare and nsenter (util-linux) to mount a small tmpfs")
    where = tmp_path / "small"
    where.mkdir()
    script = f"mount -t tmpfs -o size=2m tmpfs {shlex.quote(str(where))} && echo mounted && exec sleep 3600"
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "mounted":
            pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {holder.stderr.read().strip()}")
        yield where, holder
    finally:
        end_processes(holder)


def fill(folder: Path) -> Path:
    """A file that takes every block left (unbuffered writes until ENOSPC: nothing is left to flush at close, which
    would fail the same way)."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"\0" * 65536
        while True:
            try:
                if os.write(fd, block) == 0:
                    break
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_said_by_status_and_the_write_is_retried_with_a_backoff(scenario_copy, tmp_path, small_disk):
    where, holder = small_disk
    inside = Path(f"/proc/{holder.pid}/root") / where.relative_to("/")  # the tmpfs as this process reaches it
    root = scenario_copy("gb200-nvl72-healthy")
    a = Agent(root, where / "state", tmp_path / "agent.log", wrap=("nsenter", "--target", str(holder.pid), "--mount",
                                                                    "--"))
    a.start()
    try:
        append_kmsg(root, XID13)
        wait_for(lambda: a.count(GPU13, 13) == 1, timeout_s=SEEN_S, what="the first XID written")
        filler = fill(inside)
        fed = 0
        began = time.monotonic()
        while time.monotonic() - began < FEED_S:
            append_kmsg(root, XID13)
            fed += 1
            time.sleep(FEED_EVERY_S)
        wait_for(lambda: a.sample("gpuwarden_xid_events", f'pci="{GPU13}",xid="13"') == 1 + fed, timeout_s=SEEN_S,
                 what="every XID counted in memory while the disk is full")
        elapsed = time.monotonic() - began
        assert a.sample("gpuwarden_store_ok") == 0.0
        failures = a.sample("gpuwarden_store_write_failures_total")
        # The writes tried: the first that failed, then one after each wait of 1, 2, 4, ... s. A slower machine tries
        # fewer in the same time, never more; at one try per observation there would be about one per XID.
        most = 2 + math.log2(elapsed + 1)
        assert 1 <= failures <= most < fed / 5, (failures, most, fed)
        shown = a.status()
        assert shown.returncode == 2, shown.stdout + shown.stderr
        first = shown.stdout.splitlines()[0]
        assert first.startswith("state store: FAILING since ") and "full" in first and "ago)" in first, shown.stdout
        doc = json.loads(a.status("--json").stdout)
        writes = doc["store_writes"]
        assert writes["ok"] is False and "full" in writes["error"] and writes["since_utc"], writes
        assert writes["failed_writes"] >= failures
        assert a.count(GPU13, 13) == 1  # the store holds what it held: status said it is stale, not healthy

        filler.unlink()
        # The retry after the longest wait the backoff has reached by now (under 30 s) writes everything pending.
        wait_for(lambda: a.count(GPU13, 13) == 1 + fed, timeout_s=SEEN_S, what="the pending state written")
        wait_for(lambda: a.sample("gpuwarden_store_ok") == 1.0, timeout_s=SEEN_S, what="store_ok back to 1")
        shown = a.status()
        assert shown.returncode == 0 and "FAILING" not in shown.stdout, shown.stdout + shown.stderr
        assert "state store: writes failed from " in shown.stdout and "full" in shown.stdout, shown.stdout
    finally:
        a.stop()

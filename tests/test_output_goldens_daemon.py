"""Goldens for what the daemon shows: /metrics of the real daemon (every passive check, every kernel-log consumer,
the endpoint, the dry-run remediation) on each bundled scenario, on a fixed clock, after a fixed sequence of events:
the scenario as recorded (`-idle`), then an XID 79 on GPU 0 appended to its kernel log (`-after-xid79`); and
`gpuwarden status`, table and JSON, read from the store the daemon left. Diffed against tests/golden/outputs/ like
tests/test_output_goldens.py; refresh with `--update-golden` and read the diff.

The clock the daemon stamps with is fixed (DaemonOptions.clock, the adapter's clock), so every timestamp on the page
and in the store is the same on every run. Normalised are only what the fixed clock does not reach: how long each
check took (gpuwarden_check_duration_seconds), the folder the run had (`<tmp>`), and in status the reader's own
clock (`now`, `now_utc`, the table's "(… ago)").

status is left out on gb200-nvl72-faulty: it holds faults found by a poll and by the kernel-log reader, two
threads, and the first transition's reason names whichever committed first; /metrics carries no reason."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import NODES, ROOT, append_kmsg, wait_for
from gpuwarden.agent.act.adapters.local import LocalAdapter
from gpuwarden.agent.core import config
from gpuwarden.agent.daemon.http_endpoint import MetricsEndpoint
from gpuwarden.agent.daemon.loop import Daemon, DaemonOptions
from gpuwarden.agent.daemon.metrics import DaemonCollector, registry_for
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.state.store import Store
from gpuwarden.checks import KERNEL_CONSUMERS, PASSIVE, all_specs

GOLDEN = ROOT / "tests" / "golden" / "outputs"
SCENARIOS = sorted(p.name for p in NODES.iterdir() if (p / "node.toml").exists())
RACY_STATUS = {"gb200-nvl72-faulty"}
T0 = 1796083200.0  # 2026-12-01T00:00:00Z
XID79 = "3,{{seq}},{{usec}},-;NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
_DURATION = re.compile(r"^(gpuwarden_check_duration_seconds\{[^}]*\}) \S+$", re.M)
_AGO = re.compile(r"\((?:\d+[dhms])+ ago\)|\(just now\)|\(in [^)]*\)")


def _clock() -> float:
    return T0


def _kernel_pci(nvml_bus_id: str) -> str:
    """NVML's 00000000:19:00.0 as the driver's XID line writes it: 0000:19:00."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{domain[-4:]}:{rest.rsplit('.', 1)[0]}"


def _settled(scrape, ready, what: str) -> str:
    """The page once `ready` holds and two scrapes 0.3 s apart agree (durations aside): every loop has caught up."""
    def stable():
        first = _DURATION.sub(r"\1 0", scrape())
        if not ready(first):
            return None
        time.sleep(0.3)
        return first if _DURATION.sub(r"\1 0", scrape()) == first else None

    return wait_for(stable, timeout_s=60, what=what)


def _compare(name: str, text: str, update: bool) -> None:
    golden = GOLDEN / f"{name}.txt"
    if update:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"{golden} is missing: create it with --update-golden and review it"
    assert text == golden.read_text(), f"{name} differs from {golden} (rerun with --update-golden if intended)"


def _status(state: Path, tmp: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "status", "--state-dir", str(state), *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin",
                                                                                     "TZ": "UTC"})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = _AGO.sub("(<ago>)", proc.stdout.replace(str(tmp), "<tmp>"))
    if "--json" in extra:
        doc = json.loads(out)
        doc["now"], doc["now_utc"] = "<now>", "<now>"
        out = json.dumps(doc, indent=2) + "\n"
    return f"exit {proc.returncode}\n{out}"


def test_no_daemon_golden_is_left_over():
    names = {f"metrics-{n}-{when}" for n in SCENARIOS for when in ("idle", "after-xid79")}
    names |= {f"status-{form}-{n}-after-xid79" for n in SCENARIOS if n not in RACY_STATUS for form in ("table", "json")}
    left = sorted({p.stem for p in GOLDEN.glob("*.txt") if p.stem.startswith(("metrics-", "status-"))} - names)
    assert not left, f"goldens of no case (remove them): {left}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_daemon_outputs_match_their_goldens(name, tmp_path, update_golden):
    root, state = tmp_path / name, tmp_path / "state"
    shutil.copytree(NODES / name, root, symlinks=True)
    state.mkdir()
    store = Store(state / "state.db")
    collector = DaemonCollector(started=T0)
    daemon = Daemon(Node.recorded_at(root), list(PASSIVE), list(KERNEL_CONSUMERS), config.defaults(all_specs()),
                    store, LocalAdapter(state / "actions.jsonl", clock=_clock), collector,
                    DaemonOptions(kmsg_tick_s=0.01, idle_tick_s=0.05, intervals={s.name: 0.1 for s in PASSIVE},
                                  clock=_clock))
    endpoint = MetricsEndpoint("127.0.0.1", 0, registry_for(collector))
    daemon.start()
    endpoint.start()
    try:
        def scrape() -> str:
            url = f"http://127.0.0.1:{endpoint.port}/metrics"
            return urllib.request.urlopen(url, timeout=10).read().decode().replace(str(tmp_path), "<tmp>")

        looked = len(PASSIVE) + len(KERNEL_CONSUMERS)
        idle = _settled(scrape, lambda page: len(daemon.results()) == looked, "every check's first look")
        _compare(f"metrics-{name}-idle", idle, update_golden)

        gpu0 = json.loads((root / "nvml.json").read_text())["gpus"][0]
        append_kmsg(root, XID79.format(pci=_kernel_pci(gpu0["pci_bus_id"])))
        finding = f'check="xid",code="79",entity="{gpu0["uuid"]}"'
        after = _settled(scrape, lambda page: finding in page
                         and 'gpuwarden_node_state{state="quarantined"} 1.0' in page
                         and 'gpuwarden_intents_carried_out_total{outcome="dry_run"} 0.0' not in page,
                         "the XID 79's finding, the quarantine and its dry-run intents")
        _compare(f"metrics-{name}-after-xid79", after, update_golden)
    finally:
        endpoint.stop()
        daemon.stop()
        store.close()
    if name in RACY_STATUS:
        return
    _compare(f"status-table-{name}-after-xid79", _status(state, tmp_path), update_golden)
    _compare(f"status-json-{name}-after-xid79", _status(state, tmp_path, "--json"), update_golden)

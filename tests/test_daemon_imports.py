"""What `gpuwarden run` loads: the modules of what it runs, each heavy one at its first use. A daemon started on a
recorded node and scraped (text and OpenMetrics with gzip, as Prometheus asks) has not imported prometheus-client
(its page is the collector's own), ssl or hashlib (no web config), importlib.metadata, nor the modules of the
checks it never runs (burn-in, NCCL, RDMA, DCGM and their parsers, the sweep). Its config still knows those
checks' tables where a file sets them, and a retest still runs every quick check."""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys

import pytest
from conftest import NODES
from gpuwarden import checks
from gpuwarden.agent.cli.run import daemon_forms, load_config
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.node.host import Node
from gpuwarden.agent.node.retest import run_retest

# Runs in the daemon's own process: the daemon in the main thread (it sets signal handlers), a probe thread that
# scrapes it over a plain socket (nothing the daemon itself would not load), prints the modules loaded, and stops it.
PROBE = r"""
import json, os, signal, socket, sys, threading, time
from gpuwarden.agent.cli.main import main

root, state, port = sys.argv[1], sys.argv[2], int(sys.argv[3])

def get(extra):
    deadline = time.monotonic() + 60
    while True:
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(("127.0.0.1", port))
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with s:
        s.sendall(("GET /metrics HTTP/1.0\r\n" + extra + "\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), len(body)

def probe():
    try:
        answers = [get(""), get("Accept: application/openmetrics-text; version=1.0.0\r\nAccept-Encoding: gzip\r\n")]
        print(json.dumps({"answers": answers, "modules": sorted(sys.modules)}), flush=True)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=probe, daemon=True).start()
sys.exit(main(["run", "--root", root, "--state-dir", state, "--listen", f"127.0.0.1:{port}"]))
"""

# Loaded only where something needs them: a collector registered from outside, a web config, a sweep, a preflight.
NOT_LOADED = {"prometheus_client", "http.server", "http.client", "email", "urllib.request", "importlib.metadata",
              "zipfile", "ssl", "_ssl", "hashlib", "_hashlib", "bcrypt", "yaml", "logging", "concurrent.futures",
              "gpuwarden.agent.fleet.sweep.sweep", "gpuwarden.agent.sources.gemm", "gpuwarden.agent.sources.perftest",
              "gpuwarden.checks.parse_dcgmi_diag", "gpuwarden.checks.parse_dcgmi_diag_text",
              "gpuwarden.checks.parse_nccl_tests",
              "gpuwarden.checks.parse_perftest", "gpuwarden.checks.parse_nvbandwidth",
              "gpuwarden.checks.parse_nvidia_smi_topo", "gpuwarden.checks.pcie_link",
              "gpuwarden.checks.pcie_tree"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """The daemon's answers to two scrapes and its sys.modules after them."""
    tmp = tmp_path_factory.mktemp("daemon-imports")
    root = tmp / "node"
    shutil.copytree(NODES / "h100-hgx-healthy", root, symlinks=True, ignore=shutil.ignore_patterns("tools"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(root), str(tmp / "state"), str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def test_daemon_served_its_page_in_both_formats(loaded):
    (plain, plain_len), (om, om_len) = loaded["answers"]
    assert plain.split("\r\n")[0].endswith(" 200 OK") and plain_len > 1000
    assert "Content-Type: text/plain; version=0.0.4; charset=utf-8" in plain
    assert om.split("\r\n")[0].endswith(" 200 OK") and om_len > 100
    assert "Content-Type: application/openmetrics-text; version=1.0.0" in om
    assert "Content-Encoding: gzip" in om


def test_daemon_loads_what_it_runs(loaded):
    modules = set(loaded["modules"])
    # What it runs is there: the daemon, the endpoint, every passive check and kernel-log consumer.
    assert {"gpuwarden.agent.daemon.loop", "gpuwarden.agent.daemon.http_endpoint",
            "gpuwarden.agent.daemon.metrics"} <= modules
    assert {f"gpuwarden.checks.{w.rpartition('.')[0] or c.name}" for c in checks.CONCERNS for w in (c.poll, c.kernel)
            if w} <= modules


def test_daemon_does_not_load_what_it_does_not_run(loaded):
    modules = set(loaded["modules"])
    full = {f"gpuwarden.checks.{m}" for c in checks.CONCERNS if c.level == "full" for m in checks.modules_of(c)}
    assert full and not full & modules, sorted(full & modules)
    assert not NOT_LOADED & modules, sorted(NOT_LOADED & modules)


def config_args(path) -> argparse.Namespace:
    return argparse.Namespace(config=path)


def test_daemon_config_checks_tables_of_checks_it_does_not_load(tmp_path):
    cfg_file = tmp_path / "gpuwarden.toml"
    cfg_file.write_text("[checks.dcgm_diag]\nlevel = 3\n\n[checks.burnin]\n")
    cfg = load_config(daemon_forms(), config_args(cfg_file))
    assert cfg.checks["dcgm_diag"]["level"] == 3
    assert "burnin" not in cfg.checks  # an empty table sets nothing: its check's defaults are not needed
    assert {s.name for s in (*checks.PASSIVE, *checks.KERNEL_CONSUMERS)} <= set(cfg.checks)
    cfg_file.write_text("[checks.dcgm_diag]\nno_such_key = 1\n")
    with pytest.raises(ConfigError, match="no_such_key"):
        load_config(daemon_forms(), config_args(cfg_file))


def test_retest_runs_every_quick_check_with_the_daemons_config(scenario_copy):
    cfg = load_config(daemon_forms(), config_args(None))
    assert "pcie_link" not in cfg.checks  # a quick check the daemon itself does not run
    node = Node.recorded_at(scenario_copy("h100-hgx-healthy", with_tools=True))
    passed, results = run_retest(node, cfg, None)
    assert [r.check for r in results] == [c.name for c in checks.CONCERNS if c.level == "quick"]
    assert passed is True, [(r.check, r.status) for r in results]
    assert "pcie_link" not in cfg.checks  # the daemon's config is left as it was

"""`gpuwarden sweep --hosts`, the real command where no scheduler runs: mpirun (Debian's Open MPI) launches the
stand-in all_reduce_perf on four "hosts" of this machine (its rsh agent names each host, tests/test_sweep_launch.py),
and the sweep names the slow host from the groups' outputs alone."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from test_sweep_launch import open_mpi_hosts

STANDIN = ROOT / "tests" / "standin_all_reduce_perf.py"


def test_sweep_over_hosts_with_mpirun_names_the_slow_host(tmp_path):
    hosts = open_mpi_hosts(tmp_path)
    (tmp_path / "scenario.json").write_text(json.dumps({"slow_nodes": ["hc"], "seed": 5}))
    command = [sys.executable, str(STANDIN), "-b", "8", "-e", "2G", "-f", "2", "-g", "1", "-N", "5"]
    config = tmp_path / "gpuwarden.toml"
    config.write_text(f"""
[sweep]
command = {json.dumps(command)}
ranks_per_node = 1
group_nodes = 2
timeout_s = 60.0
results_dir = "{tmp_path / 'results'}"
[sweep.baselines]
"any/2" = {{ latency_p95_us = 65.0, busbw_gbps = 460.0 }}
""")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GW_SWEEP_SCENARIO": str(tmp_path / "scenario.json"),
           "GW_SWEEP_STANDIN_LOG": str(tmp_path / "standin.log"), "GW_STANDIN_DIR": str(tmp_path / "rendezvous"),
           **hosts}
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "sweep", "--config", str(config),
                           "--hosts", "ha,hb,hc,hd", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert proc.returncode == 1, report
    assert report["launcher"] == "mpirun"
    assert report["culprit_nodes"] == {"hc": "sweep-slow"} and report["culprit_links"] == []
    assert sorted(report["passed"]) == ["ha", "hb", "hd"]
    first = [t for t in report["tests"] if t["purpose"] == "sweep"]
    assert sorted(n for t in first for n in t["nodes"]) == ["ha", "hb", "hc", "hd"]  # every host, once, at once
    verdict = json.loads((tmp_path / "results" / "nodes" / "hc.json").read_text())
    assert verdict["findings"][0]["code"] == "sweep-slow"

"""What a short command loads: `--version`, `--help` and a preflight import only what they use (no daemon, no
metrics, no store, no sweeps or fleet planning), and the CLI built lazily is the CLI built whole."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
from conftest import NODES, ROOT
from gpuwarden.agent.cli import main as cli
from gpuwarden.agent.core.version import VERSION

# Modules a quick command has no use for: the daemon's HTTP/metrics stack, the store, the sweeps, fleet planning,
# the scheduler adapters, YAML, and what structlog and importlib.metadata pulled in.
HEAVY = ("structlog", "prometheus_client", "sqlite3", "yaml", "asyncio", "email", "importlib.metadata",
         "importlib.resources", "zipfile", "concurrent.futures",
         "gpuwarden.agent.daemon.loop", "gpuwarden.agent.daemon.metrics", "gpuwarden.agent.daemon.http_endpoint",
         "gpuwarden.agent.state.store", "gpuwarden.agent.cli.run", "gpuwarden.agent.fleet.sweep.command",
         "gpuwarden.agent.fleet.sweep.launch", "gpuwarden.agent.cli.plan",
         "gpuwarden.agent.fleet.plan.capacity", "gpuwarden.agent.fleet.plan.risk",
         "gpuwarden.agent.fleet.plan.simulate", "gpuwarden.agent.fleet.plan.defrag",
         "gpuwarden.agent.fleet.plan.sim_fleet", "gpuwarden.agent.node.topology",
         "gpuwarden.agent.cli.slurm", "gpuwarden.agent.act.adapters.slurm",
         "gpuwarden.agent.act.adapters.local", "gpuwarden.agent.act.adapters.kubernetes",
         "gpuwarden.agent.act.remediation", "socket")
# What only the full checks and the daemon's own checks use: a quick preflight runs none of them.
FULL_ONLY = ("gpuwarden.checks.burnin", "gpuwarden.checks.peer_p2p", "gpuwarden.checks.nccl_allreduce",
             "gpuwarden.checks.rdma_loopback", "gpuwarden.checks.dcgm_diag", "gpuwarden.checks.ecc_memtest",
             "gpuwarden.checks.clock_events", "gpuwarden.checks.thermal", "gpuwarden.checks.nccl_sweep",
             "gpuwarden.checks.parse_dcgmi_diag", "gpuwarden.checks.parse_dcgmi_diag_text",
             "gpuwarden.checks.parse_nccl_tests",
             "gpuwarden.checks.parse_perftest", "gpuwarden.checks.parse_nvbandwidth", "gpuwarden.agent.sources.gemm",
             "gpuwarden.agent.sources.perftest", "gpuwarden.agent.fleet.sweep.sweep", "gpuwarden.agent.core.scheduler",
             "gpuwarden.agent.fleet.sweep.criteria", "gpuwarden.agent.fleet.sweep.history", "statistics")


def loaded_by(*argv: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules in sys.modules when `gpuwarden ARGV` ends (a fresh interpreter; SystemExit from argparse too)."""
    code = ("import json, sys\n"
            "from gpuwarden.agent.cli.main import main\n"
            "try:\n"
            "    rc = main(sys.argv[1:])\n"
            "except SystemExit as exc:\n"
            "    rc = exc.code\n"
            "sys.stdout.flush()\n"
            "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n')\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    line = [x for x in proc.stderr.splitlines() if x.startswith("MODULES ")]
    assert line, proc.stderr
    return set(json.loads(line[-1].removeprefix("MODULES "))), proc


def test_version_is_pyprojects_and_loads_nothing_of_the_agent():
    assert VERSION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    modules, proc = loaded_by("--version")
    assert proc.returncode == 0 and proc.stdout == f"gpuwarden {VERSION}\n"
    assert sorted(m for m in modules if m.startswith("gpuwarden.")) == [
        "gpuwarden.agent", "gpuwarden.agent.cli", "gpuwarden.agent.cli.main", "gpuwarden.agent.core",
        "gpuwarden.agent.core.errors", "gpuwarden.agent.core.logs", "gpuwarden.agent.core.version"]
    assert not modules & set(HEAVY)


@pytest.mark.parametrize("argv", [("--help",), ("preflight", "--help")])
def test_help_loads_no_check_and_nothing_heavy(argv):
    modules, proc = loaded_by(*argv)
    assert proc.returncode == 0 and "usage: gpuwarden" in proc.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "gpuwarden.checks" not in modules and "gpuwarden.agent.core.config" not in modules


@pytest.mark.parametrize("config", [(), ("--config", str(ROOT / "packaging" / "gpuwarden.toml"))],
                         ids=["no-config", "packaged-config"])
def test_preflight_on_a_recorded_node_loads_nothing_heavy(config):
    modules, proc = loaded_by("preflight", "--root", str(NODES / "h100-hgx-healthy"), "--json", *config)
    assert proc.returncode == 0 and json.loads(proc.stdout)["status"] == "ok"
    assert not modules & {*HEAVY, *FULL_ONLY}, sorted(modules & {*HEAVY, *FULL_ONLY})
    assert "gpuwarden.checks.xid" in modules  # it did run the checks


def test_explain_of_a_log_alone_loads_no_source_of_node_evidence():
    """`gpuwarden explain LOG` asks no node, no Slurm, no Prometheus and reads no saved store: it loads none of their
    modules (with them, the node's sources and NVML, 100 of its 160 ms of start)."""
    log = ROOT / "fixtures" / "job_logs"
    modules, proc = loaded_by("explain", "--json", str(sorted(log.glob("*.log"))[0]))
    assert proc.returncode in (0, 1, 2) and json.loads(proc.stdout)["culprit"] is not None, proc.stderr
    unused = {"gpuwarden.agent.jobs.evidence_saved", "gpuwarden.agent.jobs.prometheus_evidence",
              "gpuwarden.agent.act.adapters.slurm_job", "gpuwarden.agent.node.host", "gpuwarden.agent.sources.nvml",
              "pynvml", "http.client", "ssl"}
    assert not modules & {*HEAVY, *unused}, sorted(modules & {*HEAVY, *unused})
    assert "gpuwarden.agent.jobs.joblog" in modules  # it did read the log


def test_plan_part_loads_only_its_own_module():
    modules, proc = loaded_by("plan", "capacity", "--help")
    assert proc.returncode == 0 and "usage: gpuwarden plan capacity" in proc.stdout
    assert "gpuwarden.agent.fleet.plan.capacity" in modules
    assert not modules & {"gpuwarden.agent.fleet.plan.risk", "gpuwarden.agent.fleet.plan.simulate",
                          "gpuwarden.agent.fleet.plan.defrag", "gpuwarden.agent.fleet.plan.sim_fleet"}


def _help_lines(parser) -> dict[str, str]:
    return {c.dest: c.help for c in _sub(parser)._choices_actions}


def test_the_lazy_parser_lists_what_the_whole_one_does():
    """Each command's help line in cli.COMMANDS is the one its module gives, and a parser built for one command
    prints the same top-level help as the whole one."""
    whole = cli._parser()
    assert _help_lines(whole) == {name: summary for name, summary, _ in cli.COMMANDS}
    for name, _, _ in cli.COMMANDS:
        assert cli._parser(name).format_help() == whole.format_help(), name
    assert cli._parser(None).format_help() == whole.format_help()
    whole_plan = _sub(whole).choices["plan"]
    assert _sub(cli._parser("plan", None)).choices["plan"].format_help() == whole_plan.format_help()
    for part, whole_part in _sub(whole_plan).choices.items():
        lazy_part = _sub(_sub(cli._parser("plan", part)).choices["plan"]).choices[part]
        assert whole_part.description and lazy_part.format_help() == whole_part.format_help(), part


def _sub(parser):
    (action,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return action


@pytest.mark.parametrize("argv, command", [(["preflight", "--root", "x"], ["preflight"]),
                                           (["plan", "risk", "--gpus", "8"], ["plan", "risk"]),
                                           (["--version"], []), (["-h", "preflight"], []),
                                           (["breaker", "reset", "--state-dir", "d"], ["breaker", "reset"])])
def test_command_words(argv, command):
    assert cli._chosen(argv) == command


def test_bench_preflight_writes_the_rows_bench_run_reads(tmp_path):
    """bench/preflight.py --json: a row for --version and one per node, each with its verdict, beside a peer that
    reads the node's kernel log through `dmesg` (a stand-in for gcm's check here: what it reads, not its speed)."""
    peer = tmp_path / "health_checks"
    seen = tmp_path / "seen"
    peer.write_text(f"#!/bin/sh\ndmesg > {seen}\n")
    peer.chmod(0o755)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "preflight.py"), "--repeat", "1", "--scenario",
                           "gb200-nvl72-faulty", "--gcm", str(peer), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    version, node = data["rows"]
    assert version["measure"] == "gpuwarden --version, whole process" and version["ours"] > 0
    assert node["measure"] == "preflight on a recorded node (gb200-nvl72-faulty), whole process"
    assert node["detail"]["verdict"] == "fail" and node["detail"]["exit_codes"] == [1]
    assert node["target"] == "< 0.25 s" and isinstance(node["met"], bool) and node["unit"] == "s"
    assert node["peer"] > 0 and node["ratio"] == round(node["ours"] / node["peer"], 3)
    assert seen.read_bytes() == (NODES / "gb200-nvl72-faulty" / "kmsg").read_bytes()
    assert set(data["load"]) >= {"loadavg_before", "loadavg_after"}

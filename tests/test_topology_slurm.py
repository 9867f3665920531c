"""`gpuwarden topology` against a real Slurm cluster (tests/slurm_cluster.py: slurmctld and six slurmd on
127.0.0.1): the command publishes a few nodes' NVLink domains as node features through the Slurm adapter, then
writes topology.conf and topology.yaml from slurmctld's view of the fleet. Slurm itself reads them back: the
cluster's `scontrol show hostnames` expands each block's hostlist (22.05 has no block topology plugin to load the
files). A slurmctld restart forgets the features (docs/slurm.md): the files can no longer be made until the agents
publish again, and then they come out the same."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import NODES, ROOT
from gpuwarden.agent.node.topology import block_name
from slurm_cluster import slurm_cluster  # noqa: F401 - the module's cluster (a pytest fixture)

NVML_DOMAIN = "62c4efc6-d460-488d-b7d7-69de49edd641.32766"  # gb200-nvl72-healthy's NVML fabric clusterUuid.cliqueId
RACK = "rack08"  # a domain set in the config ([topology] domain), for a rack whose NVML gives none


@pytest.fixture(scope="module")
def setup(slurm_cluster, tmp_path_factory):  # noqa: F811
    """Two configs that reach the cluster through the Slurm adapter: one reads the domain from NVML (the recorded
    GB200 tray), one sets it. The recorded tray stands for every node's hardware; the node name is the Slurm one."""
    base = tmp_path_factory.mktemp("topology")
    root = base / "tray"
    shutil.copytree(NODES / "gb200-nvl72-healthy", root, ignore=shutil.ignore_patterns("tools"))
    adapter = f'[remediation]\nadapter = "slurm"\n[remediation.slurm]\nslurm_conf = "{slurm_cluster.conf}"\n'
    nvml, rack = base / "nvml.toml", base / "rack.toml"
    nvml.write_text(adapter)
    rack.write_text(adapter + f'[topology]\ndomain = "{RACK}"\n')
    return slurm_cluster, base, root, nvml, rack


def topology(config: Path, *args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "topology", "--config", str(config),
                           "--json", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {"stderr": proc.stderr}


def publish(setup) -> None:
    cluster, _, root, nvml, rack = setup
    for node, config in (("n1", nvml), ("n2", nvml), ("n3", nvml), ("n4", rack), ("n5", rack)):
        code, out = topology(config, "--publish", "--root", str(root), "--node-name", node)
        assert code == 0, out
        assert (out["node"], out["published"]) == (node, "slurm")


def features(cluster, node: str) -> str:
    out = cluster.scontrol("show", "node", node).stdout
    return next(w for w in out.split() if w.startswith("AvailableFeatures="))


def hostnames(cluster, hostlist: str) -> list[str]:
    return cluster.scontrol("show", "hostnames", hostlist).stdout.split()


def blocks_of(conf: str) -> dict[str, str]:
    """BlockName -> Nodes of each `BlockName=… Nodes=…` line."""
    out = {}
    for line in conf.splitlines():
        if line.startswith("BlockName="):
            name, nodes = line.split()
            out[name.removeprefix("BlockName=")] = nodes.removeprefix("Nodes=")
    return out


def test_slurm_topology_published_then_written_from_the_scheduler_view(setup):
    cluster, base, root, nvml, _ = setup
    publish(setup)
    assert f"gpuwarden_domain_{NVML_DOMAIN}" in features(cluster, "n1")
    assert f"gpuwarden_domain_{RACK}" in features(cluster, "n4") and "gb200" in features(cluster, "n4")
    assert "gpuwarden_domain" not in features(cluster, "n6")  # its agent has not published

    conf, yml = base / "topology.conf", base / "topology.yaml"
    code, out = topology(nvml, "--slurm-conf", str(conf), "--slurm-yaml", str(yml))  # the scheduler's view only
    assert code == 0, out
    nvl = block_name(NVML_DOMAIN)
    assert nvl.startswith("nvl") and block_name(RACK) == RACK
    text = conf.read_text()
    assert blocks_of(text) == {nvl: "n[1-3]", RACK: "n[4-5]"}
    assert f"# {nvl}: NVLink domain {NVML_DOMAIN}, 3 node(s)" in text
    assert "# left out, no NVLink domain published: n[6-8]" in text  # n6 unpublished, n7/n8 never answer
    assert text.rstrip().endswith("BlockSizes=2,4")  # the smallest block, doubled until one size spans both
    (topo,) = yaml.safe_load(yml.read_text())
    assert topo["topology"] == "nvlink" and topo["cluster_default"] is True
    assert topo["block"] == {"block_sizes": [2, 4], "blocks": [{"block": nvl, "nodes": "n[1-3]"},
                                                               {"block": RACK, "nodes": "n[4-5]"}]}
    assert [b["nodes"] for b in out["fleet"]["blocks"]] == ["n[1-3]", "n[4-5]"]

    # Slurm's own hostlist expansion gives back exactly the nodes that published each domain.
    assert hostnames(cluster, blocks_of(text)[nvl]) == ["n1", "n2", "n3"]
    assert hostnames(cluster, blocks_of(text)[RACK]) == ["n4", "n5"]
    for b in topo["block"]["blocks"]:
        assert hostnames(cluster, b["nodes"]) == hostnames(cluster, blocks_of(text)[b["block"]])


def test_slurm_topology_holds_across_a_slurmctld_restart(setup):
    """slurmctld forgets features set by scontrol when it restarts; the adapter's copy of the domain in the node's
    Extra= survives, so the file is the same at once, and the features come back at the next publish."""
    cluster, base, root, nvml, _ = setup
    publish(setup)
    conf = base / "restart.conf"
    code, out = topology(nvml, "--slurm-conf", str(conf))
    assert code == 0, out
    before = conf.read_text()

    cluster.restart_ctld()  # as its service does: saved state kept, scontrol-set features forgotten
    assert "gpuwarden_domain" not in features(cluster, "n1") + features(cluster, "n4")
    code, out = topology(nvml, "--slurm-conf", str(conf))
    assert code == 0, out
    assert conf.read_text() == before  # the domains read back from Extra=: the same blocks

    publish(setup)  # the agents re-assert their domains (every publish_every_s, or `gpuwarden topology --publish`)
    assert "gpuwarden_domain" in features(cluster, "n1") and "gpuwarden_domain" in features(cluster, "n4")
    code, out = topology(nvml, "--slurm-conf", str(conf))
    assert code == 0, out
    assert conf.read_text() == before  # the same fleet: byte for byte the same file

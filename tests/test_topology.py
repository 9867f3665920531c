"""gpuwarden topology: this node's NVLink domain read from recorded nodes, the fleet's domains as Slurm
topology.conf / topology.yaml (checked with Slurm's own hostlist expansion, `scontrol show hostnames`, and against
real block files), Kubernetes labels, and the command."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import NODES, ROOT, edit_nvml
from gpuwarden.agent.cli import topology as topology_cli
from gpuwarden.agent.cli.flags import options
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.logs import capture as capture_logs
from gpuwarden.agent.core.scheduler import NodeView, Refused, Service, Transient
from gpuwarden.agent.node import topology, topology_command, topology_slurm
from gpuwarden.agent.node.host import Node, NodeInfo

SLURM_DATA = ROOT / "fixtures" / "slurm"
GB200 = NODES / "gb200-nvl72-healthy"
H100 = NODES / "h100-hgx-healthy"
GB200_DOMAIN = "62c4efc6-d460-488d-b7d7-69de49edd641.32766"


# -- this node ---------------------------------------------------------------------------------------------------
def test_gb200_domain_is_its_nvml_cluster_uuid_and_clique():
    node = Node.recorded_at(GB200)
    reading = topology.read_domain(node, {})
    assert (reading.domain, reading.source, reading.fault) == (GB200_DOMAIN, "nvml", False)
    assert reading.domain == NodeInfo.from_toml(GB200 / "node.toml").nvlink_domain  # what was recorded on the rack
    assert topology.node_domain(node, {}) == GB200_DOMAIN


def test_h100_hgx_has_no_domain_and_the_reason_is_logged():
    node = Node.recorded_at(H100)
    with capture_logs() as logs:
        assert topology.node_domain(node, {}) is None
    (entry,) = [e for e in logs if e["event"] == "no NVLink domain"]
    assert entry["level"] == "info"  # expected on HGX: not a fault
    assert "not supported" in entry["reason"] and entry["node"] == node.hostname


def test_a_lost_gpu_means_no_domain_as_a_warning():
    node = Node.recorded_at(NODES / "gb200-nvl72-faulty")  # GPU 2 fell off the bus
    with capture_logs() as logs:
        assert topology.node_domain(node, {}) is None
    (entry,) = [e for e in logs if e["event"] == "no NVLink domain"]
    assert entry["level"] == "warning"
    assert "GPU 2" in entry["reason"] and "GPU_IS_LOST" in entry["reason"]


def test_config_domain_wins_over_nvml_and_gives_hgx_one():
    cfg = {"topology": {"domain": "rack07"}}
    for root in (GB200, H100):
        reading = topology.read_domain(Node.recorded_at(root), cfg)
        assert (reading.domain, reading.source) == ("rack07", "config")
    # an empty setting is no setting
    assert topology.read_domain(Node.recorded_at(GB200), {"topology": {"domain": ""}}).domain == GB200_DOMAIN


class _Cfg:  # a loaded Config carries its tables as attributes
    topology = {"domain": "rack-09"}


def test_config_domain_read_from_a_config_object():
    assert topology.node_domain(Node.recorded_at(H100), _Cfg()) == "rack-09"


@pytest.mark.parametrize("bad", ["rack 07", "rack07\nBlockName=x Nodes=y", "r#1", "x" * 64, "-rack", "rack.",
                                 "räck", "a=b", 7])
def test_hostile_config_domain_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"\[topology\] domain"):
        topology.read_domain(Node.recorded_at(H100), {"topology": {"domain": bad}})


def _edit_gpu(root: Path, index: int, **fabric) -> None:
    edit_nvml(root, lambda data: data["gpus"][index]["fabric"].update(fabric))


def test_gpus_in_two_cliques_give_no_domain(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    _edit_gpu(root, 3, clique_id=7)
    reading = topology.read_domain(Node.recorded_at(root), {})
    assert reading.domain is None and reading.fault
    assert f"{GB200_DOMAIN} (GPU 0,1,2)" in reading.reason
    assert "62c4efc6-d460-488d-b7d7-69de49edd641.7 (GPU 3)" in reading.reason


@pytest.mark.parametrize("fabric, words", [
    ({"state": 2}, "GPU 1: fabric registration in progress"),
    ({"state": 1}, "GPU 1: fabric registration not started"),
    ({"status": 3}, "GPU 1: fabric registration completed with NVML error 3"),
    ({"cluster_uuid": topology.ZERO_UUID}, "zero cluster UUID (GPU 1)"),
])
def test_one_gpu_not_registered_in_the_domain_gives_no_domain(scenario_copy, fabric, words):
    root = scenario_copy("gb200-nvl72-healthy")
    _edit_gpu(root, 1, **fabric)
    reading = topology.read_domain(Node.recorded_at(root), {})
    assert reading.domain is None and reading.fault
    assert words in reading.reason


def test_zero_cluster_uuid_on_every_gpu_is_no_multi_node_domain(scenario_copy):
    root = scenario_copy("gb200-nvl72-healthy")
    for i in range(4):
        _edit_gpu(root, i, cluster_uuid=topology.ZERO_UUID)
    reading = topology.read_domain(Node.recorded_at(root), {})
    assert reading.domain is None and not reading.fault
    assert "zero cluster UUID" in reading.reason


# -- names ---------------------------------------------------------------------------------------------------------
def test_block_names():
    assert topology.block_name(GB200_DOMAIN) == "nvlf1e65d7add2b"  # stable: files and labels keep it across runs
    assert topology.block_name("rack07") == "rack07"
    assert topology.block_name("rack_07-a") == "rack_07-a"
    for hashed in ("rack.07", "7rack", "r" * 33):
        name = topology.block_name(hashed)
        assert re.fullmatch(r"nvl[0-9a-f]{12}", name)
    with pytest.raises(ValueError):
        topology.block_name("rack 07")


K8S_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
K8S_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def test_kubernetes_labels():
    labels = topology.kubernetes_labels(GB200_DOMAIN)
    assert labels == {"nvidia.com/gpu.clique": GB200_DOMAIN, "gpuwarden.io/nvlink-domain": GB200_DOMAIN,
                      "gpuwarden.io/nvlink-block": "nvlf1e65d7add2b"}
    # a domain from config is not written into the GPU operator's label (GFD owns it and would set it back)
    assert topology.kubernetes_labels("rack07") == {"gpuwarden.io/nvlink-domain": "rack07",
                                                    "gpuwarden.io/nvlink-block": "rack07"}
    for domain in (GB200_DOMAIN, "rack07", "a", "x" * 63, "rack.07_b-1"):
        for key, value in topology.kubernetes_labels(domain).items():
            assert K8S_KEY.fullmatch(key) and len(key.split("/")[-1]) <= 63
            assert K8S_VALUE.fullmatch(value) and len(value) <= 63
    with pytest.raises(ValueError):
        topology.kubernetes_labels("x" * 64)


# -- hostlists -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("names, expected", [
    ([f"node{i:02d}" for i in range(1, 19)], "node[01-18]"),
    (["node05"], "node05"),
    (["n1", "n2", "n3", "n5", "n9", "n10", "n11"], "n[1-3,5,9,10-11]"),
    (["n098", "n099", "n100"], "n[098-100]"),
    (["n9", "n09"], "n[9,09]"),
    (["gpu-a", "gpu-b", "x1.lab", "x2.lab"], "gpu-a,gpu-b,x1.lab,x2.lab"),
    (["a1", "b1", "a2", "a1"], "a[1-2],b1"),
    (["12", "13"], "12,13"),
    (["n" + "9" * 19], "n" + "9" * 19),
])
def test_hostlist(names, expected):
    assert topology_slurm.hostlist(names) == expected


def test_hostlist_of_a_huge_range_is_split_below_slurms_cap_on_ranges(scontrol):
    names = [f"n{i:05d}" for i in range(65536)]
    random.Random(1).shuffle(names)
    expr = topology_slurm.hostlist(names)
    assert expr == "n[00000-16383,16384-32767,32768-49151,49152-65535]"
    assert scontrol(expr) == sorted(names)


@pytest.fixture
def scontrol(tmp_path_factory):
    """Slurm's own hostlist expansion (`scontrol show hostnames`), which needs only a slurm.conf to read."""
    exe = shutil.which("scontrol")
    assert exe, "scontrol (Debian slurm-client) is needed: .ci/run installs it"
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=topo\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def hostnames(expr: str) -> list[str]:
        done = subprocess.run([exe, "show", "hostnames", expr], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    return hostnames


def test_hostlist_slurm_scontrol_expands_it_to_the_same_nodes(scontrol):
    rng = random.Random(9)
    prefixes = ["gb200-r07-t", "node", "n", "gpu-", "x.y", "a_b"]
    for _ in range(25):
        names = set()
        for _ in range(rng.randint(1, 60)):
            width = rng.choice([0, 1, 2, 3, 4])
            number = rng.randint(0, 10 ** max(width, 1) + 20)
            names.add(f"{rng.choice(prefixes)}{number:0{width}d}" if width else f"{rng.choice(prefixes)}{number}")
            if rng.random() < 0.1:
                names.add(rng.choice(prefixes) + "z")
        assert sorted(scontrol(topology_slurm.hostlist(names))) == sorted(names)


# -- block files ---------------------------------------------------------------------------------------------------
def slurm_blocks(text: str, scontrol) -> tuple[dict[str, list[str]], list[int]]:
    """Reads a topology/block topology.conf as slurmctld does (src/plugins/topology/block/block_record.c):
    keys case-insensitive, '#' to the end of a line a comment; then makes its checks: unique block names, every
    block with nodes and at least the base size, sizes the base times powers of two up to 2^15, block names that
    Slurm's hostlist parser takes (it joins them when it builds the higher-level blocks)."""
    blocks: dict[str, list[str]] = {}
    sizes: list[int] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pairs = [token.split("=", 1) for token in line.split()]
        assert all(len(p) == 2 and p[1] for p in pairs), line
        keys = {k.lower(): v for k, v in pairs}
        if "blocksizes" in keys:
            assert len(pairs) == 1, line
            sizes = [int(s) for s in keys["blocksizes"].split(",")]
        else:
            assert set(keys) == {"blockname", "nodes"}, line
            assert keys["blockname"] not in blocks, f"block {keys['blockname']} defined twice"
            blocks[keys["blockname"]] = scontrol(keys["nodes"])
    assert blocks
    base = sizes[0] if sizes else len(next(iter(blocks.values())))
    for size in sizes[1:]:
        ratio = size // base
        assert size % base == 0 and ratio & (ratio - 1) == 0 and ratio <= 1 << 15, sizes
    for name, nodes in blocks.items():
        assert len(nodes) >= base, f"{name}: {len(nodes)} nodes, base {base}: slurmctld stops (fatal)"
    assert scontrol(",".join(blocks)) == list(blocks)
    return blocks, sizes


def rack(rack_no: int, domain: str | None, trays=range(1, 19), **kw) -> list[NodeView]:
    return [NodeView(f"gb200-r{rack_no:02d}-t{t:02d}", Service.IN_SERVICE, domain=domain, **kw) for t in trays]


def domain(rack_no: int) -> str:
    return f"62c4efc6-d460-488d-b7d7-69de49edd6{rack_no:02d}.32766"


def test_real_block_files_pass_the_slurm_checks(scontrol):
    """The checker above accepts real files: the topology.conf(5) example and one NVIDIA topograph generated."""
    man, sizes = slurm_blocks((SLURM_DATA / "slurm-man5-topology.conf__topology-block-example.conf").read_text(),
                              scontrol)
    assert sizes == [30, 120] and len(man) == 4 and man["block4"][-1] == "node128"
    topo, sizes = slurm_blocks((SLURM_DATA / "topograph__generated-topology.conf__block__12-NVL-domains.conf")
                               .read_text(), scontrol)
    assert sizes == [8, 16, 32] and len(topo) == 12


def test_topology_conf_for_four_racks_slurm_block_rules(scontrol):
    fleet = [*rack(3, domain(3)), *rack(1, domain(1)), *rack(2, "rack02"), *rack(4, domain(4), trays=range(1, 17)),
             NodeView("gb200-r05-t01", Service.IN_SERVICE),  # its agent has not published yet
             NodeView("gb200-r05-t02", Service.DRAINED, domain="rack05\nBlockName=evil Nodes=x"),
             NodeView("evil node#", Service.IN_SERVICE, domain="rack05")]
    text = topology_slurm.topology_conf(fleet, None)
    first, second = topology.block_name(domain(1)), topology.block_name(domain(3))
    fourth = topology.block_name(domain(4))
    assert text == f"""\
# Slurm topology.conf for TopologyPlugin=topology/block (Slurm >= 23.11).
# One block per NVLink domain, from the domains the agents published to the scheduler; nodes
# without one are left out (listed below). Block name: the domain when it is a short name, else
# nvl + 12 hex digits of the domain's SHA-256. Written by `gpuwarden topology`.
# {first}: NVLink domain {domain(1)}, 18 node(s)
BlockName={first} Nodes=gb200-r01-t[01-18]
# rack02: NVLink domain rack02, 18 node(s)
BlockName=rack02 Nodes=gb200-r02-t[01-18]
# {second}: NVLink domain {domain(3)}, 18 node(s)
BlockName={second} Nodes=gb200-r03-t[01-18]
# {fourth}: NVLink domain {domain(4)}, 16 node(s)
BlockName={fourth} Nodes=gb200-r04-t[01-16]
# left out, no NVLink domain published: gb200-r05-t01
# left out, the published NVLink domain is not valid: gb200-r05-t02
# left out: 1 node(s) whose names a Slurm file cannot carry
BlockSizes=16,32,64
"""
    blocks, sizes = slurm_blocks(text, scontrol)
    assert sizes == [16, 32, 64]  # the smallest block is the base; 4 blocks = base x 4
    assert sum(len(n) for n in blocks.values()) == 70
    assert "evil" not in text


def test_topology_conf_gives_topographs_block_lines_for_its_domains():
    """The same fleet as NVIDIA topograph's generated file (12 NVLink domains of 8 nodes; topograph names each
    block after the rack): our block and size lines are the same, in the same order."""
    real = (SLURM_DATA / "topograph__generated-topology.conf__block__12-NVL-domains.conf").read_text()
    fleet = []
    for line in real.splitlines():
        if line.startswith("BlockName="):
            name, nodes = line.split()
            rack_name = name.split("=")[1]  # srv[1101-1108]
            first = int(nodes.split("[")[1].split("-")[0])
            fleet += [NodeView(f"srv{n}", Service.IN_SERVICE, domain=rack_name) for n in range(first, first + 8)]
    random.Random(3).shuffle(fleet)
    ours = topology_slurm.topology_conf(fleet, [8, 16, 32])
    code = [line for line in ours.splitlines() if not line.startswith("#")]
    assert code == [line for line in real.splitlines() if not line.startswith("#")]


def test_blocks_smaller_than_the_base_size_are_left_out_with_a_comment(scontrol):
    fleet = [*rack(1, "rack01"), *rack(2, "rack02", trays=range(1, 13))]
    text = topology_slurm.topology_conf(fleet, [16, 32])
    assert "# left out, block rack02 (NVLink domain rack02): 12 node(s), fewer than the base block size 16: " \
           "gb200-r02-t[01-12]" in text
    blocks, sizes = slurm_blocks(text, scontrol)
    assert list(blocks) == ["rack01"] and sizes == [16, 32]
    with pytest.raises(ValueError, match="nothing to write"):
        topology_slurm.topology_conf(fleet, [20])
    with pytest.raises(ValueError, match="nothing to write"):
        topology_slurm.topology_conf([NodeView("n1", Service.IN_SERVICE)], None)


@pytest.mark.parametrize("sizes", [[], [0], [18, 30], [18, 18], [18, 36, 36], [4, 4 << 16], [True], [1] * 17,
                                   [70000]])
def test_block_sizes_slurmctld_would_refuse_are_refused(sizes):
    with pytest.raises(ValueError, match="block sizes"):
        topology_slurm.check_block_sizes(sizes)


def test_block_sizes_parsing():
    assert topology_slurm.parse_block_sizes("30,120") == (30, 120)  # the man page's example
    assert topology_slurm.parse_block_sizes("18") == (18,)
    for bad in ("18;36", "1e3", "-18", "18,", " ", "9" * 300):
        with pytest.raises(ValueError):
            topology_slurm.parse_block_sizes(bad)


def test_a_node_listed_twice_with_two_domains_is_left_out(scontrol):
    fleet = [*rack(1, "rack01"), NodeView("gb200-r01-t05", Service.IN_SERVICE, domain="rack02")]
    text = topology_slurm.topology_conf(fleet, None)
    assert "# left out, listed twice with different NVLink domains: gb200-r01-t05" in text
    blocks, _ = slurm_blocks(text, scontrol)
    assert "gb200-r01-t05" not in blocks["rack01"] and len(blocks["rack01"]) == 17


def test_two_domains_with_one_block_name_are_refused():
    clash = topology.block_name(domain(1))  # a configured domain spelled like another's hashed name
    fleet = [*rack(1, domain(1)), *rack(2, clash)]
    with pytest.raises(ValueError, match="both map to block name"):
        topology_slurm.topology_conf(fleet, None)


def test_hostile_fleet_never_reaches_the_file(scontrol):
    hostile_names = ["n[1-3]", "a,b", "x y", "n#1", "n=1", "", "x" * 65, "t\n1", None, 5, "ünï"]
    hostile_domains = ["d\nBlockSizes=1", "d#", "a b", "x" * 64, "-d", 3.5, b"bytes"]
    fleet = [*rack(1, "rack01")]
    fleet += [NodeView(n, Service.IN_SERVICE, domain="rack01") for n in hostile_names]  # type: ignore[arg-type]
    fleet += [NodeView(f"h{i}", Service.IN_SERVICE, domain=d) for i, d in enumerate(hostile_domains)]  # type: ignore
    text = topology_slurm.topology_conf(fleet, None)
    blocks, sizes = slurm_blocks(text, scontrol)
    assert blocks == {"rack01": [f"gb200-r01-t{t:02d}" for t in range(1, 19)]} and sizes == [18]
    assert f"# left out, the published NVLink domain is not valid: h[0-{len(hostile_domains) - 1}]" in text
    assert f"# left out: {len(hostile_names)} node(s) whose names a Slurm file cannot carry" in text
    assert all(c == "\n" or " " <= c <= "~" for c in text)
    with pytest.raises(ValueError, match="at most"):
        topology_slurm.topology_conf([NodeView(f"n{i}", Service.IN_SERVICE)
                                      for i in range(topology_slurm.MAX_FLEET + 1)], None)


def test_topology_yaml_for_slurm_25_05():
    fleet = [*rack(2, "rack02"), *rack(1, domain(1)), NodeView("gb200-r09-t01", Service.IN_SERVICE)]
    text = topology_slurm.topology_yaml(fleet, [18, 36])
    doc = yaml.safe_load(text)
    assert doc == [{"topology": "nvlink", "cluster_default": True,
                    "block": {"block_sizes": [18, 36],
                              "blocks": [{"block": topology.block_name(domain(1)), "nodes": "gb200-r01-t[01-18]"},
                                         {"block": "rack02", "nodes": "gb200-r02-t[01-18]"}]}}]
    assert list(doc[0])[0] == "topology"  # slurmctld wants it first
    assert "# left out, no NVLink domain published: gb200-r09-t01" in text
    # the same shape as the block topology of the topology.yaml(5) example
    example = yaml.safe_load((SLURM_DATA / "slurm-man5-topology.yaml__EXAMPLE-tree-block-flat-ring-torus3d.yaml")
                             .read_text())
    (block_topo,) = [t for t in example if "block" in t]
    assert set(block_topo) == set(doc[0]) and set(block_topo["block"]) == set(doc[0]["block"])
    assert set(block_topo["block"]["blocks"][0]) == set(doc[0]["block"]["blocks"][0])


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "topology.conf"
    path.write_text("old\n")
    topology_slurm.write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["topology.conf"]
    assert path.stat().st_mode & 0o777 == 0o644
    folder = tmp_path / "is-a-folder"
    folder.mkdir()
    with pytest.raises(OSError):
        topology_slurm.write_atomic(folder, "x\n")
    assert sorted(os.listdir(tmp_path)) == ["is-a-folder", "topology.conf"] and folder.is_dir()


# -- the command ---------------------------------------------------------------------------------------------------
class Scheduler:
    """The scheduler side of the adapter protocol that `gpuwarden topology` uses (nodes, node, publish_domain),
    holding its nodes in memory: what a Slurm or Kubernetes adapter returns from its scheduler."""
    name = "test-scheduler"
    timeout_s = 5.0

    def __init__(self, views, fail=None):
        self.views = {v.name: v for v in views}
        self.fail = fail
        self.calls: list[tuple] = []

    def nodes(self):
        self.calls.append(("nodes",))
        if self.fail:
            raise self.fail
        return list(self.views.values())

    def node(self, node):
        if node not in self.views:
            raise Refused(f"unknown node {node}")
        return self.views[node]

    def publish_domain(self, node, domain):
        self.calls.append(("publish_domain", node, domain))
        self.views[node] = dataclasses.replace(self.node(node), domain=domain)


def args(*argv: str) -> topology_command.Options:
    parser = argparse.ArgumentParser()
    topology_cli.add_arguments(parser)
    return options(parser.parse_args(list(argv)), topology_command.Options)


def test_command_prints_this_nodes_domain(capsys):
    assert topology_command.run(args("--root", str(GB200)), {}, None) == 0
    assert capsys.readouterr().out == (f"gb200-rack07-tray03: NVLink domain {GB200_DOMAIN} (from nvml; Slurm block "
                                       "nvlf1e65d7add2b)\n")
    assert topology_command.run(args("--root", str(GB200), "--json"), {}, None) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["domain"] == GB200_DOMAIN and out["labels"]["nvidia.com/gpu.clique"] == GB200_DOMAIN


def test_command_exits_1_when_the_node_has_no_domain(capsys):
    sched = Scheduler(rack(1, None))
    assert topology_command.run(args("--root", str(H100), "--publish", "--node-name", "gb200-r01-t01"), {}, sched) == 1
    assert "no NVLink domain: no GPU takes part in an NVLink fabric" in capsys.readouterr().out
    assert sched.calls == []  # nothing published


def test_command_publishes_then_writes_both_files_from_the_fleet(tmp_path, capsys, scontrol):
    """Tray 18 of rack 7 publishes the domain read from its GPUs; then both files hold the whole rack."""
    sched = Scheduler([*rack(7, GB200_DOMAIN, trays=range(1, 18)), *rack(7, None, trays=[18]), *rack(8, "rack08")])
    conf, yml = tmp_path / "topology.conf", tmp_path / "topology.yaml"
    with capture_logs() as logs:
        code = topology_command.run(args("--root", str(GB200), "--node-name", "gb200-r07-t18", "--publish",
                                         "--slurm-conf", str(conf), "--slurm-yaml", str(yml), "--block-sizes", "18,36"),
                                    {}, sched)
    assert code == 0
    assert [e["event"] for e in logs] == ["published NVLink domain", "wrote Slurm topology"]
    assert sched.calls == [("publish_domain", "gb200-r07-t18", GB200_DOMAIN), ("nodes",)]
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == ["published to test-scheduler",
                                    f"wrote {conf}: 2 block(s), 36 node(s), BlockSizes=18,36",
                                    f"wrote {yml}: 2 block(s), 36 node(s), BlockSizes=18,36"]
    blocks, sizes = slurm_blocks(conf.read_text(), scontrol)
    assert blocks == {"nvlf1e65d7add2b": [f"gb200-r07-t{t:02d}" for t in range(1, 19)],
                      "rack08": [f"gb200-r08-t{t:02d}" for t in range(1, 19)]} and sizes == [18, 36]
    doc = yaml.safe_load(yml.read_text())
    assert [(b["block"], b["nodes"]) for b in doc[0]["block"]["blocks"]] == [
        ("nvlf1e65d7add2b", "gb200-r07-t[01-18]"), ("rack08", "gb200-r08-t[01-18]")]
    assert sorted(os.listdir(tmp_path)) == ["topology.conf", "topology.yaml"]


def test_command_exits_2_when_the_scheduler_refuses_to_publish(capsys):
    sched = Scheduler(rack(1, None))
    assert topology_command.run(args("--root", str(GB200), "--publish"), {}, sched) == 2  # gb200-rack07-tray03: unknown
    assert "Refused: unknown node gb200-rack07-tray03" in capsys.readouterr().err
    assert all(v.domain is None for v in sched.views.values())


def test_command_keeps_the_old_file_when_the_scheduler_fails(tmp_path, capsys):
    conf = tmp_path / "topology.conf"
    conf.write_text("BlockName=old Nodes=n1\n")
    sched = Scheduler([], fail=Transient("slurmctld: connection refused"))
    assert topology_command.run(args("--slurm-conf", str(conf)), {}, sched) == 2
    assert "Transient: slurmctld: connection refused" in capsys.readouterr().err
    assert conf.read_text() == "BlockName=old Nodes=n1\n" and os.listdir(tmp_path) == ["topology.conf"]


@pytest.mark.parametrize("argv, words", [
    (["--slurm-conf", "x.conf", "--block-sizes", "18,30"], "not the base 18 times a power of two"),
    (["--publish"], "no scheduler adapter"),
    (["--root", str(GB200), "--node-name", "bad name"], "not a valid node name"),
])
def test_command_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv, words):
    sched = None if "--publish" in argv else Scheduler(rack(1, "rack01"))
    monkeypatch.chdir(tmp_path)
    assert topology_command.run(args(*argv), {}, sched) == 2
    assert words in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_command_with_a_hostile_config_domain_exits_2(capsys):
    assert topology_command.run(args("--root", str(GB200)), {"topology": {"domain": "a\nb"}}, None) == 2
    assert "[topology] domain" in capsys.readouterr().err


def test_cli_topology_end_to_end(capsys):
    from gpuwarden.agent.cli.main import main

    assert main(["topology", "--root", str(GB200), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["domain"] == GB200_DOMAIN
    assert main(["topology", "--root", str(H100)]) == 1
    assert "no NVLink domain" in capsys.readouterr().out

"""RDMA loopback bandwidth of each active HCA port: an ib_write_bw server and client on the same port (perftest),
the BW average against the port's rate from sysfs; optionally from GPU memory (GPUDirect RDMA, --use_cuda).
Same-port loopback exercises the HCA, its PCIe link and the GPUDirect path; cable and switch are ib_port's."""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from gpuwarden.agent.core.check import Analyzer, CheckSpec, Concern
from gpuwarden.agent.core.errors import ConfigError, NotApplicable, ParseError, SourceError, ToolError, ToolMissing
from gpuwarden.agent.core.model import Action, Entity, Finding, Status
from gpuwarden.agent.sources.perftest import loopback_pair
from gpuwarden.checks.ib_port import read_ports
from gpuwarden.checks.parse_perftest import PerftestRun, last_error_line, parse_perftest
from gpuwarden.checks.pcie_tree import pci_path

CHECK_NAME = "rdma_loopback"
_SETUP_S = 30  # per port on top of duration_s: server start, device open, connection exchange, teardown
# Failures that say the test could not run here, not that the port is bad (-> UNKNOWN, no action): our argv or a
# perftest built without CUDA; the TCP side channel between server and client; userspace not seeing the HCA
# (a container without /dev/infiniband, a missing rdma-core provider); memory registration refused (memlock
# limit, nvidia-peermem / dma-buf missing for --use_cuda); CUDA not usable.
_ENVIRONMENT = re.compile(
    r"unrecognized option|Invalid Command|"
    r"Couldn't connect to|Unable to open file descriptor for socket|Couldn't listen to port|Failed to bind socket|"
    r"Did not detect devices|Unable to find the Infiniband/RoCE device|IB device \S+ not found|"
    r"Couldn't allocate MR|Couldn't allocate PD|Cannot allocate memory|Permission denied|Operation not permitted|"
    r"CUDA|cuInit|command not found|No such file or directory|Exec format error")
# perftest's banner, its server's waiting line, or one of its own failure messages. The banner's indent is [ \t], not
# \s: \s also takes newlines, and from every line start of a long run of blank lines it was quadratic.
_DETECT = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z_ ]* (?:BW|Latency) Test[ \t]*$|Waiting for client to connect|"
                     r"Unable to find the Infiniband/RoCE device|run_iter_bw|socket connection|"
                     r"between server and client", re.MULTILINE)


def _finding(entity: Entity, code: str, status: Status, msg: str, action: Action = Action.NONE,
             **evidence: Any) -> Finding:
    return Finding(CHECK_NAME, code, entity, status, f"{entity.label()}: {msg}", action, evidence)


def decide(entity: Entity, run: PerftestRun | None, output: str, returncode: int, rate_gbps: float | None,
           policy: Mapping[str, Any], server_output: str | None = None) -> list[Finding]:
    """Judge one loopback client run. `run` is None when its output could not be parsed."""
    failed = returncode != 0 or (run is not None and bool(run.errors) and not run.bw_rows)
    if failed:
        line = last_error_line(output) or f"exit status {returncode}"
        server = last_error_line(server_output) if server_output else None
        evidence = {"returncode": returncode, "error": line, "server_error": server}
        said = "\n".join(run.errors) if run is not None and run.errors else output
        if _ENVIRONMENT.search(said):
            return [_finding(entity, "rdma-loopback-not-run", Status.UNKNOWN,
                             f"ib_write_bw could not run the loopback here: {line}"
                             + (f" (server: {server})" if server else ""), **evidence)]
        return [_finding(entity, "rdma-loopback-failed", Status.FAIL,
                         f"ib_write_bw loopback failed: {line}" + (f" (server: {server})" if server else "")
                         + "; drain and check the HCA, its firmware and its PCIe link", Action.DRAIN, **evidence)]
    if run is None or not run.bw_rows:
        what = f"{run.test} test" if run is not None and run.test else "output"
        return [_finding(entity, "rdma-loopback-no-result", Status.UNKNOWN,
                         f"no bandwidth result in the ib_write_bw {what}")]
    measured = run.best_bw_gbps or 0.0
    evidence = {"measured_gbps": round(measured, 2), "rate_gbps": rate_gbps, "min_fraction": policy["min_fraction"],
                "bidirectional": run.bidirectional, "link_type": run.link_type, "cuda": run.cuda}
    if rate_gbps is None:
        return [_finding(entity, "rdma-loopback-rate-unknown", Status.UNKNOWN,
                         f"loopback wrote {measured:.1f} Gb/s but the port's rate is unknown, so it is not judged",
                         **evidence)]
    expected = rate_gbps * (2 if run.bidirectional else 1)  # -b sums both directions
    if measured < policy["min_fraction"] * expected:
        return [_finding(entity, "rdma-loopback-bw-low", Status.FAIL,
                         f"loopback bandwidth {measured:.1f} Gb/s is {measured / expected:.0%} of the "
                         f"{expected:g} Gb/s the port runs at (< {policy['min_fraction']:.0%}): drain and check the "
                         "HCA, its PCIe link and firmware", Action.DRAIN,
                         **evidence, expected_gbps=expected, fraction=round(measured / expected, 3))]
    return []


def client_args(hca: str, port: str, link_layer: str, cuda_gpu: int | None, cfg: Mapping[str, Any]) -> list[str]:
    """ib_write_bw options for one port (server and client alike; loopback_pair adds -p and the host)."""
    args = ["-d", hca, "-i", port, "--report_gbits", "-F", "-s", str(cfg["message_size"]),
            "-D", str(cfg["duration_s"])]  # perftest: "Duration mode currently doesn't support running on all sizes"
    if link_layer == "Ethernet" and cfg["roce_gid_index"] >= 0:
        args += ["-x", str(cfg["roce_gid_index"])]
    if cuda_gpu is not None:
        args.append(f"--use_cuda={cuda_gpu}")
    return args


def nearest_gpu_index(node: Any, hca_pci: str | None) -> int:
    """The GPU that shares the longest PCI path with the HCA (same switch beats same root complex), else 0."""
    try:
        gpus = [g for g in node.gpus() if g.pci]
    except SourceError:  # NVML unusable: perftest's own default GPU
        return 0
    if hca_pci is None:
        return 0
    hca = [name for name, _ in pci_path(node.sysfs, hca_pci)][:-1]
    best, index = 0, 0
    for gpu in gpus:
        above = [name for name, _ in pci_path(node.sysfs, gpu.pci)][:-1]
        shared = next((i for i, (a, b) in enumerate(zip(hca, above, strict=False)) if a != b),
                      min(len(hca), len(above)))
        if shared > best:
            best, index = shared, gpu.index
    return index


def run(node: Any, cfg: Mapping[str, Any]) -> Iterable[Finding]:
    if not 0 < cfg["min_fraction"] <= 1:
        raise ConfigError(f"checks.{CHECK_NAME}.min_fraction: {cfg['min_fraction']} is not in (0, 1]")
    ports, unreadable = read_ports(node.sysfs)
    yield from (Finding(CHECK_NAME, f.code, f.entity, f.status, f.message) for f in unreadable)
    ignored = set(cfg["ignore_ports"])
    active = [p for p in ports if p.state == "ACTIVE" and p.port not in ignored]
    if not active and not unreadable:
        raise NotApplicable("no active RDMA port" + (" (the others are ib_port's to judge)" if ports else ""))
    timeout = cfg["tool_timeout_s"] or cfg["duration_s"] + _SETUP_S
    for port in active:
        hca, num = port.port.split("/", 1)
        entity = Entity("ib_port", port.port, pci=port.pci)
        gpu = nearest_gpu_index(node, port.pci) if cfg["use_cuda"] else None
        args = client_args(hca, num, port.link_layer, gpu, cfg)
        try:
            out = loopback_pair(node.tools, hca, num, args, timeout)
        except ToolMissing:
            raise
        except ToolError as err:
            yield _finding(entity, "rdma-loopback-not-run", Status.UNKNOWN, f"no loopback result: {err}")
            continue
        try:
            parsed: PerftestRun | None = parse_perftest(out.client.output, f"{port.port} ib_write_bw client")
        except ParseError:
            parsed = None
        yield from decide(entity, parsed, out.client.output, out.client.returncode, port.rate_gbps, cfg,
                          out.server.output if out.server else None)


def analyze(text: str, source: str) -> tuple[list[Finding], list[ParseError]]:
    """A saved perftest output, judged by the same decision. The port's rate is not in perftest's output, so a
    completed run is reported with its figure as UNKNOWN (not judged); failures read as they do live."""
    parsed = parse_perftest(text, source)
    entity = Entity("ib_port", parsed.device or "unknown")
    return decide(entity, parsed, text, 0, None, CHECK.defaults), []


CHECK = CheckSpec(
    name=CHECK_NAME,
    summary="RDMA loopback bandwidth per active HCA port (perftest ib_write_bw) against the port rate",
    run=run,
    defaults={
        "min_fraction": 0.9,  # of the port's sysfs rate
        "use_cuda": False,  # GPUDirect RDMA: --use_cuda=<the GPU nearest the HCA, else 0>
        "duration_s": 5,
        "message_size": 1048576,  # bytes; the bandwidth plateau of ib_write_bw -a sweeps starts well below 1 MiB
        "roce_gid_index": -1,  # -x for RoCE ports; -1 = perftest's default
        "tool_timeout_s": 0.0,  # per port; 0 = duration_s + 30
    },
    shared_keys={"ignore_ports": "ib_port"},  # a port meant to be down is neither judged nor tested
    timeout_s=600,
    level="full",
    resources=("network",),
    analyzers=(Analyzer("perftest", lambda text: _DETECT.search(text) is not None, analyze),),
)

# The concern as a whole, read from this statement without importing the module (gpuwarden.checks).
CONCERN = Concern(
    name="rdma_loopback", order=130, level="full", look="CHECK", analyze=("perftest",),
)

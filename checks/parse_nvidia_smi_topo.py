"""Parser of `nvidia-smi topo -m`: the GPU/NIC connection matrix, CPU and NUMA affinity, and the NIC legend.

Entries (nvidia-smi's legend): X self, NV# a bonded set of # NVLinks, PIX at most one PCIe bridge, PXB several
PCIe bridges without the host bridge, PHB through a PCIe host bridge, NODE between host bridges of one NUMA node,
SYS across the SMP interconnect between NUMA nodes (older drivers print SOC for it). NIC columns are "NIC0".. with
a "NIC Legend" naming the device (newer drivers), or the device name itself ("mlx5_0", older drivers).
"""
from __future__ import annotations

import re
from dataclasses import field

from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.records import dataclass
from gpuwarden.checks.parse_limits import check_size, text_lines

# Closeness of a PCIe path, best first (NCCL's PATH_PIX < PATH_PXB < PATH_PHB < PATH_NODE(SYS) order).
PCIE_DISTANCE = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}
DISTANCE_NAMES = ("PIX", "PXB", "PHB", "NODE", "SYS")  # by PCIE_DISTANCE value
# Linear in the length of a line: possessive quantifiers (*+, ++) where what follows could fail. CPU numbers are
# ASCII digits, at most 5 (under _MAX_CPUS).
_ENTRY = re.compile(r"^(X|NV[0-9]++|PIX|PXB|PHB|NODE|SYS|SOC)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*+[A-Za-z]")
_GPU = re.compile(r"^GPU[0-9]++$")
_EXTRA = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID")
_LEGEND = re.compile(r"^\s*+(X|NV#|PIX|PXB|PHB|NODE|SYS|SOC)\s*+=(.*+)")  # the description, stripped by the caller
_NIC_LEGEND = re.compile(r"^\s*+(NIC[0-9]++)\s*+:\s*+(\S++)\s*+$")
_CPU_RANGE = re.compile(r"^([0-9]{1,5})(?:-([0-9]{1,5}))?$")
_MAX_CPUS = 1 << 16


@dataclass(frozen=True)
class TopoRow:
    name: str  # "GPU0", "NIC3", "mlx5_0"
    links: dict[str, str]  # column name -> entry ("X", "NV18", "PIX", ...)
    cpu_affinity: str | None = None  # as printed, "0-51,104-155"; None when absent or N/A
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None

    @property
    def cpus(self) -> tuple[int, ...]:
        return parse_cpu_list(self.cpu_affinity) if self.cpu_affinity else ()


@dataclass(frozen=True)
class TopoMatrix:
    source: str
    columns: tuple[str, ...]
    rows: dict[str, TopoRow]
    nic_legend: dict[str, str] = field(default_factory=dict)  # "NIC0" -> "mlx5_0"
    legend: dict[str, str] = field(default_factory=dict)  # "PIX" -> its description

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if _GPU.match(c))

    @property
    def nics(self) -> tuple[str, ...]:
        return tuple(c for c in self.columns if not _GPU.match(c))

    def nic_device(self, column: str) -> str:
        """The RDMA device behind a NIC column ("NIC0" -> "mlx5_0"; "mlx5_0" names itself)."""
        return self.nic_legend.get(column, column)

    def nearest_nic(self, gpu: str) -> tuple[str, str] | None:
        """(NIC column, entry) of the PCIe-closest NIC of a GPU row, first in column order on ties."""
        best: tuple[str, str] | None = None
        for nic in self.nics:
            entry = self.rows[gpu].links.get(nic, "")
            if entry in PCIE_DISTANCE and (best is None or PCIE_DISTANCE[entry] < PCIE_DISTANCE[best[1]]):
                best = (nic, entry)
        return best


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-51,104-155" -> (0, 1, ..., 51, 104, ..., 155). Raises ParseError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        m = _CPU_RANGE.match(part.strip())
        if m is None:
            raise ParseError(f"CPU list {text[:40]!r}: {part[:20]!r} is not a CPU number or range")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo or hi >= _MAX_CPUS:
            raise ParseError(f"CPU list {text[:40]!r}: bad range {part[:20]!r}")
        cpus.extend(range(lo, hi + 1))
    return tuple(cpus)


def _header(line: str) -> tuple[list[str], list[str]] | None:
    tokens = line.split()
    if tokens[:1] != ["GPU0"] or "X" in tokens:  # the header names columns; the GPU0 row has an X
        return None
    cut = next((i for i, t in enumerate(tokens) if t in ("CPU", "NUMA")), len(tokens))
    return tokens[:cut], _EXTRA.findall(" ".join(tokens[cut:]))


def parse_topo_matrix(text: str, source: str) -> TopoMatrix:
    check_size(text, source, "nvidia-smi topo -m output")
    lines = [_ANSI.sub("", ln).rstrip("\r") for ln in text_lines(text)]
    at = next((i for i, ln in enumerate(lines) if _header(ln) is not None), None)
    if at is None:
        raise ParseError("no topology matrix header (a line starting with GPU0)", source)
    head = _header(lines[at])
    assert head is not None
    columns, extras = head
    if len(set(columns)) != len(columns):
        raise ParseError("a column is named twice in the matrix header", source, at + 1)
    rows: dict[str, TopoRow] = {}
    end = at + 1
    for end in range(at + 1, len(lines)):
        tokens = lines[end].split()
        if not tokens or tokens[0] not in columns:
            break
        name, cells = tokens[0], tokens[1:]
        if len(cells) < len(columns):
            raise ParseError(f"row {name} has {len(cells)} entries for {len(columns)} columns", source, end + 1)
        links = dict(zip(columns, cells[:len(columns)], strict=True))
        for col, entry in links.items():
            if not _ENTRY.match(entry):
                raise ParseError(f"row {name}, column {col}: unknown entry {entry[:12]!r}", source, end + 1)
        if links[name] != "X":
            raise ParseError(f"row {name}: its own column reads {links[name]!r}, not X", source, end + 1)
        rest = cells[len(columns):]
        if len(rest) > len(extras):
            raise ParseError(f"row {name} has {len(rest)} affinity fields for {len(extras)} columns", source, end + 1)
        values = {key: (None if value == "N/A" else value) for key, value in zip(extras, rest, strict=False)}
        if values.get("CPU Affinity"):
            try:
                parse_cpu_list(values["CPU Affinity"])
            except ParseError as err:
                raise ParseError(err.what, source, end + 1) from None
        if name in rows:
            raise ParseError(f"row {name} appears twice", source, end + 1)
        rows[name] = TopoRow(name, links, values.get("CPU Affinity"), values.get("NUMA Affinity"),
                             values.get("GPU NUMA ID"))
    missing = [c for c in columns if c not in rows]
    if missing:
        raise ParseError(f"the matrix has no row for {', '.join(missing[:4])} (truncated output?)", source)
    legend: dict[str, str] = {}
    nic_legend: dict[str, str] = {}
    for ln in lines[end:]:
        m = _NIC_LEGEND.match(ln)
        if m:
            nic_legend[m[1]] = m[2]
            continue
        m = _LEGEND.match(ln)
        if m and m[2].strip():
            legend[m[1]] = m[2].strip()
    return TopoMatrix(source, tuple(columns), rows, nic_legend, legend)

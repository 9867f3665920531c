"""parse_topo_matrix on the real `nvidia-smi topo -m` captures in fixtures/tools/nvidia-smi and on matrices with NIC
columns built in the layout nvidia-smi prints (tab-separated, " X " cells, "NIC Legend"), and on arbitrary text."""
from __future__ import annotations

from pathlib import Path

import pytest
from deadline import MIB, deadline
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.checks.parse_nvidia_smi_topo import parse_cpu_list, parse_topo_matrix
from hypothesis import given, settings
from hypothesis import strategies as st

SMI = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "nvidia-smi"
TOPO_FILES = sorted(p for p in SMI.glob("*topo-m*") if not p.name.endswith(".source.txt"))

# file: (GPU columns, entry GPU0->GPU1, GPU4 CPU affinity, GPU4 NUMA affinity, number of CPUs of GPU4)
EXPECTED = {
    "stas00__nvidia-smi-topo-m__8xA100-NV12.txt": (8, "NV12", "24-47", "1", 24),
    "stas00__nvidia-smi-topo-m__8xH100-NV18.txt": (8, "NV18", "52-103", "1", 52),
    "stas00__nvidia-smi-topo-m__8xH100-NV18__HT-cpu-affinity-ranges.txt": (8, "NV18", "52-103,156-207", "1", 104),
}

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def nic_matrix(gpu_nic: list[list[str]], nic_names: list[str] | None = None, legend: bool = True,
               numa_id: bool = False) -> str:
    """A `nvidia-smi topo -m` text for len(gpu_nic) NVLink-connected GPUs and the given GPU->NIC entries, laid out
    as recent drivers print it (tabs, " X " on the diagonal, NICn columns and a NIC Legend)."""
    gpus, nics = len(gpu_nic), len(gpu_nic[0])
    names = nic_names or [f"NIC{i}" for i in range(nics)]
    extra = ["CPU Affinity", "NUMA Affinity"] + (["GPU NUMA ID"] if numa_id else [])
    lines = ["\t" + "\t".join([f"GPU{i}" for i in range(gpus)] + names + extra)]
    for g in range(gpus):
        cells = [" X " if h == g else "NV18" for h in range(gpus)] + gpu_nic[g]
        aff = ["0-55,112-167" if g < gpus // 2 else "56-111,168-223", "0" if g < gpus // 2 else "1"]
        lines.append("\t".join([f"GPU{g}"] + cells + aff + (["N/A"] if numa_id else [])))
    for n in range(nics):
        cells = [gpu_nic[g][n] for g in range(gpus)] + [" X " if m == n else "SYS" for m in range(nics)]
        lines.append("\t".join([names[n]] + cells + ["", ""]))
    text = "\n".join(lines) + "\n" + (LEGEND if legend else "")
    if nic_names is None:
        text += "\nNIC Legend:\n\n" + "".join(f"  NIC{i}: mlx5_{i}\n" for i in range(nics))
    return text


def pix_pairs(gpus: int = 8) -> list[list[str]]:
    """GPU i has NIC i behind the same PCIe switch; the other NICs are across the node or the socket."""
    return [["PIX" if n == g else ("NODE" if (n < gpus // 2) == (g < gpus // 2) else "SYS") for n in range(gpus)]
            for g in range(gpus)]


def test_every_capture_has_a_source_and_an_expectation():
    assert {p.name for p in TOPO_FILES} == set(EXPECTED)
    for p in TOPO_FILES:
        assert (SMI / (p.name + ".source.txt")).exists()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_captures(name):
    m = parse_topo_matrix((SMI / name).read_text(), name)
    gpus, nv, cpus, numa, ncpu = EXPECTED[name]
    assert len(m.gpus) == gpus and m.nics == ()
    assert m.rows["GPU0"].links["GPU1"] == nv and m.rows["GPU3"].links["GPU3"] == "X"
    assert (m.rows["GPU4"].cpu_affinity, m.rows["GPU4"].numa_affinity, len(m.rows["GPU4"].cpus)) == (cpus, numa, ncpu)
    assert m.rows["GPU0"].cpus[0] == 0 and m.legend == {} and m.nic_legend == {}


def test_nic_columns_legend_and_nearest_nic():
    m = parse_topo_matrix(nic_matrix(pix_pairs(), numa_id=True), "built")
    assert m.gpus == tuple(f"GPU{i}" for i in range(8)) and m.nics == tuple(f"NIC{i}" for i in range(8))
    assert m.nic_legend["NIC3"] == "mlx5_3" and m.nic_device("NIC3") == "mlx5_3"
    assert m.legend["PIX"] == "Connection traversing at most a single PCIe bridge" and "NV#" in m.legend
    assert m.nearest_nic("GPU5") == ("NIC5", "PIX")
    assert m.rows["GPU6"].gpu_numa_id is None and m.rows["GPU6"].numa_affinity == "1"  # "N/A" -> None
    assert m.rows["NIC2"].links["GPU2"] == "PIX" and m.rows["NIC2"].cpu_affinity is None


def test_older_driver_names_nic_columns_by_device():
    pairs = [["PXB", "SYS"], ["PXB", "SYS"], ["SYS", "PXB"], ["SYS", "PXB"]]
    m = parse_topo_matrix(nic_matrix(pairs, nic_names=["mlx5_0", "mlx5_1"], legend=False), "old")
    assert m.nics == ("mlx5_0", "mlx5_1") and m.nic_device("mlx5_1") == "mlx5_1"
    assert m.nearest_nic("GPU3") == ("mlx5_1", "PXB")


def test_ansi_underlined_header_and_soc_entries():
    text = nic_matrix([["SOC"], ["PHB"]]).replace("\tGPU0", "\t\x1b[4mGPU0", 1)
    text = text.replace("NUMA Affinity", "NUMA Affinity\x1b[0m")
    m = parse_topo_matrix(text, "ansi")
    assert m.nearest_nic("GPU0") == ("NIC0", "SOC") and m.nearest_nic("GPU1") == ("NIC0", "PHB")


def test_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    for bad in ("", "a-b", "5-2", "0-99999999"):
        with pytest.raises(ParseError):
            parse_cpu_list(bad)


@pytest.mark.parametrize("edit, what", [
    (lambda t: "no matrix here\n", "no topology matrix header"),
    (lambda t: t.replace("GPU1\tNV18\t X ", "GPU1\tNV18\t Y ", 1), "unknown entry"),
    (lambda t: t.replace("GPU1\tNV18\t X ", "GPU1\tNV18\tNV18", 1), "not X"),
    (lambda t: "\n".join(t.splitlines()[:3]), "no row for"),
    (lambda t: t.replace("0-55,112-167", "zero", 1), "is not a CPU number"),
])
def test_malformed_matrices_raise_parse_error(edit, what):
    with pytest.raises(ParseError, match=what):
        parse_topo_matrix(edit(nic_matrix(pix_pairs(4))), "bad.out")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_only_raises_parse_error(text):
    try:
        parse_topo_matrix(text, "fuzz")
    except ParseError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(nic_matrix(pix_pairs(4)).splitlines() + ["GPU0", "GPU0\tX", "NIC0: x", "\t"]),
                max_size=30))
def test_shuffled_matrix_lines_only_raise_parse_error(lines):
    try:
        parse_topo_matrix("\n".join(lines), "fuzz")
    except ParseError:
        pass


# -- hostile input: linear in the length of a line, every number finite and bounded ---------------------------------
H100 = SMI / "stas00__nvidia-smi-topo-m__8xH100-NV18.txt"


@pytest.mark.parametrize("extra", [
    "  PIX  = a" + " " * MIB + "b",  # the old legend pattern (a lazy description before spaces) took hours
    "  NIC0: " + " " * MIB + "x y",
    "\x1b[" + "1;" * (MIB // 2),
    "GPU0 " + "NV18 " * (MIB // 5),
])
def test_a_pathological_1mib_line_is_read_in_linear_time(extra):
    text = H100.read_text() + "\n" + extra + "\n"
    with deadline():
        matrix = parse_topo_matrix(text, "topo")
    assert matrix.columns == parse_topo_matrix(H100.read_text(), "topo").columns


def test_a_legend_with_long_space_runs_is_kept_whole():
    with deadline():
        matrix = parse_topo_matrix(H100.read_text() + "\n  PIX  = a" + " " * MIB + "b  \n", "topo")
    assert matrix.legend["PIX"] == "a" + " " * MIB + "b"


@pytest.mark.parametrize("affinity", ["1" * 5000, "0-" + "9" * 5000, "٠-٣", "²"])
def test_a_cpu_number_past_its_bound_is_a_parse_error_naming_the_line(affinity):
    text = H100.read_text().replace("0-51 ", affinity + " ", 1)
    with pytest.raises(ParseError) as info:
        parse_topo_matrix(text, "topo")
    assert info.value.line == 2 and "CPU" in info.value.what
    with pytest.raises(ParseError):
        parse_cpu_list(affinity)

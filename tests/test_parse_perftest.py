"""parse_perftest on every real perftest output in fixtures/tools/perftest (values read off the files), and on
arbitrary text (only ParseError may escape)."""
from __future__ import annotations

from pathlib import Path

import pytest
from deadline import MIB, deadline
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.checks.parse_perftest import last_error_line, parse_perftest
from hypothesis import given, settings
from hypothesis import strategies as st

PERFTEST = Path(__file__).resolve().parent.parent / "fixtures" / "tools" / "perftest"
FILES = sorted(p for p in PERFTEST.iterdir() if not p.name.endswith(".source.txt"))

AMD_CLIENT = "amd-pollara__ib_write_bw-b-a-q4__CLIENT.txt"
AMD_SERVER = "amd-pollara__ib_write_bw-b-a-q4__SERVER__with-shell-prompts-Connected-Completed.txt"
NV_CUDA = "nvidia-gpu-operator-docs__ib_write_bw-a__client__GPUDirect-RoCE__use_cuda_dmabuf.txt"
NV_BANNER = "nvidia-gpu-operator-docs__ib_write_bw__server__waiting-banner.txt"
ROCM = "rocm__ib_write_bw-b-a__client__RoCE-GPU-D2D__bidirectional-sweep.txt"
LAT_IB = "spiderpool__ib_read_lat__client__InfiniBand-pod__tabs-in-row.txt"
LAT_ROCE = "spiderpool__ib_read_lat__client__RoCE-pod__cpu-freq-warnings-interleaved.txt"
LAT_VF = "spiderpool__ib_read_lat__client__SRIOV-VF-pod__libibverbs-warnings.txt"
NO_DEVICE = "local__ib_write_bw-D5__client__no-RDMA-device__rc1.txt"

# file: (test, kind, bidirectional, role, device, link type, BW rows, best BW avg Gb/s, latency rows,
#        warnings, errors)
EXPECTED = {
    AMD_CLIENT: ("RDMA_Write Bidirectional BW", "bw", True, "client", "ionic_1", "Ethernet", 23, 779.21, 0, 0, 0),
    AMD_SERVER: ("RDMA_Write Bidirectional BW", "bw", True, "server", "ionic_7", "Ethernet", 23, 779.21, 0, 1, 0),
    NV_CUDA: ("RDMA_Write BW", "bw", False, "client", "mlx5_0", "Ethernet", 23, 92.46, 0, 0, 0),
    NV_BANNER: (None, None, False, "server", None, None, 0, None, 0, 0, 0),
    ROCM: ("RDMA_Write Bidirectional BW", "bw", True, "client", "<RDMA-NIC-2>", "Ethernet", 23, 204.59, 0, 0, 0),
    LAT_IB: ("RDMA_Read Latency", "lat", False, "client", "mlx5_8", "IB", 0, None, 1, 2, 0),
    LAT_ROCE: ("RDMA_Read Latency", "lat", False, "client", "mlx5_0", "Ethernet", 0, None, 1, 2, 0),
    LAT_VF: ("RDMA_Read Latency", "lat", False, "client", "mlx5_5", "Ethernet", 0, None, 1, 7, 0),
    NO_DEVICE: (None, None, False, None, None, None, 0, None, 0, 0, 2),
}


def parse(name: str):
    return parse_perftest((PERFTEST / name).read_text(), name)


def test_every_file_has_a_source_and_an_expectation():
    assert {p.name for p in FILES} == set(EXPECTED)
    for p in FILES:
        assert (PERFTEST / (p.name + ".source.txt")).exists(), p.name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_outputs_parse_to_what_the_files_say(name):
    run = parse(name)
    got = (run.test, run.kind, run.bidirectional, run.role, run.device, run.link_type, len(run.bw_rows),
           run.best_bw_gbps, len(run.lat_rows), len(run.warnings), len(run.errors))
    assert got == EXPECTED[name]


def test_bandwidth_table_rows_and_units():
    run = parse(AMD_CLIENT)
    assert run.bw_unit == "Gb/sec" and run.qps == 4 and run.params["Number of qps"] == "4"
    first, last = run.bw_rows[0], run.bw_rows[-1]
    assert (first.bytes, first.iterations, first.bw_peak, first.bw_average, first.msg_rate_mpps) == (
        2, 20000, 0.147331, 0.146472, 9.154486)
    assert (last.bytes, last.bw_average, last.bw_average_gbps) == (8388608, 779.21, 779.21)
    # Newer perftest fields are kept as printed.
    assert run.params["CQE Poll Batch"] == "Dynamic" and run.params["Using Enhanced Reorder"] == "OFF"
    assert run.params["Mtu"] == "4096[B]" and run.params["GID index"] == "1"


def test_nvidia_doc_sample_keeps_one_space_indent_and_colon_without_blank():
    run = parse(NV_CUDA)
    # " PCIe relax order: ON" has no blank before the colon; the first separator is indented.
    assert run.params["PCIe relax order"] == "ON" and run.params["GID index"] == "5"
    assert run.bw_rows[-1].bw_average == 92.39 and run.best_bw_gbps == 92.46  # 16384 B row is the peak avg
    # The doc trimmed perftest's CUDA lines: the output itself does not say it ran on GPU memory.
    assert run.cuda is False


def test_server_side_with_shell_prompts_and_connected_completed():
    run = parse(AMD_SERVER)
    assert run.role == "server" and run.params["CPU freq"] == "3295[MHz]"
    assert run.warnings == ("Using sampled CPU speed 3295 MHz over reported speed 5037 MHz",)
    assert run.errors == ()  # "[1]+ Done ...", "Connected:", "Completed:", "Total run time" are noise


def test_rocm_tiny_message_anomaly_and_unindented_params():
    run = parse(ROCM)
    assert (run.bw_rows[0].bw_peak, run.bw_rows[0].bw_average) == (0.142947, 0.012281)
    assert run.params["Device"] == "<RDMA-NIC-2>" and run.params["GID index"] == "3"


def test_latency_tables_with_tabs_and_interleaved_warnings():
    ib = parse(LAT_IB)
    (row,) = ib.lat_rows
    assert (row.bytes, row.iterations) == (2, 1000)
    assert row.usec == {"t_min": 1.84, "t_max": 12.2, "t_typical": 1.9, "t_avg": 1.97, "t_stdev": 0.47,
                        "p99": 2.24, "p99_9": 12.2}
    assert ib.params["rdma_cm QPs"] == "OFF" and ib.params["Outstand reads"] == "16"  # tab before the colon
    roce = parse(LAT_ROCE)
    assert roce.lat_rows[0].usec["t_typical"] == 7.04 and roce.lat_rows[0].usec["p99_9"] == 16.81
    assert all(w.startswith("Conflicting CPU frequency values detected") for w in roce.warnings)


def test_libibverbs_warnings_are_warnings_not_errors():
    run = parse(LAT_VF)
    assert run.warnings[0] == "libibverbs: Warning: couldn't stat '/sys/class/infiniband/mlx5_4'."
    assert run.errors == () and run.lat_rows[0].usec["t_avg"] == 6.82


def test_failed_client_is_read_as_errors():
    run = parse(NO_DEVICE)
    assert run.errors == ("Did not detect devices", "Unable to find the Infiniband/RoCE device")
    assert last_error_line((PERFTEST / NO_DEVICE).read_text()) == "Unable to find the Infiniband/RoCE device"


def test_mb_per_sec_is_converted_and_cuda_lines_are_seen():
    text = (PERFTEST / NV_CUDA).read_text().replace("[Gb/sec]", "[MB/sec]")
    text = "initializing CUDA\nPicking device No. 3, (NVIDIA H100 80GB HBM3)\n" + text
    run = parse_perftest(text, "edited")
    assert run.bw_unit == "MB/sec" and run.cuda and run.cuda_device == 3
    # perftest's MB is 0x100000 bytes (format_factor): 92.39 MB/s = 0.775 Gb/s
    assert run.bw_rows[-1].bw_average_gbps == pytest.approx(92.39 * 1048576 * 8 / 1e9)


@pytest.mark.parametrize("text, what", [
    ("", "empty"),
    ("hello world\nnothing here\n", "not perftest output"),
    ("bash: ib_write_bw: command not found\nError 127\n", "not perftest output"),  # errors, but not perftest's
    (" #bytes  #iterations  BW peak[Kb/sec]  BW average[Kb/sec]\n", "unknown bandwidth unit"),
    (" #bytes  #iterations  BW peak[Gb/sec]  BW average[Gb/sec]  MsgRate[Mpps]\n 65536  1000  12.5  12.4\n",
     "4 fields"),
    (" #bytes  #iterations  BW peak[Gb/sec]  BW average[Gb/sec]  MsgRate[Mpps]\n 65536  1000  x  12.4  0.1\n",
     "not a number"),
])
def test_garbage_raises_parse_error_naming_what(text, what):
    with pytest.raises(ParseError, match=what):
        parse_perftest(text, "garbage.out")


def test_parse_error_names_the_line():
    text = (PERFTEST / NV_CUDA).read_text().replace("92.13              92.06", "92.06")  # the 4096 B row
    with pytest.raises(ParseError) as info:
        parse_perftest(text, "edited.out")
    assert info.value.source == "edited.out" and info.value.line == 34


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_only_raises_parse_error(text):
    try:
        parse_perftest(text, "fuzz")
    except ParseError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from((PERFTEST / AMD_SERVER).read_text().splitlines() + [
    "#bytes #iterations t_min[usec] t_max[usec]", "2 1000 1.0", "Couldn't connect to localhost:18515", "\t", "*"]),
    max_size=40))
def test_shuffled_real_lines_only_raise_parse_error(lines):
    try:
        parse_perftest("\n".join(lines), "fuzz")
    except ParseError:
        pass


# -- hostile input: linear in the length of a line, every number finite and bounded ---------------------------------
HEADER = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
TITLE = "                    RDMA_Write Bidirectional BW Test\n"
# A 1 MiB line aimed at each pattern that could backtrack; the old parameter pattern took hours on the first, the
# old prompt pattern on the one with many at-signs.
PATHOLOGICAL = {
    "parameter-line-then-no-colon": lambda t: t.replace(TITLE, TITLE + " Spare : x" + " a" * (MIB // 2) + "\n"),
    "prompt-with-many-at-signs": lambda t: t.replace(TITLE, TITLE + "[" + "a@" * (MIB // 2) + "]x\n"),
    "title-of-spaces": lambda t: t.replace(TITLE, TITLE + "RDMA" + " " * MIB + "x\n"),
    "separator-then-junk": lambda t: t.replace(TITLE, TITLE + "-" * MIB + "x\n"),
    "cuda-device-of-spaces": lambda t: t.replace(TITLE, TITLE + "Picking device No." + " " * MIB + "x\n"),
    "error-device-name": lambda t: t + "IB device " + "x" * MIB + " not foun\n",
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_a_pathological_1mib_line_is_read_in_linear_time(name):
    text = PATHOLOGICAL[name]((PERFTEST / AMD_CLIENT).read_text())
    assert text != (PERFTEST / AMD_CLIENT).read_text()
    with deadline():
        run = parse_perftest(text, "out")
    assert len(run.bw_rows) == 23 and run.best_bw_gbps == 779.21 and run.device == "ionic_1"


@pytest.mark.parametrize("tail", ["a" * MIB, "9." * (MIB // 2)])
def test_a_1mib_table_header_is_refused_naming_its_line(tail):
    # the old column pattern took hours on these; no perftest header is longer than a few hundred characters
    text = (PERFTEST / AMD_CLIENT).read_text().replace(HEADER, HEADER + " " + tail)
    with deadline(), pytest.raises(ParseError) as info:
        parse_perftest(text, "out")
    assert info.value.line == 36 and "header" in info.value.what


def test_parameter_lines_read_as_before():
    run = parse_perftest(TITLE + " Dual-port       : OFF          Device         : mlx5_0\n"
                         " Key\twith tab : v1   Other : a:b  Last :   c  Empty : \n" + HEADER + "\n", "x")
    assert run.params == {"Dual-port": "OFF", "Device": "mlx5_0", "with tab": "v1", "Other": "a:b", "Last": "c"}


@pytest.mark.parametrize("edit, what", [
    (lambda t: t.replace("\n 2          20000 ", "\n " + "9" * 400 + "          20000 "), "#bytes"),
    (lambda t: t.replace("0.147331", "1" * 30 + ".5"), "BW peak"),
    (lambda t: t.replace("\n 2          20000 ", "\n ١٠٢٤          20000 "), "#bytes"),
    (lambda t: t.replace("\n 2          20000 ", "\n ²          20000 "), "#bytes"),
])
def test_a_number_past_its_bound_is_a_parse_error_naming_the_line(edit, what):
    text = edit((PERFTEST / AMD_CLIENT).read_text())
    with pytest.raises(ParseError) as info:
        parse_perftest(text, "out")
    assert info.value.line == 37 and what in info.value.what


def test_a_cuda_device_number_of_5000_digits_is_a_parse_error_naming_the_line():
    text = "Picking device No. " + "1" * 5000 + ", (NVIDIA H100)\n" + (PERFTEST / AMD_CLIENT).read_text()
    with pytest.raises(ParseError) as info:
        parse_perftest(text, "out")
    assert info.value.line == 1 and "CUDA device" in info.value.what

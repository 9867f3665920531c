"""Kernel log parsing: raw /dev/kmsg records and dmesg / journalctl / syslog text, on real captures."""
from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
from gpuwarden.agent.core.errors import ParseError
from gpuwarden.agent.core.kernel_log import LogRecord, detect_format, parse_kmsg_text, parse_log_text
from hypothesis import given, settings
from hypothesis import strategies as st

KERNEL = Path(__file__).resolve().parent.parent / "fixtures" / "logs" / "kernel"


def read(name: str) -> str:
    return (KERNEL / name).read_text(encoding="utf-8")


# --- format detection --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, fmt", [
    ("azurehpc__nhc-health-log-real-sample.txt", "embedded"),
    ("gpud__dmesg-ctime__xid119-gsp-timeout-with-stack.log", "dmesg-ctime"),
    ("gpud__dmesg-ctime__xid13-and-xid109-ctx-switch-timeout.txt", "dmesg-ctime"),
    ("gpud__dmesg-ctime__xid45-then-hung-task-nvidia-stack.txt", "dmesg-ctime"),
    ("gpud__dmesg-decode-iso__boot-noise-no-xid.log", "dmesg-decode-iso"),
    ("gpud__dmesg-decode-iso__nccl-segfault.log", "dmesg-decode-iso"),
    ("gpud__dmesg-decode-iso__xid13-burst-xid43.log", "dmesg-decode-iso"),
    ("gpud__dmesg-iso__xid48-63-94-with-peermem-noise.log", "dmesg-iso"),
    ("gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt", "dmesg"),
    ("gpud__journalctl-short-iso__noise-1.log", "journal-iso"),
    ("gpud__journalctl-short-iso__noise-2.log", "journal-iso"),
    ("gpud__kmsg-raw__noise-nvswitch.log", "kmsg"),
    ("gpud__kmsg-raw__peermem-with-malformed-last-line.log", "kmsg"),
    ("handmade__kmsg-raw__peermem-TRUNCATED-last-record.log", "kmsg"),
    ("lambdalabs__A100-syslog-xid63-64-94.txt", "syslog"),
])
def test_detect_format(name, fmt):
    assert detect_format(read(name)) == fmt


def test_one_kmsg_record_among_prose_is_not_a_kmsg_file():
    text = "Example from the DCGM tests:\n4,1227,437812449932,c;NVRM: Xid 43\nThat is all.\n"
    assert detect_format(text) == "plain"
    records, errors = parse_log_text(text, "doc")
    assert errors == []
    assert [(r.line, r.seq, r.message) for r in records] == [
        (1, None, "Example from the DCGM tests:"), (2, 1227, "NVRM: Xid 43"), (3, None, "That is all.")]


def test_detect_format_of_nothing():
    assert detect_format("") == "empty"
    assert detect_format("\n  \n") == "empty"
    assert detect_format("hello\nworld\n") == "plain"


# --- raw /dev/kmsg -----------------------------------------------------------------------------------
def test_kmsg_records_carry_header_fields():
    records, errors = parse_kmsg_text(read("gpud__kmsg-raw__noise-nvswitch.log"), "kmsg.1.log")
    assert errors == []
    assert len(records) == 47
    first, last = records[0], records[-1]
    assert first == LogRecord("nvidia-nvswitch2: open (major=510)", 1, "kmsg.1.log", seq=3964, usec=206764307,
                              priority=6, facility=0)
    assert (last.line, last.seq, last.usec) == (47, 4010, 57631398464)
    assert last.message == "IPv6: ADDRCONF(NETDEV_CHANGE): calic24dd7712a6: link becomes ready"


def test_kmsg_continuation_lines_belong_to_the_record_before():
    # The example of Documentation/ABI/testing/dev-kmsg in the Linux tree.
    text = ("7,160,424069,-;pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)\n"
            " SUBSYSTEM=acpi\n"
            " DEVICE=+acpi:PNP0A03:00\n"
            "6,339,5140900,-;NET: Registered protocol family 10\n"
            "30,340,5690716,-;udevd[80]: starting version 181\n")
    records, errors = parse_kmsg_text(text, "k")
    assert errors == []
    assert [(r.line, r.seq, r.usec, r.priority, r.facility) for r in records] == [
        (1, 160, 424069, 7, 0), (4, 339, 5140900, 6, 0), (5, 340, 5690716, 6, 3)]
    assert records[0].message == "pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)"


def test_kmsg_header_may_carry_more_fields_and_message_may_hold_semicolons():
    records, errors = parse_kmsg_text("6,12,34,-,caller=T1;a; b;c\n4,13,35,c;x\n", "k")
    assert errors == []
    assert [(r.seq, r.message) for r in records] == [(12, "a; b;c"), (13, "x")]


def test_the_gpud_peermem_file_is_well_formed_kmsg():
    # Its last line, '6,3973,227996662,-;test', is hand-written but a valid record (gpud's own test parses all 8
    # lines without error), so it must not be reported as broken.
    records, errors = parse_kmsg_text(read("gpud__kmsg-raw__peermem-with-malformed-last-line.log"), "p")
    assert errors == []
    assert len(records) == 8
    assert (records[-1].line, records[-1].seq, records[-1].usec, records[-1].message) == (8, 3973, 227996662, "test")


def test_truncated_last_record_is_a_parse_error_naming_file_and_line():
    path = KERNEL / "handmade__kmsg-raw__peermem-TRUNCATED-last-record.log"
    records, errors = parse_log_text(path.read_text(), str(path))
    assert len(records) == 7
    assert [r.line for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert len(errors) == 1
    error = errors[0]
    assert isinstance(error, ParseError)
    assert (error.source, error.line) == (str(path), 8)
    assert str(error).startswith(f"{path}:8: malformed kmsg record")
    assert "6,3973,2279" in str(error)


@pytest.mark.parametrize("bad", [
    "6,1,2,-",  # no ';'
    "6,1,2;msg",  # no flags field
    "x,1,2,-;msg",  # prio not a number
    "-6,1,2,-;msg",  # negative
    "6, 1,2,-;msg",  # space inside the header
    "6,1,2.5,-;msg",
    "6,١,2,-;msg",  # a non-ASCII digit int() would accept
    "just some text",
])
def test_malformed_kmsg_lines_are_errors_and_the_rest_still_parses(bad):
    text = f"6,1,100,-;before\n{bad}\n6,3,300,-;after\n"
    records, errors = parse_kmsg_text(text, "kmsg")
    assert [(r.line, r.message) for r in records] == [(1, "before"), (3, "after")]
    assert [(e.source, e.line) for e in errors] == [("kmsg", 2)]


def test_crlf_line_ends():
    records, errors = parse_kmsg_text("6,1,100,-;a\r\n6,2,200,-;b\r\n", "k")
    assert errors == [] and [r.message for r in records] == ["a", "b"]


def test_records_are_frozen_log_records():
    records, _ = parse_kmsg_text("6,1,100,-;a\n", "k")
    r = records[0]
    assert type(r) is LogRecord
    direct = LogRecord("a", 1, "k", 1, 100, 6, None, 0)
    assert r == direct and hash(r) == hash(direct)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.message = "b"  # type: ignore[misc]


@pytest.mark.parametrize("enabled", [True, False])
def test_parsing_leaves_the_garbage_collector_as_it_was(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        parse_kmsg_text("6,1,100,-;a\n", "k")
        parse_log_text("[ 1.0] a\n", "k")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


# --- dmesg / journalctl / syslog text ----------------------------------------------------------------
# (line taken from a fixture file, expected message, timestamp, usec, priority)
PREFIXED = [
    ("[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     None, 6781741548779, None),
    ("[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
     "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up", None, 6781753400584, None),
    ("[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
     "errorString CTX SWITCH TIMEOUT, Info 0x58005",
     "NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
     "errorString CTX SWITCH TIMEOUT, Info 0x58005", "Fri Aug 30 11:43:14 2024", None, None),
    ("[Sat Oct 12 18:38:44 2024]  ? _nv043429rm+0x23c/0x290", " ? _nv043429rm+0x23c/0x290",
     "Sat Oct 12 18:38:44 2024", None, None),
    ("2024-11-15T12:02:03,470068+00:00 NVRM: Xid (PCI:0000:19:00): 94, pid=1248209, name=python3.10, Ch 00000008",
     "NVRM: Xid (PCI:0000:19:00): 94, pid=1248209, name=python3.10, Ch 00000008",
     "2024-11-15T12:02:03,470068+00:00", None, None),
    ("kern  :warn  : 2025-01-21T02:21:33,502278+00:00 NVRM: Xid (PCI:0000:38:00): 43, pid=2815167, "
     "name=pt_main_thread, Ch 00000008",
     "NVRM: Xid (PCI:0000:38:00): 43, pid=2815167, name=pt_main_thread, Ch 00000008",
     "2025-01-21T02:21:33,502278+00:00", None, 4),
    ("kern  :debug : 2025-01-17T15:36:15,345059+00:00 pci_bus 0000:d7: on NUMA node 5",
     "pci_bus 0000:d7: on NUMA node 5", "2025-01-17T15:36:15,345059+00:00", None, 7),
    ("2025-01-02T15:20:12+0800 jmsph-pro-a800-77-123 kernel: docker0: port 1(vetha17b2cc) entered disabled state",
     "docker0: port 1(vetha17b2cc) entered disabled state", "2025-01-02T15:20:12+0800", None, None),
    ("   Jan 01 09:30:56 gpu1 kernel: [6540565.266214] NVRM: Xid (PCI:0000:51:00): 63, pid=4549, Row Remapper: "
     "New row marked for remapping, reset gpu to activate.",
     "NVRM: Xid (PCI:0000:51:00): 63, pid=4549, Row Remapper: New row marked for remapping, reset gpu to activate.",
     "Jan 01 09:30:56", 6540565266214, None),
    ("   Jan 19 08:22:56 gpu3 kernel: NVRM: Xid (PCI:0000:0b:00): 94, pid=3776851, Contained: SM (0x1). RST: No, "
     "D-RST: No",
     "NVRM: Xid (PCI:0000:0b:00): 94, pid=3776851, Contained: SM (0x1). RST: No, D-RST: No", "Jan 19 08:22:56", None,
     None),
    ("mynode-066 | ERROR: nhc: Health check failed: check_gpu_xid: GPU Xid errors detected: [ 3606.832215] NVRM: Xid "
     "(PCI:0002:00:00): 119, pid=67769, name=nvidia-smi, Timeout waiting for RPC from GSP1! Expected function 76 "
     "(GSP_RM_CONTROL) (0x2080014b 0x5).",
     "NVRM: Xid (PCI:0002:00:00): 119, pid=67769, name=nvidia-smi, Timeout waiting for RPC from GSP1! Expected "
     "function 76 (GSP_RM_CONTROL) (0x2080014b 0x5).", None, 3606832215, None),
    ("kernel: [103859.498995] NVRM: Xid (PCI:0002:00:00): 13, pid=2519562, name=python3, Graphics Exception: "
     "ChID 000c, Class 0000cbc0, Offset 00000000, Data 00000000",
     "NVRM: Xid (PCI:0002:00:00): 13, pid=2519562, name=python3, Graphics Exception: ChID 000c, Class 0000cbc0, "
     "Offset 00000000, Data 00000000", None, 103859498995, None),
    # no known shape: the whole line is the message
    ('The Xid 79 indicates that "GPU has fallen off the bus".',
     'The Xid 79 indicates that "GPU has fallen off the bus".', None, None, None),
    ("mynode-042 | Healthy", "mynode-042 | Healthy", None, None, None),
]


@pytest.mark.parametrize("line, message, timestamp, usec, priority", PREFIXED)
def test_prefix_is_stripped(line, message, timestamp, usec, priority):
    records, errors = parse_log_text(line + "\n", "log")
    assert errors == []
    assert len(records) == 1
    r = records[0]
    assert (r.message, r.timestamp, r.usec, r.priority) == (message, timestamp, usec, priority)
    assert (r.line, r.source) == (1, "log")


def test_every_nonblank_text_line_is_one_record_in_order():
    text = read("gpud__dmesg-ctime__xid45-then-hung-task-nvidia-stack.txt")
    records, errors = parse_log_text(text, "x")
    assert errors == []
    assert [r.line for r in records] == list(range(1, 16))
    assert records[0].message == "NVRM: Xid (PCI:0000:61:00): 45, pid=1496200, name=distprovers-gpu, Ch 0000000f"
    assert records[2].message == "      Tainted: P           OE     5.15.0-97-generic #107-Ubuntu"


def test_blank_lines_make_no_records_but_keep_numbering():
    records, _ = parse_log_text(read("lambdalabs__A100-syslog-xid63-64-94.txt"), "l")
    assert [r.line for r in records] == [1, 2, 4, 5]


def test_big_decode_iso_log():
    records, errors = parse_log_text(read("gpud__dmesg-decode-iso__boot-noise-no-xid.log"), "boot")
    text_lines = read("gpud__dmesg-decode-iso__boot-noise-no-xid.log").split("\n")
    assert errors == []
    assert len(records) == sum(1 for line in text_lines if line.strip())
    assert all(r.timestamp and r.timestamp.startswith("2025-01-") for r in records)
    assert {r.priority for r in records} <= set(range(8))


# --- properties: arbitrary text never raises ---------------------------------------------------------
kmsgish = st.lists(st.one_of(
    st.text(max_size=60),
    st.builds(lambda p, s, u, f, m: f"{p},{s},{u},{f};{m}", st.integers(-5, 300), st.integers(-5, 10**20),
              st.integers(-5, 10**20), st.sampled_from(["-", "c", "+", "-,caller=T1", ""]), st.text(max_size=40)),
    st.text(max_size=30).map(lambda t: " " + t),
    st.just(""),
), max_size=30).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), kmsgish))
def test_parse_kmsg_text_never_raises(text):
    records, errors = parse_kmsg_text(text, "src")
    assert all(isinstance(e, ParseError) and e.source == "src" for e in errors)
    lines = text.replace("\r\n", "\n").split("\n")
    # Every line that is neither blank nor a continuation is exactly one record or one error.
    expected = [i for i, line in enumerate(lines, 1) if line and not line.startswith(" ")]
    assert sorted([r.line for r in records] + [e.line for e in errors]) == expected
    for r in records:
        assert 0 <= r.priority <= 7 and r.seq >= 0 and r.usec >= 0


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), kmsgish))
def test_parse_log_text_never_raises(text):
    records, errors = parse_log_text(text, "src")
    assert all(isinstance(e, ParseError) and e.source == "src" for e in errors)
    assert all(isinstance(r, LogRecord) and r.source == "src" for r in records)
    assert isinstance(detect_format(text), str)
    if detect_format(text) != "kmsg":
        assert errors == []
        assert len(records) == sum(1 for line in text.replace("\r\n", "\n").split("\n") if line.strip())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 191), st.integers(0, 2**63), st.integers(0, 2**63),
                          st.text(alphabet=st.characters(blacklist_characters="\n\r"), max_size=50)),
                min_size=1, max_size=20))
def test_kmsg_round_trip(entries):
    text = "".join(f"{p},{s},{u},-;{m}\n" for p, s, u, m in entries)
    records, errors = parse_kmsg_text(text, "k")
    assert errors == []
    assert [(r.priority, r.facility, r.seq, r.usec, r.message) for r in records] == [
        (p & 7, p >> 3, s, u, m) for p, s, u, m in entries]


def test_absurdly_long_numbers_are_errors_not_crashes():
    # int() refuses strings of more than 4300 digits; such input must come back as a ParseError.
    records, errors = parse_kmsg_text("6," + "1" * 5000 + ",2,-;m\n", "k")
    assert records == [] and [e.line for e in errors] == [1]
    records, errors = parse_log_text("[" + "1" * 5000 + ".5] x\n", "k")
    assert errors == [] and records[0].usec is None

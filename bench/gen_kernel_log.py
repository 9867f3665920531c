"""A reproducible kernel log in `dmesg` form (`[ 1234.567890] message`) of any number of lines, for the analyze
benchmarks, with the count of every (GPU, XID) it holds so that a reader can be checked for exactness.

Source of the text:
- every line that is not an XID is a message of the recorded boot log `fixtures/nodes/h100-hgx-healthy/kmsg` (an
  HGX H100 boot, from leptonai/gpud's `pkg/dmesg/testdata/dmesg.decode.iso.log.1`, see that folder's SOURCE.md),
  drawn at random, so the mix of lengths is a real boot's (about 59 characters of message, 75 bytes a line with
  the stamp);
- about 2 % of lines (`--xid-fraction`) are `NVRM: Xid` lines of that node's 8 GPUs (its PCI bus ids), spread at
  random over the GPUs and over the XIDs below, each XID's text as a real driver wrote it (the captures under
  /work/shared/data/kernel_xid named beside each, from leptonai/gpud's and lambdalabs' test data).
The stamps grow by 1 µs to 10 ms a line, as a busy boot's do; `dmesg` pads the seconds to 5 places.
The same (lines, seed, fraction) always gives the same bytes.

Run: python bench/gen_kernel_log.py --lines 1000000 --out /tmp/dmesg-1M.txt   (prints the counts as JSON)
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "fixtures/nodes/h100-hgx-healthy/kmsg"
# Bumped when the output for given arguments changes, so that cached files are made again.
VERSION = 1

# h100-hgx-healthy's GPUs (nvml.json / SOURCE.md): index -> the bus id as NVRM writes it.
GPUS = ("0000:19:00", "0000:3b:00", "0000:4c:00", "0000:5d:00", "0000:9b:00", "0000:bb:00", "0000:cb:00",
        "0000:db:00")
# XID -> the text after "NVRM: Xid (PCI:…): N, " as captured (pids kept as written).
XID_TEXTS = {
    13: "pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 4, SM 1): Out Of Range Address",
    # gpud__dmesg-decode-iso__xid13-burst-xid43.log
    43: "pid=2815167, name=pt_main_thread, Ch 00000008",  # gpud__dmesg-decode-iso__xid13-burst-xid43.log
    48: "pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the "
        "framebuffer at physAddr 0x12bac1c3e0 partition 2, subpartition 1.",  # gpud__dmesg-iso__xid48-63-94-…
    63: "pid='<unknown>', name=<unknown>, Row Remapper: New row (0x00000012bac1c3e0) marked for remapping, reset gpu "
        "to activate.",  # gpud__dmesg-iso__xid48-63-94-with-peermem-noise.log
    64: "pid=3776851, Row Remapper Error: (0x000000039a559380) - All reserved rows for bank are remapped",
    # lambdalabs__A100-syslog-xid63-64-94.txt
    79: "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    # gpud__dmesg__xid79-fallen-off-bus-with-nvswitch-SXid-20034.txt
    94: "pid='<unknown>', name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No",
    # gpud__dmesg-iso__xid48-63-94-with-peermem-noise.log
    109: "pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    # gpud__dmesg-ctime__xid13-and-xid109-ctx-switch-timeout.txt
    119: "pid=2024380, name=nvidia-smi, Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function "
         "103 (GSP_RM_ALLOC) (0x2081 0x4).",  # gpud__dmesg-ctime__xid119-gsp-timeout-with-stack.log
}
# A tenth XID for the mixes (--noise mixed/long/short), from a real 'dmesg --ctime' excerpt.
XID_MIX = {**XID_TEXTS, 45: "pid=1496200, name=distprovers-gpu, Ch 0000000f"}
# embedded_xid_lines_from_docs_and_tests.tsv (a README's dmesg --ctime lines)


MIX_DIR = ROOT / "fixtures/logs/kernel"
# Real kernel logs of other machines, in their own forms (sources beside each in fixtures/logs/kernel/): the
# "mixed" noise is every line of them that is not an XID's, its form's prefix taken off. The boot log of a
# 8-GPU node (USB, ext4, mlx5, audit, IPv6, ACPI, PCI), a Kubernetes node's journal (IPv6, veth, cali), a raw
# kmsg of NVSwitch opens, nvidia-peermem errors, a GSP timeout's stack and a hung task's.
MIX_SOURCES = (
    "gpud__dmesg-decode-iso__boot-noise-no-xid.log", "gpud__journalctl-short-iso__noise-1.log",
    "gpud__journalctl-short-iso__noise-2.log", "gpud__kmsg-raw__noise-nvswitch.log",
    "gpud__dmesg-iso__xid48-63-94-with-peermem-noise.log", "gpud__dmesg-ctime__xid119-gsp-timeout-with-stack.log",
    "gpud__dmesg-ctime__xid45-then-hung-task-nvidia-stack.txt", "gpud__dmesg-decode-iso__nccl-segfault.log",
)
# The prefixes of those files' forms: dmesg --decode (facility:level : ISO stamp), journalctl -o short-iso
# (stamp host kernel:), raw kmsg (prio,seq,usec,flags;), dmesg (-T) ([stamp]), an ISO stamp alone.
_PREFIX = re.compile(r"^(?:\w+\s*:\w+\s*: \S+ |\S+ \S+ kernel: |\d+,\d+,\d+,[^;]*;|\[[^\]]*\] |\d{4}-\d\d-\S+ )")
NOISES = ("boot", "mixed", "long", "short")
FORMS = ("dmesg", "dmesg-T", "journalctl", "kmsg")
LONG_MIN, SHORT_MAX = 100, 48  # message lengths of the "long" and "short" mixes (the mixed corpus' median is ~60)
HOST = "gpu-node-017"
BOOT_EPOCH = 1_733_400_000  # 2024-12-05 12:00 UTC: where dmesg -T's and journalctl's wall clocks start


def noise_messages(noise: str = "boot") -> list[str]:
    """The messages (no prefix) that fill the lines that are not XIDs; "boot": the recorded H100 boot (raw kmsg:
    the text after the first ';'), "mixed": the other machines' logs, "long"/"short": those of them longer than
    LONG_MIN / at most SHORT_MAX characters."""
    if noise == "boot":
        out = []
        for line in SOURCE.read_text().splitlines():
            head, sep, msg = line.partition(";")
            if sep and head[:1].isdigit() and "Xid" not in msg:
                out.append(msg)
        return out
    if noise not in NOISES:
        raise ValueError(f"noise {noise!r}: one of {', '.join(NOISES)}")
    out = []
    for name in MIX_SOURCES:
        for line in (MIX_DIR / name).read_text(errors="replace").splitlines():
            msg = _PREFIX.sub("", line, count=1).rstrip()
            if msg and "Xid" not in msg:
                out.append(msg)
    if noise == "long":
        out = [m for m in out if len(m) > LONG_MIN]
    elif noise == "short":
        out = [m for m in out if len(m) <= SHORT_MAX]
    return out


def _stamp(form: str | None, usec: int, seq: int, prio: int) -> str:
    if form is None:  # the first benchmarks' form, kept so that their figures stay comparable
        return f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] "
    if form == "dmesg":
        return f"[{usec / 1e6:12.6f}] "
    if form == "kmsg":
        return f"{prio},{seq},{usec},-;"
    t = time.gmtime(BOOT_EPOCH + usec // 1_000_000)
    if form == "dmesg-T":
        return time.strftime("[%a %b ", t) + f"{t.tm_mday:2d}" + time.strftime(" %H:%M:%S %Y] ", t)
    if form == "journalctl":
        return time.strftime("%b %d %H:%M:%S ", t) + HOST + " kernel: "
    raise ValueError(f"form {form!r}: one of {', '.join(FORMS)}")


def generate(lines: int, seed: int = 1, xid_fraction: float = 0.02, counts: Counter | None = None,
             spans: dict | None = None, form: str | None = None, noise: str = "boot") -> Iterator[bytes]:
    """The log as chunks of bytes; ``counts`` (if given) gains (bus id, XID) -> lines written, and ``spans``
    (bus id, XID) -> [first line, last line], numbered from 1."""
    rng = random.Random(seed)
    pool = noise_messages(noise)
    texts = XID_TEXTS if noise == "boot" else XID_MIX
    xids = sorted(texts)
    usec = 0
    block: list[str] = []
    for number in range(1, lines + 1):
        usec += rng.randint(1, 10_000)
        if rng.random() < xid_fraction:
            gpu, xid = rng.choice(GPUS), rng.choice(xids)
            msg, prio = f"NVRM: Xid (PCI:{gpu}): {xid}, {texts[xid]}", 4
            if counts is not None:
                counts[(gpu, xid)] += 1
            if spans is not None:
                spans.setdefault((gpu, xid), [number, number])[1] = number
        else:
            msg, prio = rng.choice(pool), 6
        block.append(_stamp(form, usec, number - 1, prio) + msg + "\n")
        if len(block) >= 65_536:
            yield "".join(block).encode()
            block.clear()
    if block:
        yield "".join(block).encode()


def write(path: Path, lines: int, seed: int = 1, xid_fraction: float = 0.02, form: str | None = None,
          noise: str = "boot") -> dict:
    """Write the log to ``path`` and return what it holds: lines, bytes, XID lines, and per "bus xid" the count
    and the first and last line."""
    counts: Counter = Counter()
    spans: dict = {}
    size = 0
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        for chunk in generate(lines, seed, xid_fraction, counts, spans, form, noise):
            f.write(chunk)
            size += len(chunk)
    tmp.replace(path)
    sources = [str(SOURCE.relative_to(ROOT))] if noise == "boot" else \
        [str((MIX_DIR / n).relative_to(ROOT)) for n in MIX_SOURCES]
    return {"lines": lines, "bytes": size, "seed": seed, "xid_fraction": xid_fraction, "version": VERSION,
            "form": form or "dmesg-5", "noise": noise, "xid_lines": sum(counts.values()),
            "counts": {f"{gpu} {xid}": n for (gpu, xid), n in sorted(counts.items())},
            "lines_of": {f"{gpu} {xid}": spans[(gpu, xid)] for (gpu, xid) in sorted(spans)},
            "source": ", ".join(sources)}


def cached(directory: Path, lines: int, seed: int = 1, xid_fraction: float = 0.02, form: str | None = None,
           noise: str = "boot") -> tuple[Path, dict]:
    """The log for these arguments under ``directory``, made once and kept (with its counts beside it)."""
    directory.mkdir(parents=True, exist_ok=True)
    kind = "dmesg" if form is None and noise == "boot" else f"{form or 'dmesg-5'}-{noise}"
    path = directory / f"{kind}-{lines}-s{seed}-x{xid_fraction:g}-v{VERSION}.txt"
    meta_path = path.with_name(path.name + ".json")
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("bytes") == path.stat().st_size:
            return path, meta
    meta = write(path, lines, seed, xid_fraction, form, noise)
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return path, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--xid-fraction", type=float, default=0.02)
    ap.add_argument("--form", choices=FORMS, help="the log's form (default: dmesg with 5-place seconds, the first "
                                                   "benchmarks' form)")
    ap.add_argument("--noise", choices=NOISES, default="boot", help="what the other lines are (default: boot)")
    args = ap.parse_args(argv)
    if args.lines < 0 or not 0 <= args.xid_fraction <= 1:
        ap.error("--lines must be >= 0 and --xid-fraction within 0..1")
    json.dump(write(args.out, args.lines, args.seed, args.xid_fraction, args.form, args.noise), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

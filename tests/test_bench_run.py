"""bench/run's assembly of the table and JSON, its reading of other scripts' --json rows (and skipping of those that
have none), the generated kernel log and the exactness check against the real `gpuwarden analyze`. No figure of
time is asserted: the benchmark's numbers are its output, not a test's."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_run():
    loader = importlib.machinery.SourceFileLoader("gpuwarden_bench_run", str(ROOT / "bench/run"))
    spec = importlib.util.spec_from_loader("gpuwarden_bench_run", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


BENCH_RUN = _bench_run()
gen_kernel_log, peers = BENCH_RUN.gen_kernel_log, BENCH_RUN.peers


@pytest.fixture(scope="module")
def bench_run():
    return BENCH_RUN


def test_rows_table_markdown_and_json(bench_run):
    rows = [
        bench_run.row("analyze, 1M-line dmesg (76 MB), whole process: wall", 0.2, "s", peer=0.1,
                      peer_name="grep -c Xid", target="<= 3x grep", met=True, command="gpuwarden analyze --json X",
                      load={"before": [1.0, 1.0, 1.0], "after": [1.5, 1.0, 1.0]}),
        bench_run.row("analyze, 1M lines: peak RSS", 30.5, "MiB", peer=60.6, peer_name="gcm", target="< 64 MiB",
                      met=True),
        bench_run.normalise({"measure": "scrape, idle 8-GPU node", "ours": 4.0, "unit": "ms", "peer": 10.0,
                             "peer_name": "node_exporter", "target": "<= 0.5x node_exporter", "met": True},
                            "bench/scrape.py"),
        bench_run.skipped("bench/stream.py appended", "bench/stream.py is not in this tree", "python bench/…"),
        *bench_run.quoted_rows("bench/metrics_latency.py"),
    ]
    assert rows[0]["ratio"] == 2.0
    assert rows[2]["ratio"] == 0.4 and rows[2]["source"] == "bench/scrape.py"
    assert all(set(bench_run.ROW_KEYS) <= set(r) for r in rows)
    quoted = [r for r in rows if r.get("quoted")]
    assert len(quoted) == 2 and all("quoted" in r["peer_name"] and r["ours"] is None for r in quoted)

    table = bench_run.text_table(rows).splitlines()
    assert table[0].split() == bench_run.HEADER
    assert "2.00x" in table[1] and "yes" in table[1] and "200 ms" in table[1] and "100 ms (grep -c Xid)" in table[1]
    text = " ".join(" ".join(line.split()) for line in table)  # cells wrap onto following lines
    assert "skipped: bench/stream.py is" in text and "287 ms (node-problem-detector, quoted" in text
    for r in rows:  # every row's measure starts a line of its own
        assert any(line.startswith(r["measure"][:40]) for line in table), r["measure"]

    result = {"date": "2026-12-01 06:00 UTC", "command": "bench/run", "commit": "abc123",
              "machine": bench_run.machine(), "rows": rows,
              "load": {"loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [1.0, 1.0, 1.0]}}
    md = bench_run.markdown(result).splitlines()
    table_lines = [line for line in md if line.startswith("| ")]
    assert len(table_lines) == len(rows) + 1  # the header and a line per row
    assert "1.00 → 1.50" in table_lines[1] and "`gpuwarden analyze --json X`" in table_lines[1]
    assert json.loads(json.dumps(result))["rows"][3]["skipped"] == "bench/stream.py is not in this tree"


def test_fmt_units(bench_run):
    assert bench_run.fmt(0.0423, "s") == "42.3 ms"
    assert bench_run.fmt(8.8, "s") == "8.8 s"
    assert bench_run.fmt(5_300_000, "lines/s") == "5.3 M lines/s"
    assert bench_run.fmt(147_000, "lines/s") == "147 k lines/s"
    assert bench_run.fmt("0.07-0.08", "% of a core") == "0.07-0.08 % of a core"
    assert bench_run.fmt(None, "s") == "-"


def _script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_script_rows_read_and_skipped(bench_run, tmp_path):
    good = _script(tmp_path / "good.py", """
        import argparse, json
        ap = argparse.ArgumentParser(); ap.add_argument("mode"); ap.add_argument("--json")
        a = ap.parse_args()
        rows = [{"measure": "commit, 40 pairs", "ours": 2.0, "unit": "ms", "peer": None, "met": True,
                 "target": "flat", "detail": {"mode": a.mode}},
                {"measure": "commit, 1 pair", "ours": 1.0, "unit": "ms", "peer": 4.0}]
        json.dump({"rows": rows, "load": {"loadavg_before": [0, 0, 0]}}, open(a.json, "w"))
        """)
    old = _script(tmp_path / "old.py", """
        import argparse
        argparse.ArgumentParser().parse_args()
        """)
    silent = _script(tmp_path / "silent.py", "import sys\n")
    work = tmp_path / "work"
    work.mkdir()
    py = Path(sys.executable)

    rows = bench_run.script_rows("good", [str(good), "commit"], py, work, 60)
    assert [r["measure"] for r in rows] == ["commit, 40 pairs", "commit, 1 pair"]
    assert rows[0]["detail"]["mode"] == "commit" and rows[0]["detail"]["script_load"] == {"loadavg_before": [0, 0, 0]}
    assert rows[1]["ratio"] == 0.25 and rows[1]["peer_name"] is None and rows[1]["target"] is None
    assert all(r["source"] == "good" and r["load"]["before"] and not r.get("skipped") for r in rows)

    missing = bench_run.script_rows("gone", ["bench/no_such_script.py"], py, work, 60)
    assert len(missing) == 1 and missing[0]["skipped"] == "bench/no_such_script.py is not in this tree"
    rejected = bench_run.script_rows("old", [str(old)], py, work, 60)
    assert len(rejected) == 1 and rejected[0]["skipped"].startswith("exit 2: ")
    assert "unrecognized arguments: --json PATH" in rejected[0]["skipped"]
    empty = bench_run.script_rows("silent", [str(silent)], py, work, 60)
    assert len(empty) == 1 and empty[0]["skipped"].startswith("no rows in its --json output")


def test_generated_log_is_reproducible_and_counted(tmp_path):
    counts: Counter = Counter()
    first = b"".join(gen_kernel_log.generate(5000, seed=3, counts=counts))
    assert first == b"".join(gen_kernel_log.generate(5000, seed=3))
    assert first != b"".join(gen_kernel_log.generate(5000, seed=4))
    lines = first.decode().splitlines()
    assert len(lines) == 5000
    assert 65 <= len(first) / 5000 <= 90  # about 75 bytes a line, as the boot log it draws from
    xid_lines = [line for line in lines if "NVRM: Xid" in line]
    assert sum(counts.values()) == len(xid_lines) == sum(1 for line in lines if "Xid" in line)
    assert 0.01 < len(xid_lines) / 5000 < 0.03
    assert {gpu for gpu, _ in counts} == set(gen_kernel_log.GPUS)
    assert len({xid for _, xid in counts}) == len(gen_kernel_log.XID_TEXTS)
    stamps = [float(line[1:13]) for line in lines]
    assert stamps == sorted(stamps) and all(line[13:15] == "] " for line in lines)

    meta = gen_kernel_log.write(tmp_path / "log.txt", 5000, seed=3)
    assert (tmp_path / "log.txt").read_bytes() == first
    assert meta["xid_lines"] == len(xid_lines) and meta["bytes"] == len(first)
    for key, (lo, hi) in meta["lines_of"].items():
        bus, xid = key.split()
        assert f"PCI:{bus}): {xid}," in lines[lo - 1] and f"PCI:{bus}): {xid}," in lines[hi - 1]


def test_exactness_against_real_analyze(bench_run, tmp_path):
    log = tmp_path / "dmesg.txt"
    meta = gen_kernel_log.write(log, 3000, seed=7)
    report = tmp_path / "report.json"
    with open(report, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "analyze", "--json", str(log)],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode in (0, 1, 2), proc.stderr  # findings set the exit code; a crash would not be 0-2
    ok, note = bench_run.exact(report, meta)
    assert ok, note
    assert note.startswith(f"{len(meta['counts'])} (GPU, XID) pairs")

    key = next(iter(meta["counts"]))
    wrong = {**meta, "counts": {**meta["counts"], key: meta["counts"][key] + 1}}
    ok, note = bench_run.exact(report, wrong)
    assert not ok and "1 with another count/line" in note
    fewer = {**meta, "counts": {k: v for k, v in meta["counts"].items() if k != key}}
    ok, note = bench_run.exact(report, fewer)
    assert not ok and "1 not in the log" in note
    ok, note = bench_run.exact(tmp_path / "none.json", meta)
    assert not ok and note.startswith("no JSON report")



@pytest.mark.parametrize("form", gen_kernel_log.FORMS)
@pytest.mark.parametrize("noise", ["mixed", "long", "short"])
def test_every_mix_is_read_exactly_by_analyze(bench_run, tmp_path, form, noise):
    """The other machines' kernel logs of the benchmark, in each form: real noise (none of it an XID line), the
    lengths the mix asks for, and analyze's every (GPU, XID) count, first and last line equal to the generator's."""
    log = tmp_path / "log.txt"
    meta = gen_kernel_log.write(log, 4000, seed=5, xid_fraction=0.1, form=form, noise=noise)
    lines = log.read_text().splitlines()
    assert len(lines) == 4000 and meta["form"] == form and meta["noise"] == noise
    assert sum(meta["counts"].values()) == meta["xid_lines"] == sum("NVRM: Xid" in line for line in lines)
    assert 0.07 < meta["xid_lines"] / 4000 < 0.13 and len({k.split()[1] for k in meta["counts"]}) == 10
    noise_lines = gen_kernel_log.noise_messages(noise)
    assert not any("Xid" in m for m in noise_lines)
    lengths = sorted(len(m) for m in noise_lines)
    if noise == "long":
        assert lengths[0] > gen_kernel_log.LONG_MIN
    elif noise == "short":
        assert lengths[-1] <= gen_kernel_log.SHORT_MAX
    else:  # the other machines' logs: their subsystems are there
        text = "\n".join(noise_lines)
        assert all(word in text for word in ("usb", "EXT4", "mlx5", "audit", "IPv6", "nvidia-peermem"))
    report = tmp_path / "report.json"
    with open(report, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "analyze", "--json", str(log)],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    ok, note = bench_run.exact(report, meta)
    assert ok, note

def test_spawn_and_dmesg_shim(tmp_path):
    log = tmp_path / "saved.log"
    log.write_text("[    1.000000] NVRM: Xid (PCI:0000:19:00): 79, GPU has fallen off the bus.\n")
    shim = peers.dmesg_shim(tmp_path / "shim", log)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}")
    out = tmp_path / "out.txt"
    run = peers.spawn(["sh", "-c", "dmesg | grep -c NVRM:.Xid; exit 3"], env=env, stdout=out, timeout_s=60)
    assert run.rc == 3 and run.ok and out.read_text() == "1\n"
    assert run.max_rss_mib > 0 and run.wall_s > 0
    killed = peers.spawn(["sh", "-c", "sleep 60 & wait"], timeout_s=0.2)
    assert killed.rc is None and not killed.ok

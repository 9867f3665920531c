"""`gpuwarden explain` of a 1M-line job log beside `grep -c` of the same file: three generated mixes
(bench/gen_job_log.py: training noise, NCCL_DEBUG=INFO at full volume, 5 % failure lines) and the real logs of
fixtures/job_logs/ joined and repeated to the same length. Each program is one fresh process per run, run after run
interleaved, the file in the page cache; figures are medians.

Two greps: `grep -c NCCL` (what an operator types first) and `grep -c -F -f TEXTS` with the fixed texts the reader
looks for (agent/jobs/joblog_lines.NEEDLES: the same search explain's first pass makes).

gpuwarden is the working tree installed as a user installs it (a wheel, in a venv of bench/peers.product_venv, as
`bench/run` measures it); --here runs the gpuwarden beside this python instead (an editable tree: its start is
~20 ms longer).

    .venv/bin/python bench/explain.py [--lines 1000000] [--runs 3] [--json PATH] [--here]"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))


def _timed(argv: list[str]) -> tuple[float, int, int]:
    """Wall, exit code and peak RSS (KiB) of one fresh process. Its output goes to a file, not /dev/null: GNU grep
    stops at the first match when its output is /dev/null."""
    with tempfile.TemporaryFile() as out:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, proc.returncode, usage.ru_maxrss


def _peers():
    """bench/peers.py by its path (bench/ is not put on sys.path: its scripts' names are too plain)."""
    spec = importlib.util.spec_from_file_location("gpuwarden_bench_peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _real_logs(lines: int, path: Path) -> None:
    text = "".join((p.read_text() + "\n") for p in sorted((ROOT / "fixtures" / "job_logs").glob("*.log")))
    per = text.count("\n")
    with path.open("w") as f:
        for _ in range(lines // per):
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--here", action="store_true", help="the gpuwarden beside this python, not the installed wheel")
    args = p.parse_args(argv)
    from gpuwarden.agent.jobs.joblog_lines import NEEDLES

    gw = str((Path(sys.executable) if args.here else _peers().product_venv()).parent / "gpuwarden")
    print(f"gpuwarden: {gw}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = Path(tmp) / "texts"
        texts.write_bytes(b"\n".join(NEEDLES) + b"\n")
        logs = {}
        for mix in ("training", "nccl-info", "failures"):
            path = Path(tmp) / f"{mix}.log"
            with path.open("w") as f:
                subprocess.run([sys.executable, str(ROOT / "bench" / "gen_job_log.py"), "--lines", str(args.lines),
                                "--mix", mix], stdout=f, check=True)
            logs[mix] = path
        logs["real-logs-repeated"] = Path(tmp) / "real.log"
        _real_logs(args.lines, logs["real-logs-repeated"])
        for name, path in logs.items():
            # Into the page cache, read by another process: a file read here would count in the children's peak
            # RSS (a forked child's pages are its parent's until it execs).
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            runs: dict[str, list[float]] = {"explain": [], "grep NCCL": [], "grep texts": []}
            rss = 0
            code = None
            for _ in range(args.runs):
                wall, code, peak = _timed([gw, "explain", str(path), "--json"])
                runs["explain"].append(wall)
                rss = max(rss, peak)
                runs["grep NCCL"].append(_timed(["grep", "-c", "NCCL", str(path)])[0])
                runs["grep texts"].append(_timed(["grep", "-c", "-F", "-f", str(texts), str(path)])[0])
            med = {k: statistics.median(v) for k, v in runs.items()}
            row = {"log": name, "lines": args.lines, "bytes": path.stat().st_size, "exit": code,
                   "explain_s": round(med["explain"], 3), "grep_nccl_s": round(med["grep NCCL"], 3),
                   "grep_texts_s": round(med["grep texts"], 3),
                   "x_grep_nccl": round(med["explain"] / med["grep NCCL"], 1),
                   "x_grep_texts": round(med["explain"] / med["grep texts"], 1),
                   "explain_peak_rss_mib": round(rss / 1024, 1), "load1": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

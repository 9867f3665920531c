"""Wall time, CPU and peak RSS of one `gpuwarden preflight --root` per bundled recorded node, and of
`gpuwarden --version`, each a fresh process; beside Meta's gcm XID check on the same node's kernel log when its
`health_checks` is given (interleaved, so both see the same load).

Run: .venv/bin/python bench/preflight.py [--repeat 10] [--gpuwarden PATH] [--gcm PATH] [--json PATH]

The figure that counts is a user's: a non-editable install (an editable one adds its import finder to every
start). `bench/run` makes one and sets GPUWARDEN_BENCH_PYTHON (whose `gpuwarden` is used) and GPUWARDEN_BENCH_GCM.
Without --json it prints a table; with it, it writes the rows bench/run reads. It exits 0 when it measured, whether
or not a target was met; 1 when it could not (the command failed to give a report).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rows import write_rows

ROOT = Path(__file__).resolve().parent.parent
NODES = ROOT / "fixtures" / "nodes"
TARGET_S = 0.25  # the whole process of a one-shot preflight on a recorded node


def gpuwarden_argv(explicit: str | None) -> list[str]:
    """The `gpuwarden` to time: --gpuwarden, else the one beside GPUWARDEN_BENCH_PYTHON or this python, else this
    python's `-m gpuwarden.agent.cli`."""
    if explicit:
        return [explicit]
    for python in (os.environ.get("GPUWARDEN_BENCH_PYTHON"), sys.executable):
        if python and (Path(python).parent / "gpuwarden").is_file():
            return [str(Path(python).parent / "gpuwarden")]
    return [sys.executable, "-m", "gpuwarden.agent.cli"]


def spawn(argv: list[str], env: dict[str, str] | None = None, stdout: Path | None = None) -> dict:
    """One fresh process: wall time from spawn to reap, its CPU and peak RSS from wait4."""
    out = os.open(stdout or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
        t0 = time.perf_counter()
        pid = os.posix_spawnp(argv[0], argv, env or dict(os.environ), file_actions=actions)
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - t0
    finally:
        os.close(out)
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024,
            "rc": os.waitstatus_to_exitcode(status)}


def med(runs: list[dict], key: str) -> float | None:
    return round(statistics.median(r[key] for r in runs), 4) if runs else None


def dmesg_shim(folder: Path, kmsg: Path) -> dict[str, str]:
    """An environment whose `dmesg` prints the recorded node's kernel log (gcm's XID check runs `dmesg`)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "dmesg"
    shim.write_text(f"#!/bin/sh\nexec cat -- {shlex.quote(str(kmsg))}\n")
    shim.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}:{os.environ.get('PATH', '/usr/bin:/bin')}")


def gcm_argv(health_checks: str, log_folder: Path) -> list[str]:
    """gcm's XID check as a Slurm prolog runs it: no config file, telemetry to nowhere."""
    return [health_checks, "--config", "/dev/null", "check-syslogs", "xid", "bench", "prolog",
            "--log-folder", str(log_folder), "--sink", "do_nothing"]


def scenarios(names: list[str] | None) -> list[Path]:
    found = sorted(p.parent for p in NODES.glob("*/node.toml"))
    if names:
        by_name = {p.name: p for p in found}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SystemExit(f"bench/preflight.py: no recorded node {missing[0]!r} under {NODES}")
        return [by_name[n] for n in names]
    return found


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    ours_argv = gpuwarden_argv(args.gpuwarden)
    shown = "gpuwarden" if len(ours_argv) == 1 else shlex.join(ours_argv[1:]).replace(sys.executable, "python")
    rows = []
    version = [spawn([*ours_argv, "--version"]) for _ in range(args.repeat)]
    if any(r["rc"] != 0 for r in version):
        raise RuntimeError(f"{shlex.join([*ours_argv, '--version'])} exited {version[0]['rc']}")
    rows.append({"measure": "gpuwarden --version, whole process", "ours": med(version, "wall_s"), "unit": "s",
                 "peer": None, "peer_name": None, "ratio": None, "target": None, "met": None,
                 "command": f"{shown} --version",
                 "detail": {"runs": args.repeat, "cpu_s": med(version, "cpu_s"), "rss_mib": med(version, "rss_mib"),
                            "min_s": round(min(r["wall_s"] for r in version), 4)}})
    for node in scenarios(args.scenario):
        argv = [*ours_argv, "preflight", "--root", str(node), "--json"]
        report = work / "report.json"
        gcm_env = dmesg_shim(work / "shim" / node.name, node / "kmsg") if args.gcm and (node / "kmsg").is_file() \
            else None
        ours, peer = [], []
        for i in range(args.repeat):
            ours.append(spawn(argv, stdout=report if i == 0 else None))
            if i == 0:
                try:
                    verdict = json.loads(report.read_text())["status"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise RuntimeError(f"{shlex.join(argv)} gave no report ({exc}); exit {ours[0]['rc']}") from None
            if gcm_env:
                peer.append(spawn(gcm_argv(args.gcm, work / "gcm-logs"), env=gcm_env))
        wall, peer_wall = med(ours, "wall_s"), med(peer, "wall_s")
        rows.append({
            "measure": f"preflight on a recorded node ({node.name}), whole process", "ours": wall, "unit": "s",
            "peer": peer_wall,
            "peer_name": "gcm, one check (check-syslogs xid)" if gcm_env else None,
            "ratio": round(wall / peer_wall, 3) if wall and peer_wall else None,
            "target": f"< {TARGET_S:g} s", "met": wall < TARGET_S,
            "command": f"{shown} preflight --root {node.relative_to(ROOT)} --json",
            "detail": {"runs": args.repeat, "verdict": verdict, "exit_codes": sorted({r["rc"] for r in ours}),
                       "min_s": round(min(r["wall_s"] for r in ours), 4), "cpu_s": med(ours, "cpu_s"),
                       "rss_mib": med(ours, "rss_mib"), "gcm_cpu_s": med(peer, "cpu_s"),
                       "gcm_rss_mib": med(peer, "rss_mib"), "gcm_exit_codes": sorted({r["rc"] for r in peer})}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=10, help="fresh processes per row (default 10)")
    ap.add_argument("--scenario", action="append", metavar="NAME",
                    help="a recorded node under fixtures/nodes (repeatable; default: every one)")
    ap.add_argument("--gpuwarden", metavar="PATH", help="the gpuwarden command to time (default: see above)")
    ap.add_argument("--gcm", metavar="PATH", default=os.environ.get("GPUWARDEN_BENCH_GCM") or None,
                    help="gcm's health_checks, to run its XID check beside each preflight "
                         "(default: $GPUWARDEN_BENCH_GCM; none: no peer)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.gcm and not shutil.which(args.gcm):
        ap.error(f"--gcm {args.gcm}: not an executable")
    before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-preflight-") as tmp:
        try:
            rows = measure(args, Path(tmp))
        except RuntimeError as exc:
            print(f"bench/preflight.py: could not measure: {exc}", file=sys.stderr)
            return 1
    if args.json:
        write_rows(args.json, rows, before, nproc=os.cpu_count())
        return 0
    for r in rows:
        d = r["detail"]
        peer = f"; {r['peer_name']} {r['peer'] * 1000:.0f} ms (x{r['ratio']})" if r["peer"] else ""
        met = "" if r["met"] is None else ("  met" if r["met"] else "  NOT met") + f" ({r['target']})"
        print(f"{r['measure']:<62} wall median {r['ours'] * 1000:4.0f} ms (min {d['min_s'] * 1000:.0f}), "
              f"CPU {d['cpu_s'] * 1000:.0f} ms, peak RSS {d['rss_mib']:.1f} MiB{peer}{met}")
    print(f"load average before {before}, after {list(os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

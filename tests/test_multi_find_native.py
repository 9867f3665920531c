"""agent/core/_multi_find.h, the one pass of C that looks for many texts at once (the job-log reader's search): alone,
without Python, each of its routes finds the lines a plain search finds, on hostile buffers, and reads nothing past a
region (tests/native/multi_find_check.c, built with the address sanitizer). Its 16-byte route (NEON's tbl) is the
one an aarch64 node runs (GB200/GB300's Grace): built for aarch64 and run under qemu where a cross compiler and
qemu-user are installed (CI installs both)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from gpuwarden.agent.jobs.joblog_lines import NEEDLES

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "native" / "multi_find_check.c"
FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi") / "texts"
    path.write_bytes(b"\n".join(NEEDLES) + b"\n")
    return path


def _run(argv: list[str], texts: Path, seed: int, rounds: int) -> str:
    proc = subprocess.run([*argv, str(texts), str(seed), str(rounds)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_every_route_of_the_one_pass_finds_the_lines_a_plain_search_finds_and_reads_no_byte_past_a_region(
        texts, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    exe = tmp_path / "multi_find_check"
    subprocess.run([cc, *FLAGS, "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-o", str(exe),
                    str(CHECK)], check=True, timeout=120)
    out = _run([str(exe)], texts, 1, 20000)
    assert out.splitlines()[-1] == "ok 20000 rounds", out
    if Path("/proc/cpuinfo").read_text().find(" avx2") >= 0:
        assert out.splitlines()[0] == "routes: scalar vec16 avx2", out


def test_the_one_pass_on_aarch64_under_qemu_finds_the_same_lines(texts, tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if not (cross and qemu):
        pytest.skip("no aarch64-linux-gnu-gcc or no qemu-aarch64-static here (CI installs gcc-aarch64-linux-gnu, "
                    "libc6-dev-arm64-cross and qemu-user-static)")
    exe = tmp_path / "multi_find_check.aarch64"
    subprocess.run([cross, *FLAGS, "-static", "-o", str(exe), str(CHECK)], check=True, timeout=120)
    out = _run([qemu, str(exe)], texts, 2, 5000)
    assert out.splitlines() == ["routes: scalar vec16", "ok 5000 rounds"], out
    # the 16-byte route's table lookups are NEON's tbl there
    asm = subprocess.run([cross, "-O2", "-S", "-o", "-", str(CHECK)], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert "\ttbl\t" in asm

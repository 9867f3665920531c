"""The Debian package as an operator gets it: built from this tree (packaging/build-deb), lintian-clean, installed
with dpkg -i, the installed program run on recorded nodes, the daemon's unit enabled and valid, the man page
rendered, the config a conffile, and a purge that leaves nothing of the package behind.

Installs into this machine's root file system (needs root); the package is purged at the end even when a test
fails, and the test is skipped on a machine where gpuwarden is already installed or has a config or state."""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from conftest import NODES, ROOT

pytestmark = pytest.mark.slow

PACKAGE = "gpuwarden"
VENV = Path("/opt/venvs/gpuwarden")
UNITS = Path("/lib/systemd/system")
WANTS = Path("/etc/systemd/system/multi-user.target.wants/gpuwarden.service")
OWN_DIRS = (Path("/etc/gpuwarden"), Path("/var/lib/gpuwarden"), VENV, Path("/usr/share/doc/gpuwarden"),
            Path("/usr/share/gpuwarden"), Path("/usr/lib/gpuwarden"))
# Only what the installed program sees: nothing of this test's virtualenv or source tree.
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}


def sh(*cmd, check=False, env=None, cwd="/", timeout=300, input=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env or CLEAN_ENV, input=input)
    if check:
        assert proc.returncode == 0, f"{cmd}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def systemd_links() -> set[Path]:
    """Everything under /etc/systemd/system (the units' enable links and their folders)."""
    return set(Path("/etc/systemd/system").rglob("*"))


def installed_version() -> str | None:
    q = sh("dpkg-query", "-W", "-f", "${db:Status-Status} ${Version}", PACKAGE)
    status, _, version = q.stdout.partition(" ")
    return version if q.returncode == 0 and status not in ("", "not-installed", "config-files") else None


def purge() -> subprocess.CompletedProcess:
    return sh("dpkg", "--purge", PACKAGE, timeout=300)


@pytest.fixture(scope="module")
def installed(built_deb):
    """The package installed with dpkg -i; the file list dpkg recorded, and what /opt/venvs was before."""
    if os.geteuid() != 0:
        pytest.skip("installs a Debian package: needs root")
    if installed_version() is not None or sh("dpkg-query", "-W", PACKAGE).returncode == 0:
        pytest.skip("gpuwarden is already known to dpkg on this machine; the test would replace or purge it")
    full = [d for d in OWN_DIRS if d.is_dir() and any(d.iterdir()) or d.exists() and not d.is_dir()]
    if full:
        pytest.skip(f"{full[0]} holds files this test did not make, and the purge would remove them")
    empty = [d for d in OWN_DIRS if d.is_dir()]  # put back after the purge, as they were found
    opt_venvs_existed = Path("/opt/venvs").exists()
    links_before = systemd_links()
    try:
        install = sh("dpkg", "-i", built_deb, timeout=300)
        assert install.returncode == 0, install.stdout + install.stderr
        files = sh("dpkg-query", "-L", PACKAGE, check=True).stdout.split("\n")
        yield {"files": [Path(f) for f in files if f.startswith("/")], "opt_venvs_existed": opt_venvs_existed,
               "links_before": links_before}
    finally:
        if installed_version() is not None or sh("dpkg-query", "-W", PACKAGE).returncode == 0:
            purge()
        for d in empty:
            d.mkdir(parents=True, exist_ok=True)


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_lintian_reports_no_error_or_warning(built_deb):
    if not shutil.which("lintian"):
        pytest.fail("lintian not installed (apt install lintian)")
    proc = sh("lintian", "--no-tag-display-limit", built_deb, timeout=300)
    tags = [line for line in proc.stdout.splitlines() if line.startswith(("E:", "W:"))]
    assert tags == [], "\n".join(tags)
    # The overrides used are the ones the package ships, each with its reason.
    overrides = (ROOT / "packaging" / "debian" / "gpuwarden.lintian-overrides").read_text().split("\n\n")
    assert overrides and all(block.lstrip().startswith("#") for block in overrides if block.strip())


def test_package_metadata(built_deb):
    info = sh("dpkg-deb", "-f", built_deb, "Package", "Version", "Architecture", "Depends", check=True).stdout
    fields = dict(line.split(": ", 1) for line in info.splitlines())
    assert fields["Package"] == PACKAGE and fields["Version"] == pyproject_version()
    minor = sh("/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])", check=True).stdout
    assert f"python{minor.strip()}" in fields["Depends"]  # the interpreter the venv was built with
    contents = sh("dpkg-deb", "-c", built_deb, check=True).stdout
    assert "__pycache__" not in contents  # bytecode is made on the node (postinst), not shipped
    assert "torch" not in contents


def test_the_installed_program_runs(installed, tmp_path):
    version = sh("/usr/bin/gpuwarden", "--version", cwd=tmp_path, check=True).stdout.strip()
    assert version == f"gpuwarden {pyproject_version()}"
    assert Path("/usr/bin/gpuwarden").resolve() == VENV / "bin" / "gpuwarden"
    where = sh(VENV / "bin" / "python", "-c", "import gpuwarden.agent, lightkube; print(gpuwarden.agent.__file__)",
               cwd=tmp_path, check=True).stdout
    assert where.startswith(str(VENV / "lib")), where  # the package's own copy, with the kubernetes extra
    assert Path(os.readlink(VENV / "bin" / "python3")).is_relative_to("/usr/bin")  # Debian's interpreter
    assert list((VENV / "lib").glob("python3*/site-packages/gpuwarden/agent/__pycache__/cli.*.pyc"))  # postinst


def test_installed_preflight_on_recorded_nodes(installed, tmp_path):
    healthy = sh("/usr/bin/gpuwarden", "preflight", "--root", NODES / "h100-hgx-healthy", cwd=tmp_path)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    faulty = sh("/usr/bin/gpuwarden", "preflight", "--root", NODES / "gb200-nvl72-faulty", "--json", cwd=tmp_path)
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    assert '"79"' in faulty.stdout  # the XID catalogue's data file is in the package


def test_daemon_unit_is_enabled_and_verifies(installed):
    assert WANTS.is_symlink() and Path(os.readlink(WANTS)) == UNITS / "gpuwarden.service"
    # systemctl reads the unit files offline (no systemd as PID 1 needed).
    assert sh("systemctl", "--root=/", "is-enabled", "gpuwarden.service").stdout.strip() == "enabled"
    units = sorted(p for p in installed["files"] if p.parent == UNITS)
    assert {p.name for p in units} >= {"gpuwarden.service"}
    assert {p.name for p in units} == {p.name for p in (ROOT / "systemd").iterdir()
                                       if p.suffix in (".service", ".socket", ".slice", ".timer")}
    for unit in units:
        if unit.name != "gpuwarden.service":  # the boot preflight is the operator's to enable (docs/install.md)
            assert sh("systemctl", "--root=/", "is-enabled", unit.name).stdout.strip() != "enabled", unit
    if not shutil.which("systemd-analyze"):
        pytest.fail("systemd-analyze not installed (apt install systemd)")
    verify = sh("systemd-analyze", "verify", *units)
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr


def test_man_page_renders_without_warnings(installed):
    page = Path("/usr/share/man/man1/gpuwarden.1.gz")
    assert page in installed["files"]
    missing = [tool for tool in ("groff", "man") if not shutil.which(tool)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed (apt install groff-base man-db)")
    roff = gzip.decompress(page.read_bytes()).decode()
    groff = sh("groff", "-man", "-Tutf8", "-ww", "-z", input=roff)
    assert groff.returncode == 0 and groff.stderr == "", groff.stderr
    man = sh("man", "--warnings", "-l", page, env={**CLEAN_ENV, "MANWIDTH": "100", "MANPAGER": "cat"})
    assert man.returncode == 0 and man.stderr == "", man.stderr
    for section in ("NAME", "SYNOPSIS", "COMMANDS", "EXIT STATUS", "FILES", "SEE ALSO"):
        assert f"\n{section}\n" in man.stdout
    assert "gpuwarden preflight" in man.stdout and "--check-timeout" in man.stdout


def test_config_is_a_conffile_with_the_shipped_defaults(installed):
    conffiles = sh("dpkg-query", "-W", "-f", "${Conffiles}", PACKAGE, check=True).stdout.split()
    assert "/etc/gpuwarden/gpuwarden.toml" in conffiles
    assert Path("/etc/gpuwarden/gpuwarden.toml").read_text() == (ROOT / "packaging" / "gpuwarden.toml").read_text()
    # The installed program reads it (every key commented out: the defaults) without a word.
    checks = sh("/usr/bin/gpuwarden", "preflight", "--config", "/etc/gpuwarden/gpuwarden.toml", "--checks", "xid",
                "--root", NODES / "h100-hgx-healthy")
    assert checks.returncode == 0, checks.stderr


def test_docs_and_shared_files_are_where_the_units_point(installed):
    doc = Path("/usr/share/doc/gpuwarden")
    assert (doc / "README.md").is_file()  # uncompressed: the unit's Documentation= names it
    assert {p.name for p in (doc / "docs").iterdir()} == {p.name for p in (ROOT / "docs").glob("*.md")}
    copyright_ = (doc / "copyright").read_text()
    assert copyright_.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
    assert "License: Apache-2.0" in copyright_
    assert (doc / "changelog.gz").is_file()
    for part in ("prometheus", "grafana", "slurm"):
        src = ROOT / "packaging" / part
        for f in (p for p in src.rglob("*") if p.is_file()) if src.is_dir() else ():
            rel = f.relative_to(src)
            executable = os.access(f, os.X_OK)  # scripts go to /usr/lib/gpuwarden, the rest is data
            dst = Path("/usr/lib/gpuwarden") / rel if executable else Path("/usr/share/gpuwarden") / part / rel
            assert dst.read_bytes() == f.read_bytes(), dst


def test_purge_leaves_nothing(installed):
    files = installed["files"]
    # What the running service makes (systemd's StateDirectory=) and an operator's edits go too.
    Path("/var/lib/gpuwarden").mkdir(exist_ok=True)
    Path("/var/lib/gpuwarden/state.db").write_text("")
    Path("/etc/gpuwarden/gpuwarden.toml").write_text('[agent]\nlevel = "full"\n')
    sh("/usr/bin/gpuwarden", "checks", check=True)  # runs the installed program as root once more
    for unit in (p for p in files if p.parent == UNITS and p.name != "gpuwarden.service" and p.suffix == ".service"):
        sh("systemctl", "--root=/", "enable", unit.name, check=True)  # what an operator does (docs/install.md)

    removed = purge()
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert sh("dpkg-query", "-W", PACKAGE).returncode != 0  # dpkg has forgotten the package
    left = [p for p in files if (p.exists() or p.is_symlink()) and not p.is_dir()]
    assert left == []
    left_dirs = [d for d in OWN_DIRS if d.exists()]
    assert left_dirs == []
    assert not WANTS.is_symlink()
    # Every enable link, the operator's too, and the folders made for them (others may change this folder meanwhile).
    new = systemd_links() - installed["links_before"]
    assert [p for p in new if "gpuwarden" in p.name or p.is_dir() and not any(p.iterdir())] == []
    if not installed["opt_venvs_existed"]:
        assert not Path("/opt/venvs").exists()

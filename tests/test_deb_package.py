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
from conftest import NODES, ROOT, end_processes, host_etc_gpuwarden

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
    with host_etc_gpuwarden():  # no private systemd of another module makes or uses /etc/gpuwarden meanwhile
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
    assert list((VENV / "lib").glob("python3*/site-packages/gpuwarden/agent/cli/__pycache__/main.*.pyc"))  # postinst


def test_the_installed_package_has_the_log_readers_c_parts(installed, tmp_path):
    """debian/rules stops a build whose optional C parts did not compile (setuptools would skip them silently, and
    the log readers would run at Python speed): the installed package has both, with the job-log search's one pass."""
    out = sh(VENV / "bin" / "python", "-c", "from gpuwarden.agent.core import _line_scan, _log_rows; "
             "print(_line_scan.MULTI_ROUTE)", cwd=tmp_path, check=True).stdout.strip()
    assert out in {"avx2", "vec16"}, out


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
    for unit in units:  # `systemctl help UNIT` opens these: each is a file of the package
        for line in unit.read_text().splitlines():
            if line.startswith("Documentation="):
                for doc in line.split("=", 1)[1].split():
                    if doc.startswith("file://"):
                        assert Path(doc[len("file://"):]) in installed["files"], (unit.name, doc)


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


def test_a_new_user_gets_the_installed_agent_running_under_systemd_and_scraped_by_prometheus(installed, tmp_path):
    """The README's Install section, step by step, with the package this tree built: the conffile edited (only the
    listen address: tests use 127.0.0.1 and a free port), the installed unit started by a real systemd (a private
    PID 1: this machine's own is not systemd), then a real Prometheus started with the installed scrape job and
    rules, pointed at the agent."""
    import yaml
    from conftest import wait_for
    from systemd_harness import PrivateSystemd, missing
    from test_daemon import free_port
    from test_dashboard import get, has_data, query  # the Prometheus HTTP API, as the dashboard test reads it

    if missing():
        pytest.fail(f"a private systemd cannot start here: {missing()}")
    if not shutil.which("prometheus"):
        pytest.fail("prometheus not installed (apt install prometheus)")
    conf = Path("/etc/gpuwarden/gpuwarden.toml")
    shipped = conf.read_text()
    port = free_port()
    # The one edit: uncomment the listen key and give it an address (as `editor /etc/gpuwarden/gpuwarden.toml`).
    assert shipped.count('\n#listen = "0.0.0.0:9456"\n') == 1, "the sample's listen line changed"
    conf.write_text(shipped.replace('\n#listen = "0.0.0.0:9456"\n', f'\nlisten = "127.0.0.1:{port}"\n'))
    shared = Path("/usr/share/gpuwarden/prometheus")
    procs: list[subprocess.Popen] = []
    try:
        with PrivateSystemd() as systemd:
            systemd.daemon_reload()  # sees the unit dpkg put in /lib and enabled in /etc
            assert systemd.systemctl("is-enabled", "gpuwarden.service", check=False).stdout.strip() == "enabled"
            systemd.systemctl("start", "gpuwarden.service")  # what the package's postinst does where systemd runs
            unit = systemd.wait_active("gpuwarden.service", timeout=60)  # Type=notify: active once READY=1 came
            assert unit["SubState"] == "running", unit
            exe = systemd.nsenter("readlink", f"/proc/{unit['MainPID']}/exe").stdout.strip()
            assert exe.startswith("/usr/bin/python3"), exe  # Debian's interpreter, through the package's venv

            # Prometheus with the installed scrape job and rules, side by side as installed.
            prom = tmp_path / "prometheus"
            prom.mkdir()
            shutil.copy(shared / "gpuwarden-rules.yml", prom / "gpuwarden-rules.yml")
            cfg = yaml.safe_load((shared / "prometheus-scrape.yml").read_text())
            cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
            (job,) = cfg["scrape_configs"]
            job.update(scrape_interval="1s", scrape_timeout="1s")
            job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
            (prom / "prometheus.yml").write_text(yaml.safe_dump(cfg))
            check = sh("promtool", "check", "config", prom / "prometheus.yml")
            assert check.returncode == 0, check.stdout + check.stderr
            prom_port = free_port()
            procs.append(subprocess.Popen(
                ["prometheus", f"--config.file={prom / 'prometheus.yml'}", f"--storage.tsdb.path={prom / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                stderr=open(prom / "prometheus.log", "wb")))
            api = f"http://127.0.0.1:{prom_port}"
            wait_for(lambda: has_data(api, 'up{job="gpuwarden", instance="127.0.0.1"} == 1')
                     and has_data(api, "gpuwarden_node_state == 1"), timeout_s=90,
                     what="Prometheus to scrape the installed agent")
            (build,) = query(api, "gpuwarden_build_info")[1]
            assert build["metric"]["version"] == pyproject_version()
            (state,) = query(api, "gpuwarden_node_state == 1")[1]
            assert state["metric"]["job"] == "gpuwarden" and state["metric"]["instance"] == "127.0.0.1"
            groups = get(f"{api}/api/v1/rules")["data"]["groups"]
            rules = [rule for g in groups for rule in g["rules"]]
            assert rules and all(rule["health"] in ("ok", "unknown") for rule in rules), \
                [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] == "err"]

            # The operator's look at the node, with the installed program, where the unit keeps its state.
            status = systemd.nsenter("/usr/bin/gpuwarden", "status", check=False)
            assert status.returncode == 0 and "state" in status.stdout, status.stdout + status.stderr
            assert systemd.show("gpuwarden.service", "NRestarts")["NRestarts"] == "0", \
                systemd.output("gpuwarden.service")[-3000:]
    finally:
        end_processes(*procs)
        conf.write_text(shipped)


def test_purge_leaves_nothing(installed):
    files = installed["files"]
    # What the running service makes (systemd's StateDirectory=) and an operator's edits go too.
    Path("/var/lib/gpuwarden").mkdir(exist_ok=True)
    Path("/var/lib/gpuwarden/state.db").write_text("")
    # An operator's edit that changes nothing: another module's program reading the default config meanwhile
    # sees the defaults still.
    conf = Path("/etc/gpuwarden/gpuwarden.toml")
    conf.write_text(conf.read_text() + "# edited on this node\n")
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

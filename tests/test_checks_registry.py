"""checks.CONCERNS (which modules hold which check's forms, and at which preflight level) says what the modules say,
and a preflight that imports only the checks it runs knows every table it must: the config a lazily loaded preflight
builds is the one built from every check."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import gpuwarden.checks as checks
import pytest
from conftest import NODES, ROOT
from gpuwarden.agent.core import config
from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.passive import KernelConsumer, PassiveSpec


def scanned() -> dict[str, dict[str, list]]:
    """Every form found in the modules themselves: concern name -> module -> forms."""
    found: dict[str, dict[str, list]] = {}
    for info in pkgutil.iter_modules(checks.__path__):
        module = getattr(checks, info.name)
        for value in vars(module).values():
            if isinstance(value, (CheckSpec, PassiveSpec, KernelConsumer)):
                found.setdefault(value.name, {}).setdefault(info.name, []).append(value)
    return found


def test_concerns_name_every_module_holding_a_form_and_the_level_its_check_says():
    found = scanned()
    assert set(checks.NAMES) == set(found) == {s.name for s in checks.all_specs()}
    for name, level, modules in checks.CONCERNS:
        assert set(modules) == set(found[name]), name
        checks_here = [s for m in modules for s in found[name][m] if isinstance(s, CheckSpec)]
        if level is None:
            assert not checks_here, name
        else:
            assert [s.level for s in checks_here] in ([], [level]), name  # none: the daemon's form judged in one look
            assert checks.preflight_form(name).level == level, name
    assert list(checks.PREFLIGHT_NAMES) == [s.name for s in checks.ALL]
    every = [s for per in found.values() for forms in per.values() for s in forms]
    assert {id(s) for s in every if isinstance(s, PassiveSpec)} == {id(s) for s in checks.PASSIVE}
    assert {id(s) for s in every if isinstance(s, KernelConsumer)} == {id(s) for s in checks.KERNEL_CONSUMERS}


def test_each_concerns_forms_give_the_table_every_check_gives():
    whole = config.defaults(checks.all_specs())
    for name in checks.NAMES:
        part = config.defaults(checks.forms([name]))
        assert part.checks[name] == whole.checks[name], name
        mine = {k: t for k, t in part.list_types.items() if k.startswith(f"checks.{name}.")}
        assert mine == {k: t for k, t in whole.list_types.items() if k.startswith(f"checks.{name}.")}, name
        assert part.shared.get(name) == whole.shared.get(name), name
        assert {k: v for k, v in config.spec_choices(checks.forms([name])).items() if k.startswith(f"checks.{name}.")} \
            == {k: v for k, v in config.spec_choices(checks.all_specs()).items() if k.startswith(f"checks.{name}.")}
    # a check reading another's key brings that check's table with it
    assert {s.name for s in checks.forms(["rdma_loopback"])} == {"rdma_loopback", "ib_port"}


def test_chosen_picks_by_level_or_name_in_order():
    assert [s.name for s in checks.chosen([], "quick")] == [s.name for s in checks.ALL if s.level == "quick"]
    assert [s.name for s in checks.chosen([], "full")] == [s.name for s in checks.ALL]
    assert [s.name for s in checks.chosen(["burnin", "xid"], "quick")] == ["burnin", "xid"]
    with pytest.raises(ValueError, match="unknown check 'clock_events'"):
        checks.chosen(["clock_events"], "quick")  # the daemon's only: no preflight form


def test_a_config_loaded_lazily_checks_the_tables_its_file_sets(tmp_path):
    path = tmp_path / "gpuwarden.toml"
    path.write_text('[agent]\nchecks = ["rdma_loopback"]\n[checks.burnin]\nseconds = 5.0\n'
                    '[checks.ib_port]\nignore_ports = ["mlx5_3/1"]\n')
    cfg = config.load((), path, names=checks.NAMES, forms=checks.forms)
    assert cfg.checks["burnin"]["seconds"] == 5.0
    config.extend(cfg, checks.forms(s.name for s in checks.chosen(cfg.agent["checks"], "quick")))
    whole = config.load(checks.all_specs(), path)
    for name in ("rdma_loopback", "ib_port", "burnin"):
        assert cfg.for_check(name) == whole.for_check(name), name
    assert cfg.for_check("rdma_loopback")["ignore_ports"] == ["mlx5_3/1"]  # read from [checks.ib_port]
    path.write_text("[checks.burnin]\n[checks.xid]\n")  # tables that set nothing: no check is loaded for them
    cfg = config.load((), path, names=checks.NAMES, forms=checks.forms)
    assert not cfg.checks
    config.extend(cfg, checks.forms(["burnin"]))
    assert cfg.for_check("burnin") == config.defaults(checks.all_specs()).for_check("burnin")
    path.write_text("[checks.burnin]\nsecond = 5.0\n")
    with pytest.raises(ConfigError, match="unknown key 'checks.burnin.second'"):
        config.load((), path, names=checks.NAMES, forms=checks.forms)
    path.write_text("[checks.burnon]\n")
    with pytest.raises(ConfigError, match="unknown check 'checks.burnon'"):
        config.load((), path, names=checks.NAMES, forms=checks.forms)


def checks_in(stderr: str) -> set[str]:
    line = [x for x in stderr.splitlines() if x.startswith("CHECKS")]
    assert line, stderr
    return {m.removeprefix("gpuwarden.checks.") for m in line[-1].split()[1:]}


def test_a_quick_preflight_imports_only_the_checks_it_runs(tmp_path):
    code = ("import sys\nfrom gpuwarden.agent.cli.main import main\n"
            "rc = main(sys.argv[1:])\n"
            "print('CHECKS', *sorted(m for m in sys.modules if m.startswith('gpuwarden.checks.')), file=sys.stderr)\n"
            "sys.exit(rc)\n")
    run = [sys.executable, "-c", code, "preflight", "--root", str(NODES / "h100-hgx-healthy"), "--json"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = checks_in(proc.stderr)
    quick = {m for name, level, modules in checks.CONCERNS if level == "quick" for m in modules}
    assert quick <= loaded
    assert not loaded & {m for name, level, modules in checks.CONCERNS if level != "quick" for m in modules}
    # the packaged config names every check's table, with every key commented out: nothing more is loaded
    proc = subprocess.run([*run, "--config", str(ROOT / "packaging" / "gpuwarden.toml")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert checks_in(proc.stderr) == loaded
    # a check whose table the config file sets is loaded, and only it
    path = tmp_path / "gpuwarden.toml"
    path.write_text('[agent]\nchecks = ["xid"]\n[checks.thermal]\nsustain_s = 30.0\n[checks.burnin]\n')
    proc = subprocess.run([*run, "--config", str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = checks_in(proc.stderr)
    assert {"xid", "thermal"} <= loaded and not loaded & {"burnin", "ecc", "ib_port", "pcie_aer"}

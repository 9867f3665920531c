"""The concerns are found from the package (each module's CONCERN, read without importing it) and say what the modules
hold; a new module in checks/ is picked up with no other edit; and a preflight that imports only the checks it runs
knows every table it must: the config a lazily loaded preflight builds is the one built from every check."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import textwrap
import tomllib

import gpuwarden.checks as checks
import pytest
from conftest import NODES, ROOT
from gpuwarden.agent.core import config
from gpuwarden.agent.core.check import CheckSpec
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.passive import KernelConsumer, PassiveSpec

KINDS = {"look": (CheckSpec, PassiveSpec), "poll": (PassiveSpec,), "kernel": (KernelConsumer,)}


def scanned() -> dict[str, dict[str, list]]:
    """Every form found in the modules themselves: concern name -> module -> forms."""
    found: dict[str, dict[str, list]] = {}
    for info in pkgutil.iter_modules(checks.__path__):
        module = getattr(checks, info.name)
        for value in vars(module).values():
            if isinstance(value, (CheckSpec, PassiveSpec, KernelConsumer)):
                found.setdefault(value.name, {}).setdefault(info.name, []).append(value)
    return found


def test_the_concerns_found_are_what_the_modules_declare_and_hold():
    found = scanned()
    assert set(checks.NAMES) == set(found) == {s.name for s in checks.all_specs()}
    declaring = {info.name for info in pkgutil.iter_modules(checks.__path__)
                 if hasattr(getattr(checks, info.name), "CONCERN")}
    assert declaring == set(checks.NAMES)  # a helper (parse_*, xid_log, ecc_watch, ...) declares none
    rules = tomllib.loads((ROOT / "agent" / "jobs" / "doom_rules.toml").read_text())["rule"]
    for concern in checks.CONCERNS:
        name = concern.name
        assert getattr(checks, name).CONCERN == concern, name  # the statement read is the object built
        assert set(checks.modules_of(concern)) == set(found[name]), name
        for which in concern.parts():
            form = checks.part(concern, which)
            assert isinstance(form, KINDS[which]) and form.name == name, (name, which)
        held = [s for per in found[name].values() for s in per]
        assert {type(s) for s in held} == {type(checks.part(concern, w)) for w in concern.parts()}, name
        checks_here = [s for s in held if isinstance(s, CheckSpec)]
        if concern.level is None:
            assert not checks_here, name
        else:
            assert [s.level for s in checks_here] in ([], [concern.level]), name  # none: the poll in one look
            assert checks.preflight_form(name).level == concern.level, name
        fmts = [a.fmt for a in checks.preflight_form(name).analyzers] if concern.level else []
        assert list(concern.analyze) == fmts + (["kernel-log"] if "kernel-log" in concern.analyze else []), name
        assert concern.doom == tuple(r["name"] for r in rules if r.get("check") == name), name
    assert list(checks.PREFLIGHT_NAMES) == [s.name for s in checks.ALL]
    assert [c.order for c in checks.CONCERNS] == sorted(c.order for c in checks.CONCERNS)
    every = [s for per in found.values() for forms in per.values() for s in forms]
    assert {id(s) for s in every if isinstance(s, PassiveSpec)} == {id(s) for s in checks.PASSIVE}
    assert {id(s) for s in every if isinstance(s, KernelConsumer)} == {id(s) for s in checks.KERNEL_CONSUMERS}


def test_the_orders_are_the_reports_and_the_daemons():
    # outputs: the report's order, analyze's, the daemon's start line and a job's evidence window
    assert checks.NAMES == ("xid", "nvswitch_sxid", "ecc", "ib_port", "pcie_link", "nvlink_lanes", "fabric",
                            "pcie_aer", "jobs", "burnin", "peer_p2p", "nccl_allreduce", "rdma_loopback",
                            "dcgm_diag", "ecc_memtest", "clock_events", "thermal", "nccl_sweep")
    assert [s.name for s in checks.PASSIVE] == ["ib_port", "clock_events", "thermal", "nvlink_lanes", "pcie_aer",
                                                "fabric", "ecc", "nccl_sweep", "jobs"]
    assert [c.name for c in checks.KERNEL_CONSUMERS] == ["xid", "pcie_aer", "nvswitch_sxid"]
    assert [c.name for c in checks.log_readers()] == ["xid", "nvswitch_sxid"]


PROBE = textwrap.dedent("""\
    \"\"\"A check no list names: found because it is here.\"\"\"
    from gpuwarden.agent.core.check import CheckSpec, Concern

    CHECK = CheckSpec(name="probe", summary="finds nothing", run=lambda node, cfg: (), defaults={"answer": 42})

    CONCERN = Concern(
        name="probe", order=55, level="quick", look="CHECK",
    )
    """)


def test_a_new_module_in_checks_is_picked_up_with_no_other_edit(tmp_path):
    # The package gets one more folder on its path holding the new module, as a file dropped into checks/ would be.
    (tmp_path / "probe.py").write_text(PROBE)
    code = textwrap.dedent(f"""\
        import importlib.util, sys
        spec = importlib.util.find_spec("gpuwarden.checks")
        spec.submodule_search_locations.append({str(tmp_path)!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpuwarden.checks"] = module
        spec.loader.exec_module(module)
        from gpuwarden.agent.cli.main import main
        print("NAMES", *module.NAMES)
        sys.exit(main(sys.argv[1:]))
        """)
    run = [sys.executable, "-c", code, "preflight", "--root", str(NODES / "h100-hgx-healthy"), "--json"]
    proc = subprocess.run([*run, "--checks", "probe,xid"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.splitlines()[0].split()[1:]
    assert names[names.index("pcie_link") + 1] == "probe"  # its order puts it in the report
    report = json.loads(proc.stdout.split("\n", 1)[1])
    assert [r["check"] for r in report["results"]] == ["probe", "xid"]
    proc = subprocess.run([sys.executable, "-c", code, "checks"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "[checks.probe] answer=42" in proc.stdout


@pytest.mark.parametrize(("text", "error"), [
    ("CONCERN = Concern(\n    name='bad', order=1, level='quick', look=CHECK,\n)\n", "malformed node"),
    ("CONCERN = Concern(\n    'bad', order=1,\n)\n", "key=literal"),
    ("CONCERN = Concern(\n    name='bad', order=1, level='quick', lok='CHECK',\n)\n", "lok"),
    ("CONCERN = Concern(\n    name='other', order=1,\n)\n", "named after its module"),
    ("CONCERN = Concern(\n    name='bad', order=1, level='quick',\n)\n", "goes with a look"),
    ("CONCERN = Concern(name='bad', order=1)\n", "no line"),
])
def test_a_malformed_declaration_is_an_error_naming_the_file(tmp_path, text, error):
    path = tmp_path / "bad.py"
    path.write_text(f'"""A check."""\n{text}')
    with pytest.raises(ValueError, match=error) as exc:
        checks.declared(str(path))
    assert str(path) in str(exc.value)
    assert checks.declared(str(ROOT / "checks" / "parse_limits.py")) is None  # a helper


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
    quick = {m for c in checks.CONCERNS if c.level == "quick" for m in checks.modules_of(c)}
    assert quick <= loaded
    assert not loaded & {m for c in checks.CONCERNS if c.level != "quick" for m in checks.modules_of(c)}
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

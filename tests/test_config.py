from pathlib import Path

import pytest
from gpuwarden.agent.core import config, config_values
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.checks import ALL, all_specs

ALL_SPECS = all_specs()


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gpuwarden.toml"
    p.write_text(text)
    return p


def test_defaults_then_file_override(tmp_path):
    p = write(tmp_path, '[agent]\ncheck_timeout_s = 5\n[checks.ib_port]\nexpected_rate_gbps = 400\n'
                        'ignore_ports = ["mlx5_bond_0/1"]\n')
    cfg = config.load(ALL, p, explicit=True)
    assert cfg.agent["check_timeout_s"] == 5.0 and isinstance(cfg.agent["check_timeout_s"], float)
    assert cfg.for_check("ib_port") == {"expected_rate_gbps": 400.0, "ignore_ports": ["mlx5_bond_0/1"]}
    assert cfg.for_check("ecc")["volatile_uncorrected_max"] == 0  # untouched default


@pytest.mark.parametrize("text, needle", [
    ("[checks.ecc]\nvolatile_uncorected_max = 1\n", "checks.ecc.volatile_uncorected_max"),
    ("[checks.ecc]\nvolatile_uncorrected_max = \"one\"\n", "checks.ecc.volatile_uncorrected_max"),
    ("[checks.ib_port]\nignore_ports = [1, 2]\n", "checks.ib_port.ignore_ports"),
    ("[checks.xid]\nignore_xids = [\"13\"]\n", "checks.xid.ignore_xids"),
    ("[checks.nope]\n", "checks.nope"),
    ("[agent]\nlog_format = \"yaml\"\n", "agent.log_format"),
    ("[agent]\nchecks = [\"ecc\", \"bogus\"]\n", "bogus"),
    ("colour = 1\n", "colour"),
    ("[agent\ncheck_timeout_s = 1\n", "invalid TOML"),
])
def test_bad_config_names_key_and_file(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        config.load(ALL, p, explicit=True)
    assert needle in str(exc.value) and str(p) in str(exc.value)


def test_missing_explicit_file_is_an_error_but_missing_default_is_not(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not found"):
        config.load(ALL, tmp_path / "absent.toml", explicit=True)
    monkeypatch.setattr(config, "DEFAULT_PATH", tmp_path / "absent.toml")
    assert config.load(ALL).agent["checks"] == []


def test_every_config_key_is_documented():
    from conftest import ROOT
    from gpuwarden.checks import all_specs

    doc = (ROOT / "docs" / "configuration.md").read_text()
    for spec in all_specs():
        assert f"[checks.{spec.name}]" in doc, spec.name
        section = doc.split(f"[checks.{spec.name}]", 1)[1].split("\n[", 1)[0]
        for key in spec.defaults:
            assert f"\n{key} =" in section, f"checks.{spec.name}.{key} missing from docs/configuration.md"
    for key in config.AGENT_DEFAULTS:
        assert f"\n{key} =" in doc.split("[agent]", 1)[1].split("\n[", 1)[0], f"agent.{key}"


# -- values out of range, unreadable files: an error naming the key (or the file), never a crash or a race ---------
@pytest.mark.parametrize("text, needle", [
    ("[agent]\ncheck_timeout_s = inf\n", "agent.check_timeout_s"),
    ("[agent]\nbudget_s = nan\n", "agent.budget_s"),
    ("[agent]\nbudget_s = -inf\n", "agent.budget_s"),
    ("[agent]\nbudget_s = 1" + "0" * 400 + "\n", "agent.budget_s"),  # an int too large for a float
    ("[checks.pcie_link]\ntopo_timeout_s = 1e9\n", "checks.pcie_link.topo_timeout_s"),  # over a day
    ("[checks.ib_port]\nwindow_s = -1.0\n", "checks.ib_port.window_s"),
    ("[checks.xid]\nhold_s = nan\n", "checks.xid.hold_s"),
    ("[checks.nvlink_lanes]\ncrc_fail_per_minute = inf\n", "checks.nvlink_lanes.crc_fail_per_minute"),
    ("[checks.clock_events]\nhw_fail_ratio = 1.5\n", "checks.clock_events.hw_fail_ratio"),
    ("[checks.ecc]\nvolatile_uncorrected_max = -3\n", "checks.ecc.volatile_uncorrected_max"),
    ("[checks.nvlink_lanes]\nexpected_links = -1\n", "checks.nvlink_lanes.expected_links"),
    ("[checks.peer_p2p]\ncopy_bytes = 9223372036854775807\n", "checks.peer_p2p.copy_bytes"),
    ("[checks.rdma_loopback]\nroce_gid_index = -2\n", "checks.rdma_loopback.roce_gid_index"),
    ("[checks.rdma_loopback]\nduration_s = 100000000\n", "checks.rdma_loopback.duration_s"),
    ("[checks.xid]\nignore_xids = [-1]\n", "checks.xid.ignore_xids"),
    ("[checks.ib_port]\nignore_ports = [\"" + "x" * 5000 + "\"]\n", "checks.ib_port.ignore_ports"),
])
def test_numbers_must_be_finite_and_in_range(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        config.load(ALL_SPECS, p, explicit=True)
    assert needle in str(exc.value) and str(p) in str(exc.value) and "must be" in str(exc.value)


@pytest.mark.parametrize("text, needle, allowed", [
    ("[checks.dcgm_diag]\nlevel = -1\n", "checks.dcgm_diag.level", "1, 2, 3, 4"),
    ("[checks.dcgm_diag]\nlevel = 5\n", "checks.dcgm_diag.level", "1, 2, 3, 4"),
    ("[checks.peer_p2p]\nexpect_nvlink = \"maybe\"\n", "checks.peer_p2p.expect_nvlink", "auto, yes, no"),
    ("[checks.peer_p2p]\nbandwidth_method = \"nvbw\"\n", "checks.peer_p2p.bandwidth_method",
     "auto, nvbandwidth, torch, none"),
    ("[checks.peer_p2p]\ndevice = \"gpu\"\n", "checks.peer_p2p.device", "cuda, cpu"),
    ("[checks.burnin]\ndtype = \"fp8\"\n", "checks.burnin.dtype", "bfloat16, float16, float32"),
    ("[checks.burnin]\ndevice = \"gpu\"\n", "checks.burnin.device", "cuda, cpu"),
    ("[checks.fabric]\nfabric_manager = \"on\"\n", "checks.fabric.fabric_manager", "auto, required, off"),
    ("[checks.pcie_link]\ngpu_nic_max_distance = \"FAR\"\n", "checks.pcie_link.gpu_nic_max_distance",
     "'', PIX, PXB, PHB, NODE, SYS, SOC, off"),
    ("[agent]\nlevel = \"fast\"\n", "agent.level", "quick, full"),
])
def test_enum_like_settings_are_checked_when_loaded(tmp_path, text, needle, allowed):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        config.load(ALL_SPECS, p, explicit=True)
    assert needle in str(exc.value) and f"one of {allowed}," in str(exc.value) and str(p) in str(exc.value)


@pytest.mark.parametrize("text, key, value", [
    ("[checks.rdma_loopback]\nroce_gid_index = -1\n", ("rdma_loopback", "roce_gid_index"), -1),  # perftest's default
    ("[checks.rdma_loopback]\nroce_gid_index = 3\n", ("rdma_loopback", "roce_gid_index"), 3),
    ("[checks.dcgm_diag]\nlevel = 3\n", ("dcgm_diag", "level"), 3),
    ("[checks.pcie_link]\ngpu_nic_max_distance = \"off\"\n", ("pcie_link", "gpu_nic_max_distance"), "off"),
    ("[checks.pcie_link]\ngpu_nic_max_distance = \"NODE\"\n", ("pcie_link", "gpu_nic_max_distance"), "NODE"),
    ("[checks.clock_events]\nhw_fail_ratio = 1\n", ("clock_events", "hw_fail_ratio"), 1.0),
    ("[checks.dcgm_diag]\ntimeout_s = 86400\n", ("dcgm_diag", "timeout_s"), 86400.0),
    ("[checks.ib_port]\nwindow_s = 604800\n", ("ib_port", "window_s"), 604800.0),  # a week
])
def test_values_at_the_edges_are_accepted(tmp_path, text, key, value):
    cfg = config.load(ALL_SPECS, write(tmp_path, text), explicit=True)
    assert cfg.for_check(key[0])[key[1]] == value


def test_every_default_passes_its_own_checks():
    choices = config.spec_choices(ALL_SPECS)
    for spec in ALL_SPECS:
        for key, default in spec.defaults.items():
            full = f"checks.{spec.name}.{key}"
            config_values.coerce(full, default, default, "defaults", spec.list_types.get(key), choices.get(full))
    for key, default in config.AGENT_DEFAULTS.items():
        config_values.coerce(f"agent.{key}", default, default, "defaults")


@pytest.mark.parametrize("raw, needle", [
    (b"[agent]\nlog_level = \"\xff\xfe\"\n", "not UTF-8 text (line 2"),
    (b"[agent]\nchecks = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    (b"x = " + b"{a=" * 3000 + b"1" + b"}" * 3000 + b"\n", "nested too deeply"),
    (b"[checks.ecc]\nvolatile_uncorrected_max = " + b"1" * 5000 + b"\n", "invalid TOML"),
    (b"# " + b"x" * (config_values.MAX_FILE_BYTES + 1) + b"\n", "larger than"),
])
def test_unreadable_config_files_are_errors_naming_the_file(tmp_path, raw, needle):
    p = tmp_path / "gpuwarden.toml"
    p.write_bytes(raw)
    with pytest.raises(ConfigError) as exc:
        config.load(ALL_SPECS, p, explicit=True)
    assert needle in str(exc.value) and str(p) in str(exc.value)


@pytest.mark.parametrize("raw, needle", [
    (b"hostname = \"n\xff1\"\n", "not UTF-8"),
    (b"hostname = \"n1\"\n[versions]\nx = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    (b"hostname = " + b"9" * 5000 + b"\n", "invalid TOML"),
])
def test_unreadable_node_toml_is_an_error_naming_the_file(tmp_path, raw, needle):
    from gpuwarden.agent.node.host import NodeInfo

    (tmp_path / "node.toml").write_bytes(raw)
    with pytest.raises(ConfigError) as exc:
        NodeInfo.from_toml(tmp_path / "node.toml")
    assert needle in str(exc.value) and str(tmp_path / "node.toml") in str(exc.value)


# -- the command: exit 2, one line naming what is wrong, no traceback ---------------------------------------------
BAD_CONFIGS = {
    "inf timeout": (b"[agent]\ncheck_timeout_s = inf\n", "agent.check_timeout_s"),
    "nan budget": (b"[agent]\nbudget_s = nan\n", "agent.budget_s"),
    "negative level": (b"[checks.dcgm_diag]\nlevel = -1\n", "checks.dcgm_diag.level"),
    "negative count": (b"[checks.ecc]\nvolatile_uncorrected_max = -1\n", "checks.ecc.volatile_uncorrected_max"),
    "enum typo": (b"[checks.peer_p2p]\nexpect_nvlink = \"ye\"\n", "checks.peer_p2p.expect_nvlink"),
    "invalid UTF-8": (b"[agent]\nlevel = \"quick\xff\"\n", "not UTF-8"),
    "deep nesting": (b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    "5000-digit int": (b"[checks.ecc]\nvolatile_uncorrected_max = " + b"7" * 5000 + b"\n", "invalid TOML"),
}


def one_line_error(capsys, argv) -> str:
    from gpuwarden.agent.cli.main import main
    from gpuwarden.agent.core import logs

    with logs.preserved():  # main sets logging up; the next test starts from the defaults
        assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and err.count("\n") == 1 and err.startswith("gpuwarden ")
    return err


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_preflight_with_a_bad_config_exits_2_with_one_line(tmp_path, capsys, case):
    from conftest import NODES

    raw, needle = BAD_CONFIGS[case]
    p = tmp_path / "gpuwarden.toml"
    p.write_bytes(raw)
    err = one_line_error(capsys, ["preflight", "--root", str(NODES / "h100-hgx-healthy"), "--config", str(p)])
    assert needle in err and str(p) in err


@pytest.mark.parametrize("flag, value", [("--check-timeout", "inf"), ("--check-timeout", "nan"),
                                         ("--check-timeout", "-1"), ("--check-timeout", "1e9"),
                                         ("--budget", "nan"), ("--budget", "inf"), ("--budget", "-5")])
def test_preflight_flags_go_through_the_same_checks(capsys, flag, value):
    from conftest import NODES

    err = one_line_error(capsys, ["preflight", "--root", str(NODES / "h100-hgx-healthy"), flag, value])
    assert f"'{flag}' must be a number from 0 to 86400" in err


def test_record_budget_flag_is_checked(tmp_path, capsys):
    from conftest import NODES

    err = one_line_error(capsys, ["record", "--root", str(NODES / "h100-hgx-healthy"), "--out", str(tmp_path / "o"),
                                  "--budget", "nan"])
    assert "'--budget' must be" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("raw, needle", [(b"hostname = \"n\xff\"\n", "not UTF-8"),
                                         (b"hostname = " + b"{a=" * 3000 + b"}" * 3000 + b"\n", "nested too deeply")])
def test_preflight_on_a_scenario_with_a_bad_node_toml_exits_2_with_one_line(scenario_copy, capsys, raw, needle):
    root = scenario_copy("h100-hgx-healthy")
    (root / "node.toml").write_bytes(raw)
    err = one_line_error(capsys, ["preflight", "--root", str(root)])
    assert needle in err and str(root / "node.toml") in err


def test_the_real_command_on_a_bad_config_prints_no_traceback(tmp_path):
    import subprocess
    import sys

    from conftest import NODES

    p = tmp_path / "gpuwarden.toml"
    p.write_bytes(b"[agent]\nbudget_s = nan\n")
    proc = subprocess.run([sys.executable, "-m", "gpuwarden.agent.cli", "preflight", "--root",
                           str(NODES / "h100-hgx-healthy"), "--config", str(p), "--check-timeout", "inf"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "agent.budget_s" in proc.stderr


def test_the_ladder_table_sets_the_state_machines_timings(tmp_path):
    """[remediation.ladder] keys that are the state machine's (settle times, the retest's wait) reach its policy."""
    from gpuwarden.agent.cli.run import policy_of

    path = tmp_path / "gpuwarden.toml"
    path.write_text("[remediation.ladder]\nretest_after_s = 5.0\nstep_after_s = 2.0\n")
    policy = policy_of(config.load(all_specs(), path, explicit=True))
    assert policy["retest_after_s"] == 5.0 and policy["step_after_s"] == 2.0
    assert policy_of(config.defaults(all_specs()))["retest_after_s"] == 60.0

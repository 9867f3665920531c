from pathlib import Path

import pytest

from gpuwarden.agent import config
from gpuwarden.agent.errors import ConfigError
from gpuwarden.checks import ALL


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

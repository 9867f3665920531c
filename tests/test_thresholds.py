from gpuwarden.agent.core import thresholds


def test_every_threshold_file_parses_and_names_known_skus():
    from importlib.resources import files

    from gpuwarden.agent.core.sku import KNOWN_SKUS

    folder = files("gpuwarden.checks").joinpath("data/thresholds")
    for resource in folder.iterdir():
        if resource.name.endswith(".toml"):
            table = thresholds.sku_table(resource.name[:-5])
            assert set(table) <= set(KNOWN_SKUS), resource.name
            assert all(isinstance(v, (int, float)) for sku in table.values() for v in sku.values())


def test_configured_value_wins_and_unknown_sku_has_none(monkeypatch):
    monkeypatch.setattr(thresholds, "sku_table", lambda check: {"H100-SXM-HGX": {"floor": 100}})
    assert thresholds.threshold("x", "floor", "H100-SXM-HGX", {"floor": 0.0}) == 100.0
    assert thresholds.threshold("x", "floor", "H100-SXM-HGX", {"floor": 42.0}) == 42.0
    assert thresholds.threshold("x", "floor", "unknown", {"floor": 0.0}) is None

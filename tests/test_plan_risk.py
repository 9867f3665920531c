"""`gpuwarden plan risk`: rack and fleet interruption intervals from node MTBI, and the chance of at least one GPU
failure in a job, against the published figures, a brute-force draw of node interruptions, and hostile flags."""
from __future__ import annotations

import argparse
import json
import math
import random

import pytest
from gpuwarden.agent.cli import plan as plan_cli
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.fleet.plan import risk


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuwarden plan risk")
    plan_cli.part_arguments(p, "risk")
    return p


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = plan_cli.run_part(_parser().parse_args(list(argv)))
    out, err = capsys.readouterr()
    assert err == ""
    return rc, out


# -- the published figures ------------------------------------------------------------------------------------------
def test_rack_of_18_nodes_at_490_days_is_interrupted_every_27_days() -> None:
    assert risk.rack_mtbi_days(490, 18) == pytest.approx(27.2, abs=0.05)
    assert round(risk.rack_mtbi_days(490, 18)) == 27


def test_some_rack_of_128_is_interrupted_about_every_5_hours() -> None:
    assert risk.fleet_rack_interval_hours(490, 18, 128) == pytest.approx(5.1, abs=0.05)


@pytest.mark.parametrize("gpus, published", [(256, 0.19), (1024, 0.57)])
def test_chance_of_a_failure_over_30_days_at_1_percent_a_year(gpus: int, published: float) -> None:
    assert round(risk.p_at_least_one_failure(gpus, 30, 0.01), 2) == published


def test_default_command_prints_the_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys)
    assert rc == 0
    lines = out.splitlines()
    assert "every 27.2 days (490 / 18)" in lines[1]
    assert "every 5.1 hours (490 / (18 x 128) days)" in lines[2]
    assert lines[-2].split() == ["256", "30", "0.21", "19.1%"]
    assert lines[-1].split() == ["1,024", "30", "0.85", "57.1%"]


# -- the model against independent computations ------------------------------------------------------------------
def test_rack_interruptions_drawn_node_by_node_agree_with_mtbi_over_nodes() -> None:
    # The rack's next interruption is the first of its 18 nodes'; drawing each node's exponential time shows the
    # rates add (mean 490 / 18), within four standard errors.
    rng = random.Random(18)
    trials = 20_000
    firsts = [min(rng.expovariate(1 / 490) for _ in range(18)) for _ in range(trials)]
    mean = sum(firsts) / trials
    se = math.sqrt(sum((x - mean) ** 2 for x in firsts) / (trials - 1) / trials)
    assert abs(mean - risk.rack_mtbi_days(490, 18)) <= 4 * se


def test_chance_of_a_failure_counted_gpu_by_gpu() -> None:
    # Each of 256 GPUs survives 30 days with (1 - AFR)^(30/365); drawing them one by one agrees with the formula.
    rng = random.Random(256)
    survive = (1 - 0.01) ** (30 / 365)
    trials = 4_000
    hits = sum(any(rng.random() >= survive for _ in range(256)) for _ in range(trials))
    p = risk.p_at_least_one_failure(256, 30, 0.01)
    assert abs(hits / trials - p) <= 4 * math.sqrt(p * (1 - p) / trials)


def test_expected_failures_match_the_probability_for_small_rates() -> None:
    # For a rare event P(at least one) ~ expected count.
    assert risk.p_at_least_one_failure(8, 1, 1e-9) == pytest.approx(risk.expected_failures(8, 1, 1e-9), rel=1e-8)


# -- edges -------------------------------------------------------------------------------------------------------------
def test_zero_failure_rate_means_no_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert risk.p_at_least_one_failure(10_000_000, 36_500, 0.0) == 0.0
    rc, out = _run(capsys, "--afr", "0", "--json")
    assert rc == 0
    assert all(f["p_at_least_one"] == 0.0 and f["expected_failures"] == 0.0
               for f in json.loads(out)["failure_probability"])


def test_tiny_rate_keeps_its_precision() -> None:
    # 1 - (1 - 1e-12)^x computed naively loses most digits; log1p/expm1 keep them.
    assert risk.p_at_least_one_failure(1, 365, 1e-12) == pytest.approx(1e-12, rel=1e-9)


def test_huge_fleet_over_a_century_is_certain_and_finite() -> None:
    p = risk.p_at_least_one_failure(10_000_000, 36_500, 0.9999)
    assert p == 1.0 and math.isfinite(risk.expected_failures(10_000_000, 36_500, 0.9999))


def test_lists_of_sizes_and_lengths_give_one_row_each_sorted(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--gpus", "1024,8,256,8", "--days", "30,1", "--json")
    assert rc == 0
    rows = [(f["gpus"], f["days"]) for f in json.loads(out)["failure_probability"]]
    assert rows == [(8, 1.0), (256, 1.0), (1024, 1.0), (8, 30.0), (256, 30.0), (1024, 30.0)]


# -- JSON -------------------------------------------------------------------------------------------------------------
def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == {"version", "node_mtbi_days", "nodes_per_rack", "racks", "rack_mtbi_days",
                        "fleet_rack_interval_hours", "afr_percent", "failure_probability"}
    assert (doc["version"], doc["node_mtbi_days"], doc["nodes_per_rack"], doc["racks"], doc["afr_percent"]) == \
        (1, 490.0, 18, 128, 1.0)
    assert doc["rack_mtbi_days"] == pytest.approx(490 / 18)
    assert doc["fleet_rack_interval_hours"] == pytest.approx(490 / (18 * 128) * 24)
    assert [(f["gpus"], f["days"], round(f["p_at_least_one"], 2)) for f in doc["failure_probability"]] == \
        [(256, 30.0, 0.19), (1024, 30.0, 0.57)]
    for f in doc["failure_probability"]:
        assert set(f) == {"gpus", "days", "expected_failures", "p_at_least_one"}


# -- flags ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--afr", "100"), ("--afr", "nan"), ("--afr", "inf"), ("--afr", "-1"), ("--afr", "1e400"), ("--afr", ""),
    ("--node-mtbi-days", "0"), ("--node-mtbi-days", "inf"), ("--node-mtbi-days", "nan"),
    ("--node-mtbi-days", "-490"), ("--node-mtbi-days", "1e400"), ("--node-mtbi-days", "9" * 5000),
    ("--gpus", "0"), ("--gpus", "1.5"), ("--gpus", "9" * 5000), ("--gpus", "10000001"), ("--gpus", "8,,16"),
    ("--gpus", ",".join(["8"] * 65)), ("--gpus", "nan"),
    ("--days", "0"), ("--days", "-1"), ("--days", "inf"), ("--days", "nan"), ("--days", "36501"),
    ("--racks", "0"), ("--racks", "1000001"), ("--racks", "inf"),
    ("--nodes-per-rack", "10001"), ("--nodes-per-rack", "0"), ("--nodes-per-rack", "-18"),
])
def test_hostile_flag_values_are_a_config_error_naming_the_flag(flag: str, value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _run(capsys, f"{flag}={value}")
    assert flag in str(err.value)
    assert len(str(err.value)) < 300

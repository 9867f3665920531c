"""`gpuwarden plan capacity`: the slice-size capacity model against the published figures to the node, against
exact rational arithmetic and a brute-force Monte Carlo count, and the command's flags, table, JSON and plot."""
from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from fractions import Fraction
from math import comb

import pytest
from gpuwarden.agent.cli import plan as plan_cli
from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.fleet.plan import capacity as cap
from hypothesis import given, settings
from hypothesis import strategies as st

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuwarden plan capacity")
    plan_cli.part_arguments(p, "capacity")
    return p


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = plan_cli.run_part(_parser().parse_args(list(argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def _exact_usable(racks: int, n: int, s: int, p: Fraction) -> Fraction:
    """The definition, in rational arithmetic: R * S * sum_h C(n, h) (1-p)^h p^(n-h) floor(h / S)."""
    return racks * s * sum(comb(n, h) * (1 - p) ** h * p ** (n - h) * (h // s) for h in range(n + 1))


# -- the published figures ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slice_nodes, published", [(16, 2037), (18, 1602), (9, 1953), (8, 2043)])
def test_published_figures_128_racks_of_18_nodes_at_2_percent_to_the_node(slice_nodes: int, published: int) -> None:
    assert cap.round_nodes(cap.usable_nodes(128, 18, slice_nodes, 2.0)) == published


def test_16_node_slices_give_27_percent_more_than_18_node_slices_at_2_percent() -> None:
    gain = cap.usable_nodes(128, 18, 16, 2.0) / cap.usable_nodes(128, 18, 18, 2.0) - 1
    assert round(gain * 100) == 27


def test_command_json_carries_the_published_figures(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--racks", "128", "--nodes-per-rack", "18", "--slice", "16,18,9,8",
                      "--unavailable", "2", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert {s["slice_nodes"]: s["usable_nodes_rounded"][0] for s in doc["slices"]} == \
        {8: 2043, 9: 1953, 16: 2037, 18: 1602}


def test_command_table_shows_the_published_row(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--unavailable", "0,2")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("128 racks x 18 nodes = 2,304 nodes")
    assert lines[1].split() == ["unavailable", "8-node", "slices", "9-node", "slices", "16-node", "slices",
                                "18-node", "slices"]
    row = lines[3].split()
    assert row[0] == "2%"
    assert [row[i] for i in (1, 3, 5, 7)] == ["2,043", "1,953", "2,037", "1,602"]
    assert lines[2].split()[:2] == ["0%", "2,048"]


# -- the model against independent computations ------------------------------------------------------------------
@pytest.mark.parametrize("n, s, pct", [(18, 16, "2"), (18, 9, "7.5"), (18, 1, "33"), (72, 8, "1.25"),
                                       (4, 4, "50"), (1, 1, "0.1"), (36, 5, "99")])
def test_exact_sum_matches_rational_arithmetic(n: int, s: int, pct: str) -> None:
    p = Fraction(pct) / 100
    expected = _exact_usable(7, n, s, p)
    got = cap.usable_nodes(7, n, s, float(pct))
    assert got == pytest.approx(float(expected), rel=1e-11, abs=1e-12)


@pytest.mark.parametrize("n, s, pct, trials", [(18, 16, 2.0, 20_000), (18, 9, 5.0, 20_000), (18, 18, 1.0, 20_000),
                                               (72, 8, 10.0, 5_000), (10, 3, 30.0, 20_000)])
def test_monte_carlo_agrees_with_the_exact_model_within_four_standard_errors(n: int, s: int, pct: float,
                                                                             trials: int) -> None:
    exact = cap.usable_nodes(1, n, s, pct)
    mean, se = cap.monte_carlo_usable_per_rack(n, s, pct, trials, seed=n * 1000 + s)
    assert se > 0
    assert abs(mean - exact) <= 4 * se, (mean, exact, se)


def test_monte_carlo_tells_a_wrong_unavailability_apart() -> None:
    # The agreement above means something only if the estimator can see a wrong answer: 2 % vs 3 % on 18-node
    # slices differ by ~2 nodes per rack, far outside four standard errors.
    mean, se = cap.monte_carlo_usable_per_rack(18, 18, 2.0, 20_000, seed=7)
    assert abs(mean - cap.usable_nodes(1, 18, 18, 3.0)) > 4 * se


def test_monte_carlo_is_reproducible_from_its_seed() -> None:
    assert cap.monte_carlo_usable_per_rack(18, 9, 5.0, 2_000, seed=3) == \
        cap.monte_carlo_usable_per_rack(18, 9, 5.0, 2_000, seed=3)


# -- edges -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s, whole", [(1, 18), (7, 14), (8, 16), (9, 18), (16, 16), (18, 18)])
def test_zero_unavailability_serves_every_whole_slice(s: int, whole: int) -> None:
    assert cap.usable_nodes(128, 18, s, 0.0) == 128 * whole


@pytest.mark.parametrize("n, pct", [(18, 2.0), (1_000, 37.5), (10_000, 50.0), (10_000, 0.001), (10_000, 99.99)])
def test_one_node_slices_use_every_healthy_node_on_average(n: int, pct: float) -> None:
    # With S = 1 the model reduces to E[H] = N (1 - p): a check that holds at any size, where the binomial's
    # coefficients are far beyond a float.
    got = cap.usable_nodes(3, n, 1, pct)
    assert math.isfinite(got)
    assert got == pytest.approx(3 * n * (1 - pct / 100), rel=1e-9)


def test_distribution_of_a_large_rack_is_finite_and_sums_to_one() -> None:
    dist = cap.healthy_distribution(10_000, 0.02)
    assert len(dist) == 10_001 and all(math.isfinite(w) and w >= 0 for w in dist)
    assert math.fsum(dist) == pytest.approx(1.0, abs=1e-12)
    assert max(range(len(dist)), key=dist.__getitem__) == 9_800


def test_usable_falls_as_unavailability_grows_and_never_exceeds_the_fleet() -> None:
    result = cap.capacity(128, 18, (8, 9, 16, 18), cap.parse_unavailable("0..20:0.5"))
    for s in result.slices:
        values = result.usable[s]
        assert all(0 <= v <= result.fleet_nodes for v in values)
        assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_nearly_every_node_down_leaves_almost_nothing() -> None:
    assert 0 <= cap.usable_nodes(128, 18, 16, 99.999) < 1e-60


def test_round_nodes_rounds_halves_up() -> None:
    assert [cap.round_nodes(x) for x in (2036.5, 2037.49, 1601.5, 0.0)] == [2037, 2037, 1602, 0]


# -- flags ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, values", [
    ("1..5", (1.0, 2.0, 3.0, 4.0, 5.0)),
    ("0..1:0.25", (0.0, 0.25, 0.5, 0.75, 1.0)),
    ("0..0.3:0.1", (0.0, 0.1, 0.2, 0.3)),
    ("2", (2.0,)),
    ("2%", (2.0,)),
    ("5, 1..2, 2.5%", (1.0, 2.0, 2.5, 5.0)),
    ("1..2.5", (1.0, 2.0)),
    ("3..3", (3.0,)),
    ("0..10", tuple(float(i) for i in range(11))),
])
def test_unavailable_values_ranges_and_steps(text: str, values: tuple[float, ...]) -> None:
    assert cap.parse_unavailable(text) == values


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.,:%-+e naif\u0661", max_size=40))
def test_any_unavailable_text_is_values_in_range_or_a_config_error(text: str) -> None:
    try:
        values = cap.parse_unavailable(text)
    except ConfigError as err:
        assert "--unavailable" in str(err)
        return
    assert 0 < len(values) <= cap.MAX_POINTS
    assert all(math.isfinite(v) and 0 <= v < 100 for v in values)
    assert list(values) == sorted(set(values))


def test_slice_sizes_are_sorted_without_repeats() -> None:
    assert cap.parse_slices("18, 8,16,8", 18) == (8, 16, 18)


@pytest.mark.parametrize("flag, value", [
    ("--racks", "inf"), ("--racks", "nan"), ("--racks", "-1"), ("--racks", "0"), ("--racks", "1e3"),
    ("--racks", "9" * 5000), ("--racks", "1000001"), ("--racks", "+-5"), ("--racks", "１２"), ("--racks", ""),
    ("--nodes-per-rack", "10001"), ("--nodes-per-rack", "0"), ("--nodes-per-rack", "18.0"),
    ("--slice", "20"), ("--slice", "0"), ("--slice", ""), ("--slice", "8,,9"), ("--slice", "nan"),
    ("--slice", "-8"), ("--slice", ",".join(str(i) for i in range(1, 19)) + ",1" * 100),
    ("--unavailable", "nan"), ("--unavailable", "inf"), ("--unavailable", "-1"), ("--unavailable", "100"),
    ("--unavailable", "1e309"), ("--unavailable", "5..1"), ("--unavailable", "0..10:0"),
    ("--unavailable", "0..10:1e-9"), ("--unavailable", "0..10:5e-324"), ("--unavailable", "0..10:nan"),
    ("--unavailable", "0..10:-1"),
    ("--unavailable", "1..2..3"), ("--unavailable", "..5"), ("--unavailable", "9" * 5000),
    ("--unavailable", "0..99:0.01"), ("--unavailable", "1," * 3000),
])
def test_hostile_flag_values_are_a_config_error_naming_the_flag(flag: str, value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _run(capsys, f"{flag}={value}")
    assert flag in str(err.value)
    assert len(str(err.value)) < 300  # a hostile value is not echoed back whole


def test_too_many_points_for_a_large_rack_is_refused_before_computing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"--unavailable: 991 values for racks of 10,000 nodes; at most 199"):
        _run(capsys, "--nodes-per-rack", "10000", "--slice", "1000", "--unavailable", "0..99:0.1")


def test_largest_accepted_inputs_finish(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--racks", "1000000", "--nodes-per-rack", "10000", "--slice", "1,9999,10000",
                      "--unavailable", "0..99:5", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["fleet_nodes"] == 10_000_000_000
    assert all(math.isfinite(v) for s in doc["slices"] for v in s["usable_nodes"])


# -- JSON (a contract: docs/planning.md documents it) ---------------------------------------------------------------
def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--racks", "4", "--nodes-per-rack", "18", "--slice", "18,8",
                      "--unavailable", "0..2:0.5", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == {"version", "model", "racks", "nodes_per_rack", "fleet_nodes", "unavailable_percent",
                        "slices"}
    assert (doc["version"], doc["model"], doc["racks"], doc["nodes_per_rack"], doc["fleet_nodes"]) == \
        (1, "binomial", 4, 18, 72)
    assert doc["unavailable_percent"] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [s["slice_nodes"] for s in doc["slices"]] == [8, 18]
    for s in doc["slices"]:
        assert set(s) == {"slice_nodes", "usable_nodes", "usable_nodes_rounded", "share_of_fleet"}
        assert len(s["usable_nodes"]) == len(s["usable_nodes_rounded"]) == len(s["share_of_fleet"]) == 5
        assert all(isinstance(v, float) for v in s["usable_nodes"] + s["share_of_fleet"])
        assert all(type(v) is int for v in s["usable_nodes_rounded"])
        assert s["usable_nodes_rounded"] == [cap.round_nodes(v) for v in s["usable_nodes"]]
        assert s["share_of_fleet"] == pytest.approx([v / 72 for v in s["usable_nodes"]])
    assert doc["slices"][1]["usable_nodes"][0] == 72.0


# -- the plot -------------------------------------------------------------------------------------------------------
def test_figure_has_one_labelled_line_per_slice_size() -> None:
    pytest.importorskip("matplotlib")
    result = cap.capacity(128, 18, (8, 9, 16, 18), cap.parse_unavailable("0..10:0.5"))
    fig = cap.draw_capacity(result)
    (ax,) = [a for a in fig.axes if a.get_lines()]
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == ["8-node slices", "9-node slices", "16-node slices", "18-node slices"]
    for ln, s in zip(lines, result.slices, strict=True):
        assert list(ln.get_xdata()) == list(result.unavailable_percent)
        assert list(ln.get_ydata()) == list(result.usable[s])
    assert "128 racks x 18 nodes" in ax.get_title()
    assert ax.get_xlabel() == "node unavailability (%)" and ax.get_ylabel() == "expected usable nodes"


def test_plot_flag_writes_a_png_and_keeps_stdout_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "capacity.png"
    rc, out, err = _run(capsys, "--unavailable", "0..10", "--json", "--plot", str(out_png))
    assert rc == 0
    json.loads(out)
    assert str(out_png) in err
    data = out_png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 500)


def test_plot_without_matplotlib_names_the_plot_extra(tmp_path, monkeypatch, capsys) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # what an install without the extra looks like to import
    with pytest.raises(ConfigError, match=r"--plot needs matplotlib.*'plot' extra.*gpuwarden\[plot\]"):
        _run(capsys, "--unavailable", "2", "--plot", str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_plot_to_an_unwritable_path_is_a_config_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ConfigError, match=r"--plot .*missing.*cannot write it"):
        _run(capsys, "--unavailable", "2", "--plot", str(tmp_path / "missing" / "x.png"))

"""NCCL's settings as the job response reads them (agent/core/nccl_env.py): the effective IB timeout by NCCL version
(the NCCL user guide's figures), NCCL_IB_HCA's matching (NCCL's parseStringList / matchIfList rules), NCCL's config
files."""
from __future__ import annotations

import math

import pytest
from gpuwarden.agent.core import nccl_env as nccl

ENV = "environment of pid 1"


@pytest.mark.parametrize("exponent, retries, seconds", [
    # The guide's table: "17 = 536.9 ms (x7 = 3.8 s), 18 = 1.1 s (7.5 s), 19 = 2.1 s (15 s), 20 = 4.3 s (30 s),
    # 21 = 8.6 s (60 s), 22 = 17.2 s (2 min)"; and 14 (NCCL before 2.14) x 7 = 0.47 s.
    (14, 7, 0.47), (17, 7, 3.76), (18, 7, 7.52), (19, 7, 15.03), (20, 7, 30.06), (21, 7, 60.13), (22, 7, 120.26),
    (20, 1, 4.29), (20, 0, 4.29),  # 0 retries: the one timeout
])
def test_effective_timeout_is_the_guides_figure(exponent, retries, seconds):
    assert nccl.effective_timeout_s(exponent, retries) == pytest.approx(seconds, abs=0.01)


@pytest.mark.parametrize("exponent", [0, 32, 40])
def test_a_timeout_of_0_or_32_and_up_never_gives_up(exponent):
    assert math.isinf(nccl.effective_timeout_s(exponent, 7))


@pytest.mark.parametrize("version, exponent", [
    ("2.13.4", 14), ("2.14.3", 18), ("2.21.5", 18), ("2.22.3", 18), ("2.23.4", 20), ("2.32.3", 20),
    ("2.21.5+cuda12.4", 18),
])
def test_the_default_timeout_follows_the_jobs_nccl_release(version, exponent):
    got, why = nccl.default_ib_timeout(nccl.parse_version(version))
    assert got == exponent and "NCCL env.html" in why and version.split("+")[0] in why


def test_an_unknown_release_assumes_the_longest_default():
    # Ending a job on a guess that it gave up already would kill one that rides the outage out: assume the longest.
    got, why = nccl.default_ib_timeout(None)
    assert got == 20 and "not known" in why


def test_the_environment_wins_and_says_so():
    t = nccl.ib_timeout({"NCCL_IB_TIMEOUT": ("22", ENV), "NCCL_IB_RETRY_CNT": ("3", ENV)}, (2, 21, 5))
    assert (t.exponent.value, t.retries.value) == (22, 3)
    assert t.exponent.source == f"NCCL_IB_TIMEOUT=22 ({ENV})" and t.effective_s.value == pytest.approx(51.5, abs=0.1)
    t = nccl.ib_timeout({}, (2, 21, 5))
    assert (t.exponent.value, t.retries.value) == (18, 7) and t.effective_s.value == pytest.approx(7.52, abs=0.01)
    assert "4.096 us x 2^18 x 7 retries" in t.effective_s.source


def test_a_setting_nccl_cannot_read_falls_back_to_the_default_and_says_why():
    t = nccl.ib_timeout({"NCCL_IB_TIMEOUT": ("twenty", ENV)}, (2, 23, 0))
    assert t.exponent.value == 20 and "'twenty'" in t.exponent.source and "not a number" in t.exponent.source


def test_a_retry_count_outside_the_documented_range_is_taken_as_given():
    # NCCL prints "NCCL_IB_RETRY_CNT set by environment to 15." (nccl#1814): past the guide's 0-7.
    t = nccl.ib_timeout({"NCCL_IB_RETRY_CNT": ("15", ENV)}, (2, 23, 0))
    assert t.retries.value == 15 and "outside NCCL's documented 0-7" in t.retries.source


def test_riding_out_names_the_smallest_timeout_longer_than_the_outage():
    assert nccl.riding_out(12.0, 7) == 19  # 15 s
    assert nccl.riding_out(7.0, 7) == 18  # 7.5 s
    assert nccl.riding_out(1e9, 7) is None


PORTS = [("mlx5_0/1", True), ("mlx5_1/1", True), ("mlx5_10/1", True), ("mlx5_2/1", False), ("mlx5_2/2", True)]


@pytest.mark.parametrize("spec, chosen", [
    ("mlx5", ["mlx5_0/1", "mlx5_1/1", "mlx5_10/1", "mlx5_2/1", "mlx5_2/2"]),  # a prefix: every device it starts
    ("mlx5_1", ["mlx5_1/1", "mlx5_10/1"]),  # the guide: "mlx5_1 ... will select mlx5_1 as well as mlx5_10"
    ("=mlx5_1", ["mlx5_1/1"]),  # "=": exact
    ("=mlx5_0:1,mlx5_2:2", ["mlx5_0/1", "mlx5_2/2"]),  # ports named
    ("^mlx5_1", ["mlx5_0/1", "mlx5_2/1", "mlx5_2/2"]),  # "^": all but those it prefixes
    ("^=mlx5_1", ["mlx5_0/1", "mlx5_10/1", "mlx5_2/1", "mlx5_2/2"]),
])
def test_nccl_ib_hca_chooses_the_ports_nccl_would(spec, chosen):
    got, why = nccl.job_ports({"NCCL_IB_HCA": (spec, ENV)}, PORTS)
    assert list(got) == chosen and why == f"NCCL_IB_HCA={spec} ({ENV})"


def test_without_nccl_ib_hca_every_port_that_is_up():
    got, why = nccl.job_ports({}, PORTS)
    assert list(got) == ["mlx5_0/1", "mlx5_1/1", "mlx5_10/1", "mlx5_2/2"] and "no NCCL_IB_HCA" in why


def test_nccls_files_the_first_that_sets_a_name_wins():
    files = [("~/.nccl.conf", "NCCL_IB_TIMEOUT=22\n# NCCL_IB_HCA=mlx5_9\n"),
             ("/etc/nccl.conf", "NCCL_IB_TIMEOUT = 19\nNCCL_IB_HCA=mlx5_0\nNCCL_DEBUG=WARN\nnot a setting\n")]
    got = nccl.settings_in_files(files)
    assert got["NCCL_IB_TIMEOUT"] == ("22", "~/.nccl.conf") and got["NCCL_IB_HCA"] == ("mlx5_0", "/etc/nccl.conf")
    assert got["NCCL_DEBUG"] == ("WARN", "/etc/nccl.conf") and len(got) == 3

"""Sweep history: PASS groups' figures per node and group size, medians of the last ones kept, bounded, and a file
that is not a sweep history (corrupt, another program's, values it never writes) said by name."""
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from gpuwarden.agent.fleet.sweep.criteria import Judged
from gpuwarden.agent.fleet.sweep.history import Learned, SweepHistory, SweepHistoryError
from gpuwarden.agent.fleet.sweep.model import Outcome


def judged(outcome=Outcome.PASS, latency=70.0, busbw=440.0):
    return Judged(outcome, ("test",), latency, None, busbw, {})


class Clock:
    def __init__(self, start=1_764_000_000.0):
        self.now = start

    def __call__(self):
        self.now += 60.0
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def history(tmp_path, clock):
    return SweepHistory(tmp_path / "sweep" / "history.db", keep=5, clock=clock)


def test_sweep_history_keeps_only_passing_groups(history):
    for outcome in Outcome:
        assert history.record("n1", 2, "H100-SXM-HGX", judged(outcome)) is (outcome is Outcome.PASS)
    assert history.record("n1", 2, "H100-SXM-HGX", judged(latency=None, busbw=None)) is False  # nothing measured
    assert history.learned("n1", 2).samples == 1


def test_sweep_history_medians_per_node_and_group_size(history):
    start = history._clock.now
    for lat, bw in ((70.0, 440.0), (90.0, 420.0), (72.0, None)):
        history.record("n1", 2, "H100-SXM-HGX", judged(latency=lat, busbw=bw))
    history.record("n1", 4, "H100-SXM-HGX", judged(latency=200.0, busbw=300.0))
    history.record("n2", 2, "H100-SXM-HGX", judged(latency=1.0, busbw=1.0))
    assert history.learned("n1", 2) == Learned(72.0, 430.0, 3, start + 60.0)
    assert history.learned("n1", 4) == Learned(200.0, 300.0, 1, start + 240.0)
    assert history.learned("n3", 2) == Learned(None, None, 0, None)
    # Too few values of a figure: None, though the other figure has enough.
    assert history.learned("n1", 2, min_samples=3) == Learned(72.0, None, 3, start + 60.0)


def test_sweep_history_is_bounded_to_the_last_figures(history):
    for i in range(12):
        history.record("n1", 2, "H100-SXM-HGX", judged(latency=float(100 + i)))
    got = history.learned("n1", 2)
    assert got.samples == 5 and got.latency_p95_us == 109.0  # 107 .. 111
    with closing(sqlite3.connect(history.path)) as db:
        assert db.execute("SELECT COUNT(*) FROM figures").fetchone() == (5,)


def test_sweep_history_survives_reopening(tmp_path, clock):
    path = tmp_path / "history.db"
    SweepHistory(path, clock=clock).record("n1", 2, "H100-SXM-HGX", judged())
    assert SweepHistory(path).learned("n1", 2).busbw_gbps == 440.0


def test_sweep_history_corrupt_file_is_named(tmp_path):
    path = tmp_path / "history.db"
    path.write_bytes(b"\x00garbage, not SQLite\n" * 512)
    with pytest.raises(SweepHistoryError) as err:
        SweepHistory(path)
    assert str(err.value).startswith(f"{path}: cannot be used as the sweep history: file is not a database")
    assert "move it aside" in str(err.value)
    assert path.read_bytes().startswith(b"\x00garbage")  # left as found


def test_sweep_history_corrupted_under_a_running_sweep_is_named(history):
    history.record("n1", 2, "H100-SXM-HGX", judged())
    history.path.write_bytes(b"overwritten" * 1000)
    with pytest.raises(SweepHistoryError, match=f"^{history.path}: cannot be used as the sweep history"):
        history.learned("n1", 2)
    with pytest.raises(SweepHistoryError, match="cannot be used as the sweep history"):
        history.record("n1", 2, "H100-SXM-HGX", judged())


def test_sweep_history_refuses_another_programs_database(tmp_path):
    path = tmp_path / "other.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("CREATE TABLE things (x)")
    with pytest.raises(SweepHistoryError, match=r"not a gpuwarden sweep history \(another program's SQLite database"):
        SweepHistory(path)


def test_sweep_history_refuses_values_it_never_writes(history):
    history.record("n1", 2, "H100-SXM-HGX", judged())
    with closing(sqlite3.connect(history.path, isolation_level=None)) as db:
        db.execute("UPDATE figures SET busbw_gbps = 'fast'")
    with pytest.raises(SweepHistoryError, match="a stored figure of n1 is not what the sweep writes"):
        history.learned("n1", 2)
    with closing(sqlite3.connect(history.path, isolation_level=None)) as db:
        db.execute("UPDATE figures SET busbw_gbps = -1.0")
    with pytest.raises(SweepHistoryError, match="not what the sweep writes"):
        history.learned("n1", 2)


def test_sweep_history_unusable_folder_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SweepHistoryError, match="cannot create its folder"):
        SweepHistory(blocker / "history.db")


@pytest.mark.parametrize("node, group, sku, message", [
    ("", 2, "H100-SXM-HGX", "node must be a printable name"),
    ("n" * 300, 2, "H100-SXM-HGX", "node must be"),
    ("n1\nn2", 2, "H100-SXM-HGX", "node must be"),
    ("n1", 1, "H100-SXM-HGX", "nodes_in_group must be a whole number from 2"),
    ("n1", True, "H100-SXM-HGX", "nodes_in_group"),
    ("n1", 2, None, "sku must be"),
])
def test_sweep_history_bad_arguments_are_refused(history, node, group, sku, message):
    with pytest.raises(ValueError, match=message):
        history.record(node, group, sku, judged())


def test_sweep_history_non_finite_figures_are_not_kept(history):
    assert history.record("n1", 2, "H100-SXM-HGX", judged(latency=float("nan"), busbw=float("inf"))) is False
    assert history.record("n1", 2, "H100-SXM-HGX", judged(latency=float("nan"), busbw=400.0)) is True
    assert history.learned("n1", 2) == Learned(None, 400.0, 1, history._clock.now)


def test_sweep_history_keep_is_bounded(tmp_path):
    with pytest.raises(ValueError, match="keep must be 1 .. 10000"):
        SweepHistory(Path(tmp_path / "h.db"), keep=0)

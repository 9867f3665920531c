"""The one doubling backoff (agent/core/backoff.py) every retry of the agent waits by."""
from gpuwarden.agent.core.backoff import Backoff, doubling_delay


def test_waits_double_from_first_up_to_most_and_start_over_after_a_success():
    b = Backoff(1.0, 30.0)
    assert b.next_wait == 1.0
    assert [b.failed() for _ in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.next_wait == 30.0
    b.succeeded()
    assert b.next_wait == 1.0 and b.failed() == 1.0


def test_the_delay_after_n_failures_and_a_count_too_large_for_a_float():
    assert [doubling_delay(1.0, 300.0, n) for n in (0, 1, 8, 9)] == [1.0, 2.0, 256.0, 300.0]
    assert doubling_delay(0.5, 60.0, 10_000) == 60.0  # no OverflowError after days of a scheduler that is down
    assert doubling_delay(1.0, 30.0, -3) == 1.0

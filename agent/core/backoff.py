"""The one doubling backoff: how long to wait after each failure in a row, `first` doubling up to `most`, back to
`first` after a success. Every retry of the agent waits by it (the daemon's loops and its store writer, NVML's event
subscription, the remediation engine's scheduler calls), so each answers a failing dependency the same way: at
once the first time, then less and less often, never slower than `most`."""
from __future__ import annotations


def doubling_delay(first: float, most: float, failures_before: int) -> float:
    """The wait after a failure that follows `failures_before` others in a row: first x 2^failures_before, capped."""
    if failures_before >= 64:  # 2**64 x any first is past every cap; and no float overflow for a huge count
        return most
    return min(first * 2 ** max(0, failures_before), most)


class Backoff:
    def __init__(self, first: float, most: float):
        self.first, self.most = first, most
        self._failures = 0

    @property
    def next_wait(self) -> float:
        """The wait the next failure will give, not counting it."""
        return doubling_delay(self.first, self.most, self._failures)

    def failed(self) -> float:
        """Counts a failure and gives its wait."""
        wait = self.next_wait
        self._failures += 1
        return wait

    def succeeded(self) -> None:
        self._failures = 0

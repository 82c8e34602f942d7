"""The numpy loop's retransmit timeout: RFC 6298 over send-to-result times.

The compiled loop (csrc/exchange.c) keeps the same estimate in its own
struct; both start a round from what the rounds before it measured.
"""
from __future__ import annotations

SAMPLE_EVERY = 8        # a sample costs a copy of the round's done flags: every 8th receive is plenty
RTO_FIRST = 0.2         # before any sample, when there is no measured time to go by
RTO_MAX = 2.0


class RttEstimator:
    def __init__(self, floor: float):
        self.floor = floor              # ClientConfig.rto: the timeout never goes below it
        self.srtt: float | None = None  # smoothed send-to-result time, and its variation
        self.rttvar = 0.0
        self._receives = 0

    def rto(self) -> float:
        if self.srtt is None:
            return max(self.floor, RTO_FIRST)
        return min(max(self.floor, self.srtt + 4 * self.rttvar), RTO_MAX)

    def want_sample(self) -> bool:
        """Called once per receive: whether this one should be timed."""
        self._receives += 1
        return self._receives % SAMPLE_EVERY == 0

    def sample(self, r: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r

"""Packets in flight per aggregator, adapted within a call and from call to call.

A window larger than the queues on a slow or rate-limited path loses its
excess at every window's worth of packets, and every worker resends what
one lost: a resend storm (on 100 Mbit/s links whose switch ports queue
~150 KB, most of a dense step's packets were resends at the default
256 KB a worker). So, as TCP treats its congestion window: within a call,
the compiled round loop halves the window after each window's worth of
sends of which STORM_SHARE or more were resends (csrc/exchange.c,
judge_epoch), so a job's first call does not storm to its end; after a
call, one that resent STORM_SHARE or more of at least STORM_MIN_PACKETS
halves it (the numpy loop's only cut), one that resent under CLEAN_SHARE
grows it by an eighth (at least one packet), back up to the configured
window, its ceiling; in between it holds (a lossy link's few percent is
not congestion). Each worker adapts its own: the sums never depend on it.
"""
from __future__ import annotations

from xagg.client.config import MIN_WINDOW

# A call that resent this share of its packets (of at least STORM_MIN_PACKETS)
# lost more than a flaky link loses: 1% of frames dropped both ways resends
# ~4%, a window too large for a queue on the path 40-80%.
STORM_SHARE = 0.2
STORM_MIN_PACKETS = 1000
CLEAN_SHARE = 0.01      # below this share of resends a call says the path had room


class Window:
    """The window now (``now``, packets per aggregator) under ``ceiling``."""

    def __init__(self, ceiling: int):
        self.ceiling = max(MIN_WINDOW, ceiling)
        self.now = self.ceiling

    def after_call(self, sent: int, resent: int, ended: int | None = None) -> bool:
        """Adapt to a call that sent ``sent`` packets, ``resent`` of them
        again, and whose round loop ended at window ``ended`` (below ``now``:
        it cut the window during the call); True where that call was a storm."""
        if ended is not None and ended < self.now:
            self.now = max(MIN_WINDOW, ended)
            return True
        if storm(sent, resent):
            self.now = max(MIN_WINDOW, self.now // 2)
            return True
        if sent and resent < CLEAN_SHARE * sent:
            self.now = min(self.ceiling, self.now + max(1, self.now // 8))
        return False


def storm(sent: int, resent: int) -> bool:
    """Whether a call that sent ``sent`` packets, ``resent`` of them again,
    was a resend storm (enough packets to tell, STORM_SHARE of them resent)."""
    return sent >= STORM_MIN_PACKETS and resent >= STORM_SHARE * sent

"""Job leases: a job whose registrant has gone holds its slots until it is
removed, so a job that shows no sign of life for the lease (``job_lease``)
is removed.

A sign of life is a request from its registrant (register, resize, reset,
keepalive: jobs.py) or packets. Packets are not timestamped on the data
path: the data plane counts each job's packets anyway (XDP's per-job
``job_stats``, the userspace aggregator's), so each lease check reads those
totals and a total that moved since the last check is activity. A job is
then seen alive at most one check interval late, which costs nothing per
packet.

Everything here is a function of the clock value it is given, so tests
drive it without waiting.
"""
from __future__ import annotations

from dataclasses import dataclass

IDLE_AFTER_S = 60.0         # a training job sends every step: a minute of silence is worth showing
CHECKS_PER_LEASE = 4        # a job outlives its lease by at most a quarter of it ...
MAX_CHECK_EVERY_S = 5.0     # ... or by this much


@dataclass(frozen=True)
class Activity:
    at: float               # clock value of the last sign of life
    packets: int = 0        # the job's packet counters' total when last read

    def seen(self, now: float) -> "Activity":
        """A request from the registrant at ``now``."""
        return Activity(max(self.at, now), self.packets)

    def observe(self, packets: int, now: float) -> "Activity":
        """The counters read at ``now``: moved since the last read, alive.
        Any change counts (a reset clears them)."""
        return Activity(now, packets) if packets != self.packets else self

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.at)


def expired(idle: dict[int, float], lease_s: float) -> list[int]:
    """The jobs of ``idle`` ({job_id: idle seconds}) whose lease has run out;
    none when ``lease_s`` is 0 (jobs never expire)."""
    if lease_s <= 0:
        return []
    return sorted(j for j, s in idle.items() if s >= lease_s)


def check_every(lease_s: float) -> float | None:
    """Seconds between lease checks; None when leases are off."""
    return min(MAX_CHECK_EVERY_S, lease_s / CHECKS_PER_LEASE) if lease_s > 0 else None

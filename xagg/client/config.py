"""A worker's client settings, the defaults every layer above takes, and the
errors the client raises.

The torch hook (xagg.torch.config), ``xagg-client`` and the lab's traffic
generator take their defaults from here, so a default is written once.
"""
from __future__ import annotations

import ipaddress

from dataclasses import dataclass

from xagg.wire import chunks
from xagg.wire.jobspec import DEFAULT_FANOUT, DEFAULT_RESULT_PORT, FANOUTS
from xagg.wire.proto import MAX_VALS, C, packet_dtype, parse_addr

DEFAULT_TIMEOUT = 5.0              # seconds without progress before a call fails
DEFAULT_RTO = 0.05                 # floor of the retransmit timeout (seconds)
DEFAULT_WINDOW_BYTES = 256 << 10   # in flight per aggregator: fits switch queues under incast
MIN_WINDOW = 16                    # packets in flight per aggregator, at the least


class XaggError(RuntimeError):
    """The aggregators could not produce this sum (or the client cannot be set up)."""


class XaggTimeout(XaggError):
    """No progress from the aggregators within the configured timeout."""


@dataclass
class ClientConfig:
    job_id: int
    cookie: int
    worker_id: int
    n_workers: int
    aggregators: list                  # "host[:port]" strings or (ip, port)
    weights: list | None = None        # share of chunks per aggregator (default: equal)
    fanout: str = DEFAULT_FANOUT       # as the job was registered
    result_port: int = DEFAULT_RESULT_PORT
    # bcast fan-out to an IPv4 multicast group (the job's bcast_ip): the group,
    # joined on the result socket. A snooping switch then delivers results to
    # the workers alone, not to every port as broadcast does. "": broadcast.
    result_group: str = ""
    vals: int = C.XAGG_VALS            # int32 values per packet, as the aggregators run them
    rto: float = DEFAULT_RTO           # the retransmit timeout adapts to measured result
                                       # times (RFC 6298), never below this
    timeout: float = DEFAULT_TIMEOUT   # seconds without progress -> XaggTimeout
    window: int = 0                    # packets in flight per aggregator (0: window_bytes' worth)
    window_bytes: int = DEFAULT_WINDOW_BYTES
    bind_ip: str = "0.0.0.0"
    fast: bool = True                  # the compiled round loop (native.py) where it builds
    # This worker's row of a plan's routes (xagg.wire.planner.Plan.routes[w]):
    # route[p] = c sends aggregator p's chunks to aggregator c, a child that
    # sums them with other workers' and sends one partial to p (c == p:
    # straight to p). The header still names p; results come back from c.
    # None: every aggregator's chunks go to it directly.
    route: list | None = None

    def __post_init__(self):
        def need(ok, name, why):
            if not ok:
                raise XaggError(f"config.{name}: {why}")

        def parsed(name, fn, value):
            try:
                return fn(value)
            except ValueError as e:
                raise XaggError(f"config.{name}: {e}") from None
        need(bool(self.aggregators), "aggregators", "at least one aggregator is needed")
        self.aggregators = [a if isinstance(a, tuple) else parsed("aggregators", parse_addr, a)
                            for a in self.aggregators]
        self.weights = parsed("weights", lambda w: chunks.check_weights(w, len(self.aggregators)),
                              self.weights or [1.0] * len(self.aggregators))
        need(0 <= self.worker_id < self.n_workers, "worker_id", f"{self.worker_id} not in 0..{self.n_workers - 1}")
        need(self.fanout in FANOUTS, "fanout", f"must be one of {', '.join(sorted(FANOUTS))}, got {self.fanout!r}")
        if self.result_group:
            need(self.fanout == "bcast", "result_group", "needs fanout 'bcast' (results to one address)")
            try:
                ok = ipaddress.IPv4Address(self.result_group).is_multicast
            except ValueError:
                ok = False
            need(ok, "result_group", f"must be an IPv4 multicast address (224.0.0.0/4), "
                 f"got {self.result_group!r}")
        need(1 <= self.vals <= MAX_VALS, "vals", f"must be 1..{MAX_VALS}, got {self.vals!r}")
        need(0 < self.rto < self.timeout, "rto", f"must be > 0 and below timeout ({self.timeout}s), got {self.rto!r}")
        if self.route is not None:
            m = len(self.aggregators)
            need(isinstance(self.route, (list, tuple)) and len(self.route) == m
                 and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < m for c in self.route),
                 "route", f"must give, per aggregator, the index (0..{m - 1}) of the aggregator its "
                 f"chunks are sent through, got {self.route!r}")
            self.route = list(self.route)
        if self.window <= 0:
            self.window = max(MIN_WINDOW, self.window_bytes // packet_dtype(self.vals).itemsize)

    @property
    def send_to(self) -> list:
        """Per aggregator p, the (ip, port) its chunks are sent to: p's own, or
        the child aggregator this worker's route names."""
        if self.route is None:
            return list(self.aggregators)
        return [self.aggregators[c] for c in self.route]

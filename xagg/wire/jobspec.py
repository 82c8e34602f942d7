"""A job as one aggregator sees it: who may contribute, how much memory it
needs, where results go. Validated once here, so the XDP maps, the
userspace aggregator and the control API all refuse the same bad input with
the same message naming the field."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from xagg.wire.proto import C

# How results go back: "unicast" (one copy per worker, to the address its
# packets came from) works with any number of ranks per host and across
# routers; "bcast" (one frame to the subnet broadcast) needs a flat LAN and
# one rank per host, and costs the aggregator one frame per chunk.
FANOUTS = {"bcast": C.XAGG_FANOUT_BCAST, "unicast": C.XAGG_FANOUT_UNICAST}
DEFAULT_FANOUT = "unicast"
DEFAULT_RESULT_PORT = C.XAGG_PORT + 1     # where broadcast results go
DEFAULT_BCAST_IP = "255.255.255.255"


class JobError(ValueError):
    """A job definition that cannot be served; the message names the field."""


@dataclass
class JobSpec:
    job_id: int
    cookie: int
    n_workers: int
    n_chunks: int                         # chunks this aggregator holds
    fanout: str = DEFAULT_FANOUT
    bcast_ip: str = DEFAULT_BCAST_IP      # broadcast fan-out destination
    result_port: int = DEFAULT_RESULT_PORT  # broadcast fan-out UDP port
    worker_ips: list = field(default_factory=list)  # per worker id; "" = any source

    def __post_init__(self):
        self.validate()

    def validate(self, max_workers: int = C.XAGG_MAX_WORKERS) -> "JobSpec":
        def need(cond, fld, why):
            if not cond:
                raise JobError(f"{fld}: {why}")

        def u32(v):
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32

        def ipv4(v):
            try:
                return isinstance(v, str) and bool(ipaddress.IPv4Address(v))
            except ValueError:
                return False
        for name in ("job_id", "cookie"):
            v = getattr(self, name)
            need(u32(v), name, f"must be an unsigned 32-bit integer, got {v!r}")
        need(isinstance(self.n_workers, int) and 1 <= self.n_workers <= max_workers,
             "n_workers", f"must be 1..{max_workers}, got {self.n_workers!r}")
        need(isinstance(self.n_chunks, int) and self.n_chunks >= 1, "n_chunks",
             f"must be a positive integer, got {self.n_chunks!r}")
        need(self.fanout in FANOUTS, "fanout",
             f"must be one of {', '.join(sorted(FANOUTS))}, got {self.fanout!r}")
        need(u32(self.result_port) and 0 < self.result_port < 65536, "result_port",
             f"must be a UDP port 1..65535, got {self.result_port!r}")
        need(ipv4(self.bcast_ip), "bcast_ip", f"not an IPv4 address: {self.bcast_ip!r}")
        need(len(self.worker_ips) in (0, self.n_workers), "worker_ips",
             f"needs one address per worker ({self.n_workers}), got {len(self.worker_ips)}")
        for i, ip in enumerate(self.worker_ips):
            need(not ip or ipv4(ip), f"workers[{i}]", f"not an IPv4 address: {ip!r}")
        return self

    @property
    def full_mask(self) -> int:
        return (1 << self.n_workers) - 1

    @property
    def n_slots(self) -> int:
        return 2 * self.n_chunks          # round parity: two copies per chunk

    def worker_ip(self, wid: int) -> str:
        return self.worker_ips[wid] if self.worker_ips else ""

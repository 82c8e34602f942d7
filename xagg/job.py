"""A job as one aggregator sees it: who may contribute, how much memory it
needs, where results go. Validated once here, so the XDP maps, the
userspace twin and the control API all refuse the same bad input with the
same message naming the field."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from .proto import C

FANOUTS = {"bcast": C.XAGG_FANOUT_BCAST, "unicast": C.XAGG_FANOUT_UNICAST}


class JobError(ValueError):
    """A job definition that cannot be served; the message names the field."""


@dataclass
class JobSpec:
    job_id: int
    cookie: int
    n_workers: int
    n_chunks: int                         # chunks this aggregator holds
    fanout: str = "bcast"
    bcast_ip: str = "255.255.255.255"     # broadcast fan-out destination
    result_port: int = C.XAGG_PORT + 1    # broadcast fan-out UDP port
    worker_ips: list = field(default_factory=list)  # per worker id; "" = any source

    def __post_init__(self):
        self.validate()

    def validate(self, max_workers: int = C.XAGG_MAX_WORKERS) -> "JobSpec":
        def need(cond, fld, why):
            if not cond:
                raise JobError(f"job.{fld}: {why}")
        for name in ("job_id", "cookie"):
            v = getattr(self, name)
            need(isinstance(v, int) and 0 <= v < 2**32, name, f"must be an unsigned 32-bit integer, got {v!r}")
        need(isinstance(self.n_workers, int) and 1 <= self.n_workers <= max_workers,
             "n_workers", f"must be 1..{max_workers}, got {self.n_workers!r}")
        need(isinstance(self.n_chunks, int) and self.n_chunks >= 1, "n_chunks",
             f"must be a positive integer, got {self.n_chunks!r}")
        need(self.fanout in FANOUTS, "fanout", f"must be one of {sorted(FANOUTS)}, got {self.fanout!r}")
        need(isinstance(self.result_port, int) and 0 < self.result_port < 65536, "result_port",
             f"must be a UDP port, got {self.result_port!r}")
        try:
            ipaddress.IPv4Address(self.bcast_ip)
        except ValueError:
            raise JobError(f"job.bcast_ip: not an IPv4 address: {self.bcast_ip!r}") from None
        need(len(self.worker_ips) in (0, self.n_workers), "worker_ips",
             f"needs one address per worker ({self.n_workers}), got {len(self.worker_ips)}")
        for i, ip in enumerate(self.worker_ips):
            if ip:
                try:
                    ipaddress.IPv4Address(ip)
                except ValueError:
                    raise JobError(f"job.worker_ips[{i}]: not an IPv4 address: {ip!r}") from None
        return self

    @property
    def full_mask(self) -> int:
        return (1 << self.n_workers) - 1

    @property
    def n_slots(self) -> int:
        return 2 * self.n_chunks          # round parity: two copies per chunk

    def worker_ip(self, wid: int) -> str:
        return self.worker_ips[wid] if self.worker_ips else ""

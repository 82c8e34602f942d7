"""What a Client counts: calls, packets, losses repaired, results, and the
aggregator on its own host, for the status and metrics layers above."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClientStats:
    calls: int = 0
    packets_sent: int = 0
    retransmits: int = 0               # of which found by a tail probe, or once the round stalled for rto
    probe_resends: int = 0             # (the rest by gaps in the results; the compiled loop counts these)
    rto_resends: int = 0
    results: int = 0
    redone: int = 0                    # chunks summed twice: their predicted exponent missed
    reorder: int = 0                   # results out of send order by up to this many sends
    window: int = 0                    # packets in flight per aggregator after the last call (window.py)
    bytes: int = 0
    seconds: float = 0.0
    local_packets: int = 0             # put through the program of the aggregator on this host (local.py)
    local_sent: int = 0                # of which it answered with a frame for the wire (a completion)
    local_polls: int = 0               # its slots read for those sums (each a whole slot copied out)
    path: str = "udp"                  # how packets went: udp, afxdp (config.PATHS)
    path_reason: str = ""              # where AF_XDP runs (interface, queue, mode), or why it does not
    extra: dict = field(default_factory=dict)

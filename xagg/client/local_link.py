"""Which of a job's aggregators runs on this worker's own host, and the hold
on its data plane (local.py) that the round loops use.

The hold is taken at start, and taken again before the next round after a
round failed while it was held: that aggregator's xaggd may have been
restarted, and the program and maps held here would then sum nothing the
network brings (the new program gets those).
"""
from __future__ import annotations

import logging

from xagg.client.config import ClientConfig, XaggError
from xagg.client.local import LocalDataplane, is_own_address

log = logging.getLogger("xagg.client")


def find_local(cfg: ClientConfig) -> tuple[LocalDataplane | None, int]:
    """The aggregator on this host, if the job has one whose XDP program
    xaggd hands over: (it, its index), else (None, -1)."""
    found = (None, -1)
    for k, addr in enumerate(cfg.send_to):
        if not is_own_address(addr[0]):
            continue
        dp, why = LocalDataplane.find(*addr)
        if dp is None:      # a userspace xaggd (it hears loopback), or none that lets us in
            if why:
                log.warning("aggregator %s:%d is this host, but no xaggd hands over its XDP program (%s): "
                            "sending over loopback, where only a userspace xaggd hears",
                            addr[0], addr[1], "; ".join(why))
            continue
        why = (f"aggregator {k} routes through {addr[0]}:{addr[1]}, a child aggregator on this worker's "
               "own host: a worker host may root a share, not sum for another" if addr != cfg.aggregators[k]
               else f"aggregators {found[1]} and {k} are both on this worker's host" if found[0] else "")
        if why:
            for d in (dp, found[0]):
                if d is not None:
                    d.close()
            raise XaggError(why)
        found = (dp, k)
        log.info("aggregator %d (%s:%d) is this host: packets through its program on %s, sums from its slots",
                 k, addr[0], addr[1], dp.info["iface"])
    return found


class LocalLink:
    """``dp``: the aggregator on this host (None: none), ``k``: its index."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.dp, self.k = find_local(cfg)
        self._stale = False

    def before_round(self) -> None:
        """Take the hold again if a round failed while it was held."""
        if self._stale:
            self.close()
            self.dp, self.k = find_local(self.cfg)
            self._stale = False

    def round_failed(self) -> None:
        self._stale = self.dp is not None

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()
            self.dp, self.k = None, -1

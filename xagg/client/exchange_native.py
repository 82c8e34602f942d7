"""The round loop of csrc/exchange.c behind the Exchange interface, with the
compiled codec, which it can also run inside the loop (``codec_in_loop``).

Its state that lasts from round to round (the RTT estimate, the reordering
seen, whether the kernel takes UDP GSO) stays in the C struct between calls.
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

from xagg.client import native
from xagg.client.codec import CompiledCodec
from xagg.client.config import MIN_WINDOW, ClientConfig, XaggError
from xagg.client.exchange import Exchange
from xagg.client.fixedpoint import WIRE_BITS
from xagg.client.packets import Book
from xagg.client.stats import ClientStats
from xagg.client.window import STORM_SHARE

log = logging.getLogger("xagg.client")


class NativeExchange(Exchange):
    compiled = True
    codec_in_loop = True

    def __init__(self, cfg: ClientConfig, stats: ClientStats, dll):
        super().__init__(cfg, stats)
        self.dll = dll
        self.codecs = {bits: CompiledCodec(dll, cfg.vals, bits) for bits in WIRE_BITS}     # per call: its lanes
        self._addrs = native.sockaddrs(self.send_to)      # kept alive: _cx points at it
        self._cx = native.Exchange(fd=self.sock.fileno(), n_aggs=len(cfg.aggregators),
                                   addrs=ctypes.addressof(self._addrs), vals=cfg.vals,
                                   pkt_size=self.pkt_size, job_id=cfg.job_id, cookie=cfg.cookie,
                                   window=cfg.window, rto_floor=cfg.rto, timeout=cfg.timeout,
                                   gso=1, srtt=-1.0, rttvar=0.0, reorder=0, window_min=MIN_WINDOW,
                                   storm_share=STORM_SHARE)
        self._lx, self._lx_of = None, None      # struct xagg_local, and the data plane it was made for
        self._wire_local()

    def _wire_local(self) -> None:
        """Point the C loop at the local link's data plane, if it changed."""
        dp = self.local.dp
        if dp is self._lx_of:
            return
        self._cx.local = None
        self._lx, self._lx_of = None, dp
        if dp is not None:
            self._lx = dp.c_struct(self.sock.getsockname()[1], self.pkt_size)
            self._lx.agg = self.local.k
            self._cx.local = ctypes.addressof(self._lx)

    def _round(self, rnd: int, pkts: np.ndarray, book: Book, in_loop: native.InLoopCodec | None) -> None:
        self._wire_local()
        x = self._cx
        x.round, x.window = rnd, self.window
        if self._lx is not None:
            self._lx.gen, self._lx.slot_base = self.local.dp.job_slots(self.cfg.job_id)
        gso = x.gso
        x.sent = x.retransmits = x.received = x.err = x.probe_resends = x.rto_resends = 0
        rc = native.exchange(self.dll, x, pkts, book.off, book.row, book.results, book.done.view(np.uint8),
                             in_loop)
        self.window = x.window          # halved where the round was a resend storm
        if gso and not x.gso:
            log.info("UDP GSO unavailable: sending one datagram per call")
        self._count(x)
        if rc == 1:
            raise self.timed_out(rnd, book)
        if rc:
            raise XaggError(f"job {self.cfg.job_id} round {rnd}: {os.strerror(x.err)}")

    def _count(self, x: native.Exchange) -> None:
        s = self.stats
        s.reorder = x.reorder
        s.packets_sent += x.sent
        if self._lx is not None:
            s.local_packets, s.local_sent, s.local_polls = self._lx.injected, self._lx.transmitted, self._lx.polls
        s.retransmits += x.retransmits
        s.probe_resends += x.probe_resends
        s.rto_resends += x.rto_resends
        s.results += x.received

    def close(self) -> None:
        self._cx.local = None
        self._lx = self._lx_of = None
        super().close()

"""The round loop in numpy: the reference for csrc/exchange.c (the same
windows, the same packets on the wire), and the fallback where the compiled
library does not build.

Packets leave in GSO batches under a per-aggregator window. While results
flow, what is in flight is queued, not lost: a chunk is sent again only
once the whole round has stalled for the retransmit timeout (rtt.py), and
the timeout doubles while nothing arrives (no retransmit storms). The
aggregator answers a repeat of a finished chunk with the stored result.

Its codec (codec.NumpyCodec) takes bf16 and fp16 tensors by widening them
into float32 copies and narrowing the sums back (fixedpoint.widen, narrow):
the reference the compiled codec, which reads and writes them in place, is
held to.
"""
from __future__ import annotations

import select
import time

import numpy as np

from xagg.client.codec import NumpyCodec
from xagg.client.config import ClientConfig
from xagg.client.exchange import Exchange
from xagg.client.fixedpoint import WIRE_BITS
from xagg.client.mmsg import BatchReceiver
from xagg.client.packets import Book
from xagg.client.rtt import RttEstimator
from xagg.client.stats import ClientStats
from xagg.client.udp import GsoSender
from xagg.wire.proto import C, packet_dtype

RX_BATCH = 256          # datagrams per receive call
MAX_WAIT = 0.01         # longest single wait: the loop re-checks windows
LOCAL_WAIT = 0.0002     # longest wait while this host's aggregator owes sums
RTO_BACKOFF_MAX = 1.0   # the doubled timeout stops growing here


class NumpyExchange(Exchange):
    def __init__(self, cfg: ClientConfig, stats: ClientStats):
        super().__init__(cfg, stats)
        self.codecs = {bits: NumpyCodec(cfg.vals, bits) for bits in WIRE_BITS}     # per call: its lanes
        self._rarr = np.zeros(RX_BATCH, dtype=packet_dtype(cfg.vals))      # receive batch
        self._rx = BatchReceiver(self.sock, self._rarr)
        self._sender = GsoSender(self.sock, self.pkt_size, stats)
        self._rtt = RttEstimator(cfg.rto)

    def _round(self, rnd: int, pkts: np.ndarray, book: Book, in_loop) -> None:
        assert in_loop is None, "the numpy loop has no codec inside it"
        cfg = self.cfg
        pkts = book.per_agg(pkts)
        done = book.per_agg(book.done)
        sent_at = [np.zeros(len(d)) for d in done]
        resent = [np.zeros(len(d), bool) for d in done]
        nxt = [0] * len(pkts)       # next never-sent packet per aggregator
        remaining = len(book.done)
        last_progress = time.monotonic()
        rto = self._rtt.rto()
        lk = self.local.k if self.local.dp is not None else -1
        if lk >= 0:
            nxt[lk] = self._inject_local(pkts[lk])
            local = (*self.local.dp.job_slots(cfg.job_id), book.off[lk])
        while remaining:
            now = time.monotonic()
            self._send_windows(pkts, book.n_done, nxt, sent_at, now, lk)
            if now - last_progress >= rto:
                self._resend_late(pkts, done, nxt, sent_at, resent, now, rto, lk)
                rto = min(rto * 2, RTO_BACKOFF_MAX)
            before = [d.copy() for d in done] if self._rtt.want_sample() else None
            owed = lk >= 0 and book.n_done[lk] < len(done[lk])
            got = self._receive(rnd, book, wait=min(rto, LOCAL_WAIT if owed else MAX_WAIT))
            if owed:
                got += self._collect_local(rnd, pkts[lk], book, *local)
            if got:
                remaining -= got
                last_progress = time.monotonic()
                if before is not None:
                    self._rtt_sample(last_progress, sent_at, before, done, resent)
                rto = self._rtt.rto()
            elif time.monotonic() - last_progress > cfg.timeout:
                raise self.timed_out(rnd, book)

    def _send_windows(self, pkts: list, n_done: np.ndarray, nxt: list, sent_at: list, now: float,
                      lk: int) -> None:
        """Each aggregator's next never-sent packets, as many as its window has room for."""
        for k in range(len(pkts)):
            if k == lk:
                continue
            room = self.window - (nxt[k] - n_done[k])
            if room > 0 and nxt[k] < len(pkts[k]):
                j = min(len(pkts[k]), nxt[k] + room)
                self._sender.send(pkts[k][nxt[k]:j], self.send_to[k])
                sent_at[k][nxt[k]:j] = now
                nxt[k] = j

    def _resend_late(self, pkts: list, done: list, nxt: list, sent_at: list, resent: list, now: float,
                     rto: float, lk: int) -> None:
        """Send again what was sent more than rto ago and is not done, a window's worth per aggregator."""
        for k in range(len(pkts)):
            if k == lk:
                continue        # nothing of its can be lost
            late = np.flatnonzero((~done[k][: nxt[k]]) & (sent_at[k][: nxt[k]] < now - rto))
            if late.size:
                late = late[: self.window]
                again = pkts[k][late]           # a copy: marked as resends (XAGG_F_RESENT)
                again["hdr"]["flags"] |= C.XAGG_F_RESENT
                self._sender.send(again, self.send_to[k])
                sent_at[k][late] = now
                resent[k][late] = True
                self.stats.retransmits += late.size

    def _rtt_sample(self, now: float, sent_at: list, before: list, done: list, resent: list) -> None:
        """The slowest result of those that came since ``before``, as one sample."""
        samples = [now - sent_at[k][(done[k] & ~before[k]) & ~resent[k]] for k in range(len(done))]
        samples = np.concatenate(samples) if samples else np.zeros(0)
        if samples.size:            # Karn: times of retransmitted chunks are ambiguous
            self._rtt.sample(float(np.max(samples)))

    def _receive(self, rnd: int, book: Book, wait: float) -> int:
        """Drain the socket in batches; returns how many new chunk results arrived."""
        r, _, _ = select.select([self.sock], [], [], wait)
        if not r:
            return 0
        got = 0
        while True:
            n = self._rx.receive()
            if n:
                got += self._absorb(self._rarr[:n], rnd, book)
            if n < len(self._rarr):
                return got

    def _absorb(self, batch: np.ndarray, rnd: int, book: Book) -> int:
        """The batch's results of this job, cookie and round that are new: a chunk's first result wins."""
        cfg = self.cfg
        h = batch["hdr"]
        ok = ((h["magic"] == C.XAGG_MAGIC) & ((h["flags"] & C.XAGG_F_RESULT) != 0)
              & (h["job_id"] == cfg.job_id) & (h["cookie"] == cfg.cookie) & (h["round"] == rnd))
        rows, sel = book.rows_of(h["agg_id"], h["chunk"], ok)
        fresh = ~book.done[rows]
        rows, sel = rows[fresh], sel[fresh]
        if not rows.size:
            return 0
        rows, first = np.unique(rows, return_index=True)       # a chunk twice in one batch
        book.results[rows] = batch["vals"][sel[first]]
        book.done[rows] = True
        book.n_done += np.bincount(book.agg_of_row[rows], minlength=len(book.n_done))
        self.stats.results += rows.size
        return int(rows.size)

    def _inject_local(self, pkts: np.ndarray) -> int:
        """This host's aggregator's packets, each through its program (local.py)."""
        dp = self.local.dp
        hdr = dp.frame_header(self.sock.getsockname()[1], self.pkt_size)
        for p in pkts:
            self.stats.local_sent += dp.inject(hdr + p.tobytes())
        self.stats.packets_sent += len(pkts)
        self.stats.local_packets += len(pkts)
        return len(pkts)

    def _collect_local(self, rnd: int, pkts: np.ndarray, book: Book, gen: int, slot_base: int,
                       off: int) -> int:
        """Sums of this host's aggregator's rows now finished in its slots,
        from the first unfinished row to the next still unfinished (chunks
        finish nearly in row order; exchange.c's collect_local, LOCAL_MISSES 1)."""
        got = 0
        for i in np.flatnonzero(~book.done[off:off + len(pkts)]):
            vals = self.local.dp.poll(gen, slot_base + 2 * int(pkts[i]["hdr"]["chunk"]) + (rnd & 1), rnd)
            self.stats.local_polls += 1
            if vals is None:
                break
            book.results[off + i] = vals
            book.done[off + i] = True
            book.n_done[self.local.k] += 1
            got += 1
        self.stats.results += got
        return got

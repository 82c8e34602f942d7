"""allreduce over xagg aggregators, from one worker.

Each call is one round: every chunk goes out with XAGG_OP_SUM64, quantised
(and biased, see fixedpoint.py) with an exponent predicted from the same tensor's last calls, and with it
meta chunks (XAGG_OP_MAX) carrying each chunk's true and predicted
exponents; one round trip brings back the sums and the agreed exponents.
Chunks whose prediction did not hold (fixedpoint.check_predicted: the same
answer on every worker) are summed again in the next round with the agreed
exponent, so a call takes one or two rounds (``last_rounds``). Packets
leave in GSO batches under a per-aggregator window; a chunk whose result
does not arrive within ``rto`` is sent again (the aggregator answers a
repeat of a finished chunk with the stored result), and when nothing
arrives for ``timeout`` seconds the call raises ``XaggTimeout``: it never
returns a partial or wrong sum.

Where the compiled library loads (native.py), the rounds run in
csrc/exchange.c and the encoding and decoding in csrc/codec.c (codec.py):
straight from the tensor into the packets and from the results into the
output. Otherwise numpy does both (fixedpoint.py, _exchange_py): the
reference, equal to the bit.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from xagg.client import codec, fixedpoint, native
from xagg.client.config import ClientConfig, XaggError, XaggTimeout
from xagg.client.local import LocalDataplane, is_own_address
from xagg.client.mmsg import BatchReceiver
from xagg.wire.chunks import META_LANES, meta_chunks, split
from xagg.wire.proto import C, make_packets, packet_dtype

log = logging.getLogger("xagg.client")

UDP_SEGMENT = 103
GSO_MAX_BYTES = 65000      # one UDP GSO send must stay under 64 KiB
GSO_MAX_SEGS = 64          # and under the kernel's segment limit


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
    bytes: int = 0
    seconds: float = 0.0
    local_packets: int = 0             # put through the program of the aggregator on this host (local.py)
    local_sent: int = 0                # of which it answered with a frame for the wire (a completion)
    local_polls: int = 0               # its slots read for those sums (each a whole slot copied out)
    extra: dict = field(default_factory=dict)


class Client:
    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.round = 0
        self.last_rounds = 0       # rounds the last call used (1, or 2 with a redo)
        self.stats = ClientStats()
        self._history: dict = {}   # (key, chunks) -> agreed exponents of its last calls
        self._layouts: dict = {}   # (chunks, exact) -> _Layout
        self.pkt_dtype = packet_dtype(cfg.vals)
        self.pkt_size = self.pkt_dtype.itemsize
        self._send_to = cfg.send_to     # per aggregator: it, or the child its chunks go through
        self._srtt = None          # smoothed send-to-result time, and its variation
        self._rttvar = 0.0
        self._reorder = 0          # results seen out of send order by this many (exchange.c)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        try:        # SO_RCVBUFFORCE: past rmem_max, as root; results arrive in bursts
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)
        except PermissionError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        # a modest send buffer: a shaped link then pushes back on the sender
        # (EAGAIN) instead of overflowing its qdisc and losing datagrams
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        port = cfg.result_port if cfg.fanout == "bcast" else 0
        self.sock.bind((cfg.bind_ip, port))
        if cfg.result_group:
            self._join(cfg.result_group)
        self.sock.setblocking(False)
        self._gso = True
        self._rarr = np.zeros(256, dtype=self.pkt_dtype)      # receive batch
        self._rx = BatchReceiver(self.sock, self._rarr)
        self._fast = native.load() if cfg.fast else None
        if self._fast is not None:
            self._addrs = native.sockaddrs(cfg.send_to)      # kept alive: _cx points at it
            self._cx = native.Exchange(fd=self.sock.fileno(), n_aggs=len(cfg.aggregators),
                                       addrs=ctypes.addressof(self._addrs), vals=cfg.vals,
                                       pkt_size=self.pkt_size, job_id=cfg.job_id, cookie=cfg.cookie,
                                       window=cfg.window, rto_floor=cfg.rto, timeout=cfg.timeout)
        self._local, self._local_k, self._local_stale = None, -1, False
        self._use_local()

    def _use_local(self) -> None:
        """(Re)connect to the aggregator on this host, if any: at start, and
        after a round that failed with it (its xaggd may have been restarted:
        the program and maps this client holds would then sum nothing the
        network brings, as the new program gets those)."""
        if self._local is not None:
            self._local.close()
        self._local, self._local_k = self._find_local()
        self._local_stale = False
        if self._fast is not None:
            self._cx.local = None
            if self._local is not None:
                self._lx = self._local.c_struct(self.sock.getsockname()[1], self.pkt_size)
                self._lx.agg = self._local_k
                self._cx.local = ctypes.addressof(self._lx)

    def _find_local(self) -> tuple[LocalDataplane | None, int]:
        """The aggregator on this host (client/local.py), if the job has one
        whose XDP program xaggd hands over: (it, its index), else (None, -1)."""
        cfg, found = self.cfg, (None, -1)
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

    def _join(self, group: str) -> None:
        """Join the results' multicast group on the interface that reaches the
        first aggregator (a group has no route of its own to pick one by)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(self.cfg.aggregators[0])
            local = probe.getsockname()[0]
        mreq = socket.inet_aton(group) + socket.inet_aton(local)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)

    def close(self) -> None:
        self.sock.close()
        if self._local is not None:
            self._local.close()
            self._local = None
            if self._fast is not None:
                self._cx.local = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- public -----------------------------------------------------------
    def allreduce(self, x: np.ndarray, key=None, exact: bool = False,
                  out: np.ndarray | None = None) -> np.ndarray:
        """The elementwise sum of ``x`` over all workers (float32). ``key``
        names the tensor (e.g. a DDP bucket index) whose last calls predict
        this one's exponents; by default its size does. ``exact`` (the same
        on every worker): no prediction, exponents agreed first (two round
        trips, every chunk with its own exponent: S bits, not KEPT_BITS).
        ``out``: a C-contiguous float32 array of x's size that receives the
        sum and is returned. ``x`` itself is fine: it is then written only
        once every round of the call succeeded, so after an error it is as
        it was. Any other ``out`` is summed into as results arrive (the
        decoding hides behind the network), so after an error it holds
        partial sums."""
        dest = None if out is None else _destination(out, np.size(x))
        if self._fast is None:
            total = self._allreduce_numpy(x, key, exact)
            if dest is None:
                return total
            np.copyto(dest, total.reshape(-1))
            return out
        total = self._allreduce_native(x, key, exact, dest)
        return total if out is None else out

    def _allreduce_numpy(self, x: np.ndarray, key, exact: bool) -> np.ndarray:
        """allreduce in numpy: the reference for _allreduce_native."""
        t0 = time.perf_counter()
        cfg, nw = self.cfg, self.cfg.n_workers
        n, chunks, ranges, rnd = self._start_round(x, np.float32)
        own = fixedpoint.chunk_exponents(chunks)
        hkey = (key, len(chunks))
        past = [] if exact else self._history.get(hkey, [])
        pred = fixedpoint.predict(past, len(chunks), nw)      # all EXP_ZERO without history
        q = None if exact else fixedpoint.quantise_predicted(chunks, own, pred, nw, biased=True)
        lanes = fixedpoint.meta_lanes(own, pred)

        lay = self._layout(len(chunks), ranges, exact)
        res = self._exchange(rnd, *lay.fill(rnd, q, lanes))
        sums = np.zeros((len(chunks), cfg.vals), np.int32) if exact else res[lay.data_rows]
        agreed = lay.agreed(res)
        exps, scale, redo = fixedpoint.check_predicted(agreed, nw)

        if redo.any():      # the same chunks on every worker: sum them again, exactly scaled
            rnd2 = self._take_round()
            self.last_rounds = 2
            idx, again = self._redo_chunks(redo, ranges)
            sums[again] = self._exchange(rnd2, *_round_packets(
                cfg, rnd2, fixedpoint.quantise(chunks[again], exps[again], nw, biased=True), idx, C.XAGG_OP_SUM64))
            scale = np.where(redo, exps, scale)
            self.stats.redone += 0 if exact else int(redo.sum())
        if not exact:
            self._history[hkey] = [*past[1 - fixedpoint.HISTORY:], exps]
        out = fixedpoint.dequantise(sums, scale, nw, biased=True)
        return self._end_round(out, x, n, t0)

    def _allreduce_native(self, x: np.ndarray, key, exact: bool, dest: np.ndarray | None) -> np.ndarray:
        """allreduce through csrc/codec.c: the same steps and the same bits as
        _allreduce_numpy, without its full-size copies. The tensor is read in
        place (no padded copy), quantised straight into the layout's packets,
        and the sums go from the result rows straight into ``dest`` (or a new
        array), after the last round: ``dest`` may be ``x``."""
        t0 = time.perf_counter()
        cfg, nw, dll = self.cfg, self.cfg.n_workers, self._fast
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        n = flat.size
        count = codec.n_chunks(n, cfg.vals)
        ranges = split(count, cfg.weights)
        rnd = self._take_round()
        self.last_rounds = 1
        hkey = (key, count)
        past = [] if exact else self._history.get(hkey, [])
        pred = fixedpoint.predict(past, count, nw)
        lay = self._layout(count, ranges, exact)
        dest = np.empty(n, np.float32) if dest is None else dest
        # The codec in the round loop (each chunk's exponent read and the
        # chunk quantised as its packet first goes out, its sum taken
        # straight out of the arriving datagram), unless dest is the tensor:
        # then dest is written last, when every round is in, as a redo
        # round quantises the tensor again.
        in_loop = not exact and not np.shares_memory(dest, flat)
        if in_loop:
            own = np.full(count, fixedpoint.EXP_ZERO, np.int32)   # the loop writes the true ones
            loop = native.InLoopCodec(flat, dest, pred, lay.own_at, np.empty(count, np.int32), lay.chunk_of_row,
                                      fixedpoint.headroom_bits(nw), fixedpoint.bias(nw), fixedpoint.unbias(nw))
        else:
            own, loop = codec.chunk_exponents(dll, flat, cfg.vals), None
            if not exact:
                codec.quantise_into(dll, flat, fixedpoint.send_exponents(own, pred), nw,
                                    lay.pkts, lay.data_rows, biased=True)
        res = self._exchange(rnd, *lay.fill(rnd, None, fixedpoint.meta_lanes(own, pred)), loop)
        exps, scale, redo = fixedpoint.check_predicted(lay.agreed(res), nw)

        # the chunks summed again: their result rows, and each chunk's row there (-1: not redone)
        again_rows, again_row_of = np.zeros((0, cfg.vals), np.int32), np.full(count, -1, np.int64)
        if redo.any():
            rnd2 = self._take_round()
            self.last_rounds = 2
            idx, again = self._redo_chunks(redo, ranges)
            again_row_of[again] = np.arange(again.size)
            pkts, book = _round_packets(cfg, rnd2, np.zeros((again.size, cfg.vals), np.int32), idx,
                                        C.XAGG_OP_SUM64)
            codec.quantise_into(dll, flat, exps, nw, pkts, again_row_of, biased=True)
            again_rows = self._exchange(rnd2, pkts, book)
            scale = np.where(redo, exps, scale)
            self.stats.redone += 0 if exact else int(redo.sum())
        if not exact:
            self._history[hkey] = [*past[1 - fixedpoint.HISTORY:], exps]

        if in_loop:
            # A sum that stands was quantised with the sent exponent (the
            # agreed prediction) and is in dest; chunks with a marker
            # (all zero, or NaN/Inf somewhere) are written now, redone ones below.
            codec.dequantise_into(dll, res, lay.no_rows, scale, nw, dest, biased=True)
        elif not exact:     # every round is in: only now is dest written (the tensor is read no more)
            first = np.where(redo, -1, lay.data_rows) if redo.any() else lay.data_rows
            codec.dequantise_into(dll, res, first, scale, nw, dest, biased=True)
        if exact or redo.any():     # exact: every live chunk is redone, the rest are markers
            codec.dequantise_into(dll, again_rows, again_row_of, scale, nw, dest, biased=True)
        return self._end_round(dest, x, n, t0)

    @staticmethod
    def _redo_chunks(redo: np.ndarray, ranges: list) -> tuple[list, np.ndarray]:
        """The chunks to sum again: per aggregator (local indices), and all of them."""
        idx = [np.flatnonzero(redo[lo:hi]) for lo, hi in ranges]
        return idx, np.concatenate([lo + i for i, (lo, hi) in zip(idx, ranges)])

    def allreduce_int(self, x: np.ndarray) -> np.ndarray:
        """The exact elementwise int32 sum of ``x`` over all workers (wrapping
        modulo 2**32, as the kernel adds): for payloads already in fixed
        point, e.g. count sketches. One round, no exponents."""
        t0 = time.perf_counter()
        n, chunks, ranges, rnd = self._start_round(x, np.int32)
        ids = [np.arange(hi - lo) for lo, hi in ranges]
        sums = self._exchange(rnd, *_round_packets(self.cfg, rnd, chunks, ids))
        return self._end_round(sums, x, n, t0)

    def _start_round(self, x: np.ndarray, dtype):
        """Flatten and zero-pad ``x`` into chunks, split them over the
        aggregators and take this call's round number."""
        vals = self.cfg.vals
        flat = np.ascontiguousarray(x, dtype=dtype).reshape(-1)
        n = flat.size
        n_chunks = -(-n // vals)
        padded = np.zeros(n_chunks * vals, dtype)
        padded[:n] = flat
        self.last_rounds = 1
        return n, padded.reshape(n_chunks, vals), split(n_chunks, self.cfg.weights), self._take_round()

    def _take_round(self) -> int:
        rnd = self.round
        self.round = (self.round + 1) & 0xFFFFFFFF
        return rnd

    def _end_round(self, out: np.ndarray, x: np.ndarray, n: int, t0: float) -> np.ndarray:
        self.stats.calls += 1
        self.stats.bytes += n * 4
        self.stats.seconds += time.perf_counter() - t0
        return out.reshape(-1)[:n].reshape(np.shape(x))

    # -- one round: send every chunk, collect every result ------------------
    def _layout(self, n_chunks: int, ranges: list, exact: bool) -> "_Layout":
        key = (n_chunks, exact, tuple(ranges))     # ranges: the weights may be re-planned
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 64:        # callers with ever-new sizes: no unbounded cache
                self._layouts.clear()
            lay = self._layouts[key] = _Layout(self.cfg, n_chunks, ranges, exact)
        return lay

    def _exchange(self, rnd: int, pkts: np.ndarray, book: "_Book",
                  in_loop: native.InLoopCodec | None = None) -> np.ndarray:
        """Send every packet (book.off says whose), collect every result:
        returns them row for row (but for data rows ``in_loop`` decoded)."""
        if self._local_stale:
            self._use_local()
        try:
            if self._fast is not None:
                self._exchange_c(rnd, pkts, book, in_loop)
            else:
                self._exchange_py(rnd, [pkts[lo:hi] for lo, hi in zip(book.off[:-1], book.off[1:])], book)
        except (XaggError, OSError) as e:
            # the local data plane is looked up again before the next round
            self._local_stale = self._local is not None
            if isinstance(e, OSError):
                raise XaggError(f"job {self.cfg.job_id} round {rnd}: {e}") from e
            raise
        return book.results

    def _timed_out(self, rnd: int, book: "_Book") -> XaggTimeout:
        cfg = self.cfg
        missing = {str(cfg.aggregators[k]): int((~d).sum()) for k, d in enumerate(book.per_agg(book.done))
                   if (~d).any()}
        return XaggTimeout(f"job {cfg.job_id} round {rnd}: no result for {cfg.timeout:.1f}s; "
                           f"chunks still missing per aggregator: {missing}")

    def _exchange_c(self, rnd: int, pkts: np.ndarray, book: "_Book",
                    in_loop: native.InLoopCodec | None = None) -> None:
        """The round loop of csrc/exchange.c (see _exchange_py, its reference)."""
        x = self._cx
        x.round = rnd
        if self._local is not None:
            self._lx.gen, self._lx.slot_base = self._local.job_slots(self.cfg.job_id)
        x.srtt = -1.0 if self._srtt is None else self._srtt
        x.rttvar = self._rttvar
        x.reorder = self._reorder
        x.gso = int(self._gso)
        x.sent = x.retransmits = x.received = x.err = x.probe_resends = x.rto_resends = 0
        rc = native.exchange(self._fast, x, pkts, book.off, book.row,
                             book.results, book.done.view(np.uint8), in_loop)
        if x.srtt >= 0:
            self._srtt, self._rttvar = x.srtt, x.rttvar
        self._reorder = self.stats.reorder = x.reorder
        if self._gso and not x.gso:
            log.info("UDP GSO unavailable: sending one datagram per call")
            self._gso = False
        self.stats.packets_sent += x.sent
        if self._local is not None:
            self.stats.local_packets, self.stats.local_sent = self._lx.injected, self._lx.transmitted
            self.stats.local_polls = self._lx.polls
        self.stats.retransmits += x.retransmits
        self.stats.probe_resends += x.probe_resends
        self.stats.rto_resends += x.rto_resends
        self.stats.results += x.received
        if rc == 1:
            raise self._timed_out(rnd, book)
        if rc:
            raise XaggError(f"job {self.cfg.job_id} round {rnd}: {os.strerror(x.err)}")

    def _exchange_py(self, rnd: int, pkts: list, book: "_Book") -> None:
        cfg = self.cfg
        m = len(cfg.aggregators)
        done = book.per_agg(book.done)
        sent_at = [np.zeros(len(d)) for d in done]
        nxt = [0] * m            # next never-sent packet per aggregator
        n_done = book.n_done
        remaining = len(book.done)
        last_progress = time.monotonic()
        rto = self._rto()        # doubles while nothing arrives: no retransmit storms
        resent = [np.zeros(len(d), bool) for d in done]
        lk = self._local_k if self._local is not None else -1
        if lk >= 0:
            nxt[lk] = self._inject_local(pkts[lk])
            local = (*self._local.job_slots(cfg.job_id), book.off[lk])
        while remaining:
            now = time.monotonic()
            for k in range(m):
                if k == lk:
                    continue
                room = cfg.window - (nxt[k] - n_done[k])
                if room > 0 and nxt[k] < len(done[k]):
                    j = min(len(done[k]), nxt[k] + room)
                    self._send(pkts[k][nxt[k]:j], self._send_to[k])
                    sent_at[k][nxt[k]:j] = now
                    nxt[k] = j
            # While results flow, what is in flight is queued, not lost:
            # retransmit only once the pipeline has stalled for rto.
            if now - last_progress >= rto:
                for k in range(m):
                    if k == lk:
                        continue        # nothing of its can be lost
                    late = np.flatnonzero((~done[k][: nxt[k]]) & (sent_at[k][: nxt[k]] < now - rto))
                    if late.size:
                        late = late[: cfg.window]
                        again = pkts[k][late]           # a copy: marked as resends (XAGG_F_RESENT)
                        again["hdr"]["flags"] |= C.XAGG_F_RESENT
                        self._send(again, self._send_to[k])
                        sent_at[k][late] = now
                        resent[k][late] = True
                        self.stats.retransmits += late.size
                rto = min(rto * 2, 1.0)
            before = [d.copy() for d in done] if self._want_rtt_sample() else None
            owed = lk >= 0 and n_done[lk] < len(done[lk])
            got = self._receive(rnd, book, wait=min(rto, 0.0002 if owed else 0.01))
            if owed:
                got += self._collect_local(rnd, pkts[lk], book, *local)
            if got:
                remaining -= got
                last_progress = time.monotonic()
                if before is not None:
                    self._rtt_sample(last_progress, sent_at, before, done, resent)
                rto = self._rto()
            elif time.monotonic() - last_progress > cfg.timeout:
                raise self._timed_out(rnd, book)

    def _inject_local(self, pkts: np.ndarray) -> int:
        """This host's aggregator's packets, each through its program (local.py)."""
        hdr = self._local.frame_header(self.sock.getsockname()[1], self.pkt_size)
        for p in pkts:
            self.stats.local_sent += self._local.inject(hdr + p.tobytes())
        self.stats.packets_sent += len(pkts)
        self.stats.local_packets += len(pkts)
        return len(pkts)

    def _collect_local(self, rnd: int, pkts: np.ndarray, book: "_Book", gen: int, slot_base: int,
                       off: int) -> int:
        """Sums of this host's aggregator's rows now finished in its slots,
        from the first unfinished row to the next still unfinished (chunks
        finish nearly in row order; exchange.c's collect_local, LOCAL_MISSES 1)."""
        got = 0
        for i in np.flatnonzero(~book.done[off:off + len(pkts)]):
            vals = self._local.poll(gen, slot_base + 2 * int(pkts[i]["hdr"]["chunk"]) + (rnd & 1), rnd)
            self.stats.local_polls += 1
            if vals is None:
                break
            book.results[off + i] = vals
            book.done[off + i] = True
            book.n_done[self._local_k] += 1
            got += 1
        self.stats.results += got
        return got

    # -- retransmit timeout: RFC 6298 over send-to-result times ---------------
    def _rto(self) -> float:
        if self._srtt is None:
            return max(self.cfg.rto, 0.2)
        return min(max(self.cfg.rto, self._srtt + 4 * self._rttvar), 2.0)

    def _want_rtt_sample(self) -> bool:
        self._rtt_tick = getattr(self, "_rtt_tick", 0) + 1
        return self._rtt_tick % 8 == 0          # sampling every 8th receive is plenty

    def _rtt_sample(self, now, sent_at, before, done, resent) -> None:
        samples = [now - sent_at[k][(done[k] & ~before[k]) & ~resent[k]] for k in range(len(done))]
        samples = np.concatenate(samples) if samples else np.zeros(0)
        if not samples.size:
            return          # Karn: times of retransmitted chunks are ambiguous
        r = float(np.max(samples))
        if self._srtt is None:
            self._srtt, self._rttvar = r, r / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - r)
            self._srtt = 0.875 * self._srtt + 0.125 * r

    def _send(self, pk: np.ndarray, addr) -> None:
        buf = memoryview(np.ascontiguousarray(pk)).cast("B")
        size = self.pkt_size
        i = 0
        while i < len(buf):
            segs = min(GSO_MAX_SEGS, GSO_MAX_BYTES // size, (len(buf) - i) // size)
            chunk = buf[i:i + segs * size]
            try:
                if self._gso and segs > 1:
                    self.sock.sendmsg([chunk], [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("H", size))], 0, addr)
                else:
                    for s in range(segs):
                        self.sock.sendto(chunk[s * size:(s + 1) * size], addr)
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)
                continue        # retry the same batch once the buffer drains
            except OSError as e:
                if e.errno in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT) and self._gso:
                    log.info("UDP GSO unavailable (%s): sending one datagram per call", e)
                    self._gso = False
                    continue
                raise XaggError(f"send to {addr} failed: {e}") from e
            self.stats.packets_sent += segs
            i += segs * size

    def _receive(self, rnd: int, book: "_Book", wait: float) -> int:
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

    def _absorb(self, batch: np.ndarray, rnd: int, book: "_Book") -> int:
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


def _destination(out: np.ndarray, n: int) -> np.ndarray:
    """``out`` as the flat float32 array of n elements the sum is written to."""
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.size == n
            and out.flags.c_contiguous and out.flags.writeable):
        got = (f"{out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' not contiguous'}"
               if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"allreduce out=: a writable C-contiguous float32 array of {n} elements "
                         f"is needed, got {got}")
    return out.reshape(-1)


def _round_packets(cfg: ClientConfig, rnd: int, values: np.ndarray, chunks: list, op=C.XAGG_OP_SUM):
    """Packets for rows ``values`` (aggregator k's are the next len(chunks[k]))
    going out as chunks ``chunks[k]`` (ascending) with ``op`` (one, or one
    per row), and the book that collects their results."""
    book = _Book(chunks, cfg.vals)
    pkts = make_packets(job_id=cfg.job_id, cookie=cfg.cookie, worker_id=cfg.worker_id, round_=rnd,
                        chunks=np.concatenate(chunks), values=values, op=op,
                        agg_id=book.agg_of_row, n_aggs=len(chunks))
    return pkts, book


class _Book:
    """One round's chunks over all aggregators: flat result rows (aggregator
    k's at off[k]:off[k+1]) and the map from (agg_id, chunk) to row."""

    def __init__(self, chunks: list, vals: int):
        sizes = [len(c) for c in chunks]
        self.off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.results = np.zeros((self.off[-1], vals), np.int32)
        self.done = np.zeros(self.off[-1], bool)
        self.n_done = np.zeros(len(chunks), np.intp)
        self.agg_of_row = np.repeat(np.arange(len(chunks)), sizes)
        width = 1 + max((int(c[-1]) for c in chunks if len(c)), default=0)
        self.row = np.full((len(chunks), width), -1, np.int32)
        for k, c in enumerate(chunks):
            self.row[k, c] = self.off[k] + np.arange(len(c))

    def reset(self) -> "_Book":
        """Empty again, for the next round of the same chunks. The result rows
        are kept, not cleared nor allocated anew (a fresh 16 MB array page-faults
        on every call): a row is read only once this round marked it done."""
        self.done[:] = False
        self.n_done[:] = 0
        return self

    def per_agg(self, a: np.ndarray) -> list:
        return [a[lo:hi] for lo, hi in zip(self.off[:-1], self.off[1:])]

    def rows_of(self, agg_id: np.ndarray, chunk: np.ndarray, ok: np.ndarray):
        """(rows, indices into the batch) of the packets that are ``ok`` and this round's."""
        a, c = agg_id.astype(np.intp), chunk.astype(np.intp)
        sel = np.flatnonzero(ok & (a < self.row.shape[0]) & (c < self.row.shape[1]))
        rows = self.row[a[sel], c[sel]]
        mine = rows >= 0
        return rows[mine], sel[mine]


class _Layout:
    """The packets of one all-reduce shape, built once: per aggregator its
    data chunks (XAGG_OP_SUM64, biased: fixedpoint.py; none when exact) and behind them the meta
    chunks (XAGG_OP_MAX) carrying META_LANES exponents per data chunk, the
    rest of their lanes EXP_ZERO. A call writes only values and round."""

    def __init__(self, cfg: ClientConfig, n_chunks: int, ranges: list, exact: bool):
        vals, lanes = cfg.vals, META_LANES
        chunks, ops, data_rows, meta_src, meta_at = [], [], [], [], []
        row = 0
        for lo, hi in ranges:
            nk = hi - lo
            nd, m = (0 if exact else nk), meta_chunks(nk, vals)
            chunks.append(np.arange(nk - nd, nk + m))
            ops.append(np.repeat([C.XAGG_OP_SUM64, C.XAGG_OP_MAX], [nd, m]))
            data_rows.append(row + np.arange(nd))
            src = (np.arange(lanes)[:, None] * n_chunks + np.arange(lo, hi)).reshape(-1)   # lane-major
            meta_src.append(src)
            meta_at.append((row + nd) * vals + np.arange(src.size))
            row += nd + m
        self.data_rows = np.concatenate(data_rows).astype(np.intp)
        self.chunk_of_row = np.full(row, -1, np.int64)         # the codec in the round loop
        self.chunk_of_row[self.data_rows] = np.arange(self.data_rows.size)
        self.no_rows = np.full(n_chunks, -1, np.int64)
        self.meta_src = np.concatenate(meta_src).astype(np.intp)
        self.meta_row, self.meta_col = np.divmod(np.concatenate(meta_at).astype(np.intp), vals)
        self.shape = (lanes, n_chunks)
        self.pkts, self.book = _round_packets(cfg, 0, np.full((row, vals), fixedpoint.EXP_ZERO, np.int32),
                                              chunks, np.concatenate(ops))
        # where each chunk's own exponent (meta lane 0) goes: bytes into pkts
        lane0 = self.meta_src < n_chunks
        payload = self.pkts.dtype.fields["vals"][1]
        self.own_at = np.full(n_chunks, -1, np.int64)
        self.own_at[self.meta_src[lane0]] = (self.meta_row[lane0] * self.pkts.dtype.itemsize
                                             + payload + 4 * self.meta_col[lane0])

    def fill(self, rnd: int, q: np.ndarray | None, lanes: np.ndarray):
        """(packets, book) of this call: data ``q`` [C, vals] (None: already in
        the packets, or an exact call), ``lanes`` [3, C]."""
        self.pkts["hdr"]["round"] = rnd
        v = self.pkts["vals"]
        if q is not None:
            v[self.data_rows] = q
        v[self.meta_row, self.meta_col] = lanes.reshape(-1)[self.meta_src]
        return self.pkts, self.book.reset()

    def agreed(self, results: np.ndarray) -> np.ndarray:
        """The agreed meta lanes [3, C] out of a round's results."""
        out = np.empty(self.shape[0] * self.shape[1], np.int32)
        out[self.meta_src] = results[self.meta_row, self.meta_col]
        return out.reshape(self.shape)

"""allreduce over xagg aggregators, from one worker.

Each call is one round: every chunk goes out with XAGG_OP_SUM64, quantised
(and biased, see fixedpoint.py) with an exponent predicted from the same tensor's last calls, and with it
meta chunks (XAGG_OP_MAX) carrying each chunk's true and predicted
exponents; one round trip brings back the sums and the agreed exponents.
Chunks whose prediction did not hold (fixedpoint.check_predicted: the same
answer on every worker) are summed again in the next round with the agreed
exponent, so a call takes one or two rounds (``last_rounds``). With
16-bit lanes (cfg.wire_bits) each packet carries twice the values, two to
a word (fixedpoint.py), and a call may keep error feedback. Packets
leave in GSO batches under a per-aggregator window; a chunk whose result
does not arrive within ``rto`` is sent again (the aggregator answers a
repeat of a finished chunk with the stored result), and when nothing
arrives for ``timeout`` seconds the call raises ``XaggTimeout``: it never
returns a partial or wrong sum.

The round protocol here is one; each round is a step of an ``Exchange``
(exchange.py) with its codec, chosen once per client: where the compiled
library loads (native.py), the rounds run in csrc/exchange.c and the
encoding and decoding in csrc/codec.c, straight from the tensor into the
packets and from the results into the output; otherwise numpy does both
(exchange_numpy.py, fixedpoint.py): the reference, equal to the bit.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from xagg.client import fixedpoint, native
from xagg.client.codec import Feedback, n_chunks
from xagg.client.config import MIN_WINDOW, ClientConfig
from xagg.client.exchange import Exchange
from xagg.client.exchange_afxdp import open_afxdp
from xagg.client.exchange_native import NativeExchange
from xagg.client.exchange_numpy import NumpyExchange
from xagg.client.packets import MAX_LAYOUTS, IntRound, Layout, Layouts, RedoRound
from xagg.client.stats import ClientStats
from xagg.client.window import Window, storm
from xagg.wire.chunks import split

log = logging.getLogger("xagg.client")


def resend_storm(sent: int, resent: int, window: int, ended: int | None = None) -> str | None:
    """What to tell a user whose call, begun with ``window`` packets in
    flight per aggregator, resent STORM_SHARE or more of the ``sent``
    packets or had its window cut to ``ended`` by the round loop; None
    where it did neither."""
    cut = ended is not None and ended < window
    if not (cut or storm(sent, resent)):
        return None
    how = f"was cut to {ended} during" if cut else "halves after"
    return (f"a resend storm: a call begun with {window} packets in flight per aggregator resent "
            f"{100 * resent / max(1, sent):.0f}% of its {sent} packets. A link whose queues hold less than the "
            f"window (a slow or rate-limited one) loses the excess of every window's worth, and every worker "
            f"resends what one lost; the window {how} such a call, halves at every storm and grows back after "
            f"clean calls (xagg/client/window.py). To start below it: "
            f"XAGG_WINDOW={max(MIN_WINDOW, min(ended or window, window // 4))} (packets per aggregator; "
            f"ClientConfig.window)")


def open_exchange(cfg: ClientConfig, stats: ClientStats) -> Exchange:
    """AF_XDP's where ``cfg.path`` asks for it and it runs, else the compiled
    exchange where the library loads and ``cfg.fast``, else numpy's."""
    if cfg.path != "udp" and cfg.fast:
        ex = open_afxdp(cfg, stats)
        if ex is not None:
            return ex
    elif cfg.path != "udp":
        stats.path_reason = "AF_XDP needs the compiled round loop (fast=False)"
    dll = native.load() if cfg.fast else None
    return NumpyExchange(cfg, stats) if dll is None else NativeExchange(cfg, stats, dll)


@dataclass(frozen=True)
class Learned:
    """What a client learned from its calls that the next client of the same
    worker in the same job can go on from (a lane's client made again for a
    new aggregator set, or its job's transport closed and opened again):
    the exponents its tensors' chunks took (without them every chunk's first
    sum is predicted wrong and summed twice), the residuals of 16-bit lanes'
    error feedback (what was not sent yet) and the packet layouts of its
    shapes (built once: their headers carry the job, cookie and worker)."""
    owner: tuple                # (job_id, cookie, worker_id, n_workers, vals): whose it is
    history: dict
    residual: dict
    layouts: dict


def _owner(cfg: ClientConfig) -> tuple:
    return (cfg.job_id, cfg.cookie, cfg.worker_id, cfg.n_workers, cfg.vals)


class Client:
    """One worker's rounds on its aggregators. ``learned``: a closed client's
    (Client.learned()), taken over where it is this worker's in this job,
    else ignored."""

    def __init__(self, cfg: ClientConfig, learned: Learned | None = None):
        self.cfg = cfg
        self.round = 0
        self.last_rounds = 0       # rounds the last call used (1, or 2 with a redo)
        self.stats = ClientStats()
        self._history: dict = {}   # (key, chunks, lane bits) -> agreed exponents of its last calls
        self._residual: dict = {}  # (key, chunks, 16) -> the residual of error feedback, and a spare
        self._layouts = Layouts(cfg)
        self._int_rounds: dict = {}  # (key, chunks, ranges) -> the IntRound of a keyed allreduce_int
        self._redo_rounds: dict = {}  # (key, size, ranges, lane bits) -> the RedoRound of a keyed call's redo
        if learned is not None and learned.owner == _owner(cfg):
            self._history, self._residual = learned.history, learned.residual
            self._layouts.adopt(learned.layouts)
        self._exchange = open_exchange(cfg, self.stats)
        self._window = Window(cfg.window)   # the exchange's window, adapted after every call
        self._call_from = (0, 0)    # packets sent and resent before the call in progress
        self._storm_said = False

    def close(self) -> None:
        self._exchange.close()

    def learned(self) -> Learned:
        """What the next client of this worker in this job can take over
        (hand it on once this one makes no more calls)."""
        return Learned(_owner(self.cfg), self._history, self._residual, self._layouts.shapes())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- public -----------------------------------------------------------
    def allreduce(self, x: np.ndarray, key=None, exact: bool = False,
                  out: np.ndarray | None = None, feedback: bool = False,
                  wire_bits: int | None = None, divide: float = 1) -> np.ndarray:
        """The elementwise sum of ``x`` over all workers (float32; divided
        by ``divide`` where given, as a mean). ``x`` of float16 or bfloat16
        (fixedpoint.ELEMS) is read in place, never widened into a copy;
        other dtypes are converted to float32. ``key``
        names the tensor (e.g. a DDP bucket index) whose last calls predict
        this one's exponents; by default its size does. ``exact`` (the same
        on every worker): no prediction, exponents agreed first (two round
        trips, every chunk with its own exponent: S bits, not KEPT_BITS).
        ``out``: a C-contiguous float32, float16 or bfloat16 array of x's
        size that receives the sum (rounded to nearest even) and is
        returned. ``x`` itself is fine: it is then written only once every
        round of the call succeeded, so after an error it is as it was. Any
        other ``out`` may be summed into as results arrive (the decoding
        hides behind the network), so after an error it holds partial sums. ``wire_bits``: this call's lanes (default
        cfg.wire_bits; the same on every worker). ``feedback`` (16-bit
        lanes): error feedback per ``key``: the residual the last call's
        quantisation left is added to ``x``, and what this call's leaves is
        kept for the next (``residual``); a call that fails keeps the
        residual as it was."""
        dest = None if out is None else _destination(out, np.size(x))
        self._call_from = (self.stats.packets_sent, self.stats.retransmits)
        bits = self.cfg.wire_bits if wire_bits is None else fixedpoint.check_bits(wire_bits)
        if feedback and bits == 32:
            raise ValueError("allreduce feedback=True: error feedback needs 16-bit lanes (wire_bits=16)")
        total = self._sum(x, key, exact, dest, feedback, bits, divide)
        return total if out is None else out

    def allreduce_int(self, x: np.ndarray, key=None) -> np.ndarray:
        """The exact elementwise int32 sum of ``x`` over all workers (wrapping
        modulo 2**32, as the kernel adds): for payloads already in fixed
        point, e.g. count sketches. One round, no exponents. ``key``: where
        given, the call's packets and result rows are kept for the next call
        with the same key and size, which writes over them: the returned
        array holds until then."""
        t0 = time.perf_counter()
        self._call_from = (self.stats.packets_sent, self.stats.retransmits)
        flat = np.ascontiguousarray(x, dtype=np.int32).reshape(-1)
        count = n_chunks(flat.size, self.cfg.vals)
        ranges = split(count, self.cfg.weights)
        rnd = self._take_round()
        self.last_rounds = 1
        shape = (key, count, tuple(ranges))      # ranges: the weights may be re-planned
        kept = self._int_rounds.get(shape) if key is not None else None
        if kept is None:
            kept = IntRound(self.cfg, count, ranges)
            if key is not None:
                if len(self._int_rounds) >= MAX_LAYOUTS:
                    self._int_rounds.clear()
                self._int_rounds[shape] = kept
        sums = self._exchange.run(rnd, *kept.fill(rnd, flat))
        return self._end_call(sums, x, flat.size, t0)

    def residual(self, x_size: int, key=None) -> np.ndarray | None:
        """The residual error feedback keeps for ``key`` (a tensor of ``x_size``), None before its first call."""
        pair = self._residual.get((key, n_chunks(x_size, self.cfg.vals * fixedpoint.per_word(16)), 16))
        return None if pair is None else pair[0]

    # -- the round protocol -----------------------------------------------
    def _sum(self, x: np.ndarray, key, exact: bool, dest: np.ndarray | None, feedback: bool,
             bits: int, divide: float) -> np.ndarray:
        """Predict, exchange, check, redo what missed, remember, decode. The
        sums go into ``dest`` (or a new array) after the last round, unless
        the codec runs in the round loop: then as they arrive."""
        t0 = time.perf_counter()
        cfg, nw, codec = self.cfg, self.cfg.n_workers, self._exchange.codecs[bits]
        keep = isinstance(x, np.ndarray) and x.dtype in fixedpoint.ELEMS      # 16-bit: read as it is
        flat = np.ascontiguousarray(x, dtype=x.dtype if keep else np.float32).reshape(-1)
        n = flat.size
        count = n_chunks(n, codec.vals)
        ranges = split(count, cfg.weights)
        hkey = (key, count, bits)
        fb = None
        if feedback:        # read from [0], written into [1]: a redone chunk is quantised again from [0]
            pair = self._residual.get(hkey) or [np.zeros(n, np.float32), np.zeros(n, np.float32)]
            self._residual[hkey] = pair
            fb = Feedback(*pair)
            if exact:       # only live chunks are quantised: the others' (all zero, or NaN) start at 0
                fb.out.fill(0)
        src = codec.source(flat, fb)
        rnd = self._take_round()
        self.last_rounds = 1
        past = [] if exact else self._history.get(hkey, [])
        pred = fixedpoint.predict(past, count, nw, bits)      # all EXP_ZERO without history
        lay = self._layouts.get(count, ranges, exact, bits)
        dest = np.empty(n, np.float32) if dest is None else dest
        # The codec in the round loop (each chunk's exponent read and the
        # chunk quantised as its packet first goes out, its sum taken
        # straight out of the arriving datagram), unless dest is the tensor:
        # then dest is written last, when every round is in, as a redo
        # round quantises the tensor again.
        in_loop = self._exchange.codec_in_loop and not exact and not np.shares_memory(dest, flat)
        res = self._first_round(rnd, codec, src, flat, dest, pred, lay, exact, in_loop, divide)
        exps, scale, redo = fixedpoint.check_predicted(lay.agreed(res), nw, bits)
        again_rows, again_row_of = self._redo_round(codec, src, exps, redo, ranges,
                                                    None if key is None else (key, n, tuple(ranges), bits))
        if redo.any():
            scale = np.where(redo, exps, scale)
            self.stats.redone += 0 if exact else int(redo.sum())
        if not exact:
            self._history[hkey] = [*past[1 - fixedpoint.HISTORY:], exps]

        if in_loop:
            # A sum that stands was quantised with the sent exponent (the
            # agreed prediction) and is in dest; chunks with a marker
            # (all zero, or NaN/Inf somewhere) are written now, redone ones below.
            codec.dequantise_into(res, lay.no_rows, scale, nw, dest, divide)
        elif not exact:     # every round is in: only now is dest written (the tensor is read no more)
            first = np.where(redo, -1, lay.data_rows) if redo.any() else lay.data_rows
            codec.dequantise_into(res, first, scale, nw, dest, divide)
        if exact or redo.any():     # exact: every live chunk is redone, the rest are markers
            codec.dequantise_into(again_rows, again_row_of, scale, nw, dest, divide)
        if fb is not None:          # every round in: the new residual stands
            self._residual[hkey].reverse()
        return self._end_call(dest, x, n, t0)

    def _first_round(self, rnd: int, codec, src, flat: np.ndarray, dest: np.ndarray, pred: np.ndarray,
                     lay: Layout, exact: bool, in_loop: bool, divide: float) -> np.ndarray:
        """The data chunks quantised with the predicted exponents (none when
        exact) and the meta chunks: the result rows."""
        nw, count, bits = self.cfg.n_workers, pred.size, codec.bits
        if in_loop:
            own = np.full(count, fixedpoint.EXP_ZERO, np.int32)   # the loop writes the true ones
            loop = native.InLoopCodec(flat, dest, pred, lay.own_at, np.empty(count, np.int32), lay.chunk_of_row,
                                      fixedpoint.headroom_bits(nw, bits), fixedpoint.bias(nw, bits),
                                      fixedpoint.unbias(nw, bits), bits, src.fb, divide)
        else:
            own, loop = codec.exponents(src), None
            if not exact:
                codec.quantise_into(src, fixedpoint.send_exponents(own, pred), nw, lay.pkts, lay.data_rows)
        return self._exchange.run(rnd, *lay.fill(rnd, fixedpoint.meta_lanes(own, pred)), loop)

    def _redo_round(self, codec, src, exps: np.ndarray, redo: np.ndarray,
                    ranges: list, key=None) -> tuple[np.ndarray, np.ndarray]:
        """The chunks ``redo`` summed again with the agreed exponents: their
        result rows (valid until the next redo under ``key``), and each
        chunk's row there (-1: not redone)."""
        vals = self.cfg.vals
        again_row_of = np.full(redo.size, -1, np.int64)
        if not redo.any():
            return np.zeros((0, vals), np.int32), again_row_of
        rnd = self._take_round()
        self.last_rounds = 2
        idx = [np.flatnonzero(redo[lo:hi]) for lo, hi in ranges]      # per aggregator, its own numbering
        again = np.concatenate([lo + i for i, (lo, hi) in zip(idx, ranges)])
        again_row_of[again] = np.arange(again.size)
        kept = self._redo_rounds.get(key) if key is not None else None
        if kept is None or not kept.fits(again):
            kept = RedoRound(self.cfg, again, idx, codec.bits)
            if key is not None:
                if len(self._redo_rounds) >= MAX_LAYOUTS:
                    self._redo_rounds.clear()
                self._redo_rounds[key] = kept
        pkts, book = kept.take(rnd)
        codec.quantise_into(src, exps, self.cfg.n_workers, pkts, again_row_of)
        return self._exchange.run(rnd, pkts, book), again_row_of

    def _take_round(self) -> int:
        rnd = self.round
        self.round = (self.round + 1) & 0xFFFFFFFF
        return rnd

    def _end_call(self, out: np.ndarray, x: np.ndarray, n: int, t0: float) -> np.ndarray:
        sent, resent = (now - then for now, then in zip((self.stats.packets_sent, self.stats.retransmits),
                                                       self._call_from))
        window, ended = self._window.now, self._exchange.window     # the round loop may cut it during the call
        if self._window.after_call(sent, resent, ended):
            if not self._storm_said:        # said once; the window adapts at every call
                self._storm_said = True
                log.warning("xagg: %s", resend_storm(sent, resent, window, ended))
        self._exchange.window = self.stats.window = self._window.now
        self.stats.calls += 1
        self.stats.bytes += n * 4
        self.stats.seconds += time.perf_counter() - t0
        return out.reshape(-1)[:n].reshape(np.shape(x))


def _destination(out: np.ndarray, n: int) -> np.ndarray:
    """``out`` as the flat array of n elements (fixedpoint.ELEMS) the sum is written to."""
    if not (isinstance(out, np.ndarray) and out.dtype in fixedpoint.ELEMS and out.size == n
            and out.flags.c_contiguous and out.flags.writeable):
        got = (f"{out.dtype} {out.shape}{'' if out.flags.c_contiguous else ' not contiguous'}"
               if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"allreduce out=: a writable C-contiguous float32, float16 or bfloat16 array of {n} "
                         f"elements is needed, got {got}")
    return out.reshape(-1)

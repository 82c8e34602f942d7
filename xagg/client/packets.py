"""One round's packets and the book that collects their results.

A round sends, per aggregator, a run of chunks (each a packet) and expects
one result per chunk back. ``Book`` maps each result to its row; ``Layout``
is the packets of one all-reduce shape, built once and reused by every call
of that shape (a call writes only values and the round number).
"""
from __future__ import annotations

import numpy as np

from xagg.client import fixedpoint
from xagg.client.config import ClientConfig
from xagg.wire.chunks import META_LANES, meta_chunks
from xagg.wire.proto import C, make_packets

MAX_LAYOUTS = 64        # callers with ever-new sizes: no unbounded cache


def round_packets(cfg: ClientConfig, rnd: int, values: np.ndarray, chunks: list, op=C.XAGG_OP_SUM,
                  bits: int = 32):
    """Packets for rows ``values`` (aggregator k's are the next len(chunks[k]))
    going out as chunks ``chunks[k]`` (ascending) with ``op`` (one, or one
    per row) in ``bits``-wide lanes, and the book that collects their results."""
    book = Book(chunks, cfg.vals)
    pkts = make_packets(job_id=cfg.job_id, cookie=cfg.cookie, worker_id=cfg.worker_id, round_=rnd,
                        chunks=np.concatenate(chunks), values=values, op=op,
                        agg_id=book.agg_of_row, n_aggs=len(chunks), bits=bits)
    return pkts, book


class Book:
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

    def reset(self) -> "Book":
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


class Layout:
    """The packets of one all-reduce shape: per aggregator its data chunks
    (XAGG_OP_SUM64, biased: fixedpoint.py; none when exact) and behind them
    the meta chunks (XAGG_OP_MAX) carrying META_LANES exponents per data
    chunk, the rest of their lanes EXP_ZERO."""

    def __init__(self, cfg: ClientConfig, n_chunks: int, ranges: list, exact: bool, bits: int = 32):
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
        self.pkts, self.book = round_packets(cfg, 0, np.full((row, vals), fixedpoint.EXP_ZERO, np.int32),
                                             chunks, np.concatenate(ops), bits)
        # where each chunk's own exponent (meta lane 0) goes: bytes into pkts
        lane0 = self.meta_src < n_chunks
        payload = self.pkts.dtype.fields["vals"][1]
        self.own_at = np.full(n_chunks, -1, np.int64)
        self.own_at[self.meta_src[lane0]] = (self.meta_row[lane0] * self.pkts.dtype.itemsize
                                             + payload + 4 * self.meta_col[lane0])

    def fill(self, rnd: int, lanes: np.ndarray):
        """(packets, book) of this call, its meta ``lanes`` [3, C] written in;
        the data rows are the codec's to fill."""
        self.pkts["hdr"]["round"] = rnd
        self.pkts["vals"][self.meta_row, self.meta_col] = lanes.reshape(-1)[self.meta_src]
        return self.pkts, self.book.reset()

    def agreed(self, results: np.ndarray) -> np.ndarray:
        """The agreed meta lanes [3, C] out of a round's results."""
        out = np.empty(self.shape[0] * self.shape[1], np.int32)
        out[self.meta_src] = results[self.meta_row, self.meta_col]
        return out.reshape(self.shape)


class IntRound:
    """The packets and book of one shape of exact int32 sum (a keyed
    Client.allreduce_int): built once, then each call writes its round
    number and values in and resets the book, so a call allocates nothing
    the size of its tensor (a fresh array page-faults at every call)."""

    def __init__(self, cfg: ClientConfig, n_chunks: int, ranges: list):
        self.vals = cfg.vals
        ids = [np.arange(hi - lo) for lo, hi in ranges]
        self.pkts, self.book = round_packets(cfg, 0, np.zeros((n_chunks, cfg.vals), np.int32), ids)

    def fill(self, rnd: int, flat: np.ndarray):
        """(packets, book) of round ``rnd`` summing ``flat`` (int32), zero-padded."""
        rows, vals = self.pkts["vals"], self.vals
        full = flat.size // vals
        rows[:full] = flat[:full * vals].reshape(full, vals)
        if full < len(rows):
            rows[full, :flat.size - full * vals] = flat[full * vals:]
            rows[full, flat.size - full * vals:] = 0
        self.pkts["hdr"]["round"] = rnd
        return self.pkts, self.book.reset()


class RedoRound:
    """The packets and book of a second round that sums chunks ``again``
    again (aggregator k's are ``idx[k]``, its own numbering), kept for the
    next call under the same key that redoes the same chunks: an exact sum
    redoes every live chunk, the same ones call after call. Each call
    writes its round number in, and the codec its values, so it allocates
    nothing the size of its tensor."""

    def __init__(self, cfg: ClientConfig, again: np.ndarray, idx: list, bits: int):
        self.again = again
        self.pkts, self.book = round_packets(cfg, 0, np.zeros((again.size, cfg.vals), np.int32), idx,
                                             C.XAGG_OP_SUM64, bits)

    def fits(self, again: np.ndarray) -> bool:
        return np.array_equal(self.again, again)

    def take(self, rnd: int):
        """(packets, book) of round ``rnd``, the book empty."""
        self.pkts["hdr"]["round"] = rnd
        return self.pkts, self.book.reset()


class Layouts:
    """The layouts of the shapes a client has seen."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self._by_shape: dict = {}

    def get(self, n_chunks: int, ranges: list, exact: bool, bits: int = 32) -> Layout:
        key = (n_chunks, exact, tuple(ranges), bits)     # ranges: the weights may be re-planned
        lay = self._by_shape.get(key)
        if lay is None:
            if len(self._by_shape) >= MAX_LAYOUTS:
                self._by_shape.clear()
            lay = self._by_shape[key] = Layout(self.cfg, n_chunks, ranges, exact, bits)
        return lay

    def shapes(self) -> dict:
        """The layouts built so far, by shape (for Layouts.adopt)."""
        return self._by_shape

    def adopt(self, shapes: dict) -> None:
        """Another client's layouts (``shapes()``), built for the same job,
        cookie, worker and values per packet: a call writes only values and
        the round number into them."""
        self._by_shape = shapes

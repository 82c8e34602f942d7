"""The fixed-point codec compiled: ``csrc/codec.c`` behind checked wrappers.

The same numbers as fixedpoint.py's chunk_exponents, quantise and dequantise
(bit for bit; tests/test_codec.py), but each a single pass over caller
memory: exponents straight from the flat tensor (no padded copy), quantised
values straight into the payloads of the round's packets, sums straight from
the result rows into the caller's output. ``dll`` is ``native.load()``.

A row map (int64, one entry per chunk) names the packet or result row of
each chunk; a negative entry leaves that chunk alone (its values are in
another round's rows). The wrappers check shapes, dtypes and that every row
is in range before C writes anything: a bad row would write out of bounds.

``CompiledCodec`` and ``NumpyCodec`` are the two codecs a round protocol
calls (the exchange it runs on carries one): the same calls and the same
bits, numpy's from fixedpoint.py (the reference) on the tensor padded into
whole chunks. Data rows are always biased (XAGG_OP_SUM64). Each codec has a
lane width (``bits``, fixedpoint.WIRE_BITS): with 16-bit lanes a chunk holds
twice the packet's words in values, and a call may carry error feedback
(``Feedback``: the residual added in, the new one written out).

A tensor read or written may be float32, float16 or bfloat16
(fixedpoint.ELEMS): C reads 16-bit elements in place and rounds sums
straight into a 16-bit output, after dividing them by ``divide`` (a
bucket's average: an fp16 sum can overflow where the average does not);
numpy, the reference, widens and narrows copies (fixedpoint.widen, narrow).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xagg.client import fixedpoint


def n_chunks(n: int, vals: int) -> int:
    """Chunks of ``vals`` elements that ``n`` elements fill (the last may be short)."""
    return -(-n // vals)


def padded_chunks(flat: np.ndarray, vals: int) -> np.ndarray:
    """``flat`` zero-padded into whole chunks [C, vals]."""
    out = np.zeros(n_chunks(flat.size, vals) * vals, flat.dtype)
    out[:flat.size] = flat
    return out.reshape(-1, vals)


def _flat(a: np.ndarray, dtype, name: str) -> np.ndarray:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{name}: a C-contiguous {np.dtype(dtype)} array is needed, got "
                         f"{a.dtype}{'' if a.flags.c_contiguous else ' (not contiguous)'}")
    return a


def _tensor(a: np.ndarray, name: str) -> int:
    """The csrc/codec.h element type of ``a``, a C-contiguous array of an ELEMS type."""
    elem = fixedpoint.ELEMS.get(a.dtype)
    if elem is None or not a.flags.c_contiguous:
        raise ValueError(f"{name}: a C-contiguous float32, float16 or bfloat16 (fixedpoint.BFLOAT16) array "
                         f"is needed, got {a.dtype}{'' if a.flags.c_contiguous else ' (not contiguous)'}")
    return elem


def _rows_in_range(row_of_chunk: np.ndarray, count: int, n_rows: int) -> np.ndarray:
    _flat(row_of_chunk, np.int64, "row_of_chunk")
    if row_of_chunk.shape != (count,):
        raise ValueError(f"row_of_chunk: one row per chunk ({count}), got shape {row_of_chunk.shape}")
    if count and int(row_of_chunk.max()) >= n_rows:
        raise ValueError(f"row_of_chunk: row {int(row_of_chunk.max())} past the {n_rows} rows")
    return row_of_chunk


def _exps(exps: np.ndarray, count: int) -> np.ndarray:
    _flat(exps, np.int32, "exps")
    if exps.shape != (count,):
        raise ValueError(f"exps: one exponent per chunk ({count}), got shape {exps.shape}")
    return exps


def chunk_exponents(dll, flat: np.ndarray, vals: int) -> np.ndarray:
    """fixedpoint.chunk_exponents of ``flat`` [n] cut in chunks of ``vals``."""
    elem = _tensor(flat, "tensor")
    out = np.empty(n_chunks(flat.size, vals), np.int32)
    dll.xagg_chunk_exponents(flat.ctypes.data, elem, flat.size, vals, out.ctypes.data)
    return out


def quantise_into(dll, flat: np.ndarray, exps: np.ndarray, n_workers: int,
                  pkts: np.ndarray, row_of_chunk: np.ndarray, biased: bool = False) -> None:
    """fixedpoint.quantise of ``flat``'s chunks with ``exps`` (``biased``
    too), written into the payload of packet ``row_of_chunk[c]`` of ``pkts``
    (a short last chunk padded, as the reference pads it)."""
    elem = _tensor(flat, "tensor")
    _flat(pkts, pkts.dtype, "pkts")
    vals = pkts.dtype["vals"].shape[0]
    count = n_chunks(flat.size, vals)
    _rows_in_range(row_of_chunk, count, len(pkts))
    dll.xagg_quantise(flat.ctypes.data, elem, flat.size, vals, _exps(exps, count).ctypes.data,
                      fixedpoint.headroom_bits(n_workers), fixedpoint.bias(n_workers) if biased else 0,
                      pkts.ctypes.data, pkts.dtype.itemsize,
                      row_of_chunk.ctypes.data)


def dequantise_into(dll, rows: np.ndarray, row_of_chunk: np.ndarray, exps: np.ndarray,
                    n_workers: int, out: np.ndarray, biased: bool = False, divide: float = 1.0) -> None:
    """fixedpoint.dequantise (``biased`` too), divided by ``divide``, into
    ``out`` [n] (rounded to its type): chunk c's sums are
    ``rows[row_of_chunk[c]]`` ([R, vals] int32). A ZERO chunk becomes 0, a
    NONFINITE one NaN without reading a row; another chunk whose row is
    negative is left as it is. Nothing past ``out``'s n elements is written."""
    _flat(rows, np.int32, "rows")
    elem = _tensor(out, "out")
    vals = rows.shape[1]
    count = n_chunks(out.size, vals)
    _rows_in_range(row_of_chunk, count, len(rows))
    dll.xagg_dequantise(rows.ctypes.data, row_of_chunk.ctypes.data, _exps(exps, count).ctypes.data,
                        fixedpoint.headroom_bits(n_workers), fixedpoint.unbias(n_workers) if biased else 0, vals,
                        divide, out.ctypes.data, elem, out.size)


@dataclass
class Feedback:
    """One call's error feedback: ``into`` (the residual the tensor is summed
    with before quantising) and ``out`` (the new one, written as chunks are
    quantised), both float32 of the tensor's size and not overlapping."""
    into: np.ndarray
    out: np.ndarray

    def check(self, n: int) -> "Feedback":
        for name, a in (("residual", self.into), ("residual out", self.out)):
            _flat(a, np.float32, name)
            if a.size != n:
                raise ValueError(f"{name}: {n} elements needed, got {a.size}")
        if np.shares_memory(self.into, self.out):
            raise ValueError("the residual and the residual out overlap")
        return self


def _ptrs(fb: Feedback | None):
    return (None, None) if fb is None else (fb.into.ctypes.data, fb.out.ctypes.data)


def chunk_exponents16(dll, flat: np.ndarray, vals: int, fb: Feedback | None = None) -> np.ndarray:
    """fixedpoint.chunk_exponents of ``flat`` (plus the residual) in chunks of ``vals`` values."""
    elem = _tensor(flat, "tensor")
    out = np.empty(n_chunks(flat.size, vals), np.int32)
    dll.xagg_chunk_exponents16(flat.ctypes.data, elem, _ptrs(fb)[0], flat.size, vals, out.ctypes.data)
    return out


def quantise16_into(dll, flat: np.ndarray, exps: np.ndarray, n_workers: int, pkts: np.ndarray,
                    row_of_chunk: np.ndarray, fb: Feedback | None = None) -> None:
    """fixedpoint.quantise (bits=16, biased) of ``flat`` (plus the residual)
    into the payloads, two lanes a word; the new residual of each chunk
    written (fixedpoint.feedback)."""
    elem = _tensor(flat, "tensor")
    _flat(pkts, pkts.dtype, "pkts")
    vals = 2 * pkts.dtype["vals"].shape[0]
    count = n_chunks(flat.size, vals)
    _rows_in_range(row_of_chunk, count, len(pkts))
    if fb is not None:
        fb.check(flat.size)
    dll.xagg_quantise16(flat.ctypes.data, elem, *_ptrs(fb), flat.size, vals, _exps(exps, count).ctypes.data,
                        fixedpoint.headroom_bits(n_workers, 16), fixedpoint.bias(n_workers, 16),
                        pkts.ctypes.data, pkts.dtype.itemsize, row_of_chunk.ctypes.data)


def dequantise16_into(dll, rows: np.ndarray, row_of_chunk: np.ndarray, exps: np.ndarray,
                      n_workers: int, out: np.ndarray, divide: float = 1.0) -> None:
    """dequantise_into for rows of summed 16-bit lanes (biased)."""
    _flat(rows, np.int32, "rows")
    elem = _tensor(out, "out")
    vals = 2 * rows.shape[1]
    count = n_chunks(out.size, vals)
    _rows_in_range(row_of_chunk, count, len(rows))
    dll.xagg_dequantise16(rows.ctypes.data, row_of_chunk.ctypes.data, _exps(exps, count).ctypes.data,
                          fixedpoint.headroom_bits(n_workers, 16), fixedpoint.unbias(n_workers, 16), vals,
                          divide, out.ctypes.data, elem, out.size)


@dataclass
class Source:
    """What a codec reads of one call: the flat tensor (and its chunks
    zero-padded, for numpy's), and the call's error feedback if any."""
    flat: np.ndarray
    fb: Feedback | None = None
    chunks: np.ndarray | None = None


class CompiledCodec:
    """csrc/codec.c: the tensor read in place. ``words``: int32 words per
    packet; ``vals``: values per chunk (``bits`` wide lanes)."""

    def __init__(self, dll, words: int, bits: int = 32):
        self.dll, self.bits = dll, fixedpoint.check_bits(bits)
        self.vals = words * fixedpoint.per_word(bits)

    def source(self, flat: np.ndarray, fb: Feedback | None = None) -> Source:
        if fb is not None and self.bits == 32:
            raise ValueError("error feedback needs 16-bit lanes")
        return Source(flat, None if fb is None else fb.check(flat.size))

    def exponents(self, src: Source) -> np.ndarray:
        if self.bits == 16:
            return chunk_exponents16(self.dll, src.flat, self.vals, src.fb)
        return chunk_exponents(self.dll, src.flat, self.vals)

    def quantise_into(self, src: Source, exps: np.ndarray, n_workers: int, pkts: np.ndarray,
                      row_of_chunk: np.ndarray) -> None:
        if self.bits == 16:
            quantise16_into(self.dll, src.flat, exps, n_workers, pkts, row_of_chunk, src.fb)
        else:
            quantise_into(self.dll, src.flat, exps, n_workers, pkts, row_of_chunk, biased=True)

    def dequantise_into(self, rows: np.ndarray, row_of_chunk: np.ndarray, exps: np.ndarray, n_workers: int,
                        out: np.ndarray, divide: float = 1.0) -> None:
        if self.bits == 16:
            dequantise16_into(self.dll, rows, row_of_chunk, exps, n_workers, out, divide)
        else:
            dequantise_into(self.dll, rows, row_of_chunk, exps, n_workers, out, biased=True, divide=divide)


class NumpyCodec:
    """fixedpoint.py behind CompiledCodec's calls (``source``: the tensor
    widened to float32, plus the residual, zero-padded into chunks [C,
    vals], once per call; results narrowed to the output's type)."""

    def __init__(self, words: int, bits: int = 32):
        self.bits = fixedpoint.check_bits(bits)
        self.vals = words * fixedpoint.per_word(bits)

    def source(self, flat: np.ndarray, fb: Feedback | None = None) -> Source:
        if fb is not None and self.bits == 32:
            raise ValueError("error feedback needs 16-bit lanes")
        _tensor(flat, "tensor")
        v = fixedpoint.widen(flat)
        v = v if fb is None else v + fb.check(flat.size).into       # float32: as C adds
        return Source(flat, fb, padded_chunks(v, self.vals))

    def exponents(self, src: Source) -> np.ndarray:
        return fixedpoint.chunk_exponents(src.chunks)

    def quantise_into(self, src: Source, exps: np.ndarray, n_workers: int, pkts: np.ndarray,
                      row_of_chunk: np.ndarray) -> None:
        sel = np.flatnonzero(row_of_chunk >= 0)
        if sel.size == len(src.chunks):        # every chunk: no copy of the tensor to pick them
            sel = slice(None)
        v = src.chunks[sel]
        q = fixedpoint.quantise(v, exps[sel], n_workers, biased=True, bits=self.bits)
        pkts["vals"][row_of_chunk[sel]] = fixedpoint.to_words(q, self.bits)
        if src.fb is not None:
            r = fixedpoint.feedback(v, q, exps[sel], n_workers, biased=True, bits=self.bits)
            self._scatter(np.arange(len(src.chunks))[sel], r, src.fb.out)

    def dequantise_into(self, rows: np.ndarray, row_of_chunk: np.ndarray, exps: np.ndarray, n_workers: int,
                        out: np.ndarray, divide: float = 1.0) -> None:
        _tensor(out, "out")
        marker = (exps == fixedpoint.EXP_ZERO) | (exps == fixedpoint.EXP_NONFINITE)
        sel = np.flatnonzero((row_of_chunk >= 0) | marker)
        row = row_of_chunk[sel]
        sums = np.zeros((sel.size, rows.shape[1]), np.int32)       # a marker's row is not read
        sums[row >= 0] = rows[row[row >= 0]]
        got = fixedpoint.dequantise(fixedpoint.from_words(sums, self.bits), exps[sel], n_workers, biased=True,
                                    bits=self.bits)
        if divide != 1:
            got /= np.float32(divide)
        self._scatter(sel, fixedpoint.narrow(got, out.dtype), out)

    def _scatter(self, sel: np.ndarray, got: np.ndarray, out: np.ndarray) -> None:
        """Rows ``got`` of chunks ``sel`` (ascending) into the flat ``out`` (the short last one cut)."""
        whole = out.size // self.vals
        body = sel < whole
        out[:whole * self.vals].reshape(whole, self.vals)[sel[body]] = got[body]
        if sel.size and not body[-1]:                          # the short last chunk
            out[whole * self.vals:] = got[-1, :out.size - whole * self.vals]

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
"""
from __future__ import annotations

import numpy as np

from xagg.client import fixedpoint


def n_chunks(n: int, vals: int) -> int:
    """Chunks of ``vals`` elements that ``n`` elements fill (the last may be short)."""
    return -(-n // vals)


def _flat(a: np.ndarray, dtype, name: str) -> np.ndarray:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{name}: a C-contiguous {np.dtype(dtype)} array is needed, got "
                         f"{a.dtype}{'' if a.flags.c_contiguous else ' (not contiguous)'}")
    return a


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
    """fixedpoint.chunk_exponents of ``flat`` [n] float32 cut in chunks of ``vals``."""
    _flat(flat, np.float32, "tensor")
    out = np.empty(n_chunks(flat.size, vals), np.int32)
    dll.xagg_chunk_exponents(flat.ctypes.data, flat.size, vals, out.ctypes.data)
    return out


def quantise_into(dll, flat: np.ndarray, exps: np.ndarray, n_workers: int,
                  pkts: np.ndarray, row_of_chunk: np.ndarray, biased: bool = False) -> None:
    """fixedpoint.quantise of ``flat``'s chunks with ``exps`` (``biased``
    too), written into the payload of packet ``row_of_chunk[c]`` of ``pkts``
    (a short last chunk padded, as the reference pads it)."""
    _flat(flat, np.float32, "tensor")
    _flat(pkts, pkts.dtype, "pkts")
    vals = pkts.dtype["vals"].shape[0]
    count = n_chunks(flat.size, vals)
    _rows_in_range(row_of_chunk, count, len(pkts))
    dll.xagg_quantise(flat.ctypes.data, flat.size, vals, _exps(exps, count).ctypes.data,
                      fixedpoint.headroom_bits(n_workers), fixedpoint.bias(n_workers) if biased else 0,
                      pkts.ctypes.data, pkts.dtype.itemsize,
                      row_of_chunk.ctypes.data)


def dequantise_into(dll, rows: np.ndarray, row_of_chunk: np.ndarray, exps: np.ndarray,
                    n_workers: int, out: np.ndarray, biased: bool = False) -> None:
    """fixedpoint.dequantise (``biased`` too) into ``out`` [n] float32: chunk c's sums are
    ``rows[row_of_chunk[c]]`` ([R, vals] int32). A ZERO chunk becomes 0, a
    NONFINITE one NaN without reading a row; another chunk whose row is
    negative is left as it is. Nothing past ``out``'s n elements is written."""
    _flat(rows, np.int32, "rows")
    _flat(out, np.float32, "out")
    vals = rows.shape[1]
    count = n_chunks(out.size, vals)
    _rows_in_range(row_of_chunk, count, len(rows))
    dll.xagg_dequantise(rows.ctypes.data, row_of_chunk.ctypes.data, _exps(exps, count).ctypes.data,
                        fixedpoint.headroom_bits(n_workers), fixedpoint.unbias(n_workers) if biased else 0, vals,
                        out.ctypes.data, out.size)

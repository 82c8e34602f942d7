"""Fixed point for in-network sums: exponents agreed per chunk.

Phase 1 of every allreduce sends each chunk's exponent E_w (|x| < 2**E_w)
with XAGG_OP_MAX; the aggregator returns E = max_w E_w. Phase 2 sends
q = round(x * 2**(S - E)) with S = 30 - ceil(log2 N), so |q| <= 2**S and
the int32 sum of N workers cannot overflow. The error of the sum is at most
N/2 units of 2**(E - S), i.e. N * 2**-(S+1) relative to the chunk's largest
magnitude: 2**-27 for 4 workers, below float32's 2**-24.

A chunk holding NaN/Inf on any worker sends XAGG_EXP_NONFINITE; the agreed
exponent is then NONFINITE on every worker and the chunk's result is NaN
everywhere (a defined result that torch's GradScaler detects), never a
silently wrong finite sum.
"""
from __future__ import annotations

import math

import numpy as np

from .proto import C

EXP_ZERO = C.XAGG_EXP_ZERO
EXP_NONFINITE = C.XAGG_EXP_NONFINITE


def headroom_bits(n_workers: int) -> int:
    """S: the magnitude bits each worker may use so N of them sum in int32."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    return 30 - math.ceil(math.log2(n_workers))


def chunk_exponents(chunks: np.ndarray) -> np.ndarray:
    """Per row of ``chunks`` [C, V] float32: E with max|x| < 2**E, or a marker."""
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(chunks), axis=1)
    finite = np.isfinite(amax)
    _, e = np.frexp(np.where(finite, amax, 0).astype(np.float64))   # amax = m * 2**e, m in [0.5, 1)
    e = e.astype(np.int64)
    out = np.where(amax > 0, e, EXP_ZERO)
    out = np.where(finite, out, EXP_NONFINITE)
    return out.astype(np.int32)


def _pow2_f32(exp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 2**exp where it is a normal float32, and a mask of where it is not."""
    exp = np.asarray(exp, np.int64)
    ok = (exp >= -126) & (exp <= 127)
    return np.ldexp(np.float32(1), np.where(ok, exp, 0).astype(np.int32)).astype(np.float32), ok


def quantise(chunks: np.ndarray, exps: np.ndarray, n_workers: int) -> np.ndarray:
    """float chunks [C, V] -> int32 with the agreed exponents ``exps`` [C].

    Scaling a float32 by a power of two is exact, so the float32 path gives
    the same integers as exact arithmetic; chunks whose scale is not a
    normal float32 (values below ~2**-99) take a float64 path.
    """
    s = headroom_bits(n_workers)
    live = (exps != EXP_ZERO) & (exps != EXP_NONFINITE)
    shift = np.where(live, s - exps.astype(np.int64), 0)
    scale, fast = _pow2_f32(shift)
    scale[~live] = 0
    x = np.asarray(chunks, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.multiply(x, scale[:, None])
        y[~live] = 0            # NaN * 0 is NaN: clear non-finite chunks explicitly
        np.rint(y, out=y)
    q = y.astype(np.int32)
    slow = np.flatnonzero(live & ~fast)
    if slow.size:
        q[slow] = np.rint(np.ldexp(x[slow].astype(np.float64), shift[slow, None].astype(np.int32)))
    # |x| < 2**E_w <= 2**E, so |q| <= 2**S and N of them sum within int32
    return q


def dequantise(sums: np.ndarray, exps: np.ndarray, n_workers: int) -> np.ndarray:
    """int32 sums [C, V] -> float32, NaN where any worker had NaN/Inf."""
    s = headroom_bits(n_workers)
    live = (exps != EXP_ZERO) & (exps != EXP_NONFINITE)
    shift = np.where(live, exps.astype(np.int64) - s, 0)
    scale, fast = _pow2_f32(shift)
    scale[~live] = 0
    out = sums.astype(np.float32)          # correctly rounded: the result's only rounding
    out *= scale[:, None]
    slow = np.flatnonzero(live & ~fast)
    if slow.size:
        out[slow] = np.ldexp(sums[slow].astype(np.float64), shift[slow, None].astype(np.int32))
    out[exps == EXP_NONFINITE] = np.nan
    return out


def tolerance(max_abs: float, n_workers: int) -> float:
    """Worst-case absolute error of a sum whose chunk max is ``max_abs``."""
    if max_abs == 0:
        return 0.0
    _, e = math.frexp(max_abs)
    # quantisation of each worker, plus float32 rounding of the result
    return n_workers * 2.0 ** (e - headroom_bits(n_workers) - 1) + n_workers * max_abs * 2.0 ** -23

"""Fixed point for in-network sums: one exponent per chunk, agreed by all.

A chunk is sent as q = round(x * 2**(S - P)) with S = 30 - ceil(log2 N).
When P >= E = max_w E_w (|x| < 2**E_w on every worker), |q| <= 2**S and
the int32 sum of N workers cannot overflow; the sum's error is at most N/2
units of 2**(P - S).

P is *predicted* (``predict``): from this tensor's exponents agreed on the
last calls, plus a margin. The same packets that carry the sums carry,
with XAGG_OP_MAX, each worker's E_w and its P (as P and ~P, so the maximum
of both gives max P and min P). A chunk's sum stands when every worker
used the same P and P - slack(N) <= E <= P (``check_predicted``): no
overflow, and at most slack(N) bits of precision lost, which keeps at least
KEPT_BITS[32] bits (an error within 2**-19 of the chunk's largest magnitude
for 4 workers; int8 compression trains with 2**-7). Other chunks are summed
again with P = E. Every worker decides from the agreed maxima alone, so all
decide alike. In training, gradients change scale slowly from step to
step, so the prediction holds for nearly every chunk and a sum mostly
costs one round trip, not two.

A chunk holding NaN/Inf on any worker sends XAGG_EXP_NONFINITE; the agreed
exponent is then NONFINITE on every worker and the chunk's result is NaN
everywhere (a defined result that torch's GradScaler detects), never a
silently wrong finite sum.

Biased data rows (``biased=True``): the round's data goes out with
XAGG_OP_SUM64, which adds lanes in pairs as 64-bit words (half the kernel's
instructions per value). A carry out of one lane would then reach the next,
so each live value is sent as q + 2**S (``bias``), in [0, 2**(S+1)]: N of
them total at most 2**31 in every lane, no lane ever carries, and the sum
less N * 2**S is the signed sum. Padding and chunks sent as zeros stay 0
(their sums are never read).

16-bit lanes (``bits=16``): the same scheme with S = 14 - ceil(log2 N),
two values to each int32 word of the packet (value 2i in the low half of
word i: ``to_words``), so a packet carries twice the values and a sum
takes half the packets each way. Biased values lie in [0, 2**(S+1)], N of
them total below 2**16, so the aggregator's 64-bit adds (XAGG_OP_SUM64,
unchanged) sum four lanes a word and never carry from one into the next;
``from_words`` reads the lane totals back. Integer sums stay exact, an
overflow stays impossible; the precision rule keeps KEPT_BITS[16] bits (an
error within 2**-7 of the chunk's largest magnitude per worker, what int8
compression trains with; predictions centred on the last call, as
PREDICT_FROM says why), and the error a rounding leaves is carried to the
next call by error feedback (``feedback``): the caller's residual r is
added before quantising (v = x + r) and v less what was sent becomes the
new residual.
"""
from __future__ import annotations

import math

import numpy as np

from xagg.wire.proto import C

EXP_ZERO = C.XAGG_EXP_ZERO
EXP_NONFINITE = C.XAGG_EXP_NONFINITE

# The element types a tensor summed may hold, by their csrc/codec.h number
# (XAGG_ELEM_*). numpy has no bfloat16: a bf16 tensor is its 16-bit
# patterns viewed as BFLOAT16, a one-field record, so that nothing numpy
# does can take it for a number. 16-bit values widen to float32 exactly
# (``widen``): their chunks quantise to the float32 path's words.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
ELEMS = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BFLOAT16: 2}
BF16_NAN = 0x7FC0           # torch's bf16 NaN when it rounds float32


def widen(a: np.ndarray) -> np.ndarray:
    """float32 of an array of an ELEMS type (exact; ``a`` itself if float32)."""
    if a.dtype == BFLOAT16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def narrow(v: np.ndarray, dtype) -> np.ndarray:
    """float32 ``v`` rounded to nearest even into ``dtype`` (an ELEMS type),
    as torch's .to() rounds: past the range Inf, NaN stays NaN."""
    dtype = np.dtype(dtype)
    if dtype != BFLOAT16:
        with np.errstate(over="ignore"):
            return v.astype(dtype)
    u = np.ascontiguousarray(v, np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        r = ((u + ((u >> 16) & 1) + np.uint32(0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(v), np.uint16(BF16_NAN), r).view(BFLOAT16)


WIRE_BITS = (32, 16)        # lane widths: bits per value on the wire


def check_bits(bits) -> int:
    if bits not in WIRE_BITS:
        raise ValueError(f"must be one of {', '.join(map(str, WIRE_BITS))} bits per value, got {bits!r}")
    return bits


def per_word(bits: int = 32) -> int:
    """Values to each int32 word of a packet."""
    return 32 // check_bits(bits)


def headroom_bits(n_workers: int, bits: int = 32) -> int:
    """S: the magnitude bits each worker may use so N of them sum in a lane."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    s = check_bits(bits) - 2 - math.ceil(math.log2(n_workers))
    if s < 1:
        raise ValueError(f"{n_workers} workers leave no magnitude bits in {bits}-bit lanes")
    return s


def bias(n_workers: int, bits: int = 32) -> int:
    """What a biased data row adds to each live value: 2**S (see above)."""
    return 1 << headroom_bits(n_workers, bits)


def unbias(n_workers: int, bits: int = 32) -> int:
    """What comes off each sum of N biased rows: N * bias."""
    return n_workers * bias(n_workers, bits)


KEPT_BITS = {32: 20, 16: 6}     # a predicted scale keeps at least this many bits
HISTORY = 4                 # calls whose agreed exponents are kept
MARGIN = 2                  # 32-bit lanes: recent maximum + this (growth by 4x still fits)
# Calls whose maximum predicts the next exponent. 32-bit lanes' slack (8 bits
# at 4 workers) covers four calls' drift; 16-bit lanes' (6 bits) does not,
# where gradients shrink fast (early training), so they predict from the last
# call, their margin half the slack: a chunk's exponent may move either way.
PREDICT_FROM = {32: HISTORY, 16: 1}


def slack_bits(n_workers: int, bits: int = 32) -> int:
    """How far a predicted exponent may exceed the chunk's own (precision it may cost)."""
    return max(0, headroom_bits(n_workers, bits) - KEPT_BITS[bits])


def margin_bits(n_workers: int, bits: int = 32) -> int:
    """What a prediction adds to the recent maximum (growth it absorbs)."""
    slack = slack_bits(n_workers, bits)
    return min(MARGIN, slack) if bits == 32 else (slack + 1) // 2


def _live(e: np.ndarray) -> np.ndarray:
    return (e != EXP_ZERO) & (e != EXP_NONFINITE)


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


def quantise(chunks: np.ndarray, exps: np.ndarray, n_workers: int, biased: bool = False,
             bits: int = 32) -> np.ndarray:
    """float chunks [C, V] -> int32 with the agreed exponents ``exps`` [C]
    (``biased``: live values plus ``bias``, for XAGG_OP_SUM64), one value
    each (``to_words`` packs 16-bit ones).

    Scaling a float32 by a power of two is exact, so the float32 path gives
    the same integers as exact arithmetic; chunks whose scale is not a
    normal float32 (values below ~2**-99) take a float64 path.
    """
    s = headroom_bits(n_workers, bits)
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
    # |x| < 2**E_w <= 2**E, so |q| <= 2**S and N of them sum within a lane
    if biased:
        q[live] += np.int32(bias(n_workers, bits))
    return q


def feedback(chunks: np.ndarray, q: np.ndarray, exps: np.ndarray, n_workers: int, biased: bool = False,
             bits: int = 32) -> np.ndarray:
    """The residual [C, V] float32 that quantising ``chunks`` (v = x + r) to
    ``q`` (``quantise``'s) with ``exps`` leaves: v - q * 2**(E - S) in
    float32 where 2**(E - S) and 2**(S - E) are normal float32 (float64
    otherwise, as ``quantise``). A chunk sent as zeros (a marker exponent)
    keeps all of v, or 0 if it holds NaN/Inf (a NaN step starts afresh)."""
    s = headroom_bits(n_workers, bits)
    live = (exps != EXP_ZERO) & (exps != EXP_NONFINITE)
    v = np.asarray(chunks, np.float32)
    y = (q - np.int32(bias(n_workers, bits)) if biased else q).astype(np.int64)
    y[~live] = 0
    e = np.where(live, exps.astype(np.int64) - s, 0)
    unit, fast_u = _pow2_f32(e)
    _, fast_s = _pow2_f32(-e)
    fast = fast_u & fast_s
    with np.errstate(invalid="ignore", over="ignore"):
        out = v - y.astype(np.float32) * unit[:, None]
    slow = np.flatnonzero(live & ~fast)
    if slow.size:
        out[slow] = (v[slow].astype(np.float64) - np.ldexp(y[slow].astype(np.float64),
                                                            e[slow, None].astype(np.int32))).astype(np.float32)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(v).all(axis=1)
    out[~live] = np.where(finite[~live, None], v[~live], np.float32(0))
    return out


def to_words(q: np.ndarray, bits: int = 32) -> np.ndarray:
    """Values [C, V] (``quantise``'s, biased, so each fits its lane) as the
    int32 words [C, V * bits / 32] of their packets: value 2i in the low
    half of word i for 16-bit lanes (little-endian, as every host we run)."""
    if bits == 32:
        return q
    return np.ascontiguousarray(q.astype(np.uint16)).view(np.int32)


def from_words(words: np.ndarray, bits: int = 32) -> np.ndarray:
    """Summed int32 words [C, W] as the lane totals [C, W * 32 / bits] (int32)."""
    if bits == 32:
        return words
    return np.ascontiguousarray(words).view(np.uint16).astype(np.int32)


def dequantise(sums: np.ndarray, exps: np.ndarray, n_workers: int, biased: bool = False,
               bits: int = 32) -> np.ndarray:
    """int32 sums [C, V] (``from_words``'s lane totals) -> float32, NaN where
    any worker had NaN/Inf (``biased``: sums of biased values, N * bias over
    the signed sum)."""
    s = headroom_bits(n_workers, bits)
    live = (exps != EXP_ZERO) & (exps != EXP_NONFINITE)
    if biased:          # a marker's row was sent as zeros (and is not read in C)
        less = (sums.view(np.uint32) - np.uint32(unbias(n_workers, bits))).view(np.int32)
        sums = np.where(live[:, None], less, sums)
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


def predict(history: list, n_chunks: int, n_workers: int, bits: int = 32) -> np.ndarray:
    """Exponents to quantise with, from the agreed exponents of the last
    PREDICT_FROM[bits] calls on the same tensor: their maximum plus
    ``margin_bits``. A chunk with no live history gets EXP_ZERO (it will be
    summed again)."""
    out = np.full(n_chunks, EXP_ZERO, np.int32)
    past = [np.asarray(h, np.int64) for h in history[-PREDICT_FROM[bits]:] if len(h) == n_chunks]
    if not past:
        return out
    past = np.max([np.where(h == EXP_ZERO, -(1 << 40), h) for h in past], axis=0)
    ok = np.abs(past) < (1 << 20)           # a live exponent (not ZERO/NONFINITE)
    out[ok] = past[ok] + margin_bits(n_workers, bits)
    return out


def send_exponents(own: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """The exponent each chunk is quantised with in a predicted round: the
    prediction where it holds this worker's chunk; EXP_ZERO (sent as zeros)
    where it cannot (larger, or non-finite): that chunk's check then fails on
    every worker and it is summed again."""
    fits = _live(pred) & (own != EXP_NONFINITE) & ((own == EXP_ZERO) | (own <= pred))
    return np.where(fits, pred, EXP_ZERO).astype(np.int32)


def quantise_predicted(chunks: np.ndarray, own: np.ndarray, pred: np.ndarray, n_workers: int,
                       biased: bool = False) -> np.ndarray:
    """``quantise`` with the predicted exponents (``send_exponents``)."""
    return quantise(chunks, send_exponents(own, pred), n_workers, biased)


def meta_lanes(own: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """[3, C] int32 to send with XAGG_OP_MAX: own exponent, prediction, ~prediction."""
    pred = np.asarray(pred, np.int32)
    return np.stack([np.asarray(own, np.int32), pred, ~pred])


def check_predicted(lanes: np.ndarray, n_workers: int, bits: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the agreed (maximum) ``meta_lanes``: (E, the exponent each sum was
    quantised with, which chunks must be summed again). A function of the
    agreed values only, so every worker gets the same answer."""
    e, pmax, pmin = (np.asarray(lanes[0], np.int64), np.asarray(lanes[1], np.int64),
                     ~np.asarray(lanes[2], np.int64))
    live = _live(e)
    same = (pmax == pmin) & (np.abs(pmax) < (1 << 20))
    ok = ~live | (same & (e <= pmax) & (e >= pmax - slack_bits(n_workers, bits)))
    return e.astype(np.int32), np.where(live, pmax, e).astype(np.int32), ~ok


def tolerance(max_abs: float, n_workers: int, slack: int | None = None, bits: int = 32) -> float:
    """Worst-case absolute error of an allreduce whose chunk max is ``max_abs``
    (``slack``: bits a predicted exponent may exceed the chunk's; default the
    allreduce's, 0 for a sum quantised with the exact exponents)."""
    if max_abs == 0:
        return 0.0
    _, e = math.frexp(max_abs)
    slack = slack_bits(n_workers, bits) if slack is None else slack
    # quantisation of each worker, plus float32 rounding of the result
    return n_workers * 2.0 ** (e + slack - headroom_bits(n_workers, bits) - 1) + n_workers * max_abs * 2.0 ** -23

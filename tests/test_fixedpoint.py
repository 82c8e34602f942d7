import numpy as np
import pytest

from xagg.client import fixedpoint as fp
from xagg.wire.chunks import capacity, split


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 64])
def test_sum_of_n_workers_within_tolerance_and_never_overflows(n):
    rng = np.random.default_rng(n)
    scale = 10.0 ** rng.uniform(-30, 30, size=(16, 1))
    xs = [(rng.standard_normal((16, 256)) * scale).astype(np.float32) for _ in range(n)]
    xs[0][3] = 0                                # one worker's chunk is zero
    for x in xs:
        x[4] = 0                                # and one chunk is zero on every worker
    # worst case for overflow: every worker at the chunk's maximum, same sign
    xs[-1][5] = np.float32(np.max(np.abs(np.array(xs)[:, 5])))
    for x in xs:
        x[5] = xs[-1][5]
    exps = np.max([fp.chunk_exponents(x) for x in xs], axis=0)
    qs = [fp.quantise(x, exps, n).astype(np.int64) for x in xs]
    total = np.sum(qs, axis=0)
    assert np.abs(total).max() < 2**31
    out = fp.dequantise(total.astype(np.int32), exps, n)
    ref = np.sum(np.array(xs, np.float64), axis=0)
    for c in range(16):
        amax = float(np.max(np.abs(np.array(xs)[:, c])))
        assert np.max(np.abs(out[c] - ref[c])) <= fp.tolerance(amax, n, slack=0), c
    # a zero chunk's marker never wins the agreed exponent over a live one,
    # and a chunk zero everywhere comes back exactly zero
    others = [fp.chunk_exponents(x)[3] for x in xs[1:]]
    assert exps[3] == (max(others) if others else fp.EXP_ZERO)
    assert exps[4] == fp.EXP_ZERO and (out[4] == 0).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 64])
def test_biased_values_added_as_64_bit_words_never_carry_across_lanes(n):
    """XAGG_OP_SUM64 adds lanes in pairs as 64-bit words: biased values stay
    in [0, 2**(S+1)] and N of them never carry out of a lane, even with every
    worker at the chunk's maximum of either sign, so the word sums are the
    lane sums and give the unbiased sum's floats."""
    rng = np.random.default_rng(100 + n)
    xs = [(rng.standard_normal((4, 256)) * 1e3).astype(np.float32) for _ in range(n)]
    top = np.float32(np.max(np.abs(np.array(xs))))
    for x in xs:
        x[1], x[2] = top, -top                  # the extremes, on every worker
        x[3, ::2], x[3, 1::2] = -top, top       # alternating: a carry would show in the odd lanes
    exps = np.max([fp.chunk_exponents(x) for x in xs], axis=0)
    qs = [fp.quantise(x, exps, n, biased=True) for x in xs]
    assert all(q.min() >= 0 and q.max() <= 2 * fp.bias(n) for q in qs)
    words = np.zeros(4 * 128, np.uint64)
    for q in qs:
        words += q.reshape(-1).view(np.uint64)
    lanes = np.sum([q.astype(np.int64) for q in qs], axis=0)
    assert lanes.max() < 2**32
    assert np.array_equal(words.view(np.uint32).reshape(4, 256), lanes.astype(np.uint32))
    unbiased = np.sum([fp.quantise(x, exps, n).astype(np.int64) for x in xs], axis=0).astype(np.int32)
    assert np.array_equal(fp.dequantise(words.view(np.int32).reshape(4, 256), exps, n, biased=True),
                          fp.dequantise(unbiased, exps, n))


def test_error_is_below_float32_relative_to_chunk_max():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 256)).astype(np.float32) for _ in range(4)]
    exps = np.max([fp.chunk_exponents(x) for x in xs], axis=0)
    out = fp.dequantise(np.sum([fp.quantise(x, exps, 4) for x in xs], axis=0).astype(np.int32), exps, 4)
    ref = np.sum(np.array(xs, np.float64), axis=0)
    rel = np.max(np.abs(out - ref), axis=1) / np.max(np.abs(np.array(xs)), axis=(0, 2))
    assert rel.max() < 2**-22


def test_nonfinite_chunk_becomes_nan_on_all_workers_and_others_unaffected():
    a = np.ones((3, 256), np.float32)
    b = np.ones((3, 256), np.float32)
    b[1, 7] = np.inf
    exps = np.maximum(fp.chunk_exponents(a), fp.chunk_exponents(b))
    assert exps[1] == fp.EXP_NONFINITE
    out = fp.dequantise(fp.quantise(a, exps, 2) + fp.quantise(b, exps, 2), exps, 2)
    assert np.isnan(out[1]).all() and (out[0] == 2).all() and (out[2] == 2).all()


def test_zero_chunk():
    z = np.zeros((1, 256), np.float32)
    e = fp.chunk_exponents(z)
    assert e[0] == fp.EXP_ZERO and (fp.dequantise(fp.quantise(z, e, 3), e, 3) == 0).all()


def test_split_is_weighted_and_covers_everything():
    assert split(10, [1, 1]) == [(0, 5), (5, 10)]
    assert split(9, [2, 1]) == [(0, 6), (6, 9)]
    r = split(1001, [3, 1, 1])
    assert r[0][0] == 0 and r[-1][1] == 1001 and all(a[1] == b[0] for a, b in zip(r, r[1:]))
    assert sum(capacity(1_000_003, 256, [1, 1])) >= 3907
    with pytest.raises(ValueError, match="weights"):
        split(4, [0, 0])

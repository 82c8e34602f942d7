"""xagg.wire.chunks: the chunk split is house-monotone, so the capacity an
aggregator registers for the largest gradient holds every smaller one."""
from __future__ import annotations

import itertools

import pytest

from xagg.wire.chunks import capacity, meta_chunks, split

WEIGHTS = [
    [1], [1, 1], [2, 1], [1, 3, 3], [3, 1, 1], [1, 1, 1, 1], [5, 3, 2],
    [0.1, 0.7, 0.2], [1, 0, 2], [1e-3, 1, 1], [7, 11, 13, 17, 19],
    [1, 2, 3, 4, 5, 6, 7, 8], [0.3, 0.3, 0.4], [100, 1],
]


def test_alabama_paradox_of_the_issue():
    """Weights (1,3,3), capacity for 2,816 elements (11 chunks of 256): a
    2,560-element tensor (10 chunks) must fit aggregator 0's share."""
    caps = capacity(2816, 256, [1, 3, 3])
    for lo, hi in [split(n, [1, 3, 3])[0] for n in range(1, 12)]:
        assert (hi - lo) + meta_chunks(hi - lo, 256) <= caps[0]


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_split_is_monotone_and_covers_everything(weights):
    prev = [0] * len(weights)
    for n in range(0, 600):
        r = split(n, weights)
        assert r[0][0] == 0 and r[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
        sizes = [hi - lo for lo, hi in r]
        assert all(s >= p for s, p in zip(sizes, prev)), (n, prev, sizes)
        assert sum(s - p for s, p in zip(sizes, prev)) == (1 if n else 0)
        # near the weights: within one chunk of each quota, give or take
        # the rounding a divisor method may add for very uneven weights
        total = sum(weights)
        for s, w in zip(sizes, weights):
            assert abs(s - n * w / total) < len(weights), (n, sizes)
            if w == 0:
                assert s == 0
        prev = sizes


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
@pytest.mark.parametrize("vals", [1, 3, 256])
def test_every_size_up_to_the_maximum_fits_the_capacity(weights, vals):
    for max_elements in itertools.chain(range(1, 150), range(150, 3000, 131)):
        caps = capacity(max_elements, vals, weights)
        for n in range(1, -(-max_elements // vals) + 1):
            for k, (lo, hi) in enumerate(split(n, weights)):
                assert (hi - lo) + meta_chunks(hi - lo, vals) <= caps[k], (max_elements, n, k)


def test_large_splits_are_fast_and_proportional():
    r = split(10**9, [1, 2, 1])
    assert [hi - lo for lo, hi in r] == [250_000_000, 500_000_000, 250_000_000]
    r = split(4_000_001, [0.25, 0.75])
    assert sum(hi - lo for lo, hi in r) == 4_000_001 and abs((r[0][1] - r[0][0]) - 1_000_000) <= 1

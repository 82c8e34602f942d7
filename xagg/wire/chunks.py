"""Which aggregator holds which chunk.

A gradient of C chunks is cut into contiguous blocks, one per aggregator,
sized by weight (Sainte-Lague, which is house monotone), so an aggregator with twice the
bandwidth ingests twice the data. Each aggregator numbers its chunks from
0; behind its data chunks come the meta chunks that carry their exponents
(XAGG_OP_MAX, in the same packets' round). Clients and the daemon both call these functions, so
registration and traffic agree.
"""
from __future__ import annotations

import math
from functools import lru_cache
from fractions import Fraction


def check_weights(weights, n_aggregators: int | None = None) -> list[float]:
    """Aggregator weights as floats; ValueError unless they are finite, >= 0,
    not all zero and (given ``n_aggregators``) one per aggregator."""
    try:
        ws = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise ValueError(f"weights must be numbers, got {weights!r}") from None
    if n_aggregators is not None and len(ws) != n_aggregators:
        raise ValueError(f"{len(ws)} weights for {n_aggregators} aggregators")
    if not ws or not all(0 <= w < math.inf for w in ws) or sum(ws) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {ws}")
    return ws


def split(n_chunks: int, weights: list[float]) -> list[tuple[int, int]]:
    """[(lo, hi)) chunk ranges per aggregator, proportional to ``weights``.

    Sainte-Lague (Webster's divisor method): aggregator i's (k+1)-th chunk
    has priority w_i / (k + 1/2), and the n_chunks of highest priority win
    (ties to the lower index). The winners for n chunks are a prefix of one
    fixed order, so no block ever shrinks when n grows (house monotone);
    largest remainder is not (the Alabama paradox): there a smaller gradient
    could need more chunks at one aggregator than the capacity registered
    for the largest. Exact rationals, so every host splits alike.
    """
    return list(_split(n_chunks, tuple(check_weights(weights))))


@lru_cache(maxsize=4096)
def _split(n: int, weights: tuple) -> tuple:
    """split's work, cached: a client splits every tensor on every call."""
    ws = [Fraction(w) for w in weights]
    m = len(ws)
    sizes = [0] * m
    if n > m:
        # Every chunk with priority above t comes before any other in the
        # order. c_i = #{k >= 0: w_i / (k + 1/2) > t} < w_i / t + 1/2, so
        # with this t they number at most n and at least n - m.
        t = sum(ws) / (n - Fraction(m, 2))
        sizes = [max(0, math.ceil(w / t - Fraction(1, 2))) for w in ws]
    for _ in range(n - sum(sizes)):
        # the next in the order: highest priority, lowest index on a tie
        best = max((i for i in range(m) if ws[i] > 0),
                   key=lambda i: (ws[i] / (sizes[i] + Fraction(1, 2)), -i))
        sizes[best] += 1
    ranges, lo = [], 0
    for s in sizes:
        ranges.append((lo, lo + s))
        lo += s
    return tuple(ranges)


META_LANES = 3      # per data chunk: its exponent, the predicted one, ~predicted (fixedpoint)


def meta_chunks(n_data: int, vals: int) -> int:
    """Chunks needed to carry META_LANES exponents per data chunk."""
    return -(-n_data * META_LANES // vals)


def capacity(max_elements: int, vals: int, weights: list[float]) -> list[int]:
    """Chunks each aggregator must hold for gradients up to ``max_elements``.

    Any smaller gradient splits into blocks no larger than these (the split
    is monotone in n_chunks), data and meta chunks included.
    """
    n = -(-max_elements // vals)
    return [(hi - lo) + meta_chunks(hi - lo, vals) for lo, hi in split(n, weights)]

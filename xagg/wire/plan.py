"""Which aggregator holds which chunk.

A gradient of C chunks is cut into contiguous blocks, one per aggregator,
sized by weight (largest remainder), so an aggregator with twice the
bandwidth ingests twice the data. Each aggregator numbers its chunks from
0; behind its data chunks come the meta chunks that carry their exponents
(XAGG_OP_MAX, in the same packets' round). Clients and the daemon both call these functions, so
registration and traffic agree.
"""
from __future__ import annotations

import math


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
    """[(lo, hi)) chunk ranges per aggregator, proportional to ``weights``."""
    weights = check_weights(weights)
    total = sum(weights)
    exact = [n_chunks * w / total for w in weights]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - sizes[i], reverse=True)
    for i in by_remainder[: n_chunks - sum(sizes)]:
        sizes[i] += 1
    ranges, lo = [], 0
    for s in sizes:
        ranges.append((lo, lo + s))
        lo += s
    return ranges


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

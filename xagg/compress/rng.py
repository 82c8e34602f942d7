"""Randomness every rank agrees on.

Compressed sums break if ranks make different random choices (which rank
broadcasts, which hash a sketch uses). Everything random here is a pure
function of (seed, step, tensor name, ...) through a stable hash; Python's
``hash()`` is salted per process and must never be used for this.
"""
import hashlib
from functools import lru_cache

import torch

P31 = 2**31 - 1   # Mersenne prime for the universal hash; a * i stays < 2**62 in int64


def stable_int(*keys) -> int:
    """A 63-bit integer that depends only on ``keys`` (same on every process)."""
    h = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def generator(*keys) -> torch.Generator:
    """A CPU generator seeded from ``keys``."""
    return torch.Generator().manual_seed(stable_int(*keys))


def choice(n: int, *keys) -> int:
    """An integer in [0, n) drawn from ``keys``."""
    return stable_int("choice", *keys) % n


def universal_hash(n: int, *keys) -> torch.Tensor:
    """h(i) = (a*i + b) mod P for i in [0, n): int64, pairwise independent.

    Computed arithmetically (not from a generator) so the values are the same
    on every platform and torch version.
    """
    if n > P31:
        raise ValueError(f"universal_hash: n={n} exceeds 2**31-1")
    a = 1 + stable_int("a", *keys) % (P31 - 1)
    b = stable_int("b", *keys) % P31
    i = torch.arange(n, dtype=torch.int64)
    return (i * a + b) % P31


@lru_cache(maxsize=32)
def bucket_hash(n: int, width: int, rows: int, seed, salt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cell of each index in each row (offset so rows index one flat table of
    rows*width cells) and a +/-1 sign per (row, index). Cached: building them
    costs more than using them."""
    cells = torch.empty(rows, n, dtype=torch.int32)   # int32 halves the cache; index ops accept it
    signs = torch.empty(rows, n, dtype=torch.float32)
    for r in range(rows):
        cells[r] = universal_hash(n, seed, salt, "cell", r) % width + r * width
        # the top bits of a second hash: the low bit of (a*i+b) mod P alternates too regularly
        signs[r] = ((universal_hash(n, seed, salt, "sign", r) >> 15) & 1).float().mul_(2).sub_(1)
    return cells, signs

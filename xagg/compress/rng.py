"""Randomness every rank agrees on.

Compressed sums break if ranks make different random choices (which rank
broadcasts, which hash a sketch uses). Everything random here is a pure
function of (seed, step, tensor name, ...) through a stable hash; Python's
``hash()`` is salted per process and must never be used for this.
"""
import hashlib
from functools import lru_cache

import torch


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


def _u64(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_M1, _M2, _GOLD = _u64(0xBF58476D1CE4E5B9), _u64(0x94D049BB133111EB), _u64(0x9E3779B97F4A7C15)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix_hash(n: int, *keys) -> torch.Tensor:
    """A well-mixed hash of i in [0, n), int64 in [0, 2**62), from ``keys``.

    SplitMix64's finaliser in int64 arithmetic (products wrap modulo 2**64),
    so the values are the same on every platform and torch version. A plain
    (a*i + b) mod p hash is not enough: reduced modulo a table width it can
    fold small index ranges onto a fraction of the cells.
    """
    z = torch.arange(n, dtype=torch.int64) * _GOLD + _u64(stable_int(*keys))
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return _shr(z ^ _shr(z, 31), 2)


@lru_cache(maxsize=32)
def bucket_hash(n: int, width: int, rows: int, seed, salt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cell of each index in each row (offset so rows index one flat table of
    rows*width cells) and a +/-1 sign per (row, index). Cached: building them
    costs more than using them."""
    cells = torch.empty(rows, n, dtype=torch.int32)   # int32 halves the cache; index ops accept it
    signs = torch.empty(rows, n, dtype=torch.float32)
    for r in range(rows):
        h = mix_hash(n, seed, salt, r)
        cells[r] = h % width + r * width
        signs[r] = (_shr(h, 61) & 1).float().mul_(2).sub_(1)    # a bit the cell hardly depends on
    return cells, signs

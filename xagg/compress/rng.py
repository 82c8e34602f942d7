"""Randomness every rank agrees on.

Compressed sums break if ranks make different random choices (which rank
broadcasts, which hash a sketch uses). Everything random here is a pure
function of (seed, step, tensor name, ...) through a stable hash; Python's
``hash()`` is salted per process and must never be used for this.
"""
import ctypes
import hashlib
from functools import lru_cache

import torch

from xagg.client import native


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


def row_keys(rows: int, seed, salt: str) -> list[int]:
    """The hash key of each row (a 63-bit integer, the same on every process)."""
    return [stable_int(seed, salt, r) for r in range(rows)]


def mix_hash(idx: torch.Tensor, key: int) -> torch.Tensor:
    """A well-mixed hash of each index (int64), in [0, 2**62).

    SplitMix64's finaliser in int64 arithmetic (products wrap modulo 2**64),
    so the values are the same on every platform and torch version. A plain
    (a*i + b) mod p hash is not enough: reduced to a table width it can fold
    small index ranges onto a fraction of the cells.
    """
    z = idx.to(torch.int64) * _GOLD + _u64(key)
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return _shr(z ^ _shr(z, 31), 2)


CELL = 0x7FFFFFFF       # a hash code's cell; its top bit is the sign (client/csrc/sketch.h)


def hash_codes(idx: torch.Tensor | None, n: int, width: int, rows: int, seed, salt: str) -> torch.Tensor | None:
    """Each index's hash in each row as one int32 code (rows x n): the cell
    (offset so the rows index one flat table of rows*width cells), negative
    where the sign is -1 (client/csrc/sketch.c says how). ``idx`` None: the
    indices below n. None where no compiler is."""
    if not 1 <= width < 2**31 // max(rows, 1):
        raise ValueError(f"hash width must be in [1, 2**31 / rows), got {width} with {rows} rows")
    dll = native.load()
    if dll is None:
        return None
    if idx is not None:
        idx = idx.to(torch.int64).contiguous()
    keys = (ctypes.c_uint64 * rows)(*row_keys(rows, seed, salt))
    codes = torch.empty(rows, n, dtype=torch.int32)
    dll.xagg_hash_codes(None if idx is None else idx.data_ptr(), n, keys, rows, width, codes.data_ptr())
    return codes


@lru_cache(maxsize=32)
def bucket_codes(n: int, width: int, rows: int, seed, salt: str, blocks: int = 1) -> torch.Tensor | None:
    """``hash_codes`` of every index below n, for the compiled count-sketch;
    with ``blocks``, a ``blocked`` map. Cached: a bucket's layout lasts the
    whole job, and its map costs more to hash than to read."""
    if blocks == 1:
        return hash_codes(None, n, width, rows, seed, salt)
    blocked(n, width, blocks)           # refuses a width that does not share out
    dll = native.load()
    if dll is None:
        return None
    codes = torch.empty(rows, n, dtype=torch.int32)
    dll.xagg_hash_codes_blocked(n, (ctypes.c_uint64 * rows)(*row_keys(rows, seed, salt)), rows, width, blocks,
                                codes.data_ptr())
    return codes


def blocked(n: int, width: int, blocks: int) -> list[tuple[int, int, int, int]]:
    """A map of n indices onto ``width`` cells a row in ``blocks`` blocks:
    (first index, indices, first cell, cells) of each, the indices cut into
    equal contiguous runs, each hashed onto its own equal share of every
    row (``width`` a multiple of ``blocks``). A pass over the indices in
    order then adds into one block's cells at a time, which a cache holds
    where the whole table would not; every cell still holds about n/width
    indices, drawn at random from its block."""
    if width % blocks or not 1 <= blocks <= n:
        raise ValueError(f"{blocks} blocks of {n} indices onto {width} cells: width must be a multiple, "
                         "and blocks at most the indices")
    run, wb = -(-n // blocks), width // blocks
    return [(o, min(run, n - o), b * wb, wb) for b, o in enumerate(range(0, n, run))]


@lru_cache(maxsize=32)
def bucket_members(n: int, width: int, seed, salt: str, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The indices below n in each cell of a one-row ``bucket_codes`` map:
    (start, int64 width + 1; members, int32 n), the members of cell c at
    members[start[c]:start[c + 1]], ascending. Cached as the map is; None
    where no compiler is."""
    codes, dll = bucket_codes(n, width, 1, seed, salt, blocks), native.load()
    if codes is None or dll is None:
        return None
    start, members = torch.empty(width + 1, dtype=torch.int64), torch.empty(n, dtype=torch.int32)
    dll.xagg_sketch_members(codes.data_ptr(), n, width, start.data_ptr(), members.data_ptr())
    return start, members


def cells_at_reference(idx: torch.Tensor, width: int, rows: int, seed, salt: str):
    """Cell of each index in each row (int32, rows x m, offset so the rows
    index one flat table of rows*width cells) and a +/-1 sign (float32) per
    (row, index), in torch: what ``hash_codes`` packs into one code. The
    cell scales bits 30..61 onto the width by a multiply (no division in
    the compiled pass); the sign is bit 0, which the cell does not depend on."""
    cells = torch.empty(rows, idx.numel(), dtype=torch.int32)   # int32 halves the cache; index ops accept it
    signs = torch.empty(rows, idx.numel(), dtype=torch.float32)
    for r, key in enumerate(row_keys(rows, seed, salt)):
        h = mix_hash(idx, key)
        cells[r] = ((h >> 30) * width >> 32) + r * width
        signs[r] = (h & 1).float().mul_(2).sub_(1)
    return cells, signs


@lru_cache(maxsize=8)
def bucket_hash(n: int, width: int, rows: int, seed, salt: str, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``cells_at_reference`` of every index below n (``blocks``: the
    ``blocked`` map ``bucket_codes`` builds), for the torch references that
    read the whole map (cached, as ``bucket_codes``)."""
    if blocks == 1:
        return cells_at_reference(torch.arange(n), width, rows, seed, salt)
    cells, signs = torch.empty(rows, n, dtype=torch.int32), torch.empty(rows, n, dtype=torch.float32)
    for o, ln, at, wb in blocked(n, width, blocks):
        c, signs[:, o:o + ln] = cells_at_reference(torch.arange(o, o + ln), wb, rows, seed, salt)
        cells[:, o:o + ln] = c + (c // wb) * (width - wb) + at
    return cells, signs

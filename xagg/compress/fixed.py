"""Fixed point that sums exactly in int32, and narrow integers packed in it.

Scales must be the same on every rank and leave head-room for N workers.
Both come from one small sum round: each rank sends a bound on its own
magnitude (max |x| per chunk, or the L1 norm for sketch cells); the sum S
of those bounds bounds the sum of any N values, so a scale of S / LIMIT
keeps every integer sum within LIMIT with no clipping and no MAX operator.

Packing: int8 (or int16) values are written as signed digits of an int32,
word = sum_j q_j * 2**(8 j). That is linear, so summing words sums each
lane, and as long as every lane's sum stays in [-128, 127] the digits of the
summed word are exactly the lane sums (the top lane fills the int32 sign).
"""
import math

import torch

INT32_LIMIT = 2**30        # |int32 sum| bound used by sketches: a factor 2 spare


def pow2_scale(total_bound: float, limit: int = INT32_LIMIT) -> float:
    """Smallest power of two s with total_bound / s <= limit (power of two,
    so x / s is exact in float and only the rounding to integer loses)."""
    if total_bound <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(total_bound / limit))


def to_fixed(x: torch.Tensor, scale) -> torch.Tensor:
    """round(x / scale) as int32 (the caller guarantees the range)."""
    return torch.round(x / scale).to(torch.int32)


def lanes(bits: int) -> int:
    if bits not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {bits}")
    return 32 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int values (|q| < 2**(bits-1)) -> int32 words, 32/bits lanes each."""
    m = lanes(bits)
    q = torch.nn.functional.pad(q.to(torch.int64), (0, (-q.numel()) % m)).view(-1, m)
    shifts = torch.arange(m, dtype=torch.int64) * bits
    w = (q << shifts).sum(1)      # in [-2**31, 2**31) by the lane bound: no wrap needed
    return w.to(torch.int32)


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words (possibly sums of packed words) -> the n signed lane values (int64)."""
    m, half = lanes(bits), 1 << (bits - 1)
    w = words.to(torch.int64)
    out = torch.empty(w.numel(), m, dtype=torch.int64)
    for j in range(m - 1):
        d = ((w + half) & ((1 << bits) - 1)) - half   # the low signed digit
        out[:, j] = d
        w = (w - d) >> bits
    out[:, m - 1] = w
    return out.reshape(-1)[:n]

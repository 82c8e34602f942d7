"""Fixed point that sums exactly in int32, and narrow integers packed in it.

Scales must be the same on every rank and leave head-room for N workers.
Both come from one small sum round: each rank sends a bound on its own
magnitude (max |x| per chunk); the sum S of those bounds bounds the sum of
any N values at one index, so a scale of S / LIMIT keeps every integer sum
within LIMIT with no clipping and no MAX operator.

Packing: int8 (or int16) values are written as signed digits of an int32,
word = sum_j q_j * 2**(8 j). That is linear, so summing words sums each
lane, and as long as every lane's sum stays in [-128, 127] the digits of the
summed word are exactly the lane sums (the top lane fills the int32 sign).
"""
import math
import sys

import torch

from xagg.client import native

if sys.byteorder != "little":   # pack/unpack read int32 words as their bytes
    raise ImportError("xagg.compress.intsum assumes a little-endian host")

INT32_LIMIT = 2**30        # |int32 sum| bound: a factor 2 spare for rounding
MARGIN = 1 + 2**-10        # a summed bound may come back a little low (fixed-point transports)


def pow2_scale(total_bound: float, limit: int = INT32_LIMIT) -> float:
    """Smallest power of two s with total_bound / s <= limit (power of two,
    so x / s is exact in float and only the rounding to integer loses)."""
    if total_bound <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(total_bound / limit))


def to_fixed(x: torch.Tensor, scale) -> torch.Tensor:
    """round(x / scale) as int32 (the caller guarantees the range)."""
    return torch.round(x / scale).to(torch.int32)


def levels(bits: int, world_size: int) -> int:
    """L: the largest |q| one rank may send with ``bits``-wide lanes so that N
    rounded values (each off by at most 1/2) still sum within the lane."""
    L = (1 << (bits - 1)) - 1 - math.ceil(world_size / 2)
    if L < 1:
        raise ValueError(f"{world_size} workers leave no head-room in {bits}-bit lanes")
    return L


def headroom_scale(bound: torch.Tensor, L: int) -> torch.Tensor:
    """bound * MARGIN / L (``bound``: the summed per-rank max |x|); 1 where
    the bound is 0 (its x are all zero)."""
    return torch.where(bound > 0, bound * MARGIN / L, torch.ones_like(bound))


def send_from(acc: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor, L: int) -> torch.Tensor:
    """What is sent at ``idx`` (int64): acc there / ``scale`` (one float32
    per index), rounded to even and clamped to [-L, L], as float; acc keeps
    the rest there (acc - q * scale: the rounding, the clamp's excess).
    Compiled as one gather and one scatter (client/csrc/residual.c), the
    same bits."""
    dll = native.load()
    idx, scale = idx.contiguous(), scale.to(torch.float32).contiguous()
    if dll is None or not acc.is_contiguous() or acc.dtype != torch.float32:
        sent = acc[idx]
        q = torch.round(sent / scale).clamp_(-L, L)
        acc.index_put_((idx,), sent.sub_(q * scale))
        return q
    q = torch.empty(idx.numel(), dtype=torch.float32)
    dll.xagg_send_from(acc.data_ptr(), idx.data_ptr(), idx.numel(), scale.data_ptr(), float(L), q.data_ptr())
    return q


def chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x zero-padded to whole chunks, shape (chunks, chunk) (a view when no padding is needed)."""
    pad = (-x.numel()) % chunk
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, chunk)


def chunk_amax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """max |x| of each chunk, without copying x into a padded buffer."""
    full = x.numel() // chunk * chunk
    out = x[:full].view(-1, chunk).abs().amax(1)
    if full < x.numel():
        out = torch.cat([out, x[full:].abs().amax().reshape(1)])
    return out


def accumulate_amax(r: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor, chunk: int) -> torch.Tensor:
    """out = r + x (x where r is None) and each chunk's max |out| (NaN where
    it holds one): one compiled pass (client/csrc/int8.c), the same bits as
    the torch expressions it stands for. ``out`` is float32, contiguous, of
    x's size, aliasing neither input."""
    dll = native.load()
    if dll is None or not _contiguous32(out, x, r):
        torch.add(r, x, out=out) if r is not None else out.copy_(x)
        return chunk_amax(out, chunk)
    amax = torch.empty(-(-x.numel() // chunk), dtype=torch.float32)
    dll.xagg_int8_bound(r.data_ptr() if r is not None else None, x.data_ptr(), out.data_ptr(), x.numel(), chunk,
                        amax.data_ptr())
    return amax


def quantise_packed(acc: torch.Tensor, scale: torch.Tensor, L: int, chunk: int, bits: int = 8) -> torch.Tensor:
    """q = acc / scale (one per chunk) rounded to even and clamped to [-L, L],
    packed 32/bits to an int32 word (``pack``); acc keeps acc - q * scale.
    8-bit lanes in one compiled pass, the same bits as the torch expressions
    (16-bit lanes in those)."""
    dll = native.load()
    scale = scale.to(torch.float32).contiguous()
    if dll is None or not _contiguous32(acc) or bits != 8 or L > 127:
        n = acc.numel()
        q = torch.round(chunked(acc, chunk) / scale[:, None]).clamp_(-L, L)
        acc.sub_((q * scale[:, None]).reshape(-1)[:n])
        return pack(q.reshape(-1)[:n], bits)
    words = torch.empty(-(-acc.numel() // 4), dtype=torch.int32)
    dll.xagg_int8_quantise(acc.data_ptr(), acc.numel(), chunk, scale.data_ptr(), float(L), words.data_ptr())
    return words


def unpack_scaled(words: torch.Tensor, chunk: int, scale: torch.Tensor, out: torch.Tensor, start: int = 0,
                  divide: int = 1, bits: int = 8) -> torch.Tensor:
    """Lanes ``start`` .. ``start`` + out.numel() of summed ``bits``-wide
    ``words`` times their chunk's ``scale``, divided by ``divide``, written
    into ``out`` (float32): 8-bit lanes in one compiled pass, the same bits
    as the torch expressions (16-bit lanes in those)."""
    dll = native.load()
    words, scale = words.to(torch.int32).contiguous(), scale.to(torch.float32).contiguous()
    count, per_word = out.numel(), lanes(bits)
    if words.numel() * per_word < start + count:
        raise IndexError(f"lanes {start}..{start + count} are past the {per_word * words.numel()} the words hold")
    if dll is None or not _contiguous32(out) or bits != 8:
        lanes_ = unpack(words, bits, start + count)[start:].to(torch.float32)
        at = torch.arange(start, start + count) // chunk
        out.copy_(lanes_ * scale[at])
        return out if divide == 1 else out.div_(divide)
    dll.xagg_int8_dequantise(words.data_ptr(), start, count, chunk, scale.data_ptr(), float(divide), out.data_ptr())
    return out


def _contiguous32(*ts) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in ts)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| (a 0-d tensor; NaN if x holds one) with no temporary the size
    of x, where x.abs().max() writes one."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi)


def all_finite(x: torch.Tensor) -> bool:
    """No inf/NaN in x. min and max propagate NaN and show +-inf: reductions
    with no temporary, where isfinite(x).all() writes a mask as large as x."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def lanes(bits: int) -> int:
    if bits not in (8, 16):
        raise ValueError(f"lane width must be 8 or 16 bits, got {bits}")
    return 32 // bits


def _bias(bits: int) -> int:
    """sum_j 2**(bits-1) * 2**(bits j) as an int32: 0x80808080 or 0x80008000."""
    b = sum((1 << (bits - 1)) << (bits * j) for j in range(32 // bits))
    return b - (1 << 32)


_LANE = {8: torch.uint8, 16: torch.int16}


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int values (|q| < 2**(bits-1)) -> int32 words, 32/bits lanes each.

    q + 2**(bits-1) is a plain unsigned digit, so its bytes laid side by side
    are a base-2**bits number; subtracting the bias turns the digits back to
    signed ones: word = sum_j q_j 2**(bits j) (mod 2**32, exact in range)."""
    m = lanes(bits)
    u = torch.nn.functional.pad(q.to(torch.int32) + (1 << (bits - 1)), (0, (-q.numel()) % m),
                                value=1 << (bits - 1))
    if bits == 16:    # the bit pattern of an unsigned 16-bit digit, held in an int16
        u = torch.where(u >= 1 << 15, u - (1 << 16), u)
    return u.to(_LANE[bits]).view(torch.int32) - _bias(bits)     # int32 arithmetic wraps


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words (possibly sums of packed words) -> the n signed lane values.

    As long as every lane sum is in [-2**(bits-1), 2**(bits-1)), adding the
    bias makes every digit unsigned again, so the bytes are the digits."""
    digits = (words.to(torch.int32) + _bias(bits)).view(_LANE[bits])[:n].to(torch.int32)
    if bits == 16:
        digits &= 0xFFFF
    return digits - (1 << (bits - 1))

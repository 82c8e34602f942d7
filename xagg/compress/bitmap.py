"""Bitmaps of indices, the OR's wire form: uint8, bit i of byte j is index
8j + i (numpy's ``packbits(..., bitorder="little")``). Set and read in C
(client/csrc/orlanes.c), or through numpy where no compiler is: a bool an
index would be eight times the bytes to clear, pack and scan."""
import numpy as np
import torch

from xagg.client import native


def empty(n: int) -> torch.Tensor:
    """A cleared bitmap of n indices."""
    return torch.zeros(-(-n // 8), dtype=torch.uint8)


def set_bits(bits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``bits`` with the indices ``idx`` set (in place)."""
    dll, idx = native.load(), idx.to(torch.int64).contiguous()
    if dll is None:
        packed = pack(torch.zeros(8 * bits.numel(), dtype=torch.bool).index_fill_(0, idx, True))
        return bits.bitwise_or_(packed)
    dll.xagg_bits_set(idx.data_ptr(), idx.numel(), bits.data_ptr())
    return bits


def members(bits: torch.Tensor) -> torch.Tensor:
    """The set indices, ascending (int64)."""
    dll, bits = native.load(), bits.contiguous()
    if dll is None:
        return torch.from_numpy(np.flatnonzero(unpack(bits, 8 * bits.numel()).numpy()))
    out = torch.empty(dll.xagg_bits_count(bits.data_ptr(), bits.numel()), dtype=torch.int64)
    dll.xagg_bits_members(bits.data_ptr(), bits.numel(), out.data_ptr())
    return out


def pack(flags: torch.Tensor) -> torch.Tensor:
    """A bool an index -> its bitmap (numpy's C loop)."""
    return torch.from_numpy(np.packbits(flags.numpy(), bitorder="little"))


def unpack(bits: torch.Tensor, n: int) -> torch.Tensor:
    """A bitmap -> a bool for each of its first n indices."""
    return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little").view(np.bool_))

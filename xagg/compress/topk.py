"""Residual top-k (RedSync's RGC) and its MSTopK-selected variant.

Each rank adds its gradient to its residual, sends the k largest entries of
that sum as (value, index) pairs and keeps the rest for later steps (error
feedback). Different ranks pick different indices, so the pairs cannot be
summed in flight: they are all-gathered and scattered into a dense sum. This
is the one family that does not go through the in-kernel aggregator.
"""
from dataclasses import dataclass

import torch

from xagg.compress.base import Compressor, Part, Payload, count
from xagg.compress.mstopk import select
from xagg.compress.rng import generator


@dataclass
class ResidualTopK(Compressor):
    """rgc:ratio=0.01 - k = ratio * n entries per rank; wire 8k bytes (fp32
    value + int32 index), i.e. n / (2k) = 50x less than dense at 0.01."""
    ratio: float = 0.01
    selector: str = "topk"     # topk (exact) | mstopk | auto

    NAME = "rgc"

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")
        self._check("selector", self.selector in ("topk", "mstopk", "auto"), "must be topk, mstopk or auto")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        return 4 * n / (8 * count(self.ratio, n))

    def compress(self, name, tensor, step, **ctx):
        acc = self.accumulate(name, tensor)
        idx = select(acc, count(self.ratio, acc.numel()), self.selector, generator(self.seed, step, name))
        vals = acc[idx]
        self.keep(name, acc.index_fill_(0, idx, 0.0))    # acc is ours: what was not sent stays
        return Payload({"vals": Part("gather", vals), "idx": Part("gather", idx.to(torch.int32))},
                       {"n": acc.numel()})

    def decompress(self, name, p, step):
        out = torch.zeros(p.ctx["n"])
        # rank order is the same everywhere, so every rank adds in the same order
        out.index_add_(0, p["idx"].reshape(-1), p["vals"].reshape(-1))
        return out


@dataclass
class MSTopK(ResidualTopK):
    """mstopk:ratio=0.01 - residual top-k with the MSTopK threshold search as
    the selector (no sort); same wire format and ratio as rgc."""
    selector: str = "mstopk"

    NAME = "mstopk"

"""Residual top-k (RedSync's RGC) and its MSTopK-selected variant.

Each rank adds its gradient to its residual, sends the k largest entries of
that sum as (index, value) pairs and keeps the rest for later steps (error
feedback). Different ranks pick different indices, so the pairs cannot be
summed in flight: they are all-gathered, in one collective (indices and
the values' bits as one int32 tensor), and scattered into a dense sum. This
is the one family that does not go through the in-kernel aggregator.

The residual update and the selection are one compiled pass over the
bucket (select.py): MSTopK's sampled threshold bounds the candidates and
the exact k-th largest among them decides, so both names select the exact
top k; ``mstopk`` is kept as the name MSTopK's users know.
"""
from dataclasses import dataclass

import torch

from xagg.compress.base import Compressor, Part, Payload, Sparse, count


@dataclass
class ResidualTopK(Compressor):
    """rgc:ratio=0.01 - k = ratio * n entries per rank; wire 8k bytes (int32
    index + fp32 value), i.e. n / (2k) = 50x less than dense at 0.01."""
    ratio: float = 0.01

    NAME = "rgc"
    SPARSE = True
    STEPS = 1.5                 # what waits in the residual arrives late, summed: a step trains less far

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        return 4 * n / (8 * count(self.ratio, n))

    def compress(self, name, tensor, step, **ctx):
        k = count(self.ratio, tensor.numel())
        acc, idx, vals = self.accumulate_topk(name, tensor, k, step)
        self.keep(name, acc)                  # the sent entries are zeroed: what was not sent stays
        pairs = torch.cat([idx.to(torch.int32), vals.view(torch.int32)])
        return Payload({"pairs": Part("gather", pairs)}, {"n": acc.numel(), "k": k})

    def decompress(self, name, p, step):
        k, pairs = p.ctx["k"], p["pairs"]
        # rank order is the same everywhere, so every rank adds in the same order
        return Sparse(pairs[:, :k].reshape(-1).long(), pairs[:, k:].contiguous().view(torch.float32).reshape(-1),
                      p.ctx["n"], add=True)


@dataclass
class MSTopK(ResidualTopK):
    """mstopk:ratio=0.01 - residual top-k as rgc, named for MSTopK's sampled
    threshold search, which the selection pass uses; same wire format and ratio."""

    NAME = "mstopk"

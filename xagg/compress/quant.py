"""Homomorphic int8 / int16 quantisation with error feedback.

Round 1 sums each rank's per-chunk max |x| (float32, one per ``chunk``
elements). With S that sum and L = qmax - ceil(N/2) (qmax = 127 or 32767),
every rank uses the scale s = S / L, so N rounded values add up to at most
S/s + N/2 <= qmax in magnitude: the integer sum fits the wire width, on
every partial sum too. Round 2 sends the integers packed 4 (int8) or 2
(int16) per int32 word; the aggregator sums words and the lanes come out
as the lane sums. The rounding error stays in the residual.
"""
import math
from dataclasses import dataclass

import torch

from xagg.compress.base import Compressor, Part, Payload, nan_like
from xagg.compress.intsum import all_finite, chunk_amax, chunked, headroom_quantize, levels, pack, unpack


@dataclass
class HomomorphicQuant(Compressor):
    chunk: int = 1024        # elements sharing one scale

    NAME = "int8"
    BITS = 8
    SUMMABLE = True

    def __post_init__(self):
        super().__post_init__()
        self._check("chunk", self.chunk >= 1, "must be >= 1")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        chunks = math.ceil(n / self.chunk)
        return 4 * n / (4 * chunks + 4 * math.ceil(n * self.BITS / 32))

    def compress(self, name, tensor, step, *, world_size=1, **ctx):
        acc = self.accumulate(name, tensor)
        amax = chunk_amax(acc, self.chunk)
        return Payload({"amax": Part("sum", amax)}, {"acc": acc, "N": world_size})

    def decompress(self, name, p, step):
        if "amax" in p.parts:
            acc = p.ctx.pop("acc")
            S, n = p["amax"], acc.numel()
            if not all_finite(S):
                return nan_like(n)
            q, scale = headroom_quantize(chunked(acc, self.chunk), S[:, None], levels(self.BITS, p.ctx["N"]))
            self.keep(name, acc.sub_((q * scale).reshape(-1)[:n]))
            return Payload({"words": Part("sum", pack(q.reshape(-1)[:n], self.BITS))},
                           {"scale": scale, "n": n})
        n, scale = p.ctx["n"], p.ctx["scale"]
        total = unpack(p["words"], self.BITS, n).to(torch.float32)
        return (chunked(total, self.chunk) * scale).reshape(-1)[:n]


@dataclass
class Int8(HomomorphicQuant):
    """int8:chunk=1024 - 1 byte per element + 4 bytes per chunk: ~3.98x."""
    NAME = "int8"
    BITS = 8


@dataclass
class Int16(HomomorphicQuant):
    """int16:chunk=1024 - 2 bytes per element + 4 bytes per chunk: ~1.99x."""
    NAME = "int16"
    BITS = 16

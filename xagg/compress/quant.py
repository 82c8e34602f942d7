"""Narrow integers on the wire: int16 as the aggregators' 16-bit lanes, and
homomorphic int8 with error feedback.

``int16`` is no compressor of its own: the xagg client sums a gradient in
16-bit lanes (xagg/client/fixedpoint.py, bits=16), two values to each int32
word, with the predicted per-chunk exponents of the dense path and error
feedback fused into its codec: one round trip, half the packets each way.
``xagg-client run --compress int16`` runs the DDP hook itself with
``wire_bits=16`` (lanes, overlap with backward, one agreement per step);
within this framework (``auto``'s candidates) ``Int16.reduce`` asks the
collectives for that sum (XaggCollectives.allreduce_sum_lanes), and over
torch.distributed, which has no lanes to narrow, the sum is dense.

int8 (``HomomorphicQuant``): round 1 sums each rank's per-chunk max |x|
(float32, one per ``chunk`` elements). With S that sum and L = 127 -
ceil(N/2), every rank uses the scale s = S / L, so N rounded values add up
to at most S/s + N/2 <= 127 in magnitude: the integer sum fits the lane, on
every partial sum too. Round 2 sends the integers packed 4 per int32 word;
the aggregator sums words and the lanes come out as the lane sums. The
rounding error stays in the residual.
"""
import math
from dataclasses import dataclass

import torch

from xagg.compress.base import Compressor, Part, Payload, Written, nan_like
from xagg.compress.intsum import (accumulate_amax, all_finite, headroom_scale, levels, quantise_packed,
                                  unpack_scaled)


@dataclass
class Packed(Written):
    """int8's sum: the lanes of the summed ``words``, chunk c's times
    ``scale[c]``, read back straight into the bucket's result. Finite: a
    lane sum is at most 127 in magnitude and decompress saw 128 times every
    scale finite."""
    words: torch.Tensor
    scale: torch.Tensor
    chunk: int
    n: int

    WRITES_ALL = True

    def into(self, out, runs=None, divide=1, seen=None):
        if runs is None:
            return unpack_scaled(self.words, self.chunk, self.scale, out[:self.n], 0, divide)
        at = 0
        for o, e, big in runs:
            if big:
                unpack_scaled(self.words, self.chunk, self.scale, out[o:e], at, divide)
                at += e - o
        return out

    def finite(self) -> bool:
        return True


@dataclass
class HomomorphicQuant(Compressor):
    chunk: int = 1024        # elements sharing one scale

    NAME = "int8"
    BITS = 8
    SUMMABLE = True
    FINDS_NONFINITE = True      # its bounds' sum (NaN-aware max |x| per chunk) is non-finite on every rank

    def __post_init__(self):
        super().__post_init__()
        self._check("chunk", self.chunk >= 1, "must be >= 1")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        chunks = math.ceil(n / self.chunk)
        return 4 * n / (4 * chunks + 4 * math.ceil(n * self.BITS / 32))

    def compress(self, name, tensor, step, *, world_size=1, **ctx):
        r = self.residual(name, tensor)
        acc = self.acc_buffer(name, tensor, r)         # residual + gradient, into last step's residual
        amax = accumulate_amax(r, tensor.reshape(-1), acc.view(-1), self.chunk)
        return Payload({"amax": Part("sum", amax, control=True)}, {"acc": acc, "N": world_size})

    def decompress(self, name, p, step):
        if "amax" in p.parts:
            acc = p.ctx.pop("acc")
            S, n = p["amax"], acc.numel()
            L = levels(self.BITS, p.ctx["N"])
            scale = headroom_scale(S, L)
            if not (all_finite(S) and all_finite(scale * 128)):     # a lane sum times its scale is finite too
                return nan_like(n)
            words = quantise_packed(acc.view(-1), scale, L, self.chunk)    # what is not sent stays in acc
            self.keep(name, acc)
            return Payload({"words": Part("sum", words)}, {"scale": scale, "n": n}, final=True)
        return Packed(p["words"], p.ctx["scale"], self.chunk, p.ctx["n"])


@dataclass
class Int8(HomomorphicQuant):
    """int8:chunk=1024 - 1 byte per element + 4 bytes per chunk: ~3.98x."""
    NAME = "int8"
    BITS = 8


@dataclass
class Int16(Compressor):
    """int16 - the aggregators' 16-bit lanes (the hook's --wire-bits 16): 2
    bytes per element, per-chunk exponents predicted, error feedback, one
    round trip: 2x (dense over torch.distributed)."""
    NAME = "int16"
    WIRE_BITS = 16          # what xagg-client run's hook sums with
    SUMMABLE = True

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        return 32 / self.WIRE_BITS

    def reduce(self, name, tensor, step, coll, *, layers=None, weight=None, mean=False):
        flat = tensor.reshape(-1).to(torch.float32)
        if not coll.SUMS_LANES or step < self.warmup:     # lanes: the aggregators' (XaggCollectives)
            out = self._dense(name, flat, coll)
        else:
            out = coll.allreduce_sum_lanes(flat.clone(), name, self.WIRE_BITS)
        if mean:
            out.div_(coll.world_size)
        return out.view(tensor.shape).to(tensor.dtype)

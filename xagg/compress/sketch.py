"""Count-Sketch with LayerFusion (Sketch-fusion SGD, Dai et al. 2024).

Per step, all three rounds are sums (so all go through the aggregator):

1. per fused unit, each rank's L1 norm (float32): their sum bounds every
   sketch cell, which fixes a shared power-of-two fixed-point scale;
2. each unit's Count-Sketch of the rank's residual+gradient, in int32
   fixed point: summed, it is exactly the sketch of the summed gradients;
3. every rank reads the same heavy hitters (k = ratio * unit size largest
   estimates) off the summed sketch and sends its exact values there
   (float32 k-vector); the sum is the update, the rest stays in residuals.

Units come from fusion.layer_fusion (rule documented there).
"""
import math
from dataclasses import dataclass

import torch

from .base import Compressor, Part, Payload, count, nan_like
from .countsketch import CountSketch
from .fixed import pow2_scale, to_fixed
from .fusion import layer_fusion
from .mstopk import select
from .rng import generator

CELL_LIMIT = 2**29    # spare factor 4: rounding adds up to N/2 per element on top of S/scale


@dataclass
class SketchFusion(Compressor):
    """sketch:ratio=0.004,rows=3,cols=2 - per unit of n elements: k = ratio*n
    heavy hitters, a rows x ceil(cols*k) int32 sketch, k float32 values and
    one float32 norm: 4n / (4k (rows*cols + 1) + 4) = 35.7x by default."""
    ratio: float = 0.004
    rows: int = 3
    cols: float = 2.0

    NAME = "sketch"
    SUMMABLE = True

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")
        self._check("rows", self.rows >= 1, "must be >= 1")
        self._check("cols", self.cols > 0, "must be > 0")

    def _sketches(self, name, units):
        out = []
        for u, (off, ln) in enumerate(units):
            k = count(self.ratio, ln)
            out.append((CountSketch(ln, self.rows, max(1, math.ceil(self.cols * k)), self.seed,
                                    f"{name}/{u}/{ln}"), k))
        return out

    def ratio_for(self, n: int, world_size: int = 1, layers=None) -> float:
        units = layer_fusion(layers or [n])
        sent = sum(4 * (cs.size + k + 1) for cs, k in self._sketches("ratio", units))
        return 4 * n / sent

    def compress(self, name, tensor, step, *, layers=None, **ctx):
        acc = self.accumulate(name, tensor)
        units = layer_fusion(layers or [acc.numel()])
        l1 = torch.stack([acc[o:o + ln].abs().sum() for o, ln in units])
        return Payload({"l1": Part("sum", l1)}, {"acc": acc, "units": units})

    def decompress(self, name, p, step):
        ctx = p.ctx
        if "l1" in p.parts:                       # -> round 2: int32 sketches
            S = p["l1"]
            if not bool(torch.isfinite(S).all()):
                return nan_like(ctx["acc"].numel())
            ctx["sk"] = self._sketches(name, ctx["units"])
            ctx["scales"] = [pow2_scale(float(s), CELL_LIMIT) for s in S]
            tables = [cs.sketch(to_fixed(ctx["acc"][o:o + ln], sc))
                      for (o, ln), (cs, _), sc in zip(ctx["units"], ctx["sk"], ctx["scales"])]
            return Payload({"sketch": Part("sum", torch.cat(tables))}, ctx)
        if "sketch" in p.parts:                   # -> round 3: exact values at the heavy hitters
            acc, table, idx, at = ctx.pop("acc"), p["sketch"], [], 0
            for u, ((o, ln), (cs, k)) in enumerate(zip(ctx["units"], ctx["sk"])):
                est = cs.query(table[at:at + cs.size])
                at += cs.size
                idx.append(o + select(est, k, "auto", generator(self.seed, step, name, u)))
            idx = torch.cat(idx)
            vals = acc[idx]
            self.keep(name, acc.index_fill_(0, idx, 0.0))
            return Payload({"vals": Part("sum", vals)}, {"idx": idx, "n": acc.numel()})
        out = torch.zeros(ctx["n"])
        out[ctx["idx"]] = p["vals"]
        return out

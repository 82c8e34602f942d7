"""Count-Sketch with LayerFusion (Sketch-fusion SGD, Dai et al. 2024).

Per step, three rounds, all sums (so all can go through the aggregator):

1. each rank sketches its residual+gradient, one Count-Sketch per fused
   unit, and sends head-room bounds: max |cell| per chunk of cells and
   max |x| per unit (float32, a control sum: Collectives.allreduce_control);
2. the sketch cells, quantised with the int8 method's head-room rule and
   packed 4 per int32 word (``bits=16``: 2): the sum of the ranks' tables is
   the sketch of the summed gradients up to each rank's rounding;
3. every rank reads the same heavy hitters (the k = ratio * unit size
   largest estimates of each unit) off the summed sketch, and sends its
   values there, quantised the same way against the unit bound. Their sum
   is the update; everything not sent, rounding included, stays in the
   rank's residual (error feedback), so nothing is lost, only delayed.

Sending cells and values in 8-bit lanes rather than float32 is what buys
the ratio: a Count-Sketch narrow enough for 32x in float32 cannot tell the
heavy hitters of a dense gradient from its collisions. Units come from
fusion.layer_fusion (rule documented there).
"""
import math
from dataclasses import dataclass

import torch

from xagg.compress.base import Compressor, Part, Payload, Sparse, count, nan_like
from xagg.compress.countsketch import CountSketch
from xagg.compress.fusion import layer_fusion
from xagg.compress.intsum import (all_finite, chunk_amax, headroom_scale, levels, pack, quantise_packed, send_from,
                                  unpack, unpack_scaled)


@dataclass
class SketchFusion(Compressor):
    """sketch:ratio=0.05,rows=1,cols=3,bits=8 - per unit of n elements:
    k = ratio*n heavy hitters, a rows x ceil(cols*k) sketch; cells and values
    travel in bits-wide lanes: n*ratio*(rows*cols+1)*bits/8 bytes plus 4 per
    1024 cells, 20x by default.

    With one row every member of a cell shares its estimate, so the heavy
    hitters come as whole cells of n/(cols*k) indices each: the wider the
    row, the more of the chosen k are large. At ratio 0.05 and 1.2 cells a
    heavy hitter the bench's models took about 2x exact sums' steps to train as
    far, with 3 cells 1.5-2x (scripts/steps_to_loss.py, two seeds); the
    bytes grow, the passes over the bucket do not.

    One row by default: with the mean estimator, r rows of w cells give an
    estimate the variance of one row of r*w cells (each row's collision
    noise is ||x||^2 / w, and the mean of r divides it by r), for the same
    bytes and 1/r of the insertion's and the query's passes over the
    bucket, which are most of the method's compute. Rows pay with
    ``est=median`` (robust to one bad collision), not with the mean."""
    ratio: float = 0.05
    rows: int = 1
    cols: float = 3.0
    est: str = "mean"          # heavy-hitter estimate over rows: mean | median
    bits: int = 8
    chunk: int = 1024          # cells sharing one scale

    NAME = "sketch"
    SPARSE = True
    STEPS = 1.6                 # heavy hitters read off a sketch of 3k cells: collisions pick some wrong ones
    SUMMABLE = True
    FINDS_NONFINITE = True      # its bounds' sum (NaN-aware max |x|) is non-finite on every rank: no pass to check

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")
        self._check("rows", self.rows >= 1, "must be >= 1")
        self._check("cols", self.cols > 0, "must be > 0")
        self._check("bits", self.bits in (8, 16), "must be 8 or 16")
        self._check("est", self.est in ("mean", "median"), "must be mean or median")
        self._check("chunk", self.chunk >= 1, "must be >= 1")

    def _sketches(self, name, units):
        return [(CountSketch(ln, self.rows, max(1, math.ceil(self.cols * count(self.ratio, ln))), self.seed,
                             f"{name}/{u}/{ln}"), count(self.ratio, ln))
                for u, (_, ln) in enumerate(units)]

    def ratio_for(self, n: int, world_size: int = 1, layers=None) -> float:
        units = layer_fusion(layers or [n])
        sk = self._sketches("ratio", units)
        cells, k = sum(cs.size for cs, _ in sk), sum(k for _, k in sk)
        lane = 32 // self.bits
        sent = 4 * (math.ceil(cells / self.chunk) + len(units) + math.ceil(cells / lane) + math.ceil(k / lane))
        return 4 * n / sent

    def compress(self, name, tensor, step, *, world_size=1, layers=None, **ctx):
        x = tensor.reshape(-1).contiguous()
        r = self.residual(name, x)
        acc = self.acc_buffer(name, x, r)
        units = layer_fusion(layers or [acc.numel()])
        sk = self._sketches(name, units)
        table = self.scratch(name, "table", sum(cs.size for cs, _ in sk), zero=True)
        umax, at = [], 0
        for (o, ln), (cs, _) in zip(units, sk):       # residual + gradient, its sketch and bound: one pass
            umax.append(cs.accumulate(r[o:o + ln] if r is not None else None, x[o:o + ln], acc[o:o + ln],
                                      table[at:at + cs.size]))
            at += cs.size
        cmax = chunk_amax(table, self.chunk)
        umax = torch.tensor(umax, dtype=torch.float32)
        return Payload({"cmax": Part("sum", cmax, control=True), "umax": Part("sum", umax, control=True)},
                       {"acc": acc, "units": units, "sk": sk, "table": table, "L": levels(self.bits, world_size)})

    def decompress(self, name, p, step):
        ctx = p.ctx
        if "cmax" in p.parts:                     # -> round 2: the quantised sketches
            if not (all_finite(p["cmax"]) and all_finite(p["umax"])):
                return nan_like(ctx["acc"].numel())
            table = ctx.pop("table")            # quantised in place: what is not sent of it is not kept
            ctx["cscale"] = headroom_scale(p["cmax"], ctx["L"])
            ctx["cells"], ctx["umax"] = table.numel(), p["umax"]
            words = quantise_packed(table, ctx["cscale"], ctx["L"], self.chunk, self.bits)
            return Payload({"cells": Part("sum", words)}, ctx)
        if "cells" in p.parts:                    # -> round 3: my values at the shared heavy hitters
            table = unpack_scaled(p["cells"], self.chunk, ctx["cscale"],
                                  self.scratch(name, "summed", ctx["cells"]), bits=self.bits)
            acc, idx, at = ctx["acc"], [], 0
            for (o, ln), (cs, k) in zip(ctx["units"], ctx["sk"]):
                idx.append(o + cs.heavy_hitters(table[at:at + cs.size], k, self.est))
                at += cs.size
            idx = torch.cat(idx)
            # each unit's values against its summed bound
            scale = headroom_scale(ctx["umax"], ctx["L"]).repeat_interleave(torch.tensor([k for _, k in ctx["sk"]]))
            q = send_from(acc, idx, scale, ctx["L"])
            self.keep(name, acc)
            return Payload({"vals": Part("sum", pack(q, self.bits))},
                           {"idx": idx, "scale": scale, "n": acc.numel()}, final=True)
        return Sparse(ctx["idx"], unpack(p["vals"], self.bits, ctx["idx"].numel()).to(torch.float32) * ctx["scale"],
                      ctx["n"])

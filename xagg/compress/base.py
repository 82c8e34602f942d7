"""The compressor interface, the residual memory and the exchange loop.

A compressor speaks in rounds. ``compress`` turns a gradient into the first
``Payload``: named tensors, each with the collective that combines it across
ranks. ``exchange`` runs those collectives. ``decompress`` reads the
combined payload and returns either the summed gradient or the next round's
payload (a broadcast index list before its values, a scale before the
integers that use it). ``Compressor.reduce`` runs that loop and wraps it in
what every method shares: dense warm-up, the minimum size, fp32 residuals
and rollback when the result is not finite.
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from xagg.compress.collectives import Collectives
from xagg.compress.intsum import all_finite

OPS = ("sum", "or", "gather", "bcast")


@dataclass
class Part:
    op: str                 # sum | or | gather | bcast
    tensor: torch.Tensor
    src: int = 0            # bcast only

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Part op must be one of {OPS}, got {self.op!r}")


@dataclass
class Payload:
    parts: dict             # name -> Part; after exchange the tensors are the combined ones
    ctx: dict = field(default_factory=dict)   # local state between rounds, never sent

    def __getitem__(self, key) -> torch.Tensor:
        return self.parts[key].tensor


def exchange(p: Payload, coll: Collectives) -> Payload:
    """Run each part's collective. Sum parts of one dtype travel as a single
    allreduce, so a round costs one aggregation per dtype."""
    out = {}
    for dtype in (torch.float32, torch.int32):
        keys = [k for k, v in p.parts.items() if v.op == "sum" and v.tensor.dtype == dtype]
        if not keys:
            continue
        flat = [p.parts[k].tensor.reshape(-1) for k in keys]
        total = coll.allreduce_sum(torch.cat(flat) if len(flat) > 1 else flat[0].clone())
        for k, piece in zip(keys, total.split([f.numel() for f in flat])):
            out[k] = Part("sum", piece.view(p.parts[k].tensor.shape))
    for k, v in p.parts.items():
        if k in out:
            continue
        if v.op == "sum":
            raise TypeError(f"part {k!r}: sums carry float32 or int32, got {v.tensor.dtype}")
        if v.op == "or":
            out[k] = Part("or", coll.allreduce_or(v.tensor))
        elif v.op == "gather":
            out[k] = Part("gather", coll.allgather(v.tensor))
        else:
            out[k] = Part("bcast", coll.broadcast(v.tensor.clone(), v.src), v.src)
    return Payload(out, p.ctx)


@dataclass
class Compressor:
    """Base of every method. Options common to all (``NAME:warmup=..,...``):

    warmup    dense steps before compression starts
    min_size  layers with fewer elements go uncompressed (dense sum)
    seed      shared seed of every random choice (identical on all ranks)
    """
    warmup: int = 0
    min_size: int = 1024
    seed: int = 0
    memory: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    NAME = "base"
    SUMMABLE = False        # True: reaches the network through allreduce_sum/or (+ bcast) only
    NEEDS_WEIGHT = False    # True: reduce() wants the parameters (importance weighting)

    def __post_init__(self):
        self._check("warmup", self.warmup >= 0, "must be >= 0")
        self._check("min_size", self.min_size >= 0, "must be >= 0")

    def _check(self, opt: str, ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"{self.NAME}: option {opt}={getattr(self, opt)!r} {why}")

    # -- what a method implements ------------------------------------------
    def compress(self, name: str, tensor: torch.Tensor, step: int, *, rank: int = 0,
                 world_size: int = 1, layers: Optional[list] = None,
                 weight: Optional[torch.Tensor] = None) -> Payload:
        """First round for a flat fp32 ``tensor`` (a copy the method may keep)."""
        raise NotImplementedError

    def decompress(self, name: str, payload: Payload, step: int) -> Union[torch.Tensor, Payload]:
        """The combined payload -> the sum over ranks, or the next round."""
        raise NotImplementedError

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        """Stated compression: dense bytes / bytes this rank sends per step
        for an n-element tensor (steady state, after warm-up)."""
        return 1.0

    # -- residual memory -----------------------------------------------------
    def accumulate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Residual + gradient, as a new fp32 tensor (never aliases either)."""
        r = self.memory.get(name)
        if r is not None and r.shape != x.shape:   # the tensor behind this name changed: start over
            self.stats["residual_resets"] = self.stats.get("residual_resets", 0) + 1
            r = None
        return x.clone() if r is None else r + x

    def keep(self, name: str, kept: torch.Tensor) -> None:
        self.memory[name] = kept

    def state_dict(self) -> dict:
        return {"spec": self.spec(), "residuals": {k: v.clone() for k, v in self.memory.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("spec", self.spec()) != self.spec():
            raise ValueError(f"state is for {sd['spec']!r}, this compressor is {self.spec()!r}")
        self.memory = {k: v.to(torch.float32).clone() for k, v in sd["residuals"].items()}

    def spec(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.init)
        return f"{self.NAME}:{opts}" if opts else self.NAME

    # -- the loop ------------------------------------------------------------
    def reduce(self, name: str, tensor: torch.Tensor, step: int, coll: Collectives, *,
               layers: Optional[list] = None, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum of ``tensor`` over all ranks (same shape and dtype as ``tensor``).

        ``layers``: sizes of the layers concatenated in ``tensor`` (min_size
        and LayerFusion act per layer); ``weight``: the parameters, same
        layout, for methods with ``NEEDS_WEIGHT``.
        """
        flat = tensor.reshape(-1).to(torch.float32)   # AMP: compute and keep residuals in fp32
        n = flat.numel()
        layers = list(layers) if layers is not None else [n]
        if sum(layers) != n:
            raise ValueError(f"{name}: layers sum to {sum(layers)}, tensor has {n} elements")
        if weight is not None:
            weight = weight.reshape(-1).to(torch.float32)
        big = [sz >= self.min_size for sz in layers]
        if step < self.warmup or not any(big):
            out = self._dense(flat, coll)
        elif all(big):
            out = self._compressed(name, flat, step, coll, layers, weight)
        else:
            out = self._split(name, flat, step, coll, layers, big, weight)
        return out.view(tensor.shape).to(tensor.dtype)

    def _dense(self, flat, coll):
        return exchange(Payload({"dense": Part("sum", flat.clone())}), coll)["dense"]

    def _split(self, name, flat, step, coll, layers, big, weight):
        # small layers (biases, norms) are summed dense; the rest is compressed as one tensor
        mask = torch.cat([torch.full((sz,), b) for sz, b in zip(layers, big)])
        sizes = [sz for sz, b in zip(layers, big) if b]
        w = weight[mask] if weight is not None else None
        out = torch.empty_like(flat)
        out[mask], out[~mask] = self._compressed(name, flat[mask], step, coll, sizes, w, dense=flat[~mask])
        return out

    def _compressed(self, name, x, step, coll, layers, weight, dense=None):
        """The compressed sum of x; with ``dense`` (the small layers), the pair
        (compressed sum, dense sum)."""
        split, before = dense is not None, self.memory.get(name)
        if not all_finite(x):
            # inf everywhere is selected by every method, so the sum turns
            # non-finite on all ranks (NaN alone would slip past threshold tests)
            x = torch.full_like(x, math.inf)
        p = self.compress(name, x, step, rank=coll.rank, world_size=coll.world_size,
                          layers=layers, weight=weight)
        dense_sum = None
        while True:
            if dense is not None and _has_float_sum(p):   # rides along with a float32 sum round
                p.parts["__dense__"], dense = Part("sum", dense.clone()), None
            p = exchange(p, coll)
            if "__dense__" in p.parts:
                dense_sum = p.parts.pop("__dense__").tensor
            out = self.decompress(name, p, step)
            if isinstance(out, torch.Tensor):
                break
            p = out
        if dense is not None:           # no float32 sum round to ride along with
            dense_sum = self._dense(dense, coll)
        if not (all_finite(out) and (not split or all_finite(dense_sum))):
            # every rank sees the same sums, so every rank rolls back: an AMP
            # GradScaler will skip this step, and the residuals must not keep inf/NaN
            if before is None:
                self.memory.pop(name, None)
            else:
                self.memory[name] = before
            self.stats["nonfinite_steps"] = self.stats.get("nonfinite_steps", 0) + 1
            out = torch.full_like(out, math.nan)
        return (out, dense_sum) if split else out


def _has_float_sum(p: Payload) -> bool:
    return any(v.op == "sum" and v.tensor.dtype == torch.float32 for v in p.parts.values())


def nan_like(n: int) -> torch.Tensor:
    """The agreed result of a step where some rank had inf/NaN."""
    return torch.full((n,), math.nan)


def count(ratio: float, n: int) -> int:
    """Elements kept for a density ``ratio`` of n (at least one)."""
    return max(1, min(n, int(round(ratio * n))))

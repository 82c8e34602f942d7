"""Measuring what a method costs on this host: the inputs of auto.py's model.

``compute_cost`` runs a method against ``Loopback``, a transport that
answers at once as if every rank held this rank's tensor (so table sizes,
union sizes and decode work are those of N ranks): its time is the
method's compute, its byte and call counts what it puts on the wire.
``timed_sum`` times one sum on the real transport.
"""
from __future__ import annotations

import functools
import time

import torch

from xagg.compress.auto import Cost
from xagg.compress.base import Compressor
from xagg.compress.collectives import Collectives
from xagg.compress.rng import choice

SIZES = (1 << 12, 1 << 18)      # the two sizes compute is fitted over (fixed + per element)


class Loopback(Collectives):
    """Every rank holds this rank's tensor: a sum is N times it, a gather N
    copies. Counts bytes like TorchCollectives (a 1-bit OR)."""

    def __init__(self, world_size: int, rank: int = 0):
        super().__init__()
        self.world_size, self.rank = world_size, rank

    def _sum(self, t):
        return t * self.world_size

    def _or(self, bits):
        self._count("or", bits.numel(), bits.numel())
        return bits.clone()

    def _gather(self, t):
        return t.expand(self.world_size, *t.shape).clone()

    def _bcast(self, t, src):
        return t

    def allreduce_sum_lanes(self, t, key, bits: int):
        """A sum in ``bits``-wide lanes, as the aggregators' transport offers
        it (quant.Int16): its bytes, the sum at full width."""
        self._count("sum", t.numel() * bits // 8, t.numel() * bits // 8)
        return t * self.world_size


def sample(n: int, seed: int = 0) -> torch.Tensor:
    """A gradient-like tensor: heavy-tailed, most entries near zero (a copy:
    every candidate is timed on the same one, drawn once)."""
    return _drawn(n, seed).clone()


@functools.lru_cache(maxsize=4)
def _drawn(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4


def loopback_run(comp: Compressor, n: int, world: int, steps: int = 2) -> tuple[float, Loopback]:
    """The fastest of ``steps`` timed sums of an n-element tensor (a first,
    untimed one builds the method's tables), and the last call's transport."""
    x = sample(n)
    weight = torch.randn(n, generator=torch.Generator().manual_seed(1)) if comp.NEEDS_WEIGHT else None
    best, coll = float("inf"), None
    for step in range(steps + 1):
        # iwp: the rank that picks and broadcasts the indices (the slower one)
        coll = Loopback(world, choice(world, comp.seed, step, "calib") if comp.NEEDS_WEIGHT else 0)
        t0 = time.perf_counter()
        out = comp.reduce("calib", x, step, coll, weight=weight)
        if step:
            best = min(best, time.perf_counter() - t0)
        if out.shape != x.shape:
            raise RuntimeError(f"{comp.NAME}: a sum of {n} elements came back with shape {tuple(out.shape)}")
    return best, coll


def compute_cost(make, world: int, sizes=SIZES) -> Cost:
    """A fresh ``make()``'s compute (fitted over ``sizes``), bytes and collectives per sum."""
    (n1, n2), times = sizes, []
    coll = None
    for n in sizes:
        t, coll = loopback_run(make(), n, world)
        times.append(t)
    per_elem = max(0.0, (times[1] - times[0]) / (n2 - n1))
    fixed = max(0.0, times[0] - per_elem * n1)
    wire = max(coll.bytes_sent, coll.bytes_recv) / n2
    return Cost(fixed, per_elem, wire, sum(coll.calls.values()))


def timed_sum(comp: Compressor, n: int, coll: Collectives, rank: int, steps: int = 2) -> float:
    """The fastest of ``steps`` sums of an n-element tensor on the real
    transport ``coll`` (every rank calls it, in the same order), each as a
    training step's hook sums a bucket: where the method defers its last
    round's agreement (Compressor.DEFERS), that waits for the step's one
    (Collectives.settle), which is not timed: a step pays it once, not per sum."""
    x = sample(n, seed=1000 + rank)
    weight = torch.ones(n) if comp.NEEDS_WEIGHT else None
    best = float("inf")
    defer, coll.deferring = coll.deferring, comp.DEFERS
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            comp.reduce("probe", x, step, coll, weight=weight)
            best = min(best, time.perf_counter() - t0)
            coll.settle()
    finally:
        coll.deferring = defer
    return best

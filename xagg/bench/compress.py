"""Compression benchmark: what ``make bench`` reports for xagg.compress.

* compress + decompress throughput of every method on one rank's 25M-element
  float32 gradient (MB of gradient per second), the network replaced by a
  loopback that answers as if all N ranks held the same gradient (so table
  sizes, union sizes and decode work are those of N ranks);
* bytes each rank puts on / takes off the wire per step, and the ratio;
* MSTopK against torch.topk (k = 1%) on 1M, 10M and 100M elements.

    python -m xagg.bench.compress [--quick] [--world 4] [--methods rgc,int8]
"""
import argparse
import sys
import time

import torch

from xagg.compress import METHODS, Collectives, get_compressor, mstopk
from xagg.compress.rng import choice


class Loopback(Collectives):
    """Every rank holds this rank's tensor: a sum is N times it, a gather N
    copies. Counts bytes like TorchCollectives (a 1-bit OR)."""

    def __init__(self, world_size: int, rank: int = 0):
        super().__init__()
        self.world_size, self.rank = world_size, rank

    def _sum(self, t):
        return t * self.world_size

    def _or(self, bits):
        nbytes = (bits.numel() + 7) // 8
        self._count("or", nbytes, nbytes)
        return bits.clone()

    def _gather(self, t):
        return t.expand(self.world_size, *t.shape).clone()

    def _bcast(self, t, src):
        return t


def throughput(method: str, n: int, world: int, steps: int = 2) -> dict:
    comp = get_compressor(method)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    weight = torch.randn(n, generator=g) if comp.NEEDS_WEIGHT else None
    name, times, coll = "grad", [], None
    for step in range(steps + 1):            # step 0 builds hash tables: not timed
        # iwp: time the rank that picks and broadcasts the indices (the slower one)
        coll = Loopback(world, choice(world, comp.seed, step, name) if comp.NEEDS_WEIGHT else 0)
        t0 = time.perf_counter()
        out = comp.reduce(name, x, step, coll, weight=weight)
        times.append(time.perf_counter() - t0)
        assert out.shape == x.shape and bool(torch.isfinite(out).all())
    sec = min(times[1:])
    return {"method": method, "n": n, "seconds": sec, "mb_per_s": 4 * n / sec / 1e6,
            "sent": coll.bytes_sent, "recv": coll.bytes_recv,
            "ratio": 4 * n / coll.bytes_sent, "rounds": sum(coll.calls.values())}


def topk_race(n: int, density: float = 0.01) -> dict:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    k = int(n * density)
    t0 = time.perf_counter()
    torch.topk(x.abs(), k, sorted=False)
    t_topk = time.perf_counter() - t0
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        mstopk(x, k)
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "k": k, "topk_s": t_topk, "mstopk_s": best, "speedup": t_topk / best}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="xagg.bench.compress", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2M-element gradient, top-k race up to 10M")
    ap.add_argument("--world", type=int, default=4, help="ranks the loopback pretends to have")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated method names")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    n = 2_000_000 if args.quick else 25_000_000
    sizes = [1_000_000, 10_000_000] if args.quick else [1_000_000, 10_000_000, 100_000_000]

    rows = [throughput(m.strip(), n, args.world) for m in args.methods.split(",") if m.strip()]
    print(f"compress+decompress, one rank of {args.world}, {n / 1e6:.0f}M float32 elements")
    print(f"{'method':9s} {'MB/s':>8s} {'sent B/step':>12s} {'recv B/step':>12s} {'ratio':>7s} {'collectives':>11s}")
    for r in rows:
        print(f"{r['method']:9s} {r['mb_per_s']:8.0f} {r['sent']:12d} {r['recv']:12d} "
              f"{r['ratio']:6.1f}x {r['rounds']:11d}")
    race = []
    print("\nMSTopK vs torch.topk, k = 1%")
    print(f"{'elements':>11s} {'torch.topk s':>12s} {'mstopk s':>9s} {'speedup':>8s}")
    for s in sizes:
        r = topk_race(s)
        race.append(r)
        print(f"{s:11d} {r['topk_s']:12.3f} {r['mstopk_s']:9.3f} {r['speedup']:7.1f}x")
    return {"methods": {r["method"]: r for r in rows}, "topk": race}


def run(quick: bool) -> dict:
    """The `make bench` section."""
    return main(["--quick"] if quick else [])


if __name__ == "__main__":
    main(sys.argv[1:])

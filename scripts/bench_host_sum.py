"""A local rank's host-side work on one 16-bit bucket under local reduce
(xagg/torch/local_reduce.py), as it is and as it was: copying the bucket
into the host's shared segment and summing its slice of the L copies, in
the bucket's own dtype (csrc/host_sum.c widens each value as it reads it)
against a float32 copy of the bucket first (the staging it replaced).
Median of REPEAT runs, one rank, no network.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_host_sum.py [--elements 6500000] [--ranks 4]
        [--dtype bfloat16] [--repeat 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from xagg.client.host_sum import HostSum
from xagg.torch.buckets import as_numpy


def median_ms(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=6_500_000)
    ap.add_argument("--ranks", type=int, default=4, help="ranks on the host (L)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n, L = a.elements, a.ranks
    hs = HostSum(True)
    bucket = torch.randn(n).to(getattr(torch, a.dtype))
    x16 = as_numpy(bucket)
    seg32 = np.empty((L, n), np.float32)
    seg16 = np.empty((L, n), np.uint16).view(x16.dtype)
    mine = np.empty(-(-n // L), np.float32)
    share = slice(0, mine.size)

    def staged():
        seg32[0] = bucket.to(torch.float32).numpy()
        hs.sum([seg32[j, share] for j in range(L)], L, mine)

    def as_it_is():
        seg16[0].view(np.uint16)[:] = x16.view(np.uint16)      # copied as memory, as local_reduce.py does
        hs.sum([seg16[j, share] for j in range(L)], L, mine)

    print(f"{a.dtype} bucket of {n} elements, {L} ranks a host, one rank's copy into the segment and sum of its "
          f"slice (compiled: {hs.compiled}): float32 staging {median_ms(staged, a.repeat):.1f} ms, "
          f"as {a.dtype} {median_ms(as_it_is, a.repeat):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Top-k selection without a sort: MSTopK's threshold search.

MSTopK (Shi et al., MLSys 2021) finds a threshold t with about k elements of
|x| >= t by repeated sampling of thresholds instead of sorting. Here:

1. a random sample of |x| proposes a lower bracket ``lo`` (a quantile a bit
   below the k-th largest); one pass over x keeps the candidates |x| >= lo,
   checking that there are at least k of them (else lo = 0, all of x);
2. ``iters`` bisection steps on the candidates only (a few times k
   elements, so they are cheap) narrow [lo, hi) around the k-th largest;
3. everything >= hi is taken (fewer than k), and the rest is drawn at
   random from the band [lo, hi) with a seeded generator.

Guarantee (tested): exactly k distinct indices; every |x| >= hi is
selected; every selected |x| >= lo; the exact k-th largest value lies in
[lo, hi); and hi - lo <= (hi0 - lo0) * 2**-iters with hi0 = max|x| (1 + 2**-20)
(unless a threshold with exactly k above it was hit: then the selection is
the exact top-k). So the smallest selected magnitude is within that band of
the exact top-k threshold, and nothing larger than threshold + band is left
out. The default 24 steps make the band 6e-8 of max|x|.
"""
from typing import Optional

import torch

SAMPLE = 1 << 16         # sample size for the first bracket
SMALL = 1 << 15          # below this many elements torch.topk is as fast


def mstopk(x: torch.Tensor, k: int, *, iters: int = 24, gen: Optional[torch.Generator] = None,
           info: Optional[dict] = None) -> torch.Tensor:
    """Indices (int64, length exactly k) of approximately the k largest |x|."""
    n = x.numel()
    if not 0 < k <= n:
        raise ValueError(f"mstopk: k={k} must be in [1, {n}]")
    a = x.reshape(-1).abs()
    top = float(a.max())
    if k == n or top != top or top == float("inf"):    # all of it, or NaN/inf: no bisection possible
        return torch.topk(a, k, sorted=False).indices
    gen = gen if gen is not None else torch.Generator().manual_seed(0)

    lo = 0.0
    if n > 4 * SAMPLE and k < n // 8:
        s = a[torch.randint(n, (SAMPLE,), generator=gen)]
        # a quantile at ~2k (plus sampling noise) is below the k-th largest w.h.p.
        q = 1.0 - min(1.0, (2 * k + 4 * (k * SAMPLE / n) ** 0.5 * n / SAMPLE) / n)
        lo = float(torch.quantile(s, q)) if q > 0 else 0.0
    cand = (a >= lo).nonzero().squeeze(1) if lo > 0 else None
    if cand is not None and cand.numel() < k:          # the sample lied: take everything
        lo, cand = 0.0, None
    cv = a if cand is None else a[cand]

    lo0 = lo
    hi0 = hi = top * (1 + 2**-20) + 1e-38          # invariant: C(hi) < k <= C(lo)
    exact = False
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        c = int(torch.count_nonzero(cv >= mid))
        if c >= k:
            lo, exact = mid, c == k
            if exact:
                break
        else:
            hi = mid
    if exact:
        pick = (cv >= lo).nonzero().squeeze(1)
    else:
        sure = cv >= hi
        pick = sure.nonzero().squeeze(1)
        band = ((cv >= lo) & ~sure).nonzero().squeeze(1)
        need = k - pick.numel()
        pick = torch.cat([pick, band[torch.randperm(band.numel(), generator=gen)[:need]]])
    if info is not None:
        info.update(lo=lo, hi=hi, lo0=lo0, hi0=hi0, exact=exact, candidates=cv.numel())
    return pick if cand is None else cand[pick]


def select(x: torch.Tensor, k: int, method: str = "auto", gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Indices of (about) the k largest |x|: "topk" (exact), "mstopk", or
    "auto" (exact for small tensors, MSTopK above SMALL elements)."""
    if method == "topk" or (method == "auto" and x.numel() <= SMALL):
        return torch.topk(x.abs(), k, sorted=False).indices
    if method in ("mstopk", "auto"):
        return mstopk(x, k, gen=gen)
    raise ValueError(f"unknown selector {method!r} (topk, mstopk, auto)")

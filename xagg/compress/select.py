"""Top-k selection fused with the residual update, in one pass per bucket.

``topk_update(residual, grad, k)`` returns ``acc = residual + grad`` (a new
tensor: the caller's residual is untouched, so a step can be rolled back),
the indices of the k largest keys of acc in ascending order, and acc's
values there; with ``zero_sent`` those entries are zeroed in acc, which is
then the new residual. The key is |acc|, or with ``weight`` the importance
|acc| / (|weight| + c). Ties at the k-th key go to the lowest indices.

The compiled pass (client/csrc/select.c) writes acc and keeps the
candidates above a threshold drawn from a sample (MSTopK's sampling), then
finds the exact k-th key among them: no sort and no torch.topk over the
bucket, float32 throughout. ``reference_topk_update`` is the same result
in torch (a stable sort), used where no C compiler is available and by the
tests that hold the two equal.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from xagg.client import native

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]     # acc, idx (int64), values at idx


def _keys(acc: torch.Tensor, weight: Optional[torch.Tensor], c: float) -> torch.Tensor:
    if weight is None:
        return acc.abs()
    return acc.abs().div_(weight.abs().add_(torch.tensor(c, dtype=torch.float32)))


def reference_topk_update(residual: Optional[torch.Tensor], grad: torch.Tensor, k: int, *,
                          weight: Optional[torch.Tensor] = None, c: float = 0.0,
                          zero_sent: bool = True) -> Result:
    """What ``topk_update`` returns, computed with torch's stable sort."""
    acc = grad.clone() if residual is None else residual + grad
    if k <= 0:
        return acc, torch.empty(0, dtype=torch.int64), torch.empty(0)
    order = torch.sort(_keys(acc, weight, c), descending=True, stable=True).indices[:k]
    idx = order.sort().values
    vals = acc[idx]
    if zero_sent:
        acc[idx] = 0.0
    return acc, idx, vals


def topk_update(residual: Optional[torch.Tensor], grad: torch.Tensor, k: int, *,
                weight: Optional[torch.Tensor] = None, c: float = 0.0, zero_sent: bool = True,
                seed: int = 0, out: Optional[torch.Tensor] = None) -> Result:
    """acc, the top-k indices (int64, ascending) and acc's values there; see
    the module's docstring. ``seed`` only draws the sample that speeds the
    search: the result does not depend on it. k = 0: the update alone.
    ``out``: a float32 buffer of grad's size to write acc into (a fresh
    tensor costs a page fault per 4 KiB), aliasing neither input, except
    ``grad`` itself where there is no residual and nothing is zeroed (each
    element is read before it is written: grad is left as it was)."""
    n = grad.numel()
    if not 0 <= k <= n:
        raise ValueError(f"top-k: k={k} must be in [0, {n}]")
    dll = native.load()
    if dll is None or n >= 2**31:
        return reference_topk_update(residual, grad, k, weight=weight, c=c, zero_sent=zero_sent)
    g = _flat32(grad)
    r = _flat32(residual) if residual is not None else None
    w = _flat32(weight) if weight is not None else None
    acc = out if out is not None else torch.empty(n, dtype=torch.float32)
    if acc.numel() != n or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError("top-k: out must be a contiguous float32 tensor of the gradient's size")
    idx = torch.empty(k, dtype=torch.int32)
    vals = torch.empty(k, dtype=torch.float32)
    got = dll.xagg_select_topk(r.data_ptr() if r is not None else None, g.data_ptr(),
                               w.data_ptr() if w is not None else None, float(np.float32(c)), acc.data_ptr(),
                               n, k, seed & (2**64 - 1), int(zero_sent), idx.data_ptr(), vals.data_ptr())
    if got != k:
        raise MemoryError(f"top-k of {n} elements: out of memory for the candidates")
    return acc, idx.long(), vals


def select(x: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest |x|. The compiled pass
    writes its acc (here x itself, nothing added) back into x: no copy."""
    flat = x.reshape(-1)
    inplace = flat.dtype == torch.float32 and flat.is_contiguous()
    return topk_update(None, flat, k, zero_sent=False, seed=seed, out=flat if inplace else None)[1]


def _flat32(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    if t.dtype != torch.float32:
        raise TypeError(f"top-k takes float32, got {t.dtype}")
    return t.contiguous()

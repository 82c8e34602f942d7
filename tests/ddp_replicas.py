"""What the multi-rank DDP hook tests share, on a rank's side: rank 0
asking the test to act (files in the shared output directory), and one
step of replicas trained on the same inputs from the same parameters, so
each step checks one all-reduce against another."""
from __future__ import annotations

import os
import time
from pathlib import Path


def ask(a: dict, n: int, action: str) -> None:
    """Rank 0 has the test act (request ``n``, answered by ack-N); every rank waits for it."""
    import torch.distributed as dist
    if a["rank"] == 0:
        d = Path(a["out"])
        (d / f"req-{n}.tmp").write_text(action)
        os.replace(d / f"req-{n}.tmp", d / f"req-{n}")
        while not (d / f"ack-{n}").exists():
            time.sleep(0.05)
    dist.barrier()


def deterministic() -> None:
    """The same bits from the same backward, on a GPU too: cuDNN's default
    convolution backward sums with atomics, so two replicas' gradients (and
    so their gloo sums) differ in the last bits, and a bit-for-bit check of
    the hook's gloo fallback against DDP's own all-reduce fails."""
    import torch
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def inputs(step: int, rank: int, device=None):
    """This rank's batch of ``step`` for the digits example's models."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    return (x, y) if device is None else (x.to(device), y.to(device))


def reset(targets, source) -> None:
    """Each of ``targets`` takes ``source``'s parameters."""
    import torch
    with torch.no_grad():
        for m in targets:
            for p, q in zip(m.parameters(), source.parameters()):
                p.copy_(q)


def gradients(models, x, y) -> list:
    """Each model's flat gradient (in its dtype) on (x, y), backward run in
    the order given, the loss taken in float32."""
    import torch
    import torch.nn.functional as F
    grads = []
    for m in models:
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x).float(), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    return grads

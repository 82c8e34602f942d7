"""Whether a learning rate lets the bench judge a loss to 1%: how far the
loss at step 48 moves when every sum is rounded to 16 bits.

The bench's digits models (examples/train_digits.py) under its SGD
(momentum 0.9), 4 ranks' shards and batches, their gradients averaged in
one process (what exact sums give every rank), 48 steps; then the same run
with the average rounded to 16 bits of its largest value each step (what
int16 lanes keep). Where the model trains at the edge of stability a
rounding's difference grows, and the 11-step mean loss at step 48 differs
by more than any method's effect could show; nothing here is timed.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/loss_sensitivity.py [--models deep,wide] [--lrs 0.03,0.1]
        [--seeds 0,1] [--steps 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from xagg.bench.compress import LOSS_STEPS
from xagg.lab.training import digits_example

RANKS, BATCH = 4, 32


def losses(model: str, lr: float, seed: int, steps: int, round16: bool) -> list:
    """Rank 0's batch loss per step of ``steps`` steps on the averaged gradient."""
    digits = digits_example()
    shards = [digits.load_digits_data(r, RANKS)[0] for r in range(RANKS)]
    net = digits.make_model(model, seed)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def batches(n):             # the example's order: epoch after epoch
        epoch = 0
        while True:
            yield from digits.batches(n, BATCH, seed, epoch)
            epoch += 1
    order = [batches(len(y)) for _, y in shards]
    out = []
    for _ in range(steps):
        total, first = None, None
        for (x, y), it in zip(shards, order):
            idx = next(it)
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            first = loss.item() if first is None else first
            g = torch.cat([p.grad.reshape(-1) for p in params])
            total = g if total is None else total + g
        mean = total / RANKS
        if round16:
            step = float(mean.abs().max()) / 32767 or 1.0
            mean = torch.round(mean / step) * step
        for p, g in zip(params, mean.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        opt.step()
        out.append(first)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="deep,wide")
    ap.add_argument("--lrs", default="0.03,0.1")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=48)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{'model':5} {'lr':>6} {'seed':>4} {'exact':>8} {'16-bit':>8} {'moved':>8}   "
          f"(mean loss of steps {a.steps - LOSS_STEPS + 1}-{a.steps})")
    for model in a.models.split(","):
        for lr in map(float, a.lrs.split(",")):
            for seed in map(int, a.seeds.split(",")):
                exact, rounded = (statistics.fmean(losses(model, lr, seed, a.steps, r)[-LOSS_STEPS:])
                                  for r in (False, True))
                print(f"{model:5} {lr:6g} {seed:4d} {exact:8.4f} {rounded:8.4f} {100 * (rounded / exact - 1):+7.2f}%",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

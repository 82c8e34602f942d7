"""A real, small DDP training job: a CNN on scikit-learn's handwritten digits.

Plain torch.distributed code -- it runs under ``torchrun`` as it is, and
under ``xagg-client run`` its DDP model synchronises through the
aggregators without a change:

    xagg-client run --aggregators 10.77.0.101 --nproc-per-node 4 -- examples/train_digits.py --epochs 8
    torchrun --nproc-per-node 4 examples/train_digits.py --epochs 8          # the same over gloo

The data ships inside scikit-learn (1797 8x8 images): nothing is
downloaded. Each rank trains on its own shard; rank 0 prints loss and
accuracy per epoch and, when a hook reports it, communication time per
step. xagg is not needed to run it: with xagg installed it also reports the
whole machine's CPU per step in ``--out`` (what the lab's runs compare,
xagg.lab.training).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from xagg.lab.cpustat import machine_cpu_seconds
except ImportError:             # plain torch: no CPU figure in --out
    def machine_cpu_seconds():
        return float("nan")

# (conv1, conv2, hidden layers). "wide" and "deep" have a real model's gradient
# size (10.5 / 10.7 M parameters, 42 MB) on a task this machine trains in
# seconds: wide's sits mostly in one 9.4 M tensor, ready only when backward is
# nearly over; deep's is spread over five layers, ready layer by layer during
# backward as a ResNet's or a transformer's is (what DDP's buckets overlap)
WIDTHS = {"tiny": (8, 16, ()), "small": (32, 64, (128,)), "wide": (32, 64, (4096, 2304)),
          "deep": (32, 64, (1600,) * 5)}
WARM_STEPS = 5          # the first steps build DDP's buckets: not timed
# Adam climbs steadily here (68, 88, 92, 96% test accuracy in the first four epochs
# over 4 ranks); SGD with momentum needs about twice the steps to pass 95%
OPTIMIZERS = {"adam": lambda params, lr: torch.optim.Adam(params, lr=lr or 0.01),
              "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr or 0.1, momentum=0.9)}


def load_digits_data(rank: int = 0, world: int = 1):
    """(x_train, y_train) of this rank's shard, (x_test, y_test) whole; float32 N x 1 x 8 x 8."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    # standardised with the training set's statistics: with pixels in [0, 1] the
    # loss stayed near ln(10) for the first two epochs
    mean, std = xtr.mean(), xtr.std()
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    return (xtr[rank::world], ytr[rank::world]), (xte, yte)


class Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def make_model(size: str = "tiny", seed: int = 0) -> nn.Module:
    """conv-relu-pool x2, then linear layers; ``tiny`` ~1.9k, ``small`` ~53k,
    ``wide`` ~10.5M, ``deep`` ~10.7M parameters."""
    if size not in WIDTHS:
        raise ValueError(f"model size {size!r}: choose from {sorted(WIDTHS)}")
    c1, c2, hidden = WIDTHS[size]
    torch.manual_seed(seed)
    head, width = [], c2 * 4
    for h in hidden:
        layer = nn.Sequential(nn.Linear(width, h), nn.ReLU())
        # a layer as wide as its input adds to it: deep's five plain layers
        # barely trained with SGD (loss 2.25 after 40 steps)
        head.append(Residual(layer) if h == width else layer)
        width = h
    head.append(nn.Linear(width, 10))
    return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), *head)


def batches(n: int, batch: int, seed: int, epoch: int):
    """Index batches of one epoch, the same on every run with the same seed."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    for i in range(0, n - batch + 1, batch):
        yield perm[i:i + batch]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def hook_stats(ddp) -> dict | None:
    """The comm hook's counters when one reports them (xagg-client run); else None."""
    for _, state in getattr(ddp, "_comm_hooks", []):
        snap = getattr(state, "snapshot", None)
        if snap:
            return snap()
    return None


def init_distributed() -> None:
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:          # a lone run: a world of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"),
                              RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")


def stop_requested(path: str | None) -> bool:
    """Whether any rank sees ``path``: agreed by all-reduce, so every rank
    leaves at the same step (one that left alone would hang the others)."""
    if not path:
        return False
    flag = torch.tensor([float(os.path.exists(path))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="train_digits.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--lr", type=float, help="learning rate [default: adam 0.01, sgd 0.1]")
    ap.add_argument("--model", default="small", choices=sorted(WIDTHS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    ap.add_argument("--stop-file", metavar="PATH",
                    help="end the run once PATH exists on any rank's host, every rank at the same step "
                         "(one tiny all-reduce per step): for harnesses that stop a long run when they "
                         "have seen what they wait for")
    ap.add_argument("--out", help="rank 0 writes a JSON summary here")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    (xtr, ytr), (xte, yte) = load_digits_data(rank, world)
    ddp = DDP(make_model(args.model, args.seed))
    opt = OPTIMIZERS[args.optimizer](ddp.parameters(), args.lr)
    step, epochs, step_times, step_losses, stop = 0, [], [], [], False
    cpu_from = None                 # (step, machine CPU seconds) once warm: see summary()
    for epoch in range(args.epochs):
        t_epoch, losses, step_epoch = time.perf_counter(), [], step
        for idx in batches(len(xtr), args.batch, args.seed, epoch):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            step_losses.append(losses[-1])
            step += 1
            if step == WARM_STEPS:
                cpu_from = (step, machine_cpu_seconds(), time.process_time())
            stop = bool(args.max_steps and step >= args.max_steps) or stop_requested(args.stop_file)
            if stop:
                break
        n = max(1, step - step_epoch)
        row = {"epoch": epoch + 1, "loss": float(np.mean(losses)), "train_acc": accuracy(ddp.module, xtr, ytr),
               "test_acc": accuracy(ddp.module, xte, yte),
               "step_ms": 1e3 * (time.perf_counter() - t_epoch) / n}
        stats = hook_stats(ddp)
        if stats:
            row.update(comm_ms=1e3 * stats["seconds_comm"] / max(1, stats["steps"]), mode=stats["mode"],
                       fallbacks=stats["fallbacks"], transport=stats.get("transport", "xagg"))
        epochs.append(row)
        if rank == 0:
            comm = (f" | comm {row['comm_ms']:6.2f} ms/step ({row['transport']}, {row['mode']})"
                    if "comm_ms" in row else "")
            print(f"epoch {row['epoch']:3d} | loss {row['loss']:.4f} | train acc {100 * row['train_acc']:5.1f}% "
                  f"| test acc {100 * row['test_acc']:5.1f}% | step {row['step_ms']:6.2f} ms{comm}", flush=True)
        if stop:
            break
    if args.out:    # every rank's own CPU per warm step (all its threads: compute and transport)
        ranks_cpu = [None] * world
        dist.all_gather_object(ranks_cpu, 1e3 * (time.process_time() - cpu_from[2]) / (step - cpu_from[0])
                               if cpu_from and step > cpu_from[0] else None)
    if rank == 0 and args.out:
        warm = step_times[min(WARM_STEPS, len(step_times) - 1):]       # the first steps build buckets
        cpu_ms = (1e3 * (machine_cpu_seconds() - cpu_from[1]) / (step - cpu_from[0])
                  if cpu_from and step > cpu_from[0] else None)
        with open(args.out, "w") as f:
            json.dump({"world": world, "steps": step, "epochs": epochs, "hook": hook_stats(ddp),
                       "machine_cpu_ms_per_step": cpu_ms,
                       "ranks_cpu_ms_per_step": None if None in ranks_cpu else sum(ranks_cpu),
                       "step_ms": 1e3 * float(np.median(warm)),
                       "steps_ms": [1e3 * t for t in step_times],
                       "losses": step_losses,      # rank 0's batch loss each step (batches depend on seed and step)
                       "final_test_acc": epochs[-1]["test_acc"]}, f)
    # every rank past its last collective before any tears its connections down:
    # a gloo peer closing while another still drains a pair can abort it at exit
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many steps each compression method takes to train as far as exact
sums: the bench's 10M-parameter digits models under its SGD and learning rate, over several
seeds (model init and batch order), every collective over torch.distributed
on loopback (``xagg-client run --transport gloo --compress M``): a method's
loss per step does not depend on the transport, and nothing here is timed.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/steps_to_loss.py [--models deep,wide] [--seeds 0,1,2]
        [--methods rgc,mstopk,iwp,sketch,lossless] [--steps 48] [--most 120] [--optimizer sgd] [--lr 0.03]

Per model and seed, exact sums (DDP's own all-reduce) run ``--steps``
steps: their loss over the last LOSS_STEPS is the target. Each method then
runs up to ``--most`` steps; its row is the step whose window first reaches
the target (xagg.bench.compress.time_to_loss), and that over the exact
run's own first step there: how many of its steps train as far as one of
exact sums (what --compress auto counts a method's time by).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from xagg.bench.compress import LOSS_STEPS, LR, time_to_loss
from xagg.compress.registry import split_specs
from xagg.lab.training import client_command

ROOT = Path(__file__).resolve().parents[1]
EXACT = "exact"


def losses(model: str, seed: int, steps: int, method: str | None, optimizer: str, lr: float | None) -> list:
    """Rank 0's batch loss per step of one 4-rank run on loopback."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = client_command("gloo", "127.0.0.1:9977", nproc=4, steps=steps, model=model, out=out,
                             optimizer=optimizer, compress=method, lr=lr) + ["--seed", str(seed)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        with open(out) as f:
            return json.load(f)["losses"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="deep,wide")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="rgc,mstopk,iwp,sketch,lossless",
                    help="methods, comma-separated; a method's own parameters follow it: rgc,sketch:ratio=0.1,cols=2")
    ap.add_argument("--steps", type=int, default=48, help="steps of exact sums: their last loss is the target")
    ap.add_argument("--most", type=int, default=120, help="steps a method may take to reach it")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=LR, help="learning rate (default: the bench's; 0: the example's "
                    "default for the optimizer)")
    a = ap.parse_args()
    methods = split_specs(a.methods)
    lr = a.lr or "the example's default"
    print(f"steps to exact sums' loss after {a.steps} steps ({LOSS_STEPS}-step window), {a.optimizer} at lr {lr}, "
          "4 ranks over torch.distributed on loopback; per seed, then the median of method/exact")
    for model in a.models.split(","):
        ratios: dict = {m: [] for m in methods}
        cells: dict = {m: [] for m in [EXACT, *methods]}
        for seed in map(int, a.seeds.split(",")):
            ref = losses(model, seed, a.steps, None, a.optimizer, a.lr)
            target = statistics.fmean(ref[-LOSS_STEPS:])
            base = time_to_loss(ref, [0] * len(ref), target)[0]
            cells[EXACT].append(f"{base}")
            for m in methods:
                got = time_to_loss(losses(model, seed, a.most, m, a.optimizer, a.lr), [0] * a.most, target)
                cells[m].append(f"{got[0]}" if got else f">{a.most}")
                ratios[m].append(got[0] / base if got else float("inf"))
            print(f"  {model} seed {seed}: target {target:.4f}; " +
                  ", ".join(f"{m} {cells[m][-1]}" for m in [EXACT, *methods]), flush=True)
        for m in [EXACT, *methods]:
            r = f"{statistics.median(ratios[m]):.2f}" if m in ratios else "1.00"
            print(f"{model:5} {m:9} steps {' '.join(cells[m]):24} x exact {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compression benchmark: what ``make bench`` reports for xagg.compress.

* compress + decompress throughput of every method on one rank's 25M-element
  float32 gradient (MB of gradient per second), the network replaced by a
  loopback that answers as if all N ranks held the same gradient (so table
  sizes, union sizes and decode work are those of N ranks);
* bytes each rank puts on / takes off the wire per step, and the ratio;
* MSTopK against torch.topk (k = 1%) on 1M, 10M and 100M elements;
* with ``--steps`` (what ``make bench`` runs): the step time of the train
  section's 10M-parameter models (xagg.bench.train.MODELS "deep" and
  "wide"), 4 worker hosts of a lab with one DDP rank each, at MTU 1500
  with the client's default fan-out and worker path (``--mtu 9000``: the
  tuned corner), per method (``xagg-client run --compress``) and gloo in
  the same lab, with the final
  loss, on two shapes: workers at 1 Gbit/s with the aggregator at 4 Gbit/s,
  and every link at 100 Mbit/s (a public cloud's). Each run once, gloo
  first: a row's ratio is to the gloo and the ``--compress none`` run of the
  same model and shape (the plain hook: dense xagg as a user gets it).
  ``auto`` rows say what each bucket ended on, and are judged where a job
  spends its steps, past its choice: auto runs its trial's steps (the most
  its trial can take, ``auto_trial_steps``) more than the others, and its
  row is the median of its last ones, as many as the others ran; the median
  of all its steps, trial included, is beside it. A row's loss is rank 0's
  mean batch loss over the same steps in every row (the last LOSS_STEPS
  that every run has, auto's included: steps pick their batches by number,
  so every row's loss is over the same batches after as many updates).
  At 1 Gbit/s every row but gloo runs 2.5x gloo's steps, and is timed to
  gloo's loss (``time_to_loss``): a method that trains less a step is
  judged by the time it takes to train as far. The models train under SGD
  at LR, where the loss at a step is stable enough to judge to 1%.

    python -m xagg.bench.compress [--quick] [--world 4] [--methods rgc,int8] [--steps]
        [--mtu 1500] [--shapes 1g/agg4g,100m] [--step-methods gloo,none,auto]
"""
import argparse
import os
import statistics
import sys
import time

import torch

from xagg.client.config import DEFAULT_PATH
from xagg.compress import METHODS, get_compressor, mstopk
from xagg.compress.auto import TRIES
from xagg.compress.calibrate import Loopback
from xagg.compress.rng import choice
from xagg.compress.selector import LANE_OPTIONS
from xagg.torch.hook_trial import trial_steps

MTU = 1500              # most networks' (--mtu 9000: the tuned corner)
PATH = DEFAULT_PATH     # the workers' default data path; the fan-out is the client's default (auto) too
OPTIMIZER = "sgd"       # the train section's workload (momentum 0.9), at a learning rate where the loss is judgeable:
LR = 0.03               # with every sum rounded to 16 bits, the loss at step 48 moved 0.1-0.3% here, 4-24% at the
                        # example's 0.1, where both models train at the edge of stability (a plateau, then a spike)
                        # and any rounding's difference grows (scripts/loss_sensitivity.py); in 48 steps at 0.03
                        # deep trains further than at 0.1, wide about as far
# --compress per row ("gloo": DDP's own all_reduce); quick runs the first ones only
STEP_METHODS = ["gloo", "none", "int16", "iwp", "auto", "rgc", "mstopk", "lossless", "sketch", "int8"]
QUICK_METHODS = 5
# shape -> (worker rate, per-host rates, steps full, steps quick, models quick, extra): with ``extra``, every
# row but gloo runs that many times gloo's steps and is timed to gloo's loss; None: loss not judged. 48
# steps at LR judge trained models (loss ~0.16 deep, ~0.3 wide, from 2.3); a sparse method takes 1.3-2.5x
# exact sums' steps to train as far there (scripts/steps_to_loss.py); 10 at 100 Mbit/s time a step only
STEP_SHAPES = {"1g/agg4g": ("1gbit", {"a0": "4gbit"}, 48, 12, ("deep", "wide"), 2.5),
               "100m": ("100mbit", {}, 10, 8, ("deep",), None)}
STEP_MODELS = ("deep", "wide")
LOSS_STEPS = 11         # the loss's window: one pass over rank 0's shard of the digits (32 a batch)


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


def step_times(quick: bool, mtu: int = MTU, shapes=None, methods=None) -> list[dict]:
    """Step time and final loss per method of the 10M-parameter models on the
    lab, at ``mtu`` with the client's default fan-out and worker path, on
    ``shapes`` (names of STEP_SHAPES; all by default), for ``methods`` (of
    STEP_METHODS, gloo first; by default all, or quick's first ones)."""
    from xagg.lab import Lab, LabSpec
    from xagg.lab.experiment import Aggregators, resolve
    from xagg.lab.training import lab_train, n_params

    methods = methods or (STEP_METHODS[:QUICK_METHODS] if quick else STEP_METHODS)
    rows = []
    print(f"\n== step time per --compress, 4 worker hosts, one DDP rank each, MTU {mtu}, the client's default "
          f"fan-out and {PATH} worker path, one aggregator, {OPTIMIZER} at lr {LR} ==")
    print(f"(loss: rank 0's mean batch loss over the last {LOSS_STEPS} steps gloo ran, the same batches in every "
          "row; to loss: the time until that mean first reached gloo's, where the shape judges the loss)")
    print(f"{'model':5} {'shape':9} {'method':9} {'steps':>5} {'step ms':>8} {'x gloo':>7} {'x none':>7} "
          f"{'loss':>8} {'vs gloo':>8} {'to loss':>12} {'x gloo':>7}  chose")
    for shape, (rate, rate_of, full, short, quick_models, extra) in STEP_SHAPES.items():
        if shapes and shape not in shapes:
            continue
        steps = short if quick else full
        with Lab(LabSpec(name=f"wc{os.getpid() % 1000}", workers=4, aggregators=1, rate=rate, rate_of=rate_of,
                         mtu=mtu)) as lab, Aggregators(lab, "xdp") as aggs:
            chosen = resolve(lab, aggs.hosts, len(lab.workers), "auto", "")    # what lab_train's jobs resolve to
            fanout = f"{chosen.fanout.label}{' to ' + chosen.group if chosen.group else ''}"
            print(f"({shape}: fan-out {fanout})")
            for model in quick_models if quick else STEP_MODELS:
                base = {}
                for method in methods:
                    t0 = time.perf_counter()
                    gloo = method == "gloo"
                    trial = auto_trial_steps() if method == "auto" else 0
                    more = round(steps * (extra - 1)) if extra and not gloo else 0     # room to reach gloo's loss
                    try:
                        r = lab_train(lab, None if gloo else aggs, "gloo" if gloo else "xagg", epochs=1000,
                                      steps=steps + trial + more, model=model, optimizer=OPTIMIZER, lr=LR,
                                      echo=False, compress=None if gloo else method)
                    except RuntimeError as e:       # one method's failure is a row, not the section's end
                        rows.append({"model": model, "shape": shape, "method": method, "error": str(e)[-600:]})
                        print(f"{model:5} {shape:9} {method:9} failed: {str(e)[-300:]}", flush=True)
                        continue
                    whole_ms = r["step_ms"]
                    if trial:
                        r["step_ms"] = past_trial_ms(r["steps_ms"], steps)
                    base.setdefault(method, r)
                    chose = auto_said(r["said"])
                    if trial:
                        chose = f"{chose}; all {steps + trial + more} steps, trial included: {whole_ms:.0f} ms"
                    r["loss"] = window_loss(r["losses"], steps)
                    reached = time_to_loss(r["losses"], r["steps_ms"], base["gloo"]["loss"]) if extra else None
                    r["to_loss_s"] = reached[1] if reached else None
                    row = {"model": model, "params": n_params(model), "shape": shape, "method": method,
                           "mtu": mtu, "fanout": fanout, "path": PATH, "aggregators": 1, "workers": 4,
                           "steps": steps, "trial_steps": trial, "whole_ms": whole_ms,
                           "step_ms": r["step_ms"], "final_loss": r["loss"],
                           "loss_steps": [max(0, steps - LOSS_STEPS) + 1, steps],
                           "x_gloo": base["gloo"]["step_ms"] / r["step_ms"],
                           "x_none": base["none"]["step_ms"] / r["step_ms"] if "none" in base else None,
                           "loss_vs_gloo": r["loss"] / base["gloo"]["loss"] - 1,
                           "ran_steps": len(r["losses"]), "to_gloo_loss": list(reached) if reached else None,
                           "x_gloo_to_loss": (base["gloo"]["to_loss_s"] / reached[1]
                                              if reached and base["gloo"]["to_loss_s"] else None),
                           "chose": chose, "wall_s": time.perf_counter() - t0}
                    rows.append(row)
                    x_none = f"{row['x_none']:7.2f}" if row["x_none"] else f"{'':7}"
                    to = (f"{reached[1]:6.1f}s@{reached[0]:<4d} {row['x_gloo_to_loss']:7.2f}" if reached
                          else f"{'not in ' + str(row['ran_steps']) if extra else '-':>12} {'':7}")
                    print(f"{model:5} {shape:9} {method:9} {steps:5d} {row['step_ms']:8.1f} {row['x_gloo']:7.2f} "
                          f"{x_none} {row['final_loss']:8.5f} {100 * row['loss_vs_gloo']:+7.2f}% {to}  "
                          f"{row['chose']}", flush=True)
    return rows


def auto_trial_steps() -> int:
    """The most steps auto's trial can take with its defaults: every
    compressing candidate (not dense or int16, the plain hook's lanes), at
    most TRIES and one counted once, tried on every bucket, the per-bucket
    choice and the plain hook, and every race of the fastest two its rounds
    allow."""
    comp = get_compressor("auto")
    methods = min(TRIES + 1, len([m for m in comp.subs if m not in LANE_OPTIONS.values()]))
    return trial_steps(comp.hook_steps, methods + 2, comp.hook_rounds)


def window_loss(losses: list, end: int, span: int = LOSS_STEPS) -> float:
    """Mean of steps ``end - span + 1`` .. ``end`` (1-based) of a run's
    per-step losses: the same window in runs of different lengths."""
    if len(losses) < end:
        raise ValueError(f"a run of {len(losses)} steps has no step {end}")
    return statistics.fmean(losses[max(0, end - span):end])


def time_to_loss(losses: list, steps_ms: list, target: float, span: int = LOSS_STEPS):
    """(steps, seconds) a run took until the mean of the ``span`` losses
    ending at its step is first at or below ``target``: its steps' times
    summed, trial and warm-up included; None where it never was. Judges a
    method that trains less per step by the time it takes to train as far.
    Full windows only: an early step's loss can be below a later window's
    mean while a model sits on its first plateau."""
    for k in range(min(span, len(losses)), len(losses) + 1):
        if statistics.fmean(losses[k - span if k >= span else 0:k]) <= target:
            return k, sum(steps_ms[:k]) / 1e3
    return None


def past_trial_ms(steps_ms: list, last: int) -> float:
    """Median of the ``last`` steps of a run (its steps' ms, in order)."""
    if len(steps_ms) < last:
        raise ValueError(f"a run of {len(steps_ms)} steps has no last {last}")
    return statistics.median(steps_ms[-last:])


def auto_said(said: list) -> str:
    """What --compress auto said it chose: the hook (a trial's outcome where
    it tried both) and what each bucket ended on, in one cell."""
    lines = list(dict.fromkeys(ln.split("compress auto: ", 1)[1] for ln in said if "compress auto: " in ln))
    hook = [ln for ln in lines if "measured" in ln] or [ln for ln in lines if not ln.startswith("bucket")][:1]
    return "; ".join(hook + [ln for ln in lines if ln.startswith("bucket")])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="xagg.bench.compress", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2M-element gradient, top-k race up to 10M; with "
                    f"--steps: the first {QUICK_METHODS} methods, fewer steps, one model at 100 Mbit/s")
    ap.add_argument("--world", type=int, default=4, help="ranks the loopback pretends to have")
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m != "auto"),
                    help="comma-separated method names (the throughput table)")
    ap.add_argument("--steps", action="store_true",
                    help="also the step time of the 10M-parameter models per method on a lab (root)")
    ap.add_argument("--mtu", type=int, default=MTU, help="the lab's MTU for --steps (the fan-out and worker "
                    "path are the client's defaults either way)")
    ap.add_argument("--shapes", default=",".join(STEP_SHAPES),
                    help=f"comma-separated link shapes for --steps, of {', '.join(STEP_SHAPES)}")
    ap.add_argument("--step-methods", default="",
                    help=f"comma-separated rows for --steps, of {', '.join(STEP_METHODS)} (gloo is always run, "
                    "first: every ratio is to it); default: all")
    args = ap.parse_args(argv)
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    bad = [x for x in shapes if x not in STEP_SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {bad or 'none'} not of {', '.join(STEP_SHAPES)}")
    step_methods = [x.strip() for x in args.step_methods.split(",") if x.strip()]
    bad = [x for x in step_methods if x not in STEP_METHODS]
    if bad:
        ap.error(f"--step-methods: {bad} not of {', '.join(STEP_METHODS)}")
    step_methods = ["gloo", *[m for m in STEP_METHODS if m in step_methods and m != "gloo"]] if step_methods else None
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
    out = {"methods": {r["method"]: r for r in rows}, "topk": race}
    if args.steps:
        out["steps"] = step_times(args.quick, args.mtu, shapes, step_methods)
    return out


def run(quick: bool) -> dict:
    """The `make bench` section."""
    return main(["--quick", "--steps"] if quick else ["--steps"])


if __name__ == "__main__":
    main(sys.argv[1:])

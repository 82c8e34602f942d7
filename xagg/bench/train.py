"""`make bench` section "train": DDP step time of the digits example on the lab,
xagg (XDP aggregators via xagg-client) vs gloo, same run.

Three models: the demo CNN (53 K parameters); "wide", the same CNN with a
10.5 M-parameter head (a 42 MB gradient, a real model's size, on a task
that trains in seconds) whose gradient is mostly one tensor ready at the
end of backward (nothing left to overlap with: the worst case for any
transport); and "deep", 10.7 M parameters in five layers of 1600 (four
residual), whose gradient is ready layer by layer during backward as a
ResNet's or a transformer's is, so DDP's buckets overlap with it. Two lab shapes, 4 worker hosts with one DDP rank
each, links at MTU 9000: unshaped (CPU-bound: the hosts share this
machine's two cores), and workers at 1 Gbit/s with the one aggregator at
4 Gbit/s. xagg runs with LANES buckets in flight ("in flt": the most a
rank had at once). The transports alternate, REPEATS times each, so drift
on a shared machine hits both; a row is the median over its runs. "cpu ms" is
the whole machine's CPU per step (all ranks, aggregators and the kernel's
packet paths). "loss" is the last epoch's mean training loss on rank 0:
xagg's must match gloo's within fixed-point rounding.
"""
from __future__ import annotations

import os
import statistics

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train, n_params
from xagg.wire.fanout import Fanout

MTU = 9000
REPEATS = 2
FANOUT = Fanout.BCAST   # one rank per lab host on one bridge: a broadcast frame per chunk
OPTIMIZER = "sgd"       # the workload this section has always timed (the example's default is adam)
LANES = 2               # DDP buckets in flight at once (xagg.torch.lanes): wide's two buckets overlap
SHAPES = [("unshaped", None, {}), ("1g/agg4g", "1gbit", {"a0": "4gbit"})]
MODELS = {"small": (200, 60), "wide": (40, 20), "deep": (40, 20)}      # model -> steps (full, quick)


def run(quick: bool) -> list[dict]:
    rows = []
    print(f"\n== training step time, 4 worker hosts, one DDP rank each, {REPEATS} runs per transport, "
          f"MTU {MTU} ==")
    print(f"{'model':6} {'params':>7} {'shape':9} {'transport':9} {'step ms':>8} {'comm ms':>8} {'cpu ms':>7} "
          f"{'x gloo':>7} {'retx/st':>7} {'in flt':>6} {'loss':>8} {'test acc':>9}")
    for shape, rate, rate_of in SHAPES:
        with Lab(LabSpec(name=f"bt{os.getpid() % 1000}", workers=4, aggregators=1, rate=rate, rate_of=rate_of,
                         mtu=MTU)) as lab, Aggregators(lab, "xdp", max_slots=LANES << 14) as aggs:
            for model, (full, short) in MODELS.items():
                steps = short if quick else full
                rows += _compare(lab, aggs, shape, model, steps)
    return rows


def _compare(lab, aggs, shape, model, steps) -> list[dict]:
    runs = {"gloo": [], "xagg": []}
    for _ in range(REPEATS):
        runs["gloo"].append(lab_train(lab, None, "gloo", epochs=1000, steps=steps, model=model,
                                      optimizer=OPTIMIZER, echo=False))
        runs["xagg"].append(lab_train(lab, aggs, "xagg", epochs=1000, steps=steps, model=model,
                                      optimizer=OPTIMIZER, fanout=FANOUT, echo=False, lanes=LANES))
    med = {name: {k: statistics.median(r[k] or 0 for r in rs) for k in ("step_ms", "comm_ms", "cpu_ms")}
           | {"final_test_acc": rs[-1]["final_test_acc"], "final_loss": rs[-1]["final_loss"],
              "retransmits_per_step": rs[-1]["retransmits"] / steps,
              "max_in_flight": max(r.get("max_in_flight") or 0 for r in rs),
              "runs_step_ms": [r["step_ms"] for r in rs]}
           for name, rs in runs.items()}
    rows = []
    for name, r in med.items():
        row = {"model": model, "params": n_params(model), "shape": shape, "transport": name, "mtu": MTU,
               "vals": aggs.vals, "steps": steps, "lanes": LANES if name == "xagg" else None, **r,
               "x_gloo": med["gloo"]["step_ms"] / r["step_ms"]}
        rows.append(row)
        print(f"{model:6} {row['params'] / 1e6:6.2f}M {shape:9} {name:9} {r['step_ms']:8.1f} {r['comm_ms']:8.1f} "
              f"{r['cpu_ms']:7.1f} {row['x_gloo']:7.2f} {r['retransmits_per_step']:7.1f} {r['max_in_flight']:6d} "
              f"{r['final_loss']:8.5f} {100 * r['final_test_acc']:8.2f}%", flush=True)
    return rows

"""Step time of the bench's "deep" model (10.7 M parameters) per compression
method against dense xagg and gloo, in one lab and one run, with each
method's phases per step (from the compression hook's counters on rank 0).

    .venv/bin/python scripts/compress_train.py [--steps 20] [--methods 'rgc:ratio=0.01;iwp'] [--mtu 1500]
        [--fanout auto] [--lanes 1] [--repeats 1] [--optimizer sgd]

Workers 1 Gbit/s, the aggregator 4 Gbit/s, MTU 1500 and the client's default
fan-out and lanes unless told, one DDP rank per worker host, SGD (the
bench's train section workload) unless ``--optimizer adam``. Runs alternate
gloo, dense xagg and each method, ``--repeats`` times; a row is the median
over repeats of each run's median step after warm-up, and the last run's
final loss (the mean training loss of its last epoch, about 10 steps of the
digits shards), that loss against dense xagg's, and its test accuracy.
Phases, ms per step on rank 0: compress and decompress (selection, residual
update, packing), then the time inside each collective: sum (the whole sum:
on xagg the aggregators' round plus the agreement), xagg_sum, agree (the
ranks agreeing every rank got the sum), control (a method's small control
sums, its bounds, on torch.distributed), gather, bcast, or; "other" is the
hook's time not in any of them.
"""
from __future__ import annotations

import argparse
import os
import statistics

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train
from xagg.wire.fanout import AUTO

METHODS = ("rgc:ratio=0.01", "mstopk:ratio=0.01", "iwp:ratio=0.015", "lossless:ratio=0.01",
           "sketch:ratio=0.05,rows=1,cols=1.2")
PHASES = ("compress", "decompress", "sum", "xagg_sum", "agree", "control", "gather", "bcast", "or")


def phases(hook: dict | None, steps: int) -> dict:
    if not hook or "method" not in hook:
        return {}
    ms = {p: 1e3 * hook.get(f"seconds_{p}", 0.0) / steps for p in PHASES}
    inside = ms["compress"] + ms["decompress"] + ms["sum"] + ms["gather"] + ms["bcast"] + ms["or"]
    ms["other"] = 1e3 * hook["seconds_comm"] / steps - inside
    ms["hook"] = 1e3 * hook["seconds_comm"] / steps
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default=";".join(METHODS), help="';'-separated --compress specs")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"),
                    help="the example's optimizer (sgd: the bench's workload)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--fanout", default=AUTO, help="how results come back (auto, bcast, unicast, ...)")
    ap.add_argument("--lanes", type=int, default=1, help="dense xagg's lanes (the compressed runs use one)")
    ap.add_argument("--name", default=f"cs{os.getpid() % 100}")
    args = ap.parse_args()
    runs = [("gloo", None), ("xagg", None)] + [("xagg", m) for m in args.methods.split(";") if m]
    res = {}
    spec = LabSpec(name=args.name, workers=4, aggregators=1, rate="1gbit", rate_of={"a0": "4gbit"}, mtu=args.mtu)
    with Lab(spec) as lab, Aggregators(lab, "xdp") as aggs:
        for _ in range(args.repeats):
            for transport, method in runs:
                r = lab_train(lab, aggs if transport == "xagg" else None, transport, epochs=1000,
                              steps=args.steps, model=args.model, optimizer=args.optimizer, fanout=args.fanout,
                              echo=False, lanes=args.lanes if method is None and transport == "xagg" else 1,
                              compress=method)
                res.setdefault((transport, method), []).append(r)
                print(f"  {method or transport}: step {r['step_ms']:.1f} ms, loss {r['final_loss']:.5f}, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    gloo = statistics.median(r["step_ms"] for r in res[("gloo", None)])
    dense = statistics.median(r["step_ms"] for r in res[("xagg", None)])
    dense_loss = res[("xagg", None)][-1]["final_loss"]
    print(f"\n{args.model}, {args.optimizer}, 4 workers at 1 Gbit/s, aggregator 4 Gbit/s, MTU {args.mtu}, "
          f"fan-out {args.fanout}, "
          f"dense lanes {args.lanes}, {args.steps} steps x {args.repeats}, median step; load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'run':38} {'step ms':>8} {'x gloo':>7} {'x dense':>7} {'loss':>8} {'vs dense':>8} {'test acc':>8}  "
          + " ".join(f"{p:>8}" for p in (*PHASES, "other")))
    for (transport, method), rs in res.items():
        step = statistics.median(r["step_ms"] for r in rs)
        ph = phases(rs[-1]["hook"], args.steps)
        cols = " ".join(f"{ph[p]:8.1f}" for p in (*PHASES, "other")) if ph else ""
        print(f"{(method or transport + (' dense' if transport == 'xagg' else '')):38} {step:8.1f} "
              f"{gloo / step:7.2f} {dense / step:7.2f} {rs[-1]['final_loss']:8.5f} "
              f"{100 * (rs[-1]['final_loss'] / dense_loss - 1):+7.2f}% {100 * rs[-1]['final_test_acc']:7.2f}%  {cols}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

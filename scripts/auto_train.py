"""``--compress auto`` against dense xagg, gloo and each given method, in
one lab and one run: the bench's "deep" model (10.7 M parameters), 4
workers, one DDP rank each, MTU 9000, broadcast fan-out, SGD.

    .venv/bin/python scripts/auto_train.py [--shape 1g|100m] [--steps 30]
        [--runs 'gloo;none;int16;iwp:ratio=0.015;auto'] [--steps-of none=10]

Shapes: ``1g``: workers 1 Gbit/s, the aggregator 4 Gbit/s; ``100m``: every
link 100 Mbit/s. A row is the run's median step (after the example's warm
steps), its ratio to gloo's, to dense's, and to the best of dense and the
methods (auto's target: within 5% of it), with the final loss and, for
auto, what each bucket ended on.
"""
from __future__ import annotations

import argparse
import os

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train
from xagg.wire.fanout import Fanout

SHAPES = {"1g": dict(rate="1gbit", rate_of={"a0": "4gbit"}), "100m": dict(rate="100mbit")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="1g")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", default="gloo;none;int16;iwp:ratio=0.015;auto",
                    help="';'-separated: gloo, none (dense xagg) or a --compress spec")
    ap.add_argument("--steps-of", default="", help="RUN=STEPS,... : fewer steps for a slow run")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--name", default=f"au{os.getpid() % 1000}")
    a = ap.parse_args()
    steps_of = dict(kv.split("=") for kv in a.steps_of.split(",") if kv)
    runs = [r for r in a.runs.split(";") if r]
    spec = LabSpec(name=a.name, workers=4, aggregators=1, mtu=9000, **SHAPES[a.shape])
    res = {}
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=2 << 14) as aggs:
        for run in runs:
            transport = "gloo" if run == "gloo" else "xagg"
            r = lab_train(lab, aggs if transport == "xagg" else None, transport, epochs=1000,
                          steps=int(steps_of.get(run, a.steps)), model=a.model, optimizer="sgd",
                          fanout=Fanout.BCAST, echo=False, compress=None if run in ("gloo", "none") else run)
            res[run] = r
            # the hook auto chose for the job (said at start and at exit) and what each bucket ended on
            said = dict.fromkeys(ln for ln in r["said"] if "compress auto" in ln)
            print(f"  {run}: step {r['step_ms']:.0f} ms, loss {r['final_loss']}, load {os.getloadavg()[0]:.1f}"
                  + "".join(f"\n    {ln}" for ln in said), flush=True)
    gloo = res["gloo"]["step_ms"] if "gloo" in res else None
    dense = res["none"]["step_ms"] if "none" in res else None
    best = min(r["step_ms"] for k, r in res.items() if k not in ("gloo", "auto"))
    print(f"\n{a.model}, 4 workers, {a.shape} ({SHAPES[a.shape]}), MTU 9000, broadcast fan-out, "
          f"{a.steps} steps, median step; load {os.getloadavg()[0]:.1f}")
    for run, r in res.items():
        s = r["step_ms"]
        print(f"{run:28} {s:8.0f} ms  x gloo {gloo / s if gloo else float('nan'):5.2f}  "
              f"x dense {dense / s if dense else float('nan'):5.2f}  vs best {s / best:5.2f}  loss {r['final_loss']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

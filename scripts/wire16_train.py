"""Training step time with --compress int16 (16-bit lanes) against dense
xagg and gloo, same run: the bench's "deep" model (10.7 M parameters), 4
workers at 1 Gbit/s, the aggregator at 4 Gbit/s.

    .venv/bin/python scripts/wire16_train.py [--mtu 9000] [--steps 20] [--repeats 2]

The transports alternate (gloo, dense, int16, ...); a row is the median of
its runs' median steps, with its ratio to gloo's and the final loss.
"""
from __future__ import annotations

import argparse
import os
import statistics

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train, n_params
from xagg.wire import chunks
from xagg.wire.proto import max_vals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="deep")
    a = ap.parse_args()
    spec = LabSpec(name=f"wat{os.getpid() % 1000}", workers=4, aggregators=1, rate="1gbit",
                   rate_of={"a0": "4gbit"}, mtu=a.mtu)
    runs = {"gloo": [], "xagg dense": [], "xagg int16": []}
    slots = 2 * chunks.capacity(n_params(a.model), max_vals(a.mtu), [1.0])[0]
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=slots) as aggs:
        for _ in range(a.repeats):
            for kind in runs:
                transport = "gloo" if kind == "gloo" else "xagg"
                r = lab_train(lab, aggs, transport, model=a.model, steps=a.steps, epochs=1, optimizer="sgd",
                              echo=False, compress="int16" if kind.endswith("int16") else None)
                runs[kind].append(r)
                print(f"  {kind}: step {r['step_ms']:.0f} ms, comm {r['comm_ms']:.0f} ms, "
                      f"fallbacks {r['fallbacks']}, chunks summed twice {r['hook'].get('redone', 0)}, "
                      f"loss {r['final_loss']}", flush=True)
    gloo = statistics.median(r["step_ms"] for r in runs["gloo"])
    for kind, rs in runs.items():
        step = statistics.median(r["step_ms"] for r in rs)
        print(f"MTU {a.mtu} {a.model} 1g/agg4g {kind:11} step {step:7.0f} ms  x gloo {gloo / step:5.2f}  "
              f"loss {rs[-1]['final_loss']}", flush=True)


if __name__ == "__main__":
    main()

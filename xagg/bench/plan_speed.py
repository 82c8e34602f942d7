"""How long the planner takes for jobs of many workers and aggregators, and
what it finds beside the rack tree.

    python -m xagg.bench.plan_speed                         # 64..1,024 workers x 4, 8, 16 aggregators
    python -m xagg.bench.plan_speed --workers 128 --aggs 16 --fanout unicast

A shape: the workers in --racks racks behind 4:1 uplinks (a rack's NICs'
sum / 4), each worker its own host (1,024 ranks on hosts of 8 that reduce
first are 128 such workers), the aggregators spread evenly over the racks,
each with the NIC of the workers it serves (workers / aggregators x a
worker's NIC), so neither the aggregators nor the workers alone bind and the
plan's routes matter. Per shape: the planner's wall time (scipy's import
excluded; this machine's load printed beside it), the plan it picks, its
best xagg plan's predicted time, and under the same model the rack tree
(scaling.py's, the closed-form split), the flat plan and gloo's ring.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from xagg.wire import planner
from xagg.wire.fanout import MODELS, ResultPath
from xagg.wire.planner_inputs import CpuCosts, Node, PlanInputs
from xagg.wire.planner_model import flat_closed_form, flat_routes, predict, rack_tree_routes
from xagg.wire.proto import max_vals
from xagg.wire.rates import format_bps, parse_bps


def shape(workers: int, aggs: int, racks: int = 4, nic_bps: float = 100e9, mb: float = 25.0,
          fanouts=("mcast", "unicast")) -> PlanInputs:
    """The planner's inputs for one shape (module docstring), MTU 9000, no CPU floor."""
    if workers % racks or aggs % racks:
        raise ValueError(f"{workers} workers and {aggs} aggregators must fill {racks} racks evenly")
    per_rack = workers // racks
    agg_nic = nic_bps * workers / aggs
    paths = tuple(ResultPath.from_model(f) for f in fanouts)
    return PlanInputs([Node(f"w{i}", nic_bps, nic_bps, i // per_rack) for i in range(workers)],
                      [Node(f"a{k}", agg_nic, agg_nic, k % racks) for k in range(aggs)],
                      elements=int(mb * 250_000), vals=max_vals(9000), results=paths[0],
                      result_choices=paths if len(paths) > 1 else (),
                      uplinks={r: per_rack * nic_bps / 4 for r in range(racks)},
                      cpu=CpuCosts(0.0, 0.0, None, 0.0, 0.0)).validate()


def measure(inputs: PlanInputs) -> dict:
    """The planner's wall time and plan, and the rack tree's and flat plan's times."""
    import scipy.optimize  # noqa: F401  (imported before the clock: not planning)
    t = time.perf_counter()
    p = planner.make_plan(inputs)
    seconds = time.perf_counter() - t

    def best_of(routes):
        return min(predict(dataclasses.replace(inputs, results=r), flat_closed_form(inputs), routes)[0]
                   for r in (inputs.result_choices or (inputs.results,)))

    n_w, n_a = len(inputs.workers), len(inputs.aggregators)
    return {"workers": n_w, "aggregators": n_a, "plan_s": seconds, "load": os.getloadavg()[0],
            "kind": p.kind, "results": p.results.model, "bound": p.bottleneck,
            "tree_edges": sum(c != q for row in p.routes for q, c in enumerate(row)),
            "xagg_ms": p.xagg_predicted_s * 1e3, "rack_tree_ms": best_of(rack_tree_routes(inputs)) * 1e3,
            "flat_ms": best_of(flat_routes(n_w, n_a)) * 1e3, "gloo_ms": p.gloo_predicted_s * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xagg.bench.plan_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="64,128,256,1024", metavar="N[,N]", help="[%(default)s]")
    ap.add_argument("--aggs", default="4,8,16", metavar="N[,N]", help="aggregators in all [%(default)s]")
    ap.add_argument("--racks", type=int, default=4, metavar="N", help="[%(default)s]")
    ap.add_argument("--nic", default="100gbit", metavar="RATE", help="each worker's NIC [%(default)s]")
    ap.add_argument("--fanout", default="mcast,unicast", metavar="MODE[,MODE]",
                    help=f"result paths the planner may pick ({', '.join(MODELS)}) [%(default)s]")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    try:
        workers = [int(v) for v in args.workers.split(",")]
        aggs = [int(v) for v in args.aggs.split(",")]
        nic = parse_bps(args.nic, "--nic")
        fanouts = tuple(f.strip() for f in args.fanout.split(","))
        cases = [shape(w, a, args.racks, nic, fanouts=fanouts) for w in workers for a in aggs]
    except ValueError as e:
        ap.error(str(e))
    if not args.json:
        print(f"{args.racks} racks, 4:1 uplinks, workers' NIC {format_bps(nic)}, aggregators' NIC matched to "
              f"the workers they serve, 25 MB, MTU 9000, results {'/'.join(fanouts)}; ms predicted")
        print(f"{'workers':>7} {'aggs':>4} {'plan s':>7} {'load':>5}  {'plan':<14} {'xagg':>7} {'rack tree':>9} "
              f"{'flat':>7} {'gloo':>7}  bound")
    rows = []
    for inputs in cases:
        r = measure(inputs)
        rows.append(r)
        if not args.json:
            print(f"{r['workers']:7} {r['aggregators']:4} {r['plan_s']:7.2f} {r['load']:5.1f}  "
                  f"{r['kind'] + ', ' + r['results']:<14} {r['xagg_ms']:7.2f} {r['rack_tree_ms']:9.2f} "
                  f"{r['flat_ms']:7.2f} {r['gloo_ms']:7.2f}  {r['bound']}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

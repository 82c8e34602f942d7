"""`make bench` section "hetero": the planner on heterogeneous labs.

4 workers, 16 MB all-reduces, MTU 9000, results to a multicast group the
workers join (as the allreduce section: the lab's aggregator ports take no
multicast, so results do not load the other aggregators' links; the
planner's "mcast" fan-out model). In each lab
shape, `xagg plan`'s plan for that lab (xagg.lab.plan_inputs.lab_inputs) runs
beside the equal split and gloo, in one lab, back to back (gloo, equal,
planned, gloo; the faster gloo counts), each next to its predicted time:

* a: workers 1 Gbit/s, a0 4 Gbit/s, a1 1 Gbit/s: the plan must beat the
  equal split (which loads a1's link with half of every worker's gradient)
  by >= 1.3x;
* c: every link 1 Gbit/s, one aggregator: its link would carry N x G, so the
  plan must not lose to gloo (it picks gloo: the planned run IS gloo);
* c+: the same, with every worker host offered as an aggregator too (xaggd
  on each worker's interface, the worker's own part summed through its
  program, client/local.py): the plan roots shares there and must beat gloo;
  its "equal split" is equal over all five;
* unshaped, one aggregator: every host shares this machine's cores: the CPU
  decides;
* b: two racks (w0 w1 a0 | w2 w3 a1) joined by a 500 Mbit/s uplink,
  aggregators at 4 Gbit/s: the hierarchical plan, run through the two-level
  data plane (a rack's workers send the other rack's root's chunks through
  their own aggregator, which sends one partial up).

Per shape, bench.json's "hetero" section holds the measured planned, equal
and gloo times, the predicted ones, and the prediction error of each; with
racks, also the MB each rack's uplink carried per call, each way
(``uplink_mb_per_call``: where a tree's time goes).
"""
from __future__ import annotations

import os

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.lab.plan_inputs import lab_inputs
from xagg.wire import chunks, planner
from xagg.wire.fanout import DEFAULT_GROUP, Fanout, ResultPath

MTU = 9000
WORKERS = 4
MB = 16
GROUP = ResultPath(Fanout.BCAST, DEFAULT_GROUP)     # one copy of each result to a group (the planner's "mcast")
# name, LabSpec fields, what the plan must show there
SHAPES = [
    ("a: 1g, a0 4g / a1 1g", dict(aggregators=2, rate="1gbit", rate_of={"a0": "4gbit"}),
     "planned >= 1.3x equal split"),
    ("c: all 1g, 1 agg", dict(aggregators=1, rate="1gbit"), "planned not slower than gloo"),
    ("c+: c + worker hosts", dict(aggregators=1, rate="1gbit", worker_hosts=True), "planned faster than gloo"),
    ("unshaped, 1 agg", dict(aggregators=1), "planned not slower than gloo"),
    ("b: 2 racks, 500m uplink", dict(aggregators=2, rate="1gbit", rate_of={"a0": "4gbit", "a1": "4gbit"},
                                     racks=2, uplink="500mbit"),
     "tree >= 1.5x flat and >= 1.3x gloo"),
]


def run(quick: bool) -> dict:
    rounds = (3, 4) if quick else (4, 6)        # gloo, xagg
    out = {}
    print(f"\n== planner on heterogeneous labs, {WORKERS} workers, {MB} MB, MTU {MTU} "
          "(measured / predicted ms) ==")
    print("plan: kind/results (f: flat, t: tree, g: gloo / m: group, u: unicast)")
    print(f"{'shape':26} {'plan':5} {'planned':>15} {'equal split':>15} {'gloo':>15} {'x equal':>8} "
          f"{'x gloo':>7}  check")
    for name, fields, check in SHAPES:
        try:
            out[name] = _shape(name, fields, check, rounds)
        except Exception as e:          # one shape's failure must not hide the others'
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name:26} FAILED: {e}", flush=True)
    return out


def _shape(name, fields, check, rounds) -> dict:
    fields = dict(fields)
    worker_hosts = fields.pop("worker_hosts", False)
    spec = LabSpec(name=f"xpl{os.getpid() % 10000}", workers=WORKERS, mtu=MTU, **fields)
    with Lab(spec) as lab:
        # results to the group, or unicast where the plan is better for it (a tree:
        # the data plane's group frames would cross the uplink twice)
        inputs = lab_inputs(lab, MB, GROUP, choices=(GROUP, ResultPath(Fanout.UNICAST)), worker_hosts=worker_hosts)
        p = planner.make_plan(inputs)
        hosts = lab.aggregators + (lab.workers if worker_hosts else [])
        n_a = len(hosts)
        equal = [1.0] * n_a
        size = MB * 250_000
        # every chunk at one host, both round parities: a tree's child holds its own
        # share plus an entry for its root's range
        slots = 2 * sum(chunks.capacity(size, inputs.vals, equal)) + 64
        runs, uplink = {}, {}
        with Aggregators(lab, "xdp", max_slots=slots, hosts=hosts) as aggs:
            def xagg_run(key, **kw):
                runs[key], mb = _run_counting_uplinks(lab, aggs, size, rounds[1], **kw)
                if mb:
                    uplink[key] = mb
            runs["gloo"] = [run_gloo(lab, size, rounds=rounds[0])]
            xagg_run("equal", fanout=GROUP.fanout, weights=equal, result_group=GROUP.group)
            if p.kind == "gloo":        # the planned job IS gloo: one more gloo run, and below
                runs["gloo"].append(run_gloo(lab, size, rounds=rounds[0]))   # planned = gloo
            else:
                xagg_run("planned", weights=p.weights, routes=p.routes if p.kind == "tree" else None,
                         fanout=p.results.fanout, result_group=p.results.group)
            runs["gloo"].append(run_gloo(lab, size, rounds=rounds[0]))
    gloo_s = min(r.seconds for r in runs["gloo"])
    if p.kind == "gloo":
        runs["planned"] = min(runs["gloo"], key=lambda r: r.seconds)
    measured = {"planned": runs["planned"].seconds if "planned" in runs else None,
                "equal": runs["equal"].seconds, "gloo": gloo_s}
    predicted = {"planned": p.predicted_s, "equal": p.flat_predicted_s, "gloo": p.gloo_predicted_s}
    row = {"plan": {"kind": p.kind, "weights": p.weights, "routes": p.routes, "fanout": p.results.model,
                    "bottleneck": p.bottleneck, "reason": p.reason},
           "measured_ms": {k: v * 1e3 if v else None for k, v in measured.items()},
           "predicted_ms": {k: v * 1e3 for k, v in predicted.items()},
           "prediction_error": {k: (predicted[k] - v) / v if v else None for k, v in measured.items()},
           "runs_ms": {k: [s * 1e3 for s in (v[0] if isinstance(v, list) else v).all_seconds]
                       for k, v in runs.items()},
           "check": check}
    if uplink:
        row["uplink_mb_per_call"] = uplink
    if all(r.rate is None for r in lab.hosts):
        # the CPU-bound case calibrates the model's CPU constants: wall time x the
        # shared cores / (workers x GB), what planner_inputs.CpuCosts takes (s per GB per worker)
        gb = WORKERS * size * 4 / 1e9
        row["cpu_s_per_gb_per_worker"] = {"xagg": runs["equal"].seconds * inputs.cpu.shared_cores / gb,
                                          "gloo": gloo_s * inputs.cpu.shared_cores / gb,
                                          "model_xagg": inputs.cpu.xagg_s_per_gb,
                                          "model_gloo": inputs.cpu.gloo_s_per_gb}
    pl = measured["planned"]
    row["x_equal"] = measured["equal"] / pl if pl else None
    row["x_gloo"] = gloo_s / pl if pl else None

    def cell(k):
        m = row["measured_ms"][k]
        return f"{m:6.0f} / {row['predicted_ms'][k]:6.0f}" if m else f"{'-':>6} / {row['predicted_ms'][k]:6.0f}"
    print(f"{name:26} {p.kind[:1] + '/' + p.results.model[:1]:5} {cell('planned'):>15} {cell('equal'):>15} {cell('gloo'):>15} "
          f"{row['x_equal'] or float('nan'):8.2f} {row['x_gloo'] or float('nan'):7.2f}  {check}", flush=True)
    for k, racks in uplink.items():
        print(f"{'':26} {k}: MB over each rack's uplink per call (out, in): "
              + ", ".join(f"rack {r} {o:.1f}/{i:.1f}" for r, (o, i) in enumerate(racks)), flush=True)
    return row


def _run_counting_uplinks(lab, aggs, size, rounds, **kw):
    """run_xagg, and in a lab with racks the MB each rack's uplink carried per
    steady call, each way: a one-call job first (the first call of a job
    sends every chunk twice: no exponent history), then the measured job;
    the difference over its other calls."""
    if lab.spec.racks == 1:
        return run_xagg(lab, aggs, size, rounds=rounds, timeout=60, **kw), None
    b0 = lab.uplink_bytes()
    run_xagg(lab, aggs, size, rounds=1, timeout=60, **kw)
    b1 = lab.uplink_bytes()
    res = run_xagg(lab, aggs, size, rounds=rounds, timeout=60, **kw)
    b2 = lab.uplink_bytes()
    per = [tuple(((c - b) - (b - a)) / (rounds - 1) / 1e6 for a, b, c in zip(r0, r1, r2))
           for r0, r1, r2 in zip(b0, b1, b2)]
    return res, per

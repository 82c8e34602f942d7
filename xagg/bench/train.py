"""`make bench` section "train": DDP step time of the digits example on the lab,
xagg (XDP aggregators via xagg-client) vs gloo, same run.

Three models: the demo CNN (53 K parameters); "wide", the same CNN with a
10.5 M-parameter head (a 42 MB gradient, a real model's size, on a task
that trains in seconds) whose gradient is mostly one tensor ready at the
end of backward (nothing left to overlap with: the worst case for any
transport); and "deep", 10.7 M parameters in five layers of 1600 (four
residual), whose gradient is ready layer by layer during backward as a
ResNet's or a transformer's is, so DDP's buckets overlap with it. Two lab
shapes, 4 worker hosts with one DDP rank each: unshaped (CPU-bound: the
hosts share this machine's two cores), and workers at 1 Gbit/s with the one
aggregator at 4 Gbit/s.

Two settings: MTU 1500 with every default a user gets (``lab_train``
passes no fan-out, lanes or path of its own: what the hook does with no
flags), then MTU 9000 with broadcast fan-out and LANES buckets in flight
("in flt": the most a rank had at once). A row names its MTU, its fan-out
and the path its workers ran (UDP or AF_XDP, as the hook reports it). The
transports alternate, REPEATS times each (one in --quick), so drift on a
shared machine hits both; a row is the median over its runs.

CPU, per GB of gradient all-reduced (a step's gradient, 4 bytes a
parameter, once per step): "ranks" is the ranks' processes' own CPU (every
thread: forward, backward, optimizer, and the transport's threads and
system calls, with the packet work the kernel does inside them); "rest" is
the rest of the machine (the aggregator, the lab's switch, softirq outside
the ranks, and anything else running on the machine: read it on an idle
machine); "cpu x" is gloo's whole-machine CPU over xagg's (> 1: xagg
spends less). "loss" is the last epoch's mean training loss on rank 0:
xagg's must match gloo's within fixed-point rounding.
"""
from __future__ import annotations

import inspect
import os
import statistics

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train, n_params
from xagg.wire import chunks
from xagg.wire.fanout import Fanout
from xagg.wire.proto import max_vals

REPEATS = 2
OPTIMIZER = "sgd"       # the workload this section has always timed (the example's default is adam)
LANES = 2               # DDP buckets in flight at once (xagg.torch.lanes): wide's two buckets overlap
# (MTU, what the user set, lab_train's keywords): the defaults first, since most networks run 1500
SETTINGS = [(1500, "defaults", {}),
            (9000, f"bcast, {LANES} lanes", {"fanout": Fanout.BCAST, "lanes": LANES})]
SHAPES = [("unshaped", None, {}), ("1g/agg4g", "1gbit", {"a0": "4gbit"})]
MODELS = {"small": (200, 60), "wide": (40, 20), "deep": (40, 20)}      # model -> steps (full, quick)
QUICK_MODELS = ("small", "deep")


def run(quick: bool) -> list[dict]:
    rows = []
    repeats = 1 if quick else REPEATS
    models = {m: s for m, s in MODELS.items() if not quick or m in QUICK_MODELS}
    for mtu, setting, kw in SETTINGS:
        print(f"\n== training step time, 4 worker hosts, one DDP rank each, {repeats} run(s) per transport, "
              f"MTU {mtu}, {setting} ==")
        print(f"{'model':6} {'params':>7} {'shape':9} {'transport':9} {'fan-out':8} {'path':6} {'step ms':>8} "
              f"{'comm ms':>8} {'x gloo':>7} {'ranks s/GB':>10} {'rest s/GB':>9} {'cpu x':>6} {'retx/st':>7} "
              f"{'in flt':>6} {'loss':>8} {'test acc':>9}")
        lanes = kw.get("lanes", _default("lanes"))
        slots = 2 * lanes * max(chunks.capacity(max(n_params(m) for m in models), max_vals(mtu), [1.0]))
        for shape, rate, rate_of in SHAPES:
            with Lab(LabSpec(name=f"bt{os.getpid() % 1000}", workers=4, aggregators=1, rate=rate,
                             rate_of=rate_of, mtu=mtu)) as lab, Aggregators(lab, "xdp", max_slots=slots) as aggs:
                for model, (full, short) in models.items():
                    rows += _compare(lab, aggs, shape, model, short if quick else full, repeats, mtu, setting, kw)
    return rows


def _default(name: str):
    """What lab_train passes for ``name`` when the bench names nothing."""
    return inspect.signature(lab_train).parameters[name].default


def _compare(lab, aggs, shape, model, steps, repeats, mtu, setting, kw) -> list[dict]:
    runs = {"gloo": [], "xagg": []}
    for _ in range(repeats):
        runs["gloo"].append(lab_train(lab, None, "gloo", epochs=1000, steps=steps, model=model,
                                      optimizer=OPTIMIZER, echo=False))
        runs["xagg"].append(lab_train(lab, aggs, "xagg", epochs=1000, steps=steps, model=model,
                                      optimizer=OPTIMIZER, echo=False, **kw))
    gb = n_params(model) * 4 / 1e9          # all-reduced per step
    med = {}
    for name, rs in runs.items():
        m = {k: statistics.median(r.get(k) or 0 for r in rs) for k in ("step_ms", "comm_ms", "cpu_ms", "ranks_cpu_ms")}
        m.update(final_test_acc=rs[-1]["final_test_acc"], final_loss=rs[-1]["final_loss"],
                 retransmits_per_step=rs[-1]["retransmits"] / steps,
                 max_in_flight=max(r.get("max_in_flight") or 0 for r in rs),
                 runs_step_ms=[r["step_ms"] for r in rs],
                 cpu_s_per_gb=m["cpu_ms"] / 1e3 / gb, ranks_cpu_s_per_gb=m["ranks_cpu_ms"] / 1e3 / gb,
                 rest_cpu_s_per_gb=(m["cpu_ms"] - m["ranks_cpu_ms"]) / 1e3 / gb,
                 path=_paths(rs) if name == "xagg" else "tcp",
                 fanout=str(kw.get("fanout", _default("fanout"))) if name == "xagg" else "ring")
        med[name] = m
    rows = []
    for name, r in med.items():
        row = {"model": model, "params": n_params(model), "shape": shape, "transport": name, "mtu": mtu,
               "setting": setting, "vals": aggs.vals, "steps": steps,
               "lanes": kw.get("lanes", _default("lanes")) if name == "xagg" else None, **r,
               "x_gloo": med["gloo"]["step_ms"] / r["step_ms"],
               "cpu_x_gloo": med["gloo"]["cpu_ms"] / r["cpu_ms"] if r["cpu_ms"] else None}
        rows.append(row)
        print(f"{model:6} {row['params'] / 1e6:6.2f}M {shape:9} {name:9} {r['fanout']:8} {r['path']:6} "
              f"{r['step_ms']:8.1f} {r['comm_ms']:8.1f} {row['x_gloo']:7.2f} {r['ranks_cpu_s_per_gb']:10.1f} "
              f"{r['rest_cpu_s_per_gb']:9.1f} {row['cpu_x_gloo'] or float('nan'):6.2f} "
              f"{r['retransmits_per_step']:7.1f} {r['max_in_flight']:6d} {r['final_loss']:8.5f} "
              f"{100 * r['final_test_acc']:8.2f}%", flush=True)
    return rows


def _paths(rs) -> str:
    """The workers' path(s) as the hook reported them (one per lane): "udp", "afxdp", or both."""
    paths = {p for r in rs for p in r.get("path") or []}
    return "+".join(sorted(paths)) or "?"

"""`make bench` section "train": DDP step time of the digits example on the lab,
xagg (XDP aggregators via xagg-client) vs gloo, same run, unshaped and
with every link shaped to 1 Gbit/s.

Both transports run on the same lab, whose links carry 3500-byte frames
(about the most a veth takes with an XDP program attached, and what
datacenter NICs' XDP takes without multi-buffer); xagg packs 768 values per
packet. The two alternate, three times each, so drift on a shared machine hits
both; a row is the median over its runs. "cpu ms" is the whole machine's
CPU per step (all ranks, aggregators and the kernel's packet paths): the
lab's hosts share this machine's cores, so with 4 ranks on 2 cores the
step time follows the CPU a step costs.
"""
from __future__ import annotations

import os
import statistics

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.lab.training import lab_train

MTU, VALS = 3500, 768
REPEATS = 3
FANOUT = "bcast"        # one rank per lab host on one bridge: a broadcast frame per chunk
OPTIMIZER = "sgd"       # the workload this section has always timed (the example's default is adam)


def run(quick: bool) -> list[dict]:
    rows = []
    steps = 60 if quick else 200
    print(f"\n== training step time, demo CNN, 4 worker hosts, one DDP rank each, {steps} steps x {REPEATS} "
          f"runs per transport (MTU {MTU}, {VALS} values/packet) ==")
    print(f"{'link':9} {'transport':9} {'step ms':>8} {'comm ms':>8} {'cpu ms':>7} {'x gloo':>7} {'test acc':>9}")
    for rate in (None, "1gbit"):
        m = 4 if rate else 1
        runs = {"gloo": [], "xagg": []}
        with Lab(LabSpec(name=f"bt{os.getpid() % 1000}", workers=4, aggregators=m, rate=rate, mtu=MTU)) as lab, \
                Aggregators(lab, "xdp", vals=VALS) as aggs:
            for _ in range(REPEATS):
                runs["gloo"].append(lab_train(lab, None, "gloo", epochs=1000, steps=steps, optimizer=OPTIMIZER,
                                              echo=False))
                runs["xagg"].append(lab_train(lab, aggs, "xagg", epochs=1000, steps=steps, optimizer=OPTIMIZER,
                                              fanout=FANOUT, echo=False))
        med = {name: {k: statistics.median(r[k] or 0 for r in rs) for k in ("step_ms", "comm_ms", "cpu_ms")}
               | {"final_test_acc": rs[-1]["final_test_acc"], "runs_step_ms": [r["step_ms"] for r in rs]}
               for name, rs in runs.items()}
        for name, r in med.items():
            row = {"link": rate or "unshaped", "transport": name, "mtu": MTU, "vals": VALS, "steps": steps, **r,
                   "x_gloo": med["gloo"]["step_ms"] / r["step_ms"]}
            rows.append(row)
            print(f"{row['link']:9} {name:9} {r['step_ms']:8.1f} {r['comm_ms']:8.1f} {r['cpu_ms']:7.1f} "
                  f"{row['x_gloo']:7.2f} {100 * r['final_test_acc']:8.2f}%", flush=True)
    return rows


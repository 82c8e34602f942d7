"""What the slot lock costs end to end: two labs side by side, the aggregator's
veth with 1 RX queue (xaggd --lock auto leaves the lock out) and with 2 (the
lock taken), 16 MB xagg all-reduces alternating between them, gloo alongside.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/queues_ab.py [WORKER_RATE AGG_RATE]
"""
import contextlib
import os
import statistics
import sys

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.wire.fanout import Fanout

GROUP = "239.77.0.2"
rate, agg_rate = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else (None, None)
reps = 3
size = 16 * 250_000
res = {"q1": [], "q2": [], "gloo": []}
retx = {"q1": [], "q2": []}
with contextlib.ExitStack() as stack:
    labs = {}
    for q in (1, 2):
        spec = LabSpec(name=f"qab{q}{os.getpid() % 100}", workers=4, aggregators=1, mtu=9000, agg_queues=q,
                       rate=rate, rate_of={"a0": agg_rate} if agg_rate else {})
        lab = stack.enter_context(Lab(spec))
        labs[q] = (lab, stack.enter_context(Aggregators(lab, "xdp", max_slots=1 << 15)))
        print(q, labs[q][1].controls[0].status().get("slot_lock"), flush=True)
    for rep in range(reps):
        for q in (1, 2):
            lab, aggs = labs[q]
            x = run_xagg(lab, aggs, size, rounds=6, timeout=60, fanout=Fanout.BCAST, result_group=GROUP)
            res[f"q{q}"].append(x.seconds)
            retx[f"q{q}"].append(sum(r["stats"]["retransmits"] for r in x.reports) / 4 / 6)
        g = run_gloo(labs[1][0], size, rounds=4)
        res["gloo"].append(g.seconds)
        print(f"rep {rep}: ms", {k: round(v[-1] * 1e3, 1) for k, v in res.items()},
              "retransmits/round/worker", {k: round(v[-1], 1) for k, v in retx.items()}, flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
print("median ms", {k: round(v * 1e3, 1) for k, v in med.items()},
      "x gloo:", {k: round(med["gloo"] / med[k], 2) for k in ("q1", "q2")})

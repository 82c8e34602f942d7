"""Steady 16 MB all-reduces in the hetero bench's shape c+ (4 workers and one
spare aggregator, every link 1 Gbit/s, MTU 9000, every worker host
aggregating too, the planner's split), with `perf record -a -g` over a few
seconds of them: where a worker host's CPU goes (its test runs, its slot
reads, the rest).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/worker_hosts_profile.py
    perf report -i bench-out/worker_hosts.perf --no-children --sort sym --time 40%-100%

Inputs are generated before the calls start: the report's --time skips them.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, start_xagg
from xagg.lab.plan_inputs import lab_inputs
from xagg.wire import chunks, planner
from xagg.wire.fanout import DEFAULT_GROUP, Fanout, ResultPath


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--delay", type=float, default=9.0, help="seconds before perf starts (inputs, warm-up)")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds perf records")
    ap.add_argument("--out", default="bench-out/worker_hosts.perf")
    a = ap.parse_args()
    size = 16 * 250_000
    with Lab(LabSpec(name="whprof", workers=4, aggregators=1, rate="1gbit", mtu=9000)) as lab:
        inputs = lab_inputs(lab, 16, ResultPath(Fanout.BCAST, DEFAULT_GROUP), worker_hosts=True)
        p = planner.make_plan(inputs)
        print(f"plan: {p.kind}, weights {[round(w, 3) for w in p.weights]}, predicted {p.predicted_s * 1e3:.0f} ms")
        hosts = lab.aggregators + lab.workers
        slots = 2 * sum(chunks.capacity(size, inputs.vals, [1.0] * len(hosts))) + 64
        with Aggregators(lab, "xdp", max_slots=slots, hosts=hosts) as aggs:
            _, procs = start_xagg(lab, aggs, size, rounds=a.rounds, fanout=Fanout.BCAST, result_group=DEFAULT_GROUP,
                                  weights=p.weights, timeout=60)
            time.sleep(a.delay)
            subprocess.run(["perf", "record", "-a", "-g", "-o", a.out, "--", "sleep", str(a.seconds)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            reports = collect(procs, timeout=600)
    per_round = [max(t["seconds"] for r in reports for t in r["times"] if t["round"] == i) for i in range(a.rounds)]
    print(f"median round {statistics.median(per_round[1:]) * 1e3:.1f} ms (perf was recording for part of them)")
    for r in reports:
        s = r["stats"]
        print(f"w{r['worker']}: local packets {s['local_packets']}, their completions sent {s['local_sent']}, "
              f"slot reads {s['local_polls']}, resends {s['retransmits']}")
    print(f"perf data: {a.out}")


if __name__ == "__main__":
    main()

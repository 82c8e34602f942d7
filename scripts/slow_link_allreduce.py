"""A 16 MB all-reduce on slow links: every call's time, what was resent and
the windows the workers ended on, against gloo in the same lab.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/slow_link_allreduce.py [--rate 100mbit] [--agg-rate 400mbit]
        [--mtu 1500] [--calls 6] [--pairs 2] [--elements 4000000]

4 workers at ``--rate``, one aggregator at ``--agg-rate`` (``none``: as the
workers), the client's defaults (fan-out auto, the default worker path and
window). Each pair runs gloo, then xagg; a run's figure is its median call
after the first (gloo) or its best call (xagg: the window adapts call to
call), and the first call is shown apart: where the default window is
larger than the queues on the path, it is where a job storms.
"""
from __future__ import annotations

import argparse
import os
import sys

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, resolve, run_gloo, run_xagg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--agg-rate", default="400mbit")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--elements", type=int, default=4_000_000)
    a = ap.parse_args()
    rate_of = {} if a.agg_rate == "none" else {"a0": a.agg_rate}
    spec = LabSpec(name=f"sl{os.getpid() % 100000}", workers=4, aggregators=1, rate=a.rate, rate_of=rate_of,
                   mtu=a.mtu)
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=65536) as aggs:
        chosen = resolve(lab, aggs.hosts, 4, "auto", "")
        print(f"{4 * a.elements / 1e6:.0f} MB all-reduce, 4 workers at {a.rate}, the aggregator at "
              f"{a.agg_rate if rate_of else a.rate}, MTU {a.mtu}, fan-out auto ({chosen.fanout.label}"
              f"{' to ' + chosen.group if chosen.group else ''}), the client's default path and window", flush=True)
        for pair in range(a.pairs):
            g = run_gloo(lab, a.elements, rounds=4)
            x = run_xagg(lab, aggs, a.elements, rounds=a.calls)
            stats = [r["stats"] for r in x.reports]
            resent = sum(s["retransmits"] for s in stats) / max(1, sum(s["packets_sent"] for s in stats))
            best = min(x.all_seconds)
            print(f"pair {pair}: gloo {1e3 * g.seconds:.0f} ms; xagg best {1e3 * best:.0f} ms "
                  f"({g.seconds / best:.2f}x gloo), calls {[round(1e3 * s) for s in x.all_seconds]} ms, "
                  f"{100 * resent:.1f}% of packets resent, windows after {[s['window'] for s in stats]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

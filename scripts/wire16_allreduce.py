"""16-bit lanes against 32-bit and gloo on the lab: 16 MB all-reduce, 4
workers, one aggregator, same run (gloo, xagg 32, xagg 16, in turn).

    .venv/bin/python scripts/wire16_allreduce.py [--mb 16] [--pairs 2] [--shape 1g/agg4g|unshaped]

MTU 1500 with every default, then MTU 9000 with results to a multicast
group (as `make bench`'s allreduce section). A row: the best run's median
step (ms), its ratio to gloo's best and to 32-bit lanes', and the packets
each worker sent per round, and a worker process's CPU per steady round.
"""
from __future__ import annotations

import argparse
import os

from xagg.bench.allreduce import SETTINGS
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.wire import chunks
from xagg.wire.proto import max_vals

SHAPES = {"1g/agg4g": ("1gbit", {"a0": "4gbit"}), "100m/agg400m": ("100mbit", {"a0": "400mbit"}),
          "unshaped": (None, {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--shape", default="1g/agg4g", choices=sorted(SHAPES))
    a = ap.parse_args()
    rate, rate_of = SHAPES[a.shape]
    size = a.mb * 250_000
    for mtu, setting, kw in SETTINGS:
        spec = LabSpec(name=f"wab{os.getpid() % 1000}", workers=4, aggregators=1, rate=rate, rate_of=rate_of, mtu=mtu)
        best = {}
        with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=2 * chunks.capacity(size, max_vals(mtu), [1.0])[0]) as aggs:
            for _ in range(a.pairs):
                runs = [("gloo", lambda: run_gloo(lab, size, rounds=4))]
                runs += [(f"xagg {w}", lambda w=w: run_xagg(lab, aggs, size, rounds=6, timeout=60, wire_bits=w, **kw))
                         for w in (32, 16)]
                for kind, go in runs:
                    r = go()
                    if kind not in best or r.seconds < best[kind].seconds:
                        best[kind] = r
        gloo, x32 = best["gloo"].seconds, best["xagg 32"].seconds
        for kind, r in best.items():
            pkts = [rep.get("stats", {}).get("packets_sent", 0) for rep in r.reports]
            per_round = sum(pkts) / len(pkts) / 6 if kind != "gloo" and pkts else float("nan")
            rounds = 4 if kind == "gloo" else 6
            cpu = [sum(rep["process_cpu"]) / (rounds - rep["cpu_from_round"]) for rep in r.reports if "process_cpu" in rep]
            cpu_ms = 1e3 * sum(cpu) / len(cpu) if cpu else float("nan")
            print(f"MTU {mtu} {setting:12} {a.shape:9} {a.mb} MB {kind:8} {r.seconds * 1e3:8.1f} ms "
                  f"x gloo {gloo / r.seconds:5.2f}  x 32-bit {x32 / r.seconds:5.2f}  pkts/round/worker {per_round:8.0f}"
                  f"  worker cpu ms/round {cpu_ms:6.1f}", flush=True)


if __name__ == "__main__":
    main()

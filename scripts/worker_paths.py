"""The workers' two paths side by side: gloo, xagg over UDP and xagg over
AF_XDP, alternating in one lab, at MTU 1500 with every other setting at its
default (fan-out, values per packet, windows), in the bench's three shapes.

    sudo .venv/bin/python scripts/worker_paths.py [--mb 16] [--repeats 3] [--shapes unshaped,...]
        [--perf]

Per shape and repeat: gloo, udp, afxdp back to back (drift on a shared
machine hits all three). Prints every run's time (median of its steady
rounds, slowest worker), its CPU per GB (the workers' processes apart from
the rest of the machine) and its resends, then per path the median over
the repeats and its ratio to gloo's. --perf records `perf record -a -g`
over one more run of each path in the unshaped shape
(bench-out/perf-<path>.data).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from xagg.bench import OUT
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.wire import chunks
from xagg.wire.proto import max_vals
from xagg.bench.allreduce import SHAPES, cpu_columns

MTU = 1500
WORKERS = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8, help="calls per run (the first is warm-up)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--paths", default="udp,afxdp")
    ap.add_argument("--perf", action="store_true", help="perf record -a -g a run of each path, unshaped")
    ap.add_argument("--name", default=f"wp{os.getpid() % 1000}")
    a = ap.parse_args(argv)
    size = a.mb * 250_000
    paths = a.paths.split(",")
    OUT.mkdir(exist_ok=True)
    print(f"load: {os.getloadavg()}", flush=True)
    for shape, rate, m, rate_of in SHAPES:
        if shape not in a.shapes.split(","):
            continue
        spec = LabSpec(name=a.name, workers=WORKERS, aggregators=m, rate=rate, rate_of=rate_of, mtu=MTU)
        slots = 2 * max(chunks.capacity(size, max_vals(MTU), [1.0] * m))
        runs = {k: [] for k in ["gloo", *paths]}
        with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=slots, start_timeout=600) as aggs:
            for _ in range(a.repeats):
                for kind in runs:
                    if kind == "gloo":
                        r = run_gloo(lab, size, rounds=a.rounds // 2 + 1)
                    else:
                        r = run_xagg(lab, aggs, size, rounds=a.rounds, timeout=60, path=kind)
                    runs[kind].append(r)
                    _print(shape, kind, r, size)
            if shape == "unshaped" and a.perf:
                for kind in paths:
                    _perf(lab, aggs, size, kind)
        gloo = statistics.median(r.seconds for r in runs["gloo"])
        for kind, rs in runs.items():
            med = statistics.median(r.seconds for r in rs)
            print(f"== {shape} {kind:6} median {med * 1e3:7.1f} ms  x gloo {gloo / med:5.2f}  "
                  f"runs {[round(r.seconds * 1e3, 1) for r in rs]}  paths "
                  f"{sorted({rep['stats'].get('path', '') for r in rs for rep in r.reports if 'stats' in rep})}",
                  flush=True)
        print(f"load: {os.getloadavg()}", flush=True)
    return 0


def _print(shape, kind, r, size):
    cpu = cpu_columns(r, size)
    retx = sum(rep.get("stats", {}).get("retransmits", 0) for rep in r.reports)
    print(f"{shape:9} {kind:6} {r.seconds * 1e3:7.1f} ms  workers {cpu['workers_cpu_s_per_gb']:5.1f} "
          f"rest {cpu['rest_cpu_s_per_gb']:5.1f} machine {cpu['cpu_s_per_gb']:5.1f} s/GB  retx {retx}", flush=True)


def _perf(lab, aggs, size, kind, rounds=24):
    """perf record -a -g over one run of ``rounds`` calls (read its profile
    with --dsos [kernel.kallsyms] and the client library: the workers make
    their inputs in numpy before the first call)."""
    data = OUT / f"perf-{kind}.data"
    rec = subprocess.Popen(["perf", "record", "-a", "-g", "-o", str(data)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = run_xagg(lab, aggs, size, rounds=rounds, timeout=60, path=kind)
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    print(f"perf: {data} ({rounds} calls of {kind}, {r.seconds * 1e3:.1f} ms each)", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""`make bench`: every benchmark of the project, one table each, as ratios
against the peer measured in the same run. Writes bench-out/bench.json.

Sections: xdp (test-run cost of the program), allreduce (lab: xagg vs
gloo vs the userspace aggregator), compress (compression methods: their
throughput, and the 10M models' step time per --compress at 1 Gbit/s and
100 Mbit/s beside gloo), train
(DDP step time), loss (steps under 1% random loss vs none), hetero (the
planner on heterogeneous labs), scaling (the planner's model for 16-1,024
ranks, and in a full run the lab's shapes beside it). `--only xdp,allreduce`
picks sections, `--quick` shrinks them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from xagg.bench import OUT, allreduce, compress, hetero, loss, scaling, train, xdp

SECTIONS = {"xdp": xdp.run, "allreduce": allreduce.run, "compress": compress.run, "train": train.run,
            "loss": loss.run, "hetero": hetero.run, "scaling": scaling.run}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = ap.parse_args(argv)
    names = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    OUT.mkdir(exist_ok=True)
    # sections run now replace theirs; the others' earlier results stay (each says when)
    try:
        results = json.loads((OUT / "bench.json").read_text())
    except (OSError, ValueError):
        results = {}
    results.update(host=os.uname().nodename)
    for n in names:
        t0 = time.perf_counter()
        section = SECTIONS[n](args.quick)
        results[n] = section
        results.setdefault("when", {})
        if not isinstance(results["when"], dict):      # a file from before per-section times
            results["when"] = {}
        results["when"][n] = time.strftime("%Y-%m-%d %H:%M:%S") + (" quick" if args.quick else "")
        print(f"[{n}: {time.perf_counter() - t0:.0f}s]", flush=True)
        (OUT / "bench.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {OUT / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

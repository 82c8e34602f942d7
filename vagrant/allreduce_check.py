"""One worker VM's all-reduce through the aggregator VM, checked against numpy.

Runs the lab's traffic generator (xagg.lab.traffic: inputs derived from
(seed, worker, round, size), so every worker knows every input) against the
aggregators, then compares each result with the float64 numpy sum of all
workers' inputs within the fixed-point tolerance. Prints one JSON line;
exits 1 on a wrong sum, 2 when the all-reduce itself failed.

    python vagrant/allreduce_check.py --job-id 7 --cookie 99 --worker 0 \
        --workers 3 --aggregators 192.168.240.101 --vals 358 --size 1000003
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from xagg.client.fixedpoint import tolerance
from xagg.lab import traffic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job-id", type=int, required=True)
    ap.add_argument("--cookie", type=int, required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--aggregators", required=True, help="HOST[:PORT],... as registered")
    ap.add_argument("--vals", type=int, required=True, help="values per packet (what registration answered)")
    ap.add_argument("--size", type=int, default=1_000_003, help="float32 elements")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fanout", default="unicast")
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = traffic.main(["--job-id", str(a.job_id), "--cookie", str(a.cookie), "--worker", str(a.worker),
                               "--workers", str(a.workers), "--aggregators", a.aggregators,
                               "--vals", str(a.vals), "--sizes", str(a.size), "--rounds", str(a.rounds),
                               "--fanout", a.fanout, "--timeout", str(a.timeout), "--out", out])
        run = json.loads(buf.getvalue().strip().splitlines()[-1])
        if rc:
            print(json.dumps({"worker": a.worker, "ok": False, "error": run.get("error")}))
            return 2
        worst, ok = 0.0, True
        for r in range(a.rounds):
            want, amax = traffic.expected(0, a.workers, r, a.size)
            got = np.load(Path(out) / f"w{a.worker}_r{r}_s{a.size}.npy")
            err = float(np.max(np.abs(got - want)))
            ok &= err <= tolerance(amax, a.workers)
            worst = max(worst, err / amax)
    ms = sorted(1e3 * t["seconds"] for t in run["times"])
    print(json.dumps({"worker": a.worker, "ok": ok, "rounds": a.rounds, "size": a.size,
                      "max_rel_error": worst, "median_ms": ms[len(ms) // 2],
                      "retransmits": run["stats"].get("retransmits")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Random loss vs none, xagg all-reduce steps on the lab (issue 12: "1% random
loss: sums exact, no step more than 1.2x the lossless one").

    OMP_NUM_THREADS=1 .venv/bin/python scripts/loss_tail.py [--mb 16] [--loss 1] [--reps 3] [--rounds 10]
        [--rate 1gbit --agg-rate 4gbit]

One aggregator, 4 workers, MTU 9000, results to a multicast group (as the
bench). Lossless and lossy runs alternate in one lab (drift on a shared
machine hits both); the lossy ones drop --loss % of UDP frames at random on
every worker's switch port, both ways (Lab.set_loss(..., "both")): worker
packets to the aggregator and results back. Each run's sums are checked
against float64 sums of the inputs (the fixed-point error bound). Prints
every step's time (slowest worker; the first of each run is warm-up),
the slowest lossy step over the lossless median, the same for the lossless
steps themselves (the machine's own noise), and retransmits per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from xagg.client import fixedpoint
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_xagg
from xagg.lab.traffic import expected

GROUP = "239.77.0.2"


def check_sums(out_dir: str, size: int, rounds: int, workers: int) -> None:
    """Every worker's every step is the same array, equal to the float64 sum
    within the fixed-point bound (fixedpoint.tolerance)."""
    for r in range(rounds):
        want, top = expected(0, workers, r, size)
        got = [np.load(Path(out_dir) / f"w{w}_r{r}_s{size}.npy") for w in range(workers)]
        err = float(np.abs(got[0] - want).max())
        if not err <= fixedpoint.tolerance(top, workers):
            raise SystemExit(f"step {r}: sum off by {err} (bound {fixedpoint.tolerance(top, workers)})")
        if not all(np.array_equal(g, got[0]) for g in got):
            raise SystemExit(f"step {r}: the workers' sums differ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--loss", type=float, default=1.0, help="percent of frames dropped, both ways")
    ap.add_argument("--reps", type=int, default=3, help="lossless/lossy pairs")
    ap.add_argument("--rounds", type=int, default=10, help="steps per run (the first is warm-up)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default=None, help="shape every link (e.g. 1gbit); default unshaped")
    ap.add_argument("--agg-rate", default=None, help="the aggregator's link instead (e.g. 4gbit)")
    a = ap.parse_args()
    size = a.mb * 250_000
    steps = {"lossless": [], "lossy": []}
    retx = {"lossless": [], "lossy": []}
    spec = LabSpec(name=f"loss{os.getpid() % 1000}", workers=a.workers, aggregators=1, mtu=9000, rate=a.rate,
                   rate_of={"a0": a.agg_rate} if a.agg_rate else {})
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=1 << 15) as aggs:
        for rep in range(a.reps):
            for kind in ("lossless", "lossy"):
                lab.set_loss(a.loss if kind == "lossy" else 0, direction="both")
                with tempfile.TemporaryDirectory() as out:
                    x = run_xagg(lab, aggs, size, rounds=a.rounds, timeout=60, fanout="bcast",
                                 result_group=GROUP, out_dir=out)
                    check_sums(out, size, a.rounds, a.workers)
                steady = x.all_seconds[1:]
                steps[kind] += steady
                retx[kind].append(sum(r["stats"]["retransmits"] for r in x.reports) / a.workers / a.rounds)
                found = {k: sum(r["stats"].get(k, 0) for r in x.reports) for k in ("probe_resends", "rto_resends")}
                reorder = max(r["stats"].get("reorder", 0) for r in x.reports)
                print(f"{kind:8} run {rep}: median {statistics.median(steady) * 1e3:6.1f} ms, slowest "
                      f"{max(steady) * 1e3:6.1f} ms, retransmits/step/worker {retx[kind][-1]:5.1f} (all workers, "
                      f"all steps: {found['probe_resends']} by tail probes, {found['rto_resends']} at rto; "
                      f"reorder estimate {reorder}); steps "
                      f"{[round(s * 1e3) for s in steady]}", flush=True)
        lab.set_loss(0, direction="both")
    base = statistics.median(steps["lossless"])
    shape = f"links {a.rate}" + (f", aggregator {a.agg_rate}" if a.agg_rate else "") if a.rate else "unshaped"
    print(f"\n{a.mb} MB, {a.workers} workers, {shape}, {a.loss}% loss both ways; sums exact in every step")
    print(f"lossless: median {base * 1e3:.1f} ms, slowest step {max(steps['lossless']) / base:.2f}x the median")
    print(f"lossy:    median {statistics.median(steps['lossy']) / base:.2f}x, slowest step "
          f"{max(steps['lossy']) / base:.2f}x the lossless median; retransmits/step/worker "
          f"{statistics.median(retx['lossy']):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

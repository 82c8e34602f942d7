"""Random loss vs none, xagg all-reduce steps on the lab: the bench's "loss"
section (xagg.bench.loss) with its knobs open.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/loss_tail.py [--mb 16] [--loss 1] [--reps 3] [--rounds 10]
        [--rate 1gbit --agg-rate 4gbit | --rate none]
"""
from __future__ import annotations

import argparse

from xagg.bench import loss
from xagg.lab.traffic import WrongSum


def main() -> int:
    ap = argparse.ArgumentParser(description=loss.__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--loss", type=float, default=loss.LOSS, help="percent of frames dropped, both ways")
    ap.add_argument("--reps", type=int, default=3, help="lossless/lossy pairs")
    ap.add_argument("--rounds", type=int, default=10, help="steps per run (the first is warm-up)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit", help="shape every link (e.g. 1gbit); 'none': unshaped")
    ap.add_argument("--agg-rate", default="4gbit", help="the aggregator's link instead (e.g. 4gbit); 'none': "
                    "as the others")
    a = ap.parse_args()
    rate = None if a.rate == "none" else a.rate
    agg_rate = None if a.agg_rate == "none" or not rate else a.agg_rate
    try:
        r = loss.measure(a.mb, a.loss, a.reps, a.rounds, a.workers, rate, agg_rate)
    except WrongSum as e:
        raise SystemExit(f"wrong sums: {e}")
    loss.report(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

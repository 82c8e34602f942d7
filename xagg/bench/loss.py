"""`make bench` section "loss": random loss vs none, xagg all-reduce steps on
the lab. What must hold under 1% random loss: the sums exact, no step more
than 1.2x the lossless one.

One aggregator, 4 workers, MTU 9000, results to a multicast group (as the
allreduce section), workers at 1 Gbit/s and the aggregator at 4 Gbit/s (the
network-bound shape, where a stall shows). Lossless and lossy runs
alternate in one lab (drift on a shared machine hits both); the lossy ones
drop LOSS % of UDP frames at random on every worker's switch port, both
ways (Lab.set_loss(..., "both")): worker packets to the aggregator and
results back. Every step's sums are checked against float64 sums of the
inputs (the fixed-point bound) and must be equal on every worker. A row:
median and slowest step, each over the lossless median (the lossless row's
slowest is the machine's own noise), and resends per step per worker.
"""
from __future__ import annotations

import os
import statistics
import tempfile

from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_xagg
from xagg.lab.traffic import check_sums
from xagg.wire.fanout import Fanout

GROUP = "239.77.0.2"
LOSS = 1.0                  # percent of frames dropped, both ways
FULL = {"mb": 16, "reps": 3, "rounds": 10}
QUICK = {"mb": 4, "reps": 1, "rounds": 5}
# the workers save every step's sums for the check: on a disk-backed /tmp
# those writes between steps would stretch the steps this section times
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None


def measure(mb: int = 16, loss: float = LOSS, reps: int = 3, rounds: int = 10, workers: int = 4,
            rate: str | None = "1gbit", agg_rate: str | None = "4gbit", echo: bool = True) -> dict:
    """``reps`` lossless/lossy pairs of ``rounds`` steps (the first of each run
    is warm-up); raises WrongSum if any step's sums are wrong."""
    size = mb * 250_000
    steps = {"lossless": [], "lossy": []}
    resends = {"lossless": [], "lossy": []}
    spec = LabSpec(name=f"loss{os.getpid() % 1000}", workers=workers, aggregators=1, mtu=9000, rate=rate,
                   rate_of={"a0": agg_rate} if agg_rate else {})
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=1 << 15) as aggs:
        try:
            for rep in range(reps):
                for kind in ("lossless", "lossy"):
                    lab.set_loss(loss if kind == "lossy" else 0, direction="both")
                    with tempfile.TemporaryDirectory(dir=SCRATCH) as out:
                        x = run_xagg(lab, aggs, size, rounds=rounds, timeout=60, fanout=Fanout.BCAST,
                                     result_group=GROUP, out_dir=out)
                        check_sums(out, workers, rounds, [size])
                    steady = x.all_seconds[1:]
                    steps[kind] += steady
                    resends[kind].append(sum(r["stats"]["retransmits"] for r in x.reports) / workers / rounds)
                    if echo:
                        _echo_run(kind, rep, steady, resends[kind][-1], x.reports)
        finally:
            lab.set_loss(0, direction="both")
    base = statistics.median(steps["lossless"])
    shape = f"links {rate}" + (f", aggregator {agg_rate}" if agg_rate else "") if rate else "unshaped"
    return {"mb": mb, "loss_pct": loss, "workers": workers, "shape": shape, "lossless_median_ms": 1e3 * base,
            **{f"{k}_{stat}_x": f(steps[k]) / base for k in steps
               for stat, f in (("median", statistics.median), ("slowest", max))},
            **{f"{k}_resends_per_step": statistics.median(resends[k]) for k in resends},
            "steps_ms": {k: [round(1e3 * s, 1) for s in v] for k, v in steps.items()}}


def _echo_run(kind, rep, steady, resends, reports) -> None:
    found = {k: sum(r["stats"].get(k, 0) for r in reports) for k in ("probe_resends", "rto_resends")}
    reorder = max(r["stats"].get("reorder", 0) for r in reports)
    print(f"  {kind:8} run {rep}: median {statistics.median(steady) * 1e3:6.1f} ms, slowest "
          f"{max(steady) * 1e3:6.1f} ms, resends/step/worker {resends:5.1f} ({found['probe_resends']} by tail "
          f"probes, {found['rto_resends']} at rto; reorder estimate {reorder}); steps "
          f"{[round(s * 1e3) for s in steady]}", flush=True)


def report(r: dict) -> None:
    print(f"{r['mb']} MB, {r['workers']} workers, {r['shape']}, {r['loss_pct']}% loss both ways: "
          f"sums exact in every step")
    print(f"{'':9} {'median':>8} {'slowest':>8} {'resends/step':>13}   (x the lossless median, "
          f"{r['lossless_median_ms']:.1f} ms)")
    for k in ("lossless", "lossy"):
        print(f"{k:9} {r[k + '_median_x']:7.2f}x {r[k + '_slowest_x']:7.2f}x {r[k + '_resends_per_step']:13.1f}")


def run(quick: bool) -> dict:
    cfg = QUICK if quick else FULL
    print(f"\n== {LOSS}% random loss vs none, xagg {cfg['mb']} MB all-reduce steps, "
          f"{cfg['reps']} alternating pairs of runs ==")
    r = measure(**cfg)
    report(r)
    return r

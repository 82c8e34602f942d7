"""`xagg plan --lab NAME --probe`: measure a lab's links through xaggd.

Starts xaggd on the lab's aggregators (XDP), then, one aggregator at a
time, registers a one-aggregator probe job and runs short all-reduces
(xagg.lab.traffic) from its workers: each worker alone (solo: a one-chunk
call for the round trip, then ``mb`` MB calls for the rate), then the
aggregator's rack's workers together. xagg.wire.probe turns the samples into
rates: (workers + 1) x aggregators short runs.
"""
from __future__ import annotations

import random
import sys
import time

from xagg.lab.experiment import Aggregators, collect
from xagg.wire import probe
from xagg.wire.fanout import Fanout
from xagg.wire.proto import C

ROUNDS = 4          # calls per size: the first (two rounds, cold path) is dropped


def _run(lab, aggs: Aggregators, k: int, workers: list, sizes: list[int]) -> dict:
    """One probe job on aggregator k from ``workers`` (Host objects): the
    steady seconds per size, the slowest worker's."""
    agg = lab.aggregators[k]
    job_id, cookie = random.randrange(1, 2**31), random.randrange(2**32)
    aggs.controls[k].register(job_id, cookie=cookie, max_elements=max(sizes), workers=[w.ip for w in workers],
                              aggregators=[{"addr": f"{agg.ip}:{C.XAGG_PORT}", "weight": 1.0}], agg_index=0,
                              fanout=Fanout.UNICAST, vals=aggs.vals, replace=True)
    start = time.time() + 0.5 + 0.1 * len(workers)
    procs = [lab.spawn(w, [sys.executable, "-m", "xagg.lab.traffic", "--job-id", str(job_id), "--cookie",
                           str(cookie), "--worker", str(i), "--workers", str(len(workers)), "--aggregators",
                           agg.ip, "--fanout", Fanout.UNICAST.label, "--sizes", ",".join(map(str, sizes)), "--rounds", str(ROUNDS),
                           "--start-at", str(start), "--timeout", "20", "--vals", str(aggs.vals)],
                       stdout=-1, stderr=-1, text=True) for i, w in enumerate(workers)]
    try:
        reports = collect(procs, timeout=120)
    finally:
        aggs.controls[k].remove(job_id)
    out = {}
    for s in sizes:
        per_round = [max(t["seconds"] for r in reports for t in r["times"] if t["round"] == i and t["size"] == s)
                     for i in range(ROUNDS)]
        out[s] = probe.steady_seconds(per_round)
    return out


def probe_lab(lab, mb: float = 4, log=None, pps: dict | None = None) -> list[probe.Sample]:
    """Probe samples for every aggregator of ``lab`` (its xaggd started here);
    into ``pps``, each aggregator's packet rate as its xaggd measured it."""
    with Aggregators(lab, "xdp") as aggs:
        if pps is not None:
            pps.update({a.name: probe.packet_rate(c.status()) for a, c in zip(lab.aggregators, aggs.controls)})
        vals = aggs.vals
        small, big = vals, int(mb * 250_000)
        samples = []
        for k, a in enumerate(lab.aggregators):
            for w in lab.workers:
                t = _run(lab, aggs, k, [w], [small, big])
                samples.append(probe.Sample(a.name, [w.name], probe.wire_bytes(big, vals),
                                            t[big], rtt_s=t[small]))
                if log:
                    log(f"probe {w.name} -> {a.name}: {samples[-1].bps / 1e9:.2f} Gbit/s, "
                        f"rtt {t[small] * 1e3:.2f} ms")
            mates = [w for w in lab.workers if w.rack == a.rack] or lab.workers
            if len(mates) > 1:
                t = _run(lab, aggs, k, mates, [big])
                rtt = min(s.rtt_s for s in samples if s.aggregator == a.name)
                samples.append(probe.Sample(a.name, [w.name for w in mates], probe.wire_bytes(big, vals), t[big],
                                            rtt_s=rtt))
                if log:
                    log(f"probe {'+'.join(w.name for w in mates)} -> {a.name}: "
                        f"{samples[-1].bps / 1e9:.2f} Gbit/s into it")
    return samples


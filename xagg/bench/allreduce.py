"""`make bench` section "allreduce": xagg vs gloo on the lab, same run.

For each link setting (unshaped, every link shaped to 1 Gbit/s), worker
count and size (shaped: as many aggregators as workers, so no aggregator
link must carry more than D each way, which is what makes D/B the bound;
unshaped: one aggregator): xagg through the XDP aggregator, xagg through the
userspace aggregator, and torch.distributed gloo all_reduce, all on the same
lab (broadcast fan-out: one rank per host on one bridge). Reports time,
algorithm bandwidth, ratio to gloo, and CPU seconds of the whole machine (all
processes plus softirq) per GB reduced. Writes the rows into bench.json and a
PNG plot.
"""
from __future__ import annotations

import os

from xagg.bench import OUT
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.wire import plan
from xagg.wire.proto import C

FULL = {"sizes_mb": [1, 16, 100], "workers": [4, 8], "rates": [None, "1gbit"], "userspace_max_mb": 16}
QUICK = {"sizes_mb": [1, 16], "workers": [4], "rates": [None, "1gbit"], "userspace_max_mb": 1}
FANOUT = "bcast"


def run(quick: bool) -> list[dict]:
    cfg = QUICK if quick else FULL
    rows = []
    print("\n== all-reduce on the lab: xagg vs gloo (same run) ==")
    print(f"{'link':7} {'N':>2} {'MB':>4} {'kind':14} {'time ms':>9} {'Gb/s':>6} {'x gloo':>7} {'CPU s/GB':>9} "
          f"{'D/B ms':>7}")
    for rate in cfg["rates"]:
        for n in cfg["workers"]:
            name = f"bench{os.getpid() % 1000}"
            m = n if rate else 1
            with Lab(LabSpec(name=name, workers=n, aggregators=m, rate=rate)) as lab:
                for mb in cfg["sizes_mb"]:
                    size = mb * 250_000
                    results = [run_gloo(lab, size, rounds=4)]
                    slots = 2 * max(plan.capacity(size, C.XAGG_VALS, [1.0] * m))    # x2: round parity
                    with Aggregators(lab, "xdp", max_slots=slots) as aggs:
                        results.append(run_xagg(lab, aggs, size, rounds=5, timeout=60, fanout=FANOUT))
                    if mb <= cfg["userspace_max_mb"]:
                        with Aggregators(lab, "userspace") as aggs:
                            results.append(run_xagg(lab, aggs, size, rounds=3, timeout=120, fanout=FANOUT))
                    gloo = results[0].seconds
                    bound = size * 4 * 8 / 1e9 * 1e3 if rate else None     # D/B at 1 Gbit/s, ms
                    for r in results:
                        row = {"link": rate or "unshaped", "workers": n, "aggregators": m, "mb": mb,
                               "kind": r.kind,
                               "ms": r.seconds * 1e3, "gbps": r.gbps, "x_gloo": gloo / r.seconds,
                               "cpu_s_per_gb": r.cpu_seconds / (len(r.all_seconds) * size * 4 / 1e9),
                               "bound_ms": bound}
                        rows.append(row)
                        print(f"{row['link']:7} {n:2} {mb:4} {r.kind:14} {row['ms']:9.1f} {row['gbps']:6.2f} "
                              f"{row['x_gloo']:7.2f} {row['cpu_s_per_gb']:9.1f} "
                              f"{bound if bound else float('nan'):7.0f}", flush=True)
    _plot(rows)
    return rows


def _plot(rows) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for kind in sorted({r["kind"] for r in rows}):
            for n in sorted({r["workers"] for r in rows}):
                pts = [(r["mb"], r["gbps"]) for r in rows if r["link"] == link and r["kind"] == kind
                       and r["workers"] == n]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{kind} N={n}")
        ax.set_xscale("log")
        ax.set_xlabel("all-reduce size (MB)")
        ax.set_ylabel("algorithm bandwidth (Gb/s)")
        ax.set_title(f"links: {link}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "allreduce.png", dpi=100)
    print(f"wrote {OUT / 'allreduce.png'}")


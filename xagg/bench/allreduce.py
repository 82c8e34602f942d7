"""`make bench` section "allreduce": xagg vs gloo on the lab, same run.

Two settings: MTU 1500 with every default a user gets (the fan-out, values
per packet as xaggd's MTU takes, the worker path: whatever the lab's
experiments pass when nothing is named), where xagg also runs on the other
worker path (UDP or AF_XDP), then MTU 9000 with results to a multicast group
(xaggd packs 2,233 values per packet through the multi-buffer XDP build). Three lab shapes, 4 workers:

* unshaped: one aggregator; every host shares this machine's two cores, so
  this is the CPU-bound case;
* workers 1 Gbit/s, the aggregator 4 Gbit/s: in-network aggregation's bound
  is D/B (each worker sends and receives D once), gloo's ring 2(N-1)/N D/B;
* every link 1 Gbit/s, 4 aggregators: chunks split evenly, so no
  aggregator's link carries more than D each way.

Per size, gloo, xagg, gloo and xagg again run back to back (drift on a
shared machine hits both; each transport's fastest run counts; three such
pairs in the unshaped shape, whose CPU-bound runs are the noisiest); the
userspace aggregator runs at 1 MB, unshaped. A row: the worker path that
ran (udp, afxdp; gloo's tcp), time (median of steady rounds), algorithm
bandwidth, ratio to gloo, CPU seconds per GB reduced of the workers'
processes and of the rest of the machine (cpu_columns), gloo's
whole-machine CPU over this row's ("cpu x", > 1: less than gloo), client
retransmits per round (and as a share of the packets sent) and packets
dropped anywhere in the lab (qdisc queues, veth/XDP_TX rings, socket
buffers) during the run. Writes the rows into bench.json and a PNG plot.
"""
from __future__ import annotations

import os

from xagg.bench import OUT
from xagg.client.config import DEFAULT_PATH
from xagg.lab import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
from xagg.wire import chunks
from xagg.wire.fanout import DEFAULT_GROUP, Fanout
from xagg.wire.proto import max_vals

WORKERS = 4
# name, worker rate, aggregators, per-host rates
SHAPES = [("unshaped", None, 1, {}),
          ("1g/agg4g", "1gbit", 1, {"a0": "4gbit"}),
          ("1g x4agg", "1gbit", 4, {})]
FULL = {"sizes_mb": [1, 16, 64], "userspace_max_mb": 1}
QUICK = {"sizes_mb": [1, 16], "userspace_max_mb": 1}
PAIRS = {"unshaped": 3}         # gloo/xagg pairs per size (default 2)
# (MTU, what the user set): the defaults first, since most networks run 1500;
# then the tuned corner, where XDP results go to a multicast group the workers
# join: the lab's aggregator ports take no multicast (a snooping switch), where
# broadcast would load each aggregator's link with the others' results.
SETTINGS = [(1500, "defaults", {}),
            (9000, "mcast group", {"fanout": Fanout.BCAST, "result_group": DEFAULT_GROUP})]
# At the defaults, xagg also runs on the worker path the default does not
# take, so each run shows what the default's choice costs or saves.
OTHER_PATH = {"udp": "afxdp", "afxdp": "udp", "auto": "udp"}[DEFAULT_PATH]


def run(quick: bool) -> list[dict]:
    cfg = QUICK if quick else FULL
    rows = []
    for mtu, setting, kw in SETTINGS:
        print(f"\n== all-reduce on the lab, {WORKERS} workers, MTU {mtu}, {setting}: xagg vs gloo (same run) ==")
        print(f"{'shape':9} {'MB':>3} {'kind':15} {'path':6} {'time ms':>8} {'Gb/s':>6} {'x gloo':>7} "
              f"{'wrk s/GB':>8} {'rest s/GB':>9} {'cpu x':>6} {'retx/rd':>7} {'resent%':>7} {'drops':>6} "
              f"{'bound ms':>8}")
        for shape, rate, m, rate_of in SHAPES:
            rows += _one_shape(cfg, mtu, setting, kw, shape, rate, m, rate_of)
    _plot(rows)
    return rows


def _one_shape(cfg, mtu, setting, kw, shape, rate, m, rate_of) -> list[dict]:
    spec = LabSpec(name=f"bench{os.getpid() % 1000}", workers=WORKERS, aggregators=m, rate=rate,
                   rate_of=rate_of, mtu=mtu)
    slots = 2 * max(chunks.capacity(max(cfg["sizes_mb"]) * 250_000, max_vals(mtu), [1.0] * m))
    rows = []
    with Lab(spec) as lab:
        with Aggregators(lab, "xdp", max_slots=slots) as aggs:
            paths = [None, OTHER_PATH] if setting == "defaults" else [None]
            timed = {mb: _one_size(lab, aggs, mb, PAIRS.get(shape, 2), kw, paths) for mb in cfg["sizes_mb"]}
        if rate is None:        # the userspace daemon needs port 9977 free of XDP
            with Aggregators(lab, "userspace") as us:
                # it has no route for a group in its namespace: it broadcasts
                fanout = kw.get("fanout")
                for mb in [mb for mb in timed if mb <= cfg["userspace_max_mb"]]:
                    u = run_xagg(lab, us, mb * 250_000, rounds=3, timeout=120,
                                 **({"fanout": fanout} if fanout is not None else {}))
                    timed[mb].append((u.kind, u, {}))
        for mb, runs in timed.items():
            rows += _rows(lab, shape, rate, mb, runs, mtu, setting)
    return rows


def _one_size(lab, aggs, mb, pairs: int, kw: dict, paths: list) -> list:
    """gloo, xagg on each of ``paths`` (None: the default), gloo, ...:
    (kind, Result, drops during the run)."""
    size = mb * 250_000
    timed = []
    for _ in range(pairs):
        timed.append(("gloo", run_gloo(lab, size, rounds=4), {}))
        for path in paths:
            before = lab.drops()
            x = run_xagg(lab, aggs, size, rounds=6, timeout=60, **kw, **({"path": path} if path else {}))
            timed.append((x.kind + (f" {path}" if path else ""), x, lab.drops_between(before, lab.drops())))
    return timed


def _rows(lab, shape, rate, mb, timed, mtu, setting) -> list[dict]:
    size = mb * 250_000
    gloo = min(r.seconds for kind, r, _ in timed if kind == "gloo")
    gloo_cpu = min((cpu_columns(r, size)["cpu_s_per_gb"] for kind, r, _ in timed if kind == "gloo"))
    bound = size * 4 * 8 / 1e9 * 1e3 if rate else None     # D/B at a worker's 1 Gbit/s, ms
    rows = []
    for kind in dict.fromkeys(k for k, _, _ in timed):     # one row per transport: its faster run
        _, r, drops = min((t for t in timed if t[0] == kind), key=lambda t: t[1].seconds)
        retx = [rep.get("stats", {}).get("retransmits", 0) for rep in r.reports]
        sent = sum(rep.get("stats", {}).get("packets_sent", 0) for rep in r.reports)
        path = "+".join(sorted({rep.get("stats", {}).get("path", "") for rep in r.reports})) or "tcp"
        cpu = cpu_columns(r, size)
        row = {"mtu": mtu, "setting": setting, "shape": shape, "workers": WORKERS, "aggregators": len(lab.aggregators), "mb": mb,
               "kind": kind.split()[0], "path": path, "ms": r.seconds * 1e3, "gbps": r.gbps,
               "x_gloo": gloo / r.seconds, "runs_ms": [s * 1e3 for s in r.all_seconds],
               "each_run_ms": [t[1].seconds * 1e3 for t in timed if t[0] == kind],
               **cpu, "cpu_x_gloo": gloo_cpu / cpu["cpu_s_per_gb"] if cpu["cpu_s_per_gb"] > 0 else float("nan"),
               "retransmits_per_round": sum(retx) / len(r.all_seconds),
               "resent_pct": 100 * sum(retx) / sent if sent else 0.0, "drops": drops,
               "bound_ms": bound}
        rows.append(row)
        print(f"{shape:9} {mb:3} {row['kind']:15} {path:6} {row['ms']:8.1f} {row['gbps']:6.2f} {row['x_gloo']:7.2f} "
              f"{cpu['workers_cpu_s_per_gb']:8.1f} {cpu['rest_cpu_s_per_gb']:9.1f} {row['cpu_x_gloo']:6.2f} "
              f"{row['retransmits_per_round']:7.1f} {row['resent_pct']:7.2f} "
              f"{sum(drops.values()) if drops else '':>6} {bound if bound else float('nan'):8.0f}", flush=True)
    return rows


def cpu_columns(r, size: int) -> dict:
    """CPU seconds per GB reduced: the workers' processes (their own user and
    system time, all threads), the rest of the machine (the aggregators, the
    lab's switch, softirq outside the workers' processes, and whatever else
    runs on the machine), and the whole machine; over the steady rounds
    (the first waits for every worker to start).

    The kernel charges packet work done in a process's system call to that
    process: a worker's send through its veth can carry the frame across the
    switch and through the aggregator's XDP program before the call returns,
    and that time lands in the workers' column.
    """
    first = max(rep.get("cpu_from_round", 0) for rep in r.reports)    # CPU counted from this round on
    gb = (len(r.all_seconds) - first) * size * 4 / 1e9
    own = sum(sum(rep.get("process_cpu", [0.0])) for rep in r.reports)
    return {"cpu_s_per_gb": r.cpu_seconds / gb, "workers_cpu_s_per_gb": own / gb,
            "rest_cpu_s_per_gb": (r.cpu_seconds - own) / gb}


def _plot(rows) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for kind, path in sorted({(r["kind"], r["path"]) for r in rows}):
            for mtu in sorted({r["mtu"] for r in rows}):
                pts = [(r["mb"], r["gbps"]) for r in rows
                       if r["shape"] == shape and (r["kind"], r["path"]) == (kind, path) and r["mtu"] == mtu]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{kind} ({path}), MTU {mtu}")
        ax.set_xscale("log")
        ax.set_xlabel("all-reduce size (MB)")
        ax.set_ylabel("algorithm bandwidth (Gb/s)")
        ax.set_title(f"lab: {shape}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "allreduce.png", dpi=100)
    print(f"wrote {OUT / 'allreduce.png'}")

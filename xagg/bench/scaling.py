"""Predicted all-reduce times for clusters the lab cannot hold, and the same
model next to the lab at the sizes it can run.

    python -m xagg.bench.scaling                      # 16..1,024 ranks, 25 and 100 Gbit/s NICs
    python -m xagg.bench.scaling --nic 100gbit --aggs-per-rack 4 --mtu 1500
    sudo .venv/bin/python -m xagg.bench.scaling --lab --plot docs/scaling.svg

The model (xagg/wire/scaling.py) is the planner's: an all-reduce takes as
long as its busiest resource (a host's NIC, a rack's uplink, an aggregator's
link or packet rate, a client process's packet rate, a host's memory for the
in-host reduce) plus its hops' latency. Rows are ranks; columns the
algorithms, each with its time in ms and what binds it:

  gloo ring        gloo's ring over every rank, ranks ordered by host
  hier. ring       reduce inside the host, ring across hosts, broadcast inside
  xagg flat        every rank a worker of the job, chunks split over the aggregators
  xagg tree        the same through the rack tree (a rack's aggregator sums its
                   rack's workers' part of another rack's root's chunks)
  .../host         the host reduces first and is the job's one worker
xagg runs with the fastest result path of --fanout (as the planner picks).

--lab builds the lab's shapes (4 workers; 1 and 4 aggregators; unshaped,
and workers at 1 Gbit/s with the aggregator(s) at 4 or 1 Gbit/s), runs gloo
and xagg on each at MTU 1500 with unicast results (xaggd's values per
packet, the UDP worker path) and at MTU 9000 with a multicast group, and prints the planner's prediction for each shape beside
what the lab measured. It needs root, and a lab shares one machine's cores,
so its figures include the machine's load (printed). Results:
bench-out/scaling.json, and the plot with --plot (SVG or PNG, by suffix).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from xagg.bench import OUT
from xagg.wire import scaling
from xagg.wire.fanout import MODELS
from xagg.wire.planner_inputs import PlanInputError
from xagg.wire.rates import format_bps, parse_bps

RANKS = (16, 64, 256, 1024)
# the lab's shapes: name, workers' rate, aggregators, per-host rates
LAB_SHAPES = [("unshaped", None, 1, {}), ("unshaped x4agg", None, 4, {}),
              ("1g/agg4g", "1gbit", 1, {"a0": "4gbit"}), ("1g x4agg", "1gbit", 4, {})]
# (MTU, setting, the result path as the planner names it)
LAB_SETTINGS = [(1500, "unicast", "unicast"), (9000, "mcast group", "mcast")]


def table(base: scaling.Cluster, ranks, costs: scaling.Costs, fanouts) -> list[dict]:
    """One row per rank count: every algorithm's prediction on ``base`` grown to it."""
    rows = []
    for n in ranks:
        c = dataclasses.replace(base, ranks=n).check()
        preds = scaling.predict_all(c, costs, fanouts)
        rows.append({"ranks": n, "hosts": c.hosts, "racks": c.racks, "nic_bps": c.nic_bps,
                     "aggregators": c.racks * c.aggs_per_rack, "mtu": c.mtu, "mb": c.mb,
                     "predicted": {p.algorithm: {"ms": p.seconds * 1e3, "bound": p.bound, "results": p.results}
                                   for p in preds}})
    return rows


def _title(base: scaling.Cluster, costs: scaling.Costs) -> str:
    agg_nic = format_bps(base.agg_nic_bps or base.nic_bps)
    return (f"{base.mb:g} MB all-reduce, {base.ranks_per_host} ranks/host, NIC {format_bps(base.nic_bps)}, "
            f"{base.hosts_per_rack} hosts/rack, uplink {base.oversub:g}:1 ({format_bps(base.uplink_bps)}), "
            f"{base.aggs_per_rack} aggregator(s)/rack ({agg_nic}, {base.agg_cores} cores), MTU {base.mtu}; "
            f"hop {costs.hop_s * 1e6:g} us")


def print_table(rows: list[dict], base: scaling.Cluster, costs: scaling.Costs) -> None:
    print(f"\n== {_title(base, costs)} ==")
    print(f"{'ranks':>5} {'hosts':>5} {'racks':>5}  " + " ".join(f"{a + ' ms, bound':<32}" for a in scaling.ALGORITHMS))
    for r in rows:
        cells = []
        for a in scaling.ALGORITHMS:
            p = r["predicted"][a]
            why = p["bound"] + (f", {p['results']}" if p["results"] else "")
            cells.append(f"{p['ms']:7.1f} {why:<24}")
        print(f"{r['ranks']:5} {r['hosts']:5} {r['racks']:5}  " + " ".join(cells))


def markdown(rows: list[dict], title: str) -> str:
    """The rows as a Markdown table (docs/scaling.md): ms and what binds, per algorithm."""
    head = f"**{title}**\n\n| ranks (hosts, racks) | " + " | ".join(scaling.ALGORITHMS) + " |\n"
    head += "|---" * (len(scaling.ALGORITHMS) + 1) + "|\n"
    lines = []
    for r in rows:
        cells = []
        for a in scaling.ALGORITHMS:
            p = r["predicted"][a]
            cells.append(f"{p['ms']:.1f} ({p['bound']}{', ' + p['results'] if p['results'] else ''})")
        lines.append(f"| {r['ranks']} ({r['hosts']}, {r['racks']}) | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def lab_markdown(rows: list[dict]) -> str:
    """The lab check as a Markdown table (docs/scaling.md)."""
    out = ["| MTU, results | shape | gloo model | gloo lab | xagg model (bound) | xagg lab | load |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        g, x = r["gloo"], r["xagg"]
        out.append(f"| {r['mtu']}, {r['setting']} | {r['shape']} | {g['model_ms']:.1f} | {g['lab_ms']:.1f} | "
                   f"{x['model_ms']:.1f} ({x['bound']}) | {x['lab_ms']:.1f} | {r['load']:.0f} |")
    return "\n".join(out) + "\n"


def lab_check(mb: float) -> list[dict]:
    """Each lab shape and setting: the model's prediction (the planner's
    inputs for that lab, its CPU floor and per-call latencies) and the
    measured times, gloo and xagg alternating, the faster of two each."""
    from xagg.lab import Lab, LabSpec
    from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
    from xagg.lab.plan_inputs import lab_inputs
    from xagg.wire import chunks
    from xagg.wire.fanout import DEFAULT_GROUP, Fanout, ResultPath
    from xagg.wire.proto import max_vals

    rows = []
    size = int(mb * 250_000)
    for mtu, setting, model in LAB_SETTINGS:
        kw = ({"fanout": Fanout.BCAST, "result_group": DEFAULT_GROUP} if model == "mcast"
              else {"fanout": Fanout.UNICAST})
        for shape, rate, m, rate_of in LAB_SHAPES:
            spec = LabSpec(name=f"wgsc{os.getpid() % 100}", workers=4, aggregators=m, rate=rate,
                           rate_of=rate_of, mtu=mtu)
            slots = 2 * max(chunks.capacity(size, max_vals(mtu), [1.0] * m))
            with Lab(spec) as lab:
                inputs = lab_inputs(lab, mb, ResultPath.from_model(model))
                gloo_p = scaling.ring(inputs, scaling.LAB_COSTS)
                xagg_p = scaling.xagg(inputs, scaling.LAB_COSTS)
                gloo_s, xagg_s = [], []
                # a slow start on a loaded machine (bcc compiles each daemon's program) is not a failure
                with Aggregators(lab, "xdp", max_slots=slots, start_timeout=300) as aggs:
                    for _ in range(2):
                        gloo_s.append(run_gloo(lab, size, rounds=4).seconds)
                        xagg_s.append(run_xagg(lab, aggs, size, rounds=6, timeout=60, **kw).seconds)
            row = {"mtu": mtu, "setting": setting, "shape": shape, "workers": 4, "aggregators": m, "mb": mb,
                   "load": os.getloadavg()[0],
                   "gloo": {"model_ms": gloo_p.seconds * 1e3, "bound": gloo_p.bound, "lab_ms": min(gloo_s) * 1e3},
                   "xagg": {"model_ms": xagg_p.seconds * 1e3, "bound": xagg_p.bound, "lab_ms": min(xagg_s) * 1e3}}
            rows.append(row)
            _print_lab_row(row)
    return rows


def _print_lab_row(r: dict) -> None:
    g, x = r["gloo"], r["xagg"]
    print(f"MTU {r['mtu']:4} {r['setting']:11} {r['shape']:15} gloo model {g['model_ms']:6.1f} lab {g['lab_ms']:6.1f} "
          f"({g['lab_ms'] / g['model_ms']:4.2f}x)   xagg model {x['model_ms']:6.1f} lab {x['lab_ms']:6.1f} "
          f"({x['lab_ms'] / x['model_ms']:4.2f}x, bound {x['bound']})   load {r['load']:.1f}", flush=True)


def plot(panels: list[tuple[str, list[dict]]], lab_rows: list[dict], path: str) -> None:
    """Time against ranks per algorithm, one panel per cluster; the lab's
    points (model and measured) in the last panel."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'xagg[test]'")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    plt.rcParams["svg.fonttype"] = "none"      # SVG text stays text: small, and greppable
    plt.rcParams["svg.hashsalt"] = "xagg"      # the same numbers write the same file
    n = len(panels) + bool(lab_rows)
    cols = min(n, 3)
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(5.2 * cols, 4.2 * -(-n // cols)), squeeze=False)
    axes = list(axes.flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    for ax, (title, rows) in zip(axes, panels):
        for a in scaling.ALGORITHMS:
            ax.plot([r["ranks"] for r in rows], [r["predicted"][a]["ms"] for r in rows], marker="o",
                    linestyle="--" if a.endswith("ring") else "-", label=a)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["ranks"] for r in rows], [str(r["ranks"]) for r in rows])
        _log_ms(ax, plain)
        ax.set_xlabel("ranks")
        ax.set_ylabel("predicted all-reduce time (ms)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    if lab_rows:
        ax = axes[n - 1]
        labels = [f"{r['shape']}\nMTU {r['mtu']}" for r in lab_rows]
        xs = range(len(lab_rows))
        for kind, mark in (("gloo", "s"), ("xagg", "o")):
            ax.plot(xs, [r[kind]["model_ms"] for r in lab_rows], mark, fillstyle="none", label=f"{kind} model")
            ax.plot(xs, [r[kind]["lab_ms"] for r in lab_rows], mark, label=f"{kind} lab")
        ax.set_xticks(list(xs), labels, rotation=60, fontsize=6)
        _log_ms(ax, plain)
        ax.set_ylabel("all-reduce time (ms)")
        ax.set_title(f"lab, 4 workers, {lab_rows[0]['mb']:g} MB: model vs measured", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)
    print(f"wrote {path}")


def _log_ms(ax, plain) -> None:
    """A log time axis labelled 1, 2, 5, 10, 20, ... ms."""
    import matplotlib.ticker
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def _csv(value: str, parse, what: str) -> list:
    try:
        return [parse(v) for v in value.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{what}: {e}") from None


def _model(name: str) -> str:
    if name.strip() not in MODELS:
        raise ValueError(f"{name!r}: one of {', '.join(MODELS)}")
    return name.strip()


def parser() -> argparse.ArgumentParser:
    d = scaling.Cluster(ranks=8)
    ap = argparse.ArgumentParser(prog="python -m xagg.bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--ranks", default=",".join(map(str, RANKS)), metavar="N[,N]",
        help="rank counts, comma-separated [%(default)s]")
    add("--ranks-per-host", metavar="L", type=int, default=d.ranks_per_host, help="ranks (GPUs) per host [%(default)s]")
    add("--nic", default="25gbit,100gbit", metavar="RATE[,RATE]",
        help="each host's NIC; several: one table each [%(default)s]")
    add("--hosts-per-rack", metavar="N", type=int, default=d.hosts_per_rack,
        help="hosts behind one top-of-rack switch [%(default)s]")
    add("--oversub", metavar="X", type=float, default=d.oversub,
        help="a rack's hosts' NIC bandwidth over its uplink's, 1 = none [%(default)s]")
    add("--aggs-per-rack", default=str(d.aggs_per_rack), metavar="N[,N]",
        help="dedicated aggregator hosts in each rack; several: one table each [%(default)s]")
    add("--agg-nic", metavar="RATE", help="aggregator hosts' NIC [the workers']")
    add("--agg-cores", metavar="N", type=int, default=d.agg_cores,
        help="cores (RX queues) running the XDP program on each aggregator [%(default)s]")
    add("--agg-pps", metavar="PPS", type=float,
        help="packets/s one aggregator core sums [the XDP program's test-run rate: "
             + ", ".join(f"MTU {m} {p / 1e6:.2f} M" for m, p in scaling.XDP_PPS_PER_CORE.items()) + "]")
    add("--mtu", metavar="BYTES", type=int, default=d.mtu, help="MTU (values per packet follow) [%(default)s]")
    add("--mb", metavar="MB", type=float, default=d.mb,
        help="all-reduce size, MB of float32 [%(default)s: DDP's bucket]")
    add("--fanout", default="mcast,unicast", metavar="MODE[,MODE]",
        help="result paths xagg may use (bcast, mcast, unicast); the fastest counts [%(default)s]")
    add("--hop-us", metavar="US", type=float, default=scaling.DEFAULT_HOP_S * 1e6,
                    help="latency per network hop, us: a ring pays 2(N-1), xagg 2 (4 through a tree) [%(default)g]")
    add("--client-kpps", metavar="KPPS", type=float, default=scaling.DEFAULT_CLIENT_PPS / 1e3,
                    help="packets/s (thousands) one xagg client process sends and receives; 0: no limit "
                         "[%(default)g]")
    add("--host-mem-gbs", metavar="GBS", type=float, default=scaling.DEFAULT_HOST_MEM_BPS / 8e9,
                    help="GB/s a host's memory gives the in-host reduce and gather; 0: no limit [%(default)g]")
    add("--lab", action="store_true", help="also run the lab's shapes and print model vs lab (root)")
    add("--lab-mb", metavar="MB", type=float, default=16, help="all-reduce size on the lab [%(default)s]")
    add("--plot", metavar="FILE", help="write the plot (.svg or .png; needs matplotlib)")
    add("--json", action="store_true", help="print the rows as JSON instead of tables")
    add("--markdown", action="store_true", help="print Markdown tables (as docs/scaling.md has them)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    report(ap, ap.parse_args(argv))
    return 0


def run(quick: bool) -> dict:
    """The `make bench` section: the model's tables, and in a full run the
    lab's shapes beside them."""
    ap = parser()
    return report(ap, ap.parse_args([] if quick else ["--lab"]))


def report(ap, args) -> dict:
    """Print what ``args`` ask for; returns the rows (and the lab's)."""
    try:
        ranks = _csv(args.ranks, int, "--ranks")
        nics = _csv(args.nic, lambda v: parse_bps(v, "--nic"), "--nic")
        fanouts = _csv(args.fanout, _model, "--fanout")
        costs = scaling.Costs(args.hop_us * 1e-6, args.client_kpps * 1e3 or None, args.host_mem_gbs * 8e9 or None)
        aggs_per_rack = _csv(args.aggs_per_rack, int, "--aggs-per-rack")
        agg_nic = parse_bps(args.agg_nic, "--agg-nic") if args.agg_nic else None
        panels = []
        for nic, n_aggs in [(nic, a) for a in aggs_per_rack for nic in nics]:
            base = scaling.Cluster(args.ranks_per_host, args.ranks_per_host, nic, args.hosts_per_rack, args.oversub,
                                   n_aggs, agg_nic, args.agg_cores, args.mtu, args.mb, args.agg_pps).check()
            rows = table(base, ranks, costs, fanouts)
            panels.append((f"NIC {format_bps(nic)}, {base.oversub:g}:1 uplinks, {base.aggs_per_rack} agg/rack, "
                           f"MTU {base.mtu}, {base.mb:g} MB", rows))
            if args.markdown:
                print(markdown(rows, _title(base, costs)))
            elif not args.json:
                print_table(rows, base, costs)
    except (PlanInputError, ValueError, argparse.ArgumentTypeError) as e:
        ap.error(str(e))
    lab_rows = lab_check(args.lab_mb) if args.lab else []
    if args.markdown and lab_rows:
        print(lab_markdown(lab_rows))
    result = {"clusters": [{"title": t, "rows": r} for t, r in panels], "lab": lab_rows}
    if args.json:
        print(json.dumps(result, indent=1))
    if args.lab:
        OUT.mkdir(exist_ok=True)
        (OUT / "scaling.json").write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(panels, lab_rows, args.plot)
    return result


if __name__ == "__main__":
    sys.exit(main())

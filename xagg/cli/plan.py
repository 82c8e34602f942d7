"""`xagg plan`: what the planner sees and decides for a cluster.

The inputs come from an operator's file (``--inputs FILE``, JSON,
docs/planner.md), from flags (``--host w0=1gbit --host a0=4gbit``) or from a
lab (``--lab NAME``: its shaped rates, racks and uplinks as its state file
records them, and this machine's cores, which all its hosts share); flags
override the file or the lab. ``--probe`` measures the rates first.
"""
from __future__ import annotations

import json
import os

import click

from xagg.client.probe import probe_from_here
from xagg.lab.cluster import Lab, LabError
from xagg.lab.plan_inputs import lab_inputs, probed
from xagg.wire import planner, probe
from xagg.wire.addresses import split_host_port
from xagg.wire.control import ControlClient, ControlError
from xagg.wire.fanout import MODELS, ResultPath
from xagg.wire.planner_inputs import (
    Node,
    PlanInputError,
    PlanInputs,
    inputs_from_dict,
    inputs_to_dict,
    offer_worker_hosts,
)
from xagg.wire.proto import C, max_vals
from xagg.wire.rates import format_bps, parse_bps

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _override_hosts(inputs: PlanInputs, items) -> None:
    """--host NAME=RATE[,up=RATE][,down=RATE][,rack=R][,pps=N], repeatable."""
    nodes = {n.name: n for n in inputs.workers + inputs.aggregators}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected NAME=RATE, e.g. a0=4gbit", param_hint="--host")
        name = name.strip()
        if name not in nodes:
            node = Node(name)
            (inputs.aggregators if name.startswith("a") else inputs.workers).append(node)
            nodes[name] = node
        node = nodes[name]
        for part in rest.split(","):
            key, eq, val = part.partition("=")
            key, val = (key, val) if eq else ("rate", key)
            try:
                if key == "rate":
                    node.up_bps = node.down_bps = parse_bps(val, f"--host {name}")
                elif key in ("up", "down"):
                    setattr(node, f"{key}_bps", parse_bps(val, f"--host {name} {key}"))
                elif key == "rack":
                    node.rack = int(val)
                elif key == "pps":
                    node.pps = float(val)
                else:
                    raise ValueError(f"--host {name}: unknown key {key!r} (rate, up, down, rack, pps)")
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--host") from None


def gather_inputs(lab_name, inputs_file, hosts, uplinks, mb, vals, fanout, cores,
                  probe_mb: float = 0, measured: dict | None = None, worker_hosts: bool = False) -> PlanInputs:
    """The inputs from --lab / --inputs and the override flags, checked.
    ``probe_mb``: measure the lab's rates with a probe of that size first
    (xagg.lab.probe); its estimates go into ``measured``. The flags, applied
    after it, still override what it measured."""
    if lab_name and inputs_file:
        raise click.UsageError("give --lab or --inputs, not both")
    if probe_mb and not lab_name:
        raise click.UsageError("--probe measures a lab's links (--lab NAME), or from this host with --as "
                               "WORKER --aggregators ... --control ...")
    if lab_name:
        lab = Lab.load(lab_name)
        inputs = lab_inputs(lab, mb or 16)      # --fanout and --worker-hosts applied below
        if probe_mb:
            inputs = probed(lab, inputs, probe_mb, measured if measured is not None else {},
                            log=lambda m: click.echo(m, err=True))
    elif inputs_file:
        with open(inputs_file) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise click.BadParameter(f"{inputs_file}: not JSON: {e}", param_hint="--inputs") from None
        d = d.get("inputs", d) if isinstance(d, dict) else d     # `xagg plan --json` output works too
        inputs = inputs_from_dict(d)
    else:
        if not hosts:
            raise click.UsageError("no inputs: give --lab NAME, --inputs FILE or --host NAME=RATE ...")
        inputs = PlanInputs([], [], elements=int((mb or 16) * 250_000), vals=vals or max_vals(9000))
    _override_hosts(inputs, hosts)
    for item in uplinks:
        r, sep, rate = item.partition("=")
        if not sep or not r.strip().isdigit():
            raise click.BadParameter(f"{item!r}: expected RACK=RATE, e.g. 0=500mbit", param_hint="--uplink")
        try:
            inputs.uplinks[int(r)] = parse_bps(rate, f"--uplink {r}")
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--uplink") from None
    if worker_hosts:
        offer_worker_hosts(inputs)
    if mb:
        inputs.elements = int(mb * 250_000)
    if vals:
        inputs.vals = vals
    if fanout:
        models = [f.strip() for f in fanout.split(",") if f.strip()]
        if not models or any(m not in MODELS for m in models):
            raise click.BadParameter(f"{fanout!r}: one or more of {', '.join(MODELS)}, "
                                     "comma-separated", param_hint="--fanout")
        paths = tuple(map(ResultPath.from_model, models))
        inputs.results, inputs.result_choices = paths[0], paths if len(paths) > 1 else ()
    if cores is not None:
        inputs.cpu.shared_cores = cores or None
    return inputs.validate()


def _probed_from_here(inputs: PlanInputs, me, aggregators, control, token_file, mb, measured) -> PlanInputs:
    """The inputs with what this host (worker ``me``) measured to each aggregator."""
    names = [a.name for a in inputs.aggregators]
    aggs = [a.strip() for a in (aggregators or "").split(",") if a.strip()]
    ctls = [c.strip() for c in (control or "").split(",") if c.strip()]
    if me not in {w.name for w in inputs.workers}:
        raise click.BadParameter(f"{me!r} is not a worker of the inputs", param_hint="--as")
    if len(aggs) != len(names) or len(ctls) != len(names):
        raise click.UsageError(f"--probe --as needs --aggregators and --control for the inputs' {len(names)} "
                               f"aggregators ({', '.join(names)}), in that order")
    aggs = ["%s:%d" % split_host_port(a, default_port=C.XAGG_PORT) for a in aggs]
    token = open(token_file).read() if token_file else os.environ.get("XAGG_TOKEN")
    samples = probe_from_here(aggs, ctls, token, names, me, mb)
    for smp in samples:
        click.echo(f"probe {me} -> {smp.aggregator}: {smp.bps / 1e9:.2f} Gbit/s, rtt {smp.rtt_s * 1e3:.2f} ms",
                   err=True)
    pps = {}
    for name, ctl in zip(names, ctls):          # each daemon's own measure of its program
        try:
            with ControlClient(ctl, token=token) as cc:
                pps[name] = probe.packet_rate(cc.status())
        except (OSError, ControlError) as e:
            click.echo(f"{name}: no packet rate from {ctl} ({e})", err=True)
    est = probe.estimate(inputs, samples, pps=pps)
    measured.update(est.to_dict())
    return probe.apply(inputs, est)


def describe(inputs: PlanInputs, p: planner.Plan) -> str:
    """The inputs and the plan, for people."""
    cpu = f"shared by all hosts: {inputs.cpu.shared_cores:g} cores" if inputs.cpu.shared_cores else "per host"
    lines = [f"inputs: {len(inputs.workers)} workers, {len(inputs.aggregators)} aggregators, "
             f"{inputs.gradient_bytes / 1e6:g} MB ({inputs.elements} float32), {inputs.vals} values/packet, "
             f"fan-out {'/'.join(r.model for r in inputs.result_choices) or inputs.results.model}, CPU {cpu}"]
    for kind, nodes in (("worker", inputs.workers), ("aggregator", inputs.aggregators)):
        for n in nodes:
            rate = (f"on {n.on}'s host and link" if n.on else format_bps(n.up_bps)
                    if n.up_bps == n.down_bps else f"up {format_bps(n.up_bps)} down {format_bps(n.down_bps)}")
            extra = f", {n.pps / 1e6:.2f} Mpps" if n.pps else ""
            lines.append(f"  {kind:10} {n.name:4} rack {n.rack}  {rate}{extra}")
    for r, bps in sorted(inputs.uplinks.items()):
        lines.append(f"  uplink     rack {r}  {format_bps(bps)} each way")
    lines.append(f"plan: {p.kind}, results {p.results.model}  ({p.reason})")
    names = [a.name for a in inputs.aggregators]
    lines.append("  weights (share of chunks rooted): "
                 + ", ".join(f"{n} {w:.3f}" for n, w in zip(names, p.weights)))
    if any(c != q for row in p.routes for q, c in enumerate(row)):
        for q, root in enumerate(names):
            for c, mask in p.children(q):
                ws = [inputs.workers[w].name for w in range(len(inputs.workers)) if mask >> w & 1]
                who = ", ".join(ws) if len(ws) <= 8 else f"{len(ws)} workers ({ws[0]}, ..., {ws[-1]})"
                lines.append(f"  tree: {who} -> {names[c]} -> {root} (for {root}'s chunks)")
    lines.append(f"predicted: this plan {p.predicted_s * 1e3:.1f} ms (bound by {p.bottleneck}); "
                 f"best xagg {p.xagg_predicted_s * 1e3:.1f} ms, equal-split flat "
                 f"{p.flat_predicted_s * 1e3:.1f} ms, gloo ring {p.gloo_predicted_s * 1e3:.1f} ms")
    return "\n".join(lines)


@click.command(context_settings=CONTEXT)
@click.option("--lab", "lab_name", metavar="NAME", help="Read the inputs from lab NAME (xagg lab up).")
@click.option("--inputs", "inputs_file", type=click.Path(exists=True, dir_okay=False),
              help="Operator figures, JSON (docs/planner.md), or a saved `xagg plan --json`.")
@click.option("--host", "hosts", multiple=True, metavar="NAME=RATE[,up=R,down=R,rack=N,pps=N]",
              help="A host's figures, repeatable; names w*: workers, a*: aggregators. Adds or overrides.")
@click.option("--uplink", "uplinks", multiple=True, metavar="RACK=RATE",
              help="A rack's uplink, both ways, repeatable: --uplink 0=500mbit")
@click.option("--mb", type=float, help="All-reduce size to plan for, MB of float32 [default: 16].")
@click.option("--vals", type=int, help="Values per packet [default: the lab's MTU's, else MTU 9000's].")
@click.option("--fanout", metavar="MODE[,MODE]",
              help="How results come back: bcast (every host hears them, other aggregators too), "
                   "mcast (a group only workers joined), unicast (one copy per worker); several, "
                   "comma-separated, let the planner pick [default: bcast].")
@click.option("--cores", type=float, help="CPU cores ALL hosts share (a lab on one machine); "
              "0: each host has its own [lab default: this machine's].")
@click.option("--worker-hosts", is_flag=True,
              help="Offer every worker's host as an aggregator too, after the others (named WORKER.agg; its "
                   "xaggd runs on the worker's interface with --lock on, and the worker sums its own share "
                   "through that program, not the link).")
@click.option("--json", "as_json", is_flag=True, help="Print inputs and plan as JSON (feed it back with --inputs).")
@click.option("--probe", "probe_mb", type=float, default=None, is_flag=False, flag_value=4.0,
              metavar="[MB]", help="Measure the lab's rates first: short all-reduces through each aggregator "
              "(each worker alone, then its rack's workers together; MB per call, default 4). "
              "--host/--uplink figures still override what it measured.")
@click.option("--as", "me", metavar="WORKER",
              help="With --probe outside a lab: this host is worker WORKER of the inputs; it probes each "
                   "aggregator (--aggregators, --control) alone and its figures and theirs are measured.")
@click.option("-a", "--aggregators", envvar="XAGG_AGGREGATORS", metavar="HOST:PORT,...",
              help="With --probe --as: the aggregators' data addresses, in the inputs' order [env XAGG_AGGREGATORS]")
@click.option("--control", envvar="XAGG_CONTROL", metavar="ADDR,...",
              help="With --probe --as: their xaggd control endpoints, which register the probe jobs "
                   "(token: XAGG_TOKEN or --token-file) [env XAGG_CONTROL]")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
              help="The daemons' control token, from a file (or XAGG_TOKEN).")
def plan(lab_name, inputs_file, hosts, uplinks, mb, vals, fanout, cores, worker_hosts, as_json, probe_mb, me,
         aggregators, control, token_file):
    """Plan where a job's gradient goes, and predict its all-reduce time.

    \b
    The planner takes every host's link rate (and rack), each aggregator's
    packet rate and the racks' uplinks, and models an all-reduce: each link
    carries bytes / rate seconds, each aggregator packets / packet rate,
    each worker at least its whole gradient each way, plus CPU. It solves an
    LP for the share of chunks each aggregator roots (and, across racks,
    which aggregator sums a rack's workers first: a tree), rounds it to
    whole chunks and routes, scores the rack tree beside it (each rack's
    aggregators sum its workers' parts of the other racks' roots' chunks;
    1,024 workers in a few racks plan in seconds), and compares with gloo's ring
    (2(N-1)/N x G per worker link). It says "gloo" when the ring is faster:
    xagg must never make a job slower.
    \b
    Examples:
      xagg plan --lab xlab                            # a lab's shaped rates
      xagg plan --host w0=1gbit --host w1=1gbit --host w2=1gbit --host w3=1gbit \\
                --host a0=4gbit --host a1=1gbit --cores 0
      xagg plan --lab xlab --json > plan.json         # then: xagg-client run --plan auto --plan-inputs plan.json
    \b
    The same model at 16-1,024 ranks (hosts of 8 ranks, oversubscribed racks),
    next to gloo's ring and a hierarchical ring: python -m xagg.bench.scaling
    (docs/scaling.md).
    """
    try:
        measured: dict = {}
        if probe_mb and me:         # a real host: gather the figures, then probe from here
            inputs = _probed_from_here(gather_inputs(lab_name, inputs_file, hosts, uplinks, mb, vals, fanout, cores,
                                                     worker_hosts=worker_hosts),
                                       me, aggregators, control, token_file, probe_mb, measured)
            _override_hosts(inputs, hosts)      # the operator's figures win over the probe's
            inputs.validate()
        else:
            inputs = gather_inputs(lab_name, inputs_file, hosts, uplinks, mb, vals, fanout, cores,
                                   probe_mb or 0, measured, worker_hosts)
        p = planner.make_plan(inputs)
    except PlanInputError as e:
        raise click.BadParameter(str(e), param_hint="inputs") from None
    except LabError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"inputs": inputs_to_dict(inputs), "plan": p.to_dict(),
                               **({"probe": measured} if measured else {})}, indent=1))
    else:
        if measured:
            click.echo("rates measured by the probe (round trips: " + ", ".join(
                f"{k} {v:.2f} ms" for k, v in measured["rtt_ms"].items()) + ")")
        click.echo(describe(inputs, p))

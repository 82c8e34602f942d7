"""Where a job's gradient goes: which aggregator roots which share of the
chunks, which aggregator each worker sends each share through, or gloo's
ring when no xagg plan beats it.

The model (docs/planner.md; ../shared/ROUTING.md has its background): an
all-reduce of G bytes takes as long as its busiest resource needs,

    T = max(every link's bytes / its rate, every aggregator's packets / its
            packet rate, every worker's floor G/U_w and G/D_w, the CPU)
        + a fixed per-call latency,

where the loads follow from the plan: aggregator p roots a share f_p of the
chunks; worker w sends its part of p's chunks to routes[w][p] (p itself, or
a child aggregator c that sums them and sends one partial to p); p sends
the results once (broadcast) or once per worker (unicast). A rack's uplink
carries whatever crosses it. The same loads, with fractions instead of
whole chunks, are the LP that planner_lp.py solves; this module evaluates
them exactly (whole chunks, meta chunks, frame overheads) and decides.

Inputs are figures (bits/s, packets/s, CPU seconds per GB); where they come
from (an operator's file, a lab's state, a probe) is the caller's business:
``inputs_from_dict`` reads the file format, ``xagg plan`` the rest.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from xagg.wire import chunks
from xagg.wire.rates import parse_bps

# Per packet on the wire beyond the values: Ethernet 14 + IPv4 20 + UDP 8 +
# xagg header 40 (tbf counts the frame from the Ethernet header on).
DEFAULT_OVERHEAD_BYTES = 82
# Measured on the 2-core lab machine, unshaped, 4 workers, 16 MB, MTU 9000
# (bench-out/bench.json "allreduce" and "hetero"; docs/planner.md): machine
# CPU seconds per GB of one worker's gradient, i.e. wall time x cores /
# (workers x GB). Everything a call costs (client, kernel, XDP, tbf).
DEFAULT_XAGG_CPU_S_PER_GB = 3.4
DEFAULT_GLOO_CPU_S_PER_GB = 2.1
# Fixed cost per all-reduce call (first packet out to last result in / the
# ring's 2(N-1) steps' latencies), seconds.
DEFAULT_XAGG_LATENCY_S = 0.006
DEFAULT_GLOO_LATENCY_S = 0.004
# TCP/IP + Ethernet bytes per byte of gradient in gloo's ring (MSS 8948 at
# MTU 9000: 66 header bytes per segment, plus ACKs the other way).
DEFAULT_GLOO_WIRE_FACTOR = 1.01
# XDP multi-buffer build (MTU 9000, multi-queue safe) in BPF_PROG_TEST_RUN on
# this machine: 0.365 Mpps per core (2.7 us/packet); xaggd check prints it.
DEFAULT_AGG_PPS_PER_QUEUE = 365_000.0

KINDS = ("flat", "tree", "gloo")
# Plans predicted within this fraction of the fastest count as tied; the tie goes to
# the most concentrated split. Measured (lab, 4 workers at 1 Gbit/s, a0 4 Gbit/s, a1
# 1 Gbit/s, results to a group, 16 MB): 0.999/0.001 took 149 ms, 0.8/0.2 187-238 ms
# (retransmits on the second stream), though both sit at the workers' floor in the model.
TIE = 0.01
# How results reach the workers, as the model sees it: "bcast" (subnet broadcast: every
# host of the segment hears it, the other aggregators too), "mcast" (a group only
# workers joined, through a snooping switch: workers only), "unicast" (once per worker).
FANOUT_MODELS = ("bcast", "mcast", "unicast")


class PlanInputError(ValueError):
    """A planner input that cannot be used; ``field`` names it."""

    def __init__(self, name: str, why: str):
        self.field = name
        super().__init__(f"{name}: {why}")


@dataclass
class Node:
    """A host: a worker, or an aggregator (then ``pps`` is its packet
    capacity: the build's packets/s per core x its RX queues). An aggregator
    ``on`` a worker runs on that worker's host: the link is the worker's (its
    own rates are not used), and the worker's packets for its share never
    cross it (client/local.py)."""
    name: str
    up_bps: float | None = None      # what it can send, bits/s; None = unshaped (no limit)
    down_bps: float | None = None    # what it can receive
    rack: int = 0
    pps: float | None = None         # aggregators only; None = not a limit
    on: str | None = None            # aggregators only: the worker whose host it is


@dataclass
class CpuCosts:
    """CPU seconds per GB of one worker's gradient, per all-reduce, and per-call latencies.
    ``shared_cores``: every host runs on the same this-many cores (a lab on one machine),
    so the whole job's CPU shares them; None: each host has its own."""
    xagg_s_per_gb: float = DEFAULT_XAGG_CPU_S_PER_GB
    gloo_s_per_gb: float = DEFAULT_GLOO_CPU_S_PER_GB
    shared_cores: float | None = None
    xagg_latency_s: float = DEFAULT_XAGG_LATENCY_S
    gloo_latency_s: float = DEFAULT_GLOO_LATENCY_S


@dataclass
class PlanInputs:
    workers: list[Node]
    aggregators: list[Node]
    elements: int                           # float32 values per all-reduce (the planned size)
    vals: int                               # values per packet (xaggd's, from the MTU)
    fanout: str = "bcast"
    uplinks: dict = field(default_factory=dict)   # rack -> bits/s of its uplink, each way
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    gloo_wire_factor: float = DEFAULT_GLOO_WIRE_FACTOR
    cpu: CpuCosts = field(default_factory=CpuCosts)
    trees: bool = True                      # may the planner use two-level routes
    fanout_choices: tuple = ()              # fan-outs the planner may pick from (default: fanout)

    # -- derived ----------------------------------------------------------------------
    @property
    def n_chunks(self) -> int:
        return -(-self.elements // self.vals)

    @property
    def frame_bytes(self) -> int:
        return 4 * self.vals + self.overhead_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes one worker sends for one all-reduce, meta chunks and headers included."""
        n = self.n_chunks
        return (n + chunks.meta_chunks(n, self.vals)) * self.frame_bytes

    @property
    def gradient_bytes(self) -> int:
        return 4 * self.elements

    def validate(self) -> "PlanInputs":
        def need(ok, name, why):
            if not ok:
                raise PlanInputError(name, why)

        def positive(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf

        need(len(self.workers) >= 1, "workers", "at least one worker")
        need(len(self.aggregators) >= 1, "aggregators", "at least one aggregator")
        names = [n.name for n in self.workers + self.aggregators]
        need(len(set(names)) == len(names), "hosts", f"names must be unique, got {names}")
        by_name = {w.name: w for w in self.workers}
        hosts = [a.on for a in self.aggregators if a.on is not None]
        need(len(set(hosts)) == len(hosts), "aggregators", f"at most one aggregator per worker host, got {hosts}")
        for a in self.aggregators:
            if a.on is not None:
                need(a.on in by_name, f"aggregators.{a.name}.on", f"must name a worker, got {a.on!r}")
                need(a.rack == by_name[a.on].rack, f"aggregators.{a.name}.rack",
                     f"must be its host {a.on}'s rack ({by_name[a.on].rack}), got {a.rack}")
        for kind, nodes in (("workers", self.workers), ("aggregators", self.aggregators)):
            for n in nodes:
                for attr in ("up_bps", "down_bps") + (("pps",) if kind == "aggregators" else ()):
                    v = getattr(n, attr)
                    need(v is None or positive(v), f"{kind}.{n.name}.{attr}",
                         f"must be > 0 (or absent: no limit), got {v!r}")
                need(isinstance(n.rack, int) and n.rack >= 0, f"{kind}.{n.name}.rack",
                     f"must be an integer >= 0, got {n.rack!r}")
        need(isinstance(self.elements, int) and self.elements > 0, "elements",
             f"must be a positive integer (float32 values per all-reduce), got {self.elements!r}")
        need(isinstance(self.vals, int) and 1 <= self.vals, "vals",
             f"must be a positive integer (values per packet), got {self.vals!r}")
        need(self.fanout in FANOUT_MODELS, "fanout", f"must be one of {list(FANOUT_MODELS)}, got {self.fanout!r}")
        need(isinstance(self.fanout_choices, (tuple, list)) and all(f in FANOUT_MODELS for f in self.fanout_choices),
             "fanouts", f"each must be one of {list(FANOUT_MODELS)}, got {self.fanout_choices!r}")
        need(isinstance(self.overhead_bytes, int) and self.overhead_bytes >= 0, "overhead_bytes",
             f"must be an integer >= 0, got {self.overhead_bytes!r}")
        need(positive(self.gloo_wire_factor) and self.gloo_wire_factor >= 1, "gloo_wire_factor",
             f"must be >= 1, got {self.gloo_wire_factor!r}")
        racks = {n.rack for n in self.workers + self.aggregators}
        for r, bps in self.uplinks.items():
            need(isinstance(r, int) and r in racks, f"uplinks.{r}", f"no host is in rack {r!r}")
            need(bps is None or positive(bps), f"uplinks.{r}", f"must be > 0 bits/s, got {bps!r}")
        c = self.cpu
        for name in ("xagg_s_per_gb", "gloo_s_per_gb", "xagg_latency_s", "gloo_latency_s"):
            v = getattr(c, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
                 f"cpu.{name}", f"must be >= 0, got {v!r}")
        need(c.shared_cores is None or positive(c.shared_cores), "cpu.shared_cores",
             f"must be > 0 (or absent: every host has its own), got {c.shared_cores!r}")
        return self


@dataclass
class Plan:
    """The planner's answer (the contract between the planner, the data plane and the lab)."""
    kind: str                 # "flat" | "tree" | "gloo"
    weights: list[float]      # f_p: share of the gradient's chunks ROOTED at aggregator p
    routes: list[list[int]]   # routes[w][p] = c: worker w sends p's chunks through c (c == p: direct)
    predicted_s: float        # predicted all-reduce time of this plan for the planned size
    flat_predicted_s: float   # same inputs, equal-split flat plan
    gloo_predicted_s: float   # same inputs, gloo's ring
    xagg_predicted_s: float = 0.0   # the best xagg plan's (== predicted_s unless kind is gloo)
    bottleneck: str = ""      # what bounds the chosen plan ("link a1 in", "worker floor", ...)
    reason: str = ""          # one line: why this kind
    fanout: str = ""          # how results go back under this plan (FANOUT_MODELS): "mcast" and
                              # "bcast" are the job's bcast fan-out (to a group / the subnet)

    def children(self, p: int) -> list[tuple[int, int]]:
        """(child aggregator c, worker mask) for p's chunk range: who sends partials to p."""
        out = {}
        for w, row in enumerate(self.routes):
            if row[p] != p:
                out[row[p]] = out.get(row[p], 0) | (1 << w)
        return sorted(out.items())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- the exact model --------------------------------------------------------------------

def chunk_counts(inputs: PlanInputs, weights) -> list[int]:
    """Chunks (data + meta) each aggregator roots under ``weights``: the monotone split."""
    return [(hi - lo) + chunks.meta_chunks(hi - lo, inputs.vals)
            for lo, hi in chunks.split(inputs.n_chunks, list(weights))]


def flat_routes(n_workers: int, n_aggs: int) -> list[list[int]]:
    return [list(range(n_aggs)) for _ in range(n_workers)]


def _seconds(nbytes: float, bps: float | None) -> float:
    return 0.0 if bps is None or nbytes == 0 else nbytes * 8 / bps


def host_of(inputs: PlanInputs) -> tuple[list[str], list[str]]:
    """The host (whose link it uses) of each worker and of each aggregator."""
    return [w.name for w in inputs.workers], [a.on or a.name for a in inputs.aggregators]


def loads(inputs: PlanInputs, counts: list[int], routes: list[list[int]]) -> dict[str, float]:
    """Seconds each resource needs for one all-reduce, by name: the model's terms.

    ``counts``: chunks rooted per aggregator (data + meta); ``routes`` as in Plan.
    Results go as the data plane sends them (bpf/xagg_xdp.c): a root sends one
    copy to each child and, with a group/broadcast fan-out, one group frame
    (which reaches every worker, those behind children too), or unicast copies
    to the workers it serves directly; a child fans its copy out again, a group
    frame or unicast to its own workers. Links are per host: a worker host
    that aggregates carries both roles' traffic on its one link, except what
    its worker and its aggregator exchange (through the program, not the link).
    """
    W, A, fb = inputs.workers, inputs.aggregators, inputs.frame_bytes
    w_host, a_host = host_of(inputs)
    rack = {**{w.name: w.rack for w in W}, **{a.on or a.name: a.rack for a in A}}
    pkts = [0.0] * len(A)         # packets each aggregator's program sums or passes
    h_in = dict.fromkeys(rack, 0.0)     # packets into each host over its link
    h_out = dict.fromkeys(rack, 0.0)    # packets out of it
    up = {r: 0.0 for r in inputs.uplinks}    # bytes leaving rack r
    down = {r: 0.0 for r in inputs.uplinks}  # bytes entering rack r

    def move(src: str, dst: str, k: float):
        """k packets from host src to host dst (nothing on the wire within a host)."""
        if src == dst:
            return
        h_out[src] += k
        h_in[dst] += k
        if rack[src] != rack[dst]:
            if rack[src] in up:
                up[rack[src]] += k * fb
            if rack[dst] in down:
                down[rack[dst]] += k * fb

    racks = set(rack.values())

    def group_frame(s: int, k: int):
        """One result frame from aggregator s to the group/broadcast address: one
        copy per link, every worker host; a broadcast also reaches the other
        aggregators (a group only workers joined does not); each uplink once."""
        src = a_host[s]
        h_out[src] += k
        reached = set(w_host) | ({a_host[a] for a in range(len(A))} if inputs.fanout == "bcast" else set())
        for h in reached - {src}:
            h_in[h] += k
        if inputs.fanout == "bcast":
            for a in range(len(A)):
                if a != s:
                    pkts[a] += k
        others = racks - {rack[src]}
        if others and rack[src] in up:
            up[rack[src]] += k * fb
        for r in others & set(down):
            down[r] += k * fb

    def unicast(s: int, ws, k: int):
        for w in ws:      # a copy to a worker on the aggregator's own host still leaves it
            if w_host[w] == a_host[s]:
                h_out[a_host[s]] += k
            move(a_host[s], w_host[w], k)

    for p, k in enumerate(counts):
        kids = {}                 # child -> the workers it sums for p
        for w, row in enumerate(routes):
            c = row[p]
            pkts[c] += k
            move(w_host[w], a_host[c], k)
            if c != p:
                kids.setdefault(c, []).append(w)
        for c in kids:            # one partial per chunk up, the result back down
            pkts[p] += k
            move(a_host[c], a_host[p], k)
            pkts[c] += k
            move(a_host[p], a_host[c], k)
        if inputs.fanout == "unicast":
            unicast(p, [w for w, row in enumerate(routes) if row[p] == p], k)
            for c, ws in kids.items():
                unicast(c, ws, k)
        else:
            for s in [p, *kids]:
                group_frame(s, k)
    out = {}
    link = {**{a.name: a for a in A}, **{w.name: w for w in W}}     # a worker host's link is the worker's
    for h in rack:
        out[f"{h} in"] = _seconds(h_in[h] * fb, link[h].down_bps)
        out[f"{h} out"] = _seconds(h_out[h] * fb, link[h].up_bps)
    for a, n in enumerate(A):
        out[f"{n.name} packets"] = 0.0 if n.pps is None else pkts[a] / n.pps
    for r in inputs.uplinks:
        out[f"rack{r} uplink out"] = _seconds(up[r], inputs.uplinks[r])
        out[f"rack{r} uplink in"] = _seconds(down[r], inputs.uplinks[r])
    return out


def floors(inputs: PlanInputs) -> dict[str, float]:
    """Terms no routing changes: the CPU the job needs (shared cores: all of
    it on them). (What each worker sends and receives depends on the plan
    once worker hosts aggregate: loads.)"""
    return {"cpu": _cpu_seconds(inputs, inputs.cpu.xagg_s_per_gb)}


def _cpu_seconds(inputs: PlanInputs, s_per_gb: float) -> float:
    per_worker = s_per_gb * inputs.gradient_bytes / 1e9
    c = inputs.cpu.shared_cores
    return per_worker if c is None else per_worker * len(inputs.workers) / c


def predict(inputs: PlanInputs, weights, routes=None) -> tuple[float, str]:
    """(seconds, the binding term) of an xagg plan under the exact chunk-level model."""
    routes = routes or flat_routes(len(inputs.workers), len(inputs.aggregators))
    terms = {**loads(inputs, chunk_counts(inputs, weights), routes), **floors(inputs)}
    name = max(terms, key=terms.get)
    return terms[name] + inputs.cpu.xagg_latency_s, name


def gloo_predict(inputs: PlanInputs) -> tuple[float, str]:
    """(seconds, the binding term) of gloo's ring over the workers in rank order:
    each worker sends and receives 2(N-1)/N x G; a ring edge between racks
    carries as much through both racks' uplinks."""
    W, n = inputs.workers, len(inputs.workers)
    if n == 1:
        return inputs.cpu.gloo_latency_s, "one worker"
    g = 2 * (n - 1) / n * inputs.gradient_bytes * inputs.gloo_wire_factor
    terms = {}
    for w in W:
        terms[f"{w.name} out"] = _seconds(g, w.up_bps)
        terms[f"{w.name} in"] = _seconds(g, w.down_bps)
    for r, bps in inputs.uplinks.items():
        leaving = sum(1 for i in range(n) if W[i].rack == r and W[(i + 1) % n].rack != r)
        entering = sum(1 for i in range(n) if W[i].rack != r and W[(i + 1) % n].rack == r)
        terms[f"rack{r} uplink out"] = _seconds(leaving * g, bps)
        terms[f"rack{r} uplink in"] = _seconds(entering * g, bps)
    terms["cpu"] = _cpu_seconds(inputs, inputs.cpu.gloo_s_per_gb)
    name = max(terms, key=terms.get)
    return terms[name] + inputs.cpu.gloo_latency_s, name


def flat_closed_form(inputs: PlanInputs) -> list[float]:
    """ROUTING.md's flat split, no solver: aggregator a's load per unit share
    L_a = max(N/D_a, m/U_a, N x packets/(G P_a)); f_a proportional to 1/L_a."""
    n, fan = len(inputs.workers), (len(inputs.workers) if inputs.fanout == "unicast" else 1)
    g, pk = inputs.wire_bytes, inputs.wire_bytes / inputs.frame_bytes
    inv = []
    for a in inputs.aggregators:
        load = max(_seconds(n * g, a.down_bps), _seconds(fan * g, a.up_bps),
                   0.0 if a.pps is None else n * pk / a.pps)
        inv.append(math.inf if load == 0 else 1 / load)
    if any(math.isinf(x) for x in inv):       # unlimited aggregators share equally
        inv = [1.0 if math.isinf(x) else 0.0 for x in inv]
    total = sum(inv)
    return [x / total for x in inv]


# -- deciding ---------------------------------------------------------------------------

def registrable(weights, n_chunks: int) -> list[float]:
    """``weights`` normalised, each aggregator given at least one chunk of the
    planned size: xaggd registers a job only with n_chunks >= 1 at every
    aggregator of it (a share of 0 would have to leave the job instead)."""
    total = sum(weights)
    ws = [w / total for w in weights]
    floor = 1.0 / n_chunks
    while True:
        counts = [hi - lo for lo, hi in chunks.split(n_chunks, ws)]
        if all(counts) or floor > 1.0 / len(ws):
            return ws
        ws = [max(w, floor) for w in ws]
        total = sum(ws)
        ws = [w / total for w in ws]
        floor *= 2


def _clean(weights) -> list[float]:
    """An LP's shares, solver noise dropped (an aggregator at 1e-9 roots nothing)."""
    out = [f if f > 1e-6 else 0.0 for f in weights]
    return out if sum(out) > 0 else [1.0] * len(out)


def _candidates(inputs: PlanInputs, samples: int, seed: int) -> list[tuple[list, list]]:
    """(weights, routes) worth scoring: the equal, closed-form and LP flat splits,
    everything on one aggregator, and the LP's tree rounded (each with its own split)."""
    from xagg.wire.planner_lp import round_routes, solve   # scipy only when planning
    n_w, n_a = len(inputs.workers), len(inputs.aggregators)
    flat = flat_routes(n_w, n_a)
    out = [([1.0] * n_a, flat), (flat_closed_form(inputs), flat)]
    # everything on one aggregator (the others keep one chunk each): see TIE
    out += [([1.0 if q == p else 0.0 for q in range(n_a)], flat) for p in range(n_a)] if n_a > 1 else []
    lp = solve(inputs)
    if lp is not None:
        out.append((_clean(lp.weights), flat))
        out.append((_clean(solve(inputs, flat).weights), flat))
        if lp.is_tree:
            # whole tree edges drawn from the LP's fractions, each with its own best split
            seen = set()
            for routes in round_routes(lp, samples, seed):
                key = tuple(map(tuple, routes))
                if key not in seen and routes != flat:
                    seen.add(key)
                    out.append((_clean(solve(inputs, routes).weights), routes))
    return out


def make_plan(inputs: PlanInputs, samples: int = 64, seed: int = 0) -> Plan:
    """The best plan for ``inputs``: the LP's split and routes, rounded to whole
    chunks and tree edges, scored by the exact model (so never worse than the
    flat splits it also scores), under each fan-out the inputs allow; or gloo
    when its ring is predicted faster. Deterministic for the same inputs
    (seeded rounding)."""
    inputs.validate()
    flat_s, _ = predict(inputs, [1.0] * len(inputs.aggregators))
    gloo_s, gloo_why = gloo_predict(inputs)
    scored = []
    for fi, fanout in enumerate(inputs.fanout_choices or (inputs.fanout,)):
        inp = dataclasses.replace(inputs, fanout=fanout)
        for i, (w, r) in enumerate(_candidates(inp, samples, seed)):
            scored.append((predict(inp, registrable(w, inp.n_chunks), r)[0], fi, i, w, r, inp))
    # the fastest; among those within TIE of it: the first fan-out listed, the
    # fewest data streams (the most concentrated split), the earlier candidate
    fastest = min(s[0] for s in scored)
    _, _, _, weights, routes, inp = min((s for s in scored if s[0] <= fastest * (1 + TIE)),
                                        key=lambda s: (s[1], -max(s[3]) / sum(s[3]), s[2]))
    weights = registrable(weights, inputs.n_chunks)
    best_s, why = predict(inp, weights, routes)
    kind = "tree" if any(c != p for row in routes for p, c in enumerate(row)) else "flat"
    if gloo_s < best_s:
        return Plan("gloo", weights, routes, gloo_s, flat_s, gloo_s, best_s, gloo_why,
                    f"gloo's ring ({gloo_s * 1e3:.0f} ms, bound by {gloo_why}) beats the best xagg plan "
                    f"({best_s * 1e3:.0f} ms, bound by {why})", inp.fanout)
    return Plan(kind, weights, routes, best_s, flat_s, gloo_s, best_s, why,
                f"{kind} xagg plan ({best_s * 1e3:.0f} ms, bound by {why}; results {inp.fanout}) "
                f"beats gloo's ring ({gloo_s * 1e3:.0f} ms)", inp.fanout)


# -- the file format -----------------------------------------------------------------------

def _bps(value, where: str) -> float | None:
    try:
        return parse_bps(value, where)
    except ValueError as e:
        raise PlanInputError(where, str(e).split(": ", 1)[1]) from None


def _node(d: dict, where: str, agg: bool) -> Node:
    if not isinstance(d, dict) or "name" not in d:
        raise PlanInputError(where, f"expected an object with a name, got {d!r}")
    known = {"name", "rate", "up", "down", "rack", "pps", "queues", "pps_per_queue"} | ({"on"} if agg else set())
    extra = set(d) - known
    if extra:
        raise PlanInputError(f"{where}.{sorted(extra)[0]}", f"unknown field (known: {sorted(known)})")
    if "on" in d:
        link = sorted({"rate", "up", "down"} & set(d))
        if link:
            raise PlanInputError(f"{where}.{link[0]}", f"an aggregator on worker {d['on']!r} uses that "
                                 "worker's link: give its rate there")
    rate = _bps(d.get("rate"), f"{where}.rate")
    up = _bps(d["up"], f"{where}.up") if "up" in d else rate
    down = _bps(d["down"], f"{where}.down") if "down" in d else rate
    pps = None
    if agg:
        if "pps" in d:
            pps = d["pps"]
        else:
            pps = d.get("pps_per_queue", DEFAULT_AGG_PPS_PER_QUEUE) * d.get("queues", 1)
    return Node(str(d["name"]), up, down, d.get("rack", 0), pps, d.get("on"))


def _on_its_host(n: Node, d: dict, workers: list) -> Node:
    """An aggregator on a worker's host is in that worker's rack unless the file says otherwise."""
    if n.on is not None and "rack" not in d:
        n.rack = next((w.get("rack", 0) for w in workers if isinstance(w, dict) and w.get("name") == n.on), 0)
    return n


def inputs_from_dict(d: dict) -> PlanInputs:
    """PlanInputs from the operator's file format (JSON; docs/planner.md)::

        {"workers": [{"name": "w0", "rate": "1gbit"}, ...],
         "aggregators": [{"name": "a0", "rate": "4gbit", "queues": 2},
                         {"name": "w0agg", "on": "w0"}, ...],     # w0's host aggregates too
         "uplinks": {"0": "500mbit"}, "mb": 16, "vals": 2233, "fanout": "bcast",
         "fanouts": ["mcast", "unicast"],     # optional: let the planner pick one
         "cpu": {"shared_cores": 2}}

    A host's ``rate`` sets both directions; ``up``/``down`` override one.
    PlanInputError names the field of anything wrong.
    """
    if not isinstance(d, dict):
        raise PlanInputError("inputs", f"expected an object, got {type(d).__name__}")
    known = {"workers", "aggregators", "uplinks", "mb", "elements", "vals", "fanout", "fanouts",
             "overhead_bytes", "gloo_wire_factor", "cpu", "trees"}
    extra = set(d) - known
    if extra:
        raise PlanInputError(sorted(extra)[0], f"unknown field (known: {sorted(known)})")
    for need in ("workers", "aggregators", "vals"):
        if need not in d:
            raise PlanInputError(need, "missing")
    if not isinstance(d["workers"], list) or not isinstance(d["aggregators"], list):
        raise PlanInputError("workers" if not isinstance(d["workers"], list) else "aggregators",
                             "expected a list of hosts")
    if "elements" in d:
        elements = d["elements"]
    elif "mb" in d:
        mb = d["mb"]
        if not isinstance(mb, (int, float)) or isinstance(mb, bool) or mb <= 0:
            raise PlanInputError("mb", f"must be > 0 (MB of float32 gradient), got {mb!r}")
        elements = int(mb * 250_000)
    else:
        raise PlanInputError("mb", "missing (or give elements)")
    cpu_d = d.get("cpu", {})
    if not isinstance(cpu_d, dict):
        raise PlanInputError("cpu", f"expected an object, got {cpu_d!r}")
    fields = {f.name for f in dataclasses.fields(CpuCosts)}
    bad = set(cpu_d) - fields
    if bad:
        raise PlanInputError(f"cpu.{sorted(bad)[0]}", f"unknown field (known: {sorted(fields)})")
    uplinks = {}
    if not isinstance(d.get("uplinks", {}), dict):
        raise PlanInputError("uplinks", "expected an object {rack: rate}")
    for r, v in d.get("uplinks", {}).items():
        try:
            rack = int(r)
        except ValueError:
            raise PlanInputError(f"uplinks.{r}", "rack numbers are integers") from None
        uplinks[rack] = _bps(v, f"uplinks.{r}")
    inputs = PlanInputs(
        workers=[_node(w, f"workers[{i}]", False) for i, w in enumerate(d["workers"])],
        aggregators=[_on_its_host(_node(a, f"aggregators[{i}]", True), a, d["workers"])
                     for i, a in enumerate(d["aggregators"])],
        elements=elements, vals=d["vals"], fanout=d.get("fanout", "bcast"), uplinks=uplinks,
        fanout_choices=tuple(d["fanouts"]) if isinstance(d.get("fanouts"), list) else d.get("fanouts", ()),
        overhead_bytes=d.get("overhead_bytes", DEFAULT_OVERHEAD_BYTES),
        gloo_wire_factor=d.get("gloo_wire_factor", DEFAULT_GLOO_WIRE_FACTOR),
        cpu=CpuCosts(**cpu_d), trees=d.get("trees", True))
    return inputs.validate()


def inputs_to_dict(inputs: PlanInputs) -> dict:
    """The file format again (rates in bits/s), so a plan's inputs can be saved and replayed."""
    def node(n: Node, agg: bool) -> dict:
        out = {"name": n.name, "rack": n.rack}
        if n.up_bps is not None:
            out["up"] = n.up_bps
        if n.down_bps is not None:
            out["down"] = n.down_bps
        if agg and n.pps is not None:
            out["pps"] = n.pps
        if agg and n.on is not None:
            out = {"name": n.name, "on": n.on, "rack": n.rack, **({"pps": n.pps} if n.pps is not None else {})}
        return out
    return {"workers": [node(w, False) for w in inputs.workers],
            "aggregators": [node(a, True) for a in inputs.aggregators],
            "uplinks": {str(r): v for r, v in inputs.uplinks.items() if v is not None},
            "elements": inputs.elements, "vals": inputs.vals, "fanout": inputs.fanout,
            "fanouts": list(inputs.fanout_choices),
            "overhead_bytes": inputs.overhead_bytes, "gloo_wire_factor": inputs.gloo_wire_factor,
            "cpu": dataclasses.asdict(inputs.cpu), "trees": inputs.trees}

"""The planner's exact model: how long an all-reduce takes under a plan.

An all-reduce of G bytes takes as long as its busiest resource needs
(docs/planner.md),

    T = max(every link's bytes / its rate, every aggregator's packets / its
            packet rate, every worker's floor G/U_w and G/D_w, the CPU)
        + a fixed per-call latency,

where the loads follow from the plan: aggregator p roots a share f_p of the
chunks; worker w sends its part of p's chunks to routes[w][p] (p itself, or
a child aggregator c that sums them and sends one partial to p); p sends
the results once (a broadcast fan-out) or once per worker (unicast). A
rack's uplink carries whatever crosses it. The same loads, with fractions
instead of whole chunks, are the LP that planner_lp.py solves; this module
evaluates them exactly (whole chunks, meta chunks, frame overheads).
"""
from __future__ import annotations

import math

from xagg.wire import chunks
from xagg.wire.planner_inputs import PlanInputs


def chunk_counts(inputs: PlanInputs, weights) -> list[int]:
    """Chunks (data + meta) each aggregator roots under ``weights``: the monotone split."""
    return [(hi - lo) + chunks.meta_chunks(hi - lo, inputs.vals)
            for lo, hi in chunks.split(inputs.n_chunks, list(weights))]


def flat_routes(n_workers: int, n_aggs: int) -> list[list[int]]:
    return [list(range(n_aggs)) for _ in range(n_workers)]


def rack_tree_routes(inputs: PlanInputs) -> list[list[int]]:
    """The rack tree (ALEPH's): each worker sends another rack's root's chunks
    through a dedicated aggregator of its own rack, the one at the root's
    place among its rack's aggregators (so a rack's children share the other
    racks' roots), and its own rack's roots' chunks directly; a rack with no
    dedicated aggregator sends everything directly."""
    in_rack: dict = {}
    for a, node in enumerate(inputs.aggregators):
        in_rack.setdefault(node.rack, []).append(a)
    place = {a: aggs.index(a) for aggs in in_rack.values() for a in aggs}
    kids = {r: [a for a in aggs if inputs.aggregators[a].on is None] for r, aggs in in_rack.items()}
    routes = []
    for w in inputs.workers:
        mine = kids.get(w.rack, [])
        routes.append([p if inputs.aggregators[p].rack == w.rack or not mine
                       else mine[place[p] % len(mine)] for p in range(len(inputs.aggregators))])
    return routes


def _seconds(nbytes: float, bps: float | None) -> float:
    return 0.0 if bps is None or nbytes == 0 else nbytes * 8 / bps


def host_of(inputs: PlanInputs) -> tuple[list[str], list[str]]:
    """The host (whose link it uses) of each worker and of each aggregator."""
    return [w.name for w in inputs.workers], [a.on or a.name for a in inputs.aggregators]


class _Traffic:
    """The packets one all-reduce puts on each host's link, each rack's uplink
    and each aggregator's program, tallied as the plan moves them.

    Workers alike (the same rack, rates and routes, no aggregator on their
    host) load their own links alike: one of them (the class's first) is tallied
    for all, m times over where they meet a shared resource, and the others
    copy its figures at the end; so a plan's cost grows with its classes and
    aggregators, not its workers times its aggregators."""

    def __init__(self, inputs: PlanInputs, routes: list[list[int]]):
        self.inputs, self.fb = inputs, inputs.frame_bytes
        self.w_host, self.a_host = host_of(inputs)
        self.rack = {**{w.name: w.rack for w in inputs.workers},
                     **{a.on or a.name: a.rack for a in inputs.aggregators}}
        self.classes = _classes(inputs, routes)       # (members, the row they share)
        self.pkts = [0.0] * len(inputs.aggregators)    # packets each aggregator's program sums or passes
        self.h_in = dict.fromkeys(self.rack, 0.0)      # packets into each host over its link
        self.h_out = dict.fromkeys(self.rack, 0.0)     # packets out of it
        self.heard = 0.0                               # group frames every worker host hears
        self.worker_hosts = set(self.w_host)
        self.agg_only = set(self.a_host) - self.worker_hosts
        self.racks = set(self.rack.values())
        self.up = dict.fromkeys(inputs.uplinks, 0.0)   # bytes leaving rack r
        self.down = dict.fromkeys(inputs.uplinks, 0.0)  # bytes entering rack r

    def move(self, src: str, dst: str, k: float, m: int = 1, each: str = ""):
        """k packets from host src to host dst (nothing on the wire within a
        host), for m alike workers: ``each`` (src or dst) is their class's
        tallied host, whose link carries k; the other end carries k x m."""
        if src == dst:
            return
        self.h_out[src] += k if each == src else k * m
        self.h_in[dst] += k if each == dst else k * m
        if self.rack[src] != self.rack[dst]:
            if self.rack[src] in self.up:
                self.up[self.rack[src]] += k * m * self.fb
            if self.rack[dst] in self.down:
                self.down[self.rack[dst]] += k * m * self.fb

    def group_frame(self, s: int, k: int):
        """One result frame from aggregator s to the group/broadcast address: one
        copy per link, every worker host; a broadcast also reaches the other
        aggregators (a group only workers joined does not); each uplink once."""
        src, n_a = self.a_host[s], len(self.a_host)
        self.h_out[src] += k
        self.heard += k
        if src in self.worker_hosts:           # a worker host does not hear its own frame
            self.h_in[src] -= k
        if self.inputs.results.reaches_aggregators:
            for h in self.agg_only - {src}:
                self.h_in[h] += k
            for a in range(n_a):
                if a != s:
                    self.pkts[a] += k
        others = self.racks - {self.rack[src]}
        if others and self.rack[src] in self.up:
            self.up[self.rack[src]] += k * self.fb
        for r in others & set(self.down):
            self.down[r] += k * self.fb

    def unicast(self, s: int, classes, k: int):
        for ws, _ in classes:   # a copy to a worker on the aggregator's own host still leaves it
            w = self.w_host[ws[0]]
            if w == self.a_host[s]:
                self.h_out[w] += k
            self.move(self.a_host[s], w, k, len(ws), each=w)

    def root(self, p: int, k: int):
        """Aggregator p's k chunks: in from its workers (directly or as its
        children's partials), the results back out."""
        kids = {}                 # child -> the classes it sums for p
        for ws, row in self.classes:
            c, w = row[p], self.w_host[ws[0]]
            self.pkts[c] += k * len(ws)
            self.move(w, self.a_host[c], k, len(ws), each=w)
            if c != p:
                kids.setdefault(c, []).append((ws, row))
        for c in kids:            # one partial per chunk up, the result back down
            self.pkts[p] += k
            self.move(self.a_host[c], self.a_host[p], k)
            self.pkts[c] += k
            self.move(self.a_host[p], self.a_host[c], k)
        if self.inputs.results.one_frame:
            for s in [p, *kids]:
                self.group_frame(s, k)
        else:
            self.unicast(p, [(ws, row) for ws, row in self.classes if row[p] == p], k)
            for c, classes in kids.items():
                self.unicast(c, classes, k)

    def seconds(self, every_worker: bool = True) -> dict[str, float]:
        """Each resource's seconds by name; ``every_worker`` False: a class's
        tallied worker stands for the others (each the same figures, and
        the first in order, so the busiest term and its name are the same)."""
        inputs, fb = self.inputs, self.fb
        others = {self.w_host[w] for ws, _ in self.classes for w in ws[1:]}
        if every_worker:
            for ws, _ in self.classes:              # the class's links: its tallied worker's
                for w in ws[1:]:
                    self.h_in[self.w_host[w]] = self.h_in[self.w_host[ws[0]]]
                    self.h_out[self.w_host[w]] = self.h_out[self.w_host[ws[0]]]
            others = set()
        for h in self.w_host:
            self.h_in[h] += self.heard
        out = {}
        link = {**{a.name: a for a in inputs.aggregators},
                **{w.name: w for w in inputs.workers}}     # a worker host's link is the worker's
        for h in self.rack:
            if h in others:
                continue
            out[f"{h} in"] = _seconds(self.h_in[h] * fb, link[h].down_bps)
            out[f"{h} out"] = _seconds(self.h_out[h] * fb, link[h].up_bps)
        for a, n in enumerate(inputs.aggregators):
            out[f"{n.name} packets"] = 0.0 if n.pps is None else self.pkts[a] / n.pps
        for r, bps in inputs.uplinks.items():
            out[f"rack{r} uplink out"] = _seconds(self.up[r], bps)
            out[f"rack{r} uplink in"] = _seconds(self.down[r], bps)
        return out


def _classes(inputs: PlanInputs, routes: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Workers whose links the plan loads alike, (indices, their route row):
    the same rack, link rates and routes, no aggregator on their host."""
    hosting = {a.on for a in inputs.aggregators if a.on is not None}
    out: dict = {}
    for w, n in enumerate(inputs.workers):
        key = (n.name,) if n.name in hosting else (n.rack, n.up_bps, n.down_bps, tuple(routes[w]))
        out.setdefault(key, []).append(w)
    return [(ws, routes[ws[0]]) for ws in out.values()]


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
    traffic = _Traffic(inputs, routes)
    for p, k in enumerate(counts):
        traffic.root(p, k)
    return traffic.seconds()


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
    traffic = _Traffic(inputs, routes)
    for p, k in enumerate(chunk_counts(inputs, weights)):
        traffic.root(p, k)
    terms = {**traffic.seconds(every_worker=False), **floors(inputs)}
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
    """The flat split in closed form, no solver: aggregator a's load per unit share
    L_a = max(N/D_a, m/U_a, N x packets/(G P_a)); f_a proportional to 1/L_a."""
    n = len(inputs.workers)
    fan = 1 if inputs.results.one_frame else n
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


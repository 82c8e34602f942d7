"""The planner's LP relaxation (scipy HiGHS) and the rounding of its routes.

Workers alike in everything the model sees (rack, link rates, no
aggregator on their host, and with routes given, the same routes) form a
group: the LP is symmetric in them, so it has an optimum where they all
route alike, and its variables are per group. A thousand workers in a few
racks are a few groups, which is what keeps the LP small.

Variables, as fractions of one worker's gradient:

    T                 the time to minimise (seconds)
    f[p]              share of the chunks rooted at aggregator p, sum 1
    x[g, c, p]        each of group g's workers' part of p's chunks sent
                      through c (c == p: direct), sum over c = f[p]
    y[c, p]           c's partial of p's chunks, >= every x[g, c, p] (c != p):
                      one partial per chunk, however many workers c sums

Every row is "resource load / capacity <= T" for the loads of planner_model.loads
(host links, aggregator packet rates, rack uplinks), results counted as the
data plane sends them down a tree: the root one copy per child and per
worker it serves directly (unicast) or one group frame, each child its own
fan-out again. The floor no routing changes (the CPU) is added back when a
rounded plan is scored. A worker host that aggregates has one link for both
roles, and its worker's part of its own share never crosses it; such an
aggregator is never a child. A child is drawn from the worker's rack or the
root's (one in a third rack would put the share on two more uplink
crossings). A tiny cost on indirect routes keeps a tie flat.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from xagg.wire.planner_inputs import PlanInputs
from xagg.wire.planner_model import host_of

TREE_PENALTY = 1e-7     # seconds per unit of indirect route: a tie goes to the flat plan


def worker_groups(inputs: PlanInputs, routes: list[list[int]] | None = None) -> list[list[int]]:
    """Workers the LP cannot tell apart, as lists of worker indices in order:
    the same rack and link rates, no aggregator on their host, and (with
    ``routes``) the same route row."""
    hosting = {a.on for a in inputs.aggregators if a.on is not None}
    out: dict = {}
    for w, n in enumerate(inputs.workers):
        key = (n.name,) if n.name in hosting else (n.rack, n.up_bps, n.down_bps)
        if routes is not None:
            key += tuple(routes[w])
        out.setdefault(key, []).append(w)
    return list(out.values())


@dataclass
class LpSolution:
    t: float                  # the relaxation's optimum (routable loads only), seconds
    weights: list[float]      # f[p]
    groups: list[list[int]]   # worker_groups
    x: np.ndarray             # [g, c, p]: each of group g's workers' part

    @property
    def is_tree(self) -> bool:
        n_a = self.x.shape[1]
        off = ~np.eye(n_a, dtype=bool)
        return bool((self.x[:, off] > 1e-9).any())

    def part(self, w: int, c: int, p: int) -> float:
        """Worker w's part of p's chunks sent through c."""
        return float(self.x[next(g for g, ws in enumerate(self.groups) if w in ws), c, p])


class _Rows:
    """The LP's variables (T, f[p], the x[g, c, p] a group may use, the
    y[c, p] of possible children) and its "load / capacity <= T" rows, each
    {variable: coefficient} with its capacity in units of one worker's
    gradient per second."""

    def __init__(self, inputs: PlanInputs, trees: bool, routes: list[list[int]] | None):
        self.inputs = inputs
        self.W, self.A = inputs.workers, inputs.aggregators
        self.n_a = len(self.A)
        self.groups = worker_groups(inputs, routes)
        self.m = [len(ws) for ws in self.groups]
        self.g_rack = [self.W[ws[0]].rack for ws in self.groups]
        w_host, self.a_host = host_of(inputs)
        self.g_host = [w_host[ws[0]] for ws in self.groups]
        self.g = inputs.wire_bytes * 8
        self.pk = inputs.wire_bytes / inputs.frame_bytes
        self.one_frame = inputs.results.one_frame
        self.several = len({h.rack for h in self.W + self.A}) > 1
        self.x: dict = {}         # (g, c, p) -> variable
        self.y: dict = {}         # (c, p) -> variable
        n = 1 + self.n_a
        for g, ws in enumerate(self.groups):
            for p in range(self.n_a):
                for c in self._via(g, p, trees, None if routes is None else routes[ws[0]][p]):
                    self.x[g, c, p] = n
                    n += 1
        for (g, c, p) in self.x:
            if c != p and (c, p) not in self.y:
                self.y[c, p] = n
                n += 1
        self.n_var = n
        self.x_via: dict = {}     # c -> [(g, p, variable)]
        self.x_of: dict = {}      # g -> [(c, p, variable)]
        for (g, c, p), j in self.x.items():
            self.x_via.setdefault(c, []).append((g, p, j))
            self.x_of.setdefault(g, []).append((c, p, j))
        self.y_at: dict = {}      # a -> [(c, p, variable)] where a is c or p
        for (c, p), j in self.y.items():
            self.y_at.setdefault(c, []).append((c, p, j))
            self.y_at.setdefault(p, []).append((c, p, j))
        self.rows: list[dict] = []
        self.caps: list[float] = []

    def _via(self, g: int, p: int, trees: bool, fixed: int | None) -> list[int]:
        """The aggregators group g may send p's chunks through."""
        if fixed is not None:
            return [fixed]
        if not trees:
            return [p]
        return [c for c in range(self.n_a) if c == p or (
            self.A[c].on is None and self.A[c].rack in (self.g_rack[g], self.A[p].rack))]

    def fi(self, p):
        return 1 + p

    def add(self, row: dict, cap: float):
        self.rows.append(row)
        self.caps.append(cap)

    @staticmethod
    def _put(row: dict, j: int, v: float):
        row[j] = row.get(j, 0.0) + v

    def into(self, a, link=False) -> dict:
        """What enters aggregator a, in shares of a worker's gradient (over
        its link: not its own host's worker's part): its workers' parts, its
        children's partials, its roots' results (as a child), and every
        other aggregator's results where a broadcast reaches it."""
        row: dict = {}
        for g, p, j in self.x_via.get(a, []):
            if not (link and self.g_host[g] == self.a_host[a]):
                self._put(row, j, self.m[g])
        for c, p, j in self.y_at.get(a, []):          # a partial in, or the result down to a
            self._put(row, j, 1.0)
        if self.inputs.results.reaches_aggregators:
            for (c, p), j in self.y.items():
                if c != a:                             # a child's broadcast
                    self._put(row, j, 1.0)
            for p in range(self.n_a):
                if p != a:
                    self._put(row, self.fi(p), 1.0)
        return row

    def results_out(self, a) -> dict:
        """What leaves aggregator a: its partials up, a copy of each result to
        each of its children, and its results' fan-out: one group frame per
        share it roots or sums as a child, or one copy per worker it serves."""
        row: dict = {}
        for c, p, j in self.y_at.get(a, []):
            self._put(row, j, 2.0 if c == a and self.one_frame else 1.0)
        if self.one_frame:
            self._put(row, self.fi(a), 1.0)
        else:
            for g, p, j in self.x_via.get(a, []):
                self._put(row, j, self.m[g])
        return row

    def aggregators(self):
        for a, n in enumerate(self.A):
            if n.on is None and n.down_bps is not None:
                self.add(self.into(a, link=True), n.down_bps / self.g)
            if n.on is None and n.up_bps is not None:
                self.add(self.results_out(a), n.up_bps / self.g)
            if n.pps is not None:
                self.add(self.into(a), n.pps / self.pk)

    def worker_hosts(self):
        """A worker host that aggregates: what its link carries for both roles.
        (Any other worker's sends the whole gradient and receives every sum,
        whatever the plan: the floor its link puts under T is no routing's to
        change, and left out here it lets the LP balance what routing does.)"""
        agg_on = {self.a_host[a]: a for a in range(self.n_a) if self.A[a].on is not None}
        for g, ws in enumerate(self.groups):
            a = agg_on.get(self.g_host[g])
            if a is None:
                continue
            n = self.W[ws[0]]
            off = [j for c, p, j in self.x_of[g] if self.a_host[c] != self.g_host[g]]
            if n.up_bps is not None:
                row = dict.fromkeys(off, 1.0)
                for j, v in self.results_out(a).items():
                    self._put(row, j, v)
                self.add(row, n.up_bps / self.g)
            if n.down_bps is not None:
                # the worker's results: every other root's and child's group frame, or
                # a copy of each part it sent off its host
                if self.one_frame:
                    row = {self.fi(p): 1.0 for p in range(self.n_a) if self.a_host[p] != self.g_host[g]}
                    row.update({j: 1.0 for (c, p), j in self.y.items()})
                else:
                    row = dict.fromkeys(off, 1.0)
                for j, v in self.into(a, link=True).items():
                    row[j] = max(row.get(j, 0.0), v)     # a broadcast reaches the host once
                self.add(row, n.down_bps / self.g)

    def uplinks(self, bps: dict):
        """What crosses each rack's uplink each way: parts to another rack's
        aggregator (and their unicast results back), partials up and results
        down a tree edge between racks, every group frame once out of its
        sender's rack and once into each other rack."""
        A, racks = self.A, [r for r, b in bps.items() if b is not None]
        out: dict = {r: {} for r in racks}
        inn: dict = {r: {} for r in racks}

        def put(side, r, j, v):
            if r in side:
                self._put(side[r], j, v)

        for (g, c, p), j in self.x.items():
            rw, rc = self.g_rack[g], A[c].rack
            if rw != rc:
                put(out, rw, j, self.m[g])
                put(inn, rc, j, self.m[g])
                if not self.one_frame:                  # its unicast results come back
                    put(out, rc, j, self.m[g])
                    put(inn, rw, j, self.m[g])
        for (c, p), j in self.y.items():
            rc, rp = A[c].rack, A[p].rack
            if rc != rp:                                # a partial up and a result down
                for r in (rc, rp):
                    put(out, r, j, 1.0)
                    put(inn, r, j, 1.0)
            if self.one_frame:                          # the child's group frame
                self._frame(out, inn, rc, j, put)
        if self.one_frame:
            for p in range(self.n_a):
                self._frame(out, inn, A[p].rack, self.fi(p), put)
        for r in racks:
            self.add(out[r], bps[r] / self.g)
            self.add(inn[r], bps[r] / self.g)

    def _frame(self, out, inn, src_rack, j, put):
        if self.several:
            put(out, src_rack, j, 1.0)
        for r in inn:
            if r != src_rack:
                put(inn, r, j, 1.0)


def _constraints(lp: _Rows):
    """(A_ub, b_ub, A_eq, b_eq): every row as load / capacity - T <= 0, a
    partial at least every part it sums, the shares summing to 1 and each
    group's workers sending all of each share."""
    from scipy.sparse import coo_matrix
    ri, ci, vs = [], [], []
    for i, (row, cap) in enumerate(zip(lp.rows, lp.caps)):
        for j, v in row.items():
            ri.append(i), ci.append(j), vs.append(v / cap)      # load / capacity - T <= 0
        ri.append(i), ci.append(0), vs.append(-1.0)
    i = len(lp.rows)
    for (g, c, p), j in lp.x.items():
        if c != p:                                  # x[g, c, p] - y[c, p] <= 0
            ri += [i, i]
            ci += [j, lp.y[c, p]]
            vs += [1.0, -1.0]
            i += 1
    a_ub = coo_matrix((vs, (ri, ci)), shape=(i, lp.n_var))
    ri, ci, vs = [0] * lp.n_a, [lp.fi(p) for p in range(lp.n_a)], [1.0] * lp.n_a
    eq = {}
    for (g, c, p), j in lp.x.items():
        if (g, p) not in eq:
            eq[g, p] = 1 + len(eq)
            ri.append(eq[g, p]), ci.append(lp.fi(p)), vs.append(-1.0)
        ri.append(eq[g, p]), ci.append(j), vs.append(1.0)
    a_eq = coo_matrix((vs, (ri, ci)), shape=(1 + len(eq), lp.n_var))
    b_eq = np.zeros(1 + len(eq))
    b_eq[0] = 1.0
    return a_ub, np.zeros(i), a_eq, b_eq


def solve(inputs: PlanInputs, routes: list[list[int]] | None = None) -> LpSolution | None:
    """The LP optimum, or None when nothing routable is limited (every
    aggregator link, packet rate and uplink unshaped: any split is as good).
    With ``routes`` (whole routes, as in Plan) only the split is free: the
    best weights for those routes."""
    from scipy.optimize import linprog

    n_a = len(inputs.aggregators)
    lp = _Rows(inputs, trees=inputs.trees and n_a > 1, routes=routes)
    lp.aggregators()
    lp.worker_hosts()
    lp.uplinks(inputs.uplinks)
    if not lp.rows:
        return None
    a_ub, b_ub, a_eq, b_eq = _constraints(lp)
    cost = np.zeros(lp.n_var)
    cost[0] = 1.0
    cost[list(lp.y.values())] = TREE_PENALTY
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=b_ub, A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=(0, None),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"planner LP failed: {res.message}")
    v = res.x
    x = np.zeros((len(lp.groups), n_a, n_a))
    for (g, c, p), j in lp.x.items():
        x[g, c, p] = v[j]
    return LpSolution(float(v[0]), [float(v[lp.fi(p)]) for p in range(n_a)], lp.groups, x)


def round_routes(lp: LpSolution, n_workers: int, samples: int, seed: int) -> list[list[list[int]]]:
    """Whole tree edges from the LP's fractional routes, each route matrix
    once: the most likely child for each (group, root p), each group's
    workers shared among p's children in proportion to x[g, c, p] / f[p]
    (largest remainder, in worker order), and GRID-style ``samples`` seeded
    draws (every host draws the same) where each group picks one child with
    probability x[g, c, p] / f[p]. A group that routes alike shares one row
    list. The caller keeps the best under the exact model."""
    n_g, n_a, _ = lp.x.shape
    rng = random.Random(seed)

    def probs(g, p):
        col = [max(lp.x[g, c, p], 0.0) for c in range(n_a)]
        s = sum(col)
        return [1.0 if c == p else 0.0 for c in range(n_a)] if s <= 1e-12 else [v / s for v in col]

    table = [[probs(g, p) for p in range(n_a)] for g in range(n_g)]

    def whole(rows) -> list[list[int]]:
        """Routes from one row per group."""
        routes: list = [None] * n_workers
        for ws, row in zip(lp.groups, rows):
            for w in ws:
                routes[w] = row
        return routes

    def shared() -> list[list[int]]:
        routes = [[0] * n_a for _ in range(n_workers)]
        for g, ws in enumerate(lp.groups):
            for p in range(n_a):
                exact = [q * len(ws) for q in table[g][p]]
                counts = [int(e) for e in exact]
                for c in sorted(range(n_a), key=lambda c: counts[c] - exact[c])[:len(ws) - sum(counts)]:
                    counts[c] += 1
                for w, c in zip(ws, [c for c in range(n_a) for _ in range(counts[c])]):
                    routes[w][p] = c
        return routes

    likely = tuple(tuple(max(range(n_a), key=lambda c: (table[g][p][c], c == p)) for p in range(n_a))
                   for g in range(n_g))
    def draw(g, p):        # a settled choice takes no draw
        return likely[g][p] if table[g][p][likely[g][p]] > 1 - 1e-9 else \
            rng.choices(range(n_a), weights=table[g][p])[0]

    draws = [likely] + [tuple(tuple(draw(g, p) for p in range(n_a)) for g in range(n_g)) for _ in range(samples)]
    out = [whole([list(row) for row in draws[0]]), shared()]
    seen = {draws[0]}
    for d in draws[1:]:
        if d not in seen:
            seen.add(d)
            out.append(whole([list(row) for row in d]))
    return out

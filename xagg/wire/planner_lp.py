"""The planner's LP relaxation (scipy HiGHS) and the rounding of its routes.

Variables, as fractions of one worker's gradient:

    T                 the time to minimise (seconds)
    f[p]              share of the chunks rooted at aggregator p, sum 1
    x[w, c, p]        worker w's part of p's chunks sent through c (c == p:
                      direct), sum over c = f[p]
    y[c, p]           c's partial of p's chunks, >= every x[w, c, p] (c != p):
                      one partial per chunk, however many workers c sums

Every row is "resource load / capacity <= T" for the loads of planner_model.loads
(host links, aggregator packet rates, rack uplinks); the floor no routing
changes (the CPU) is added back when a rounded plan is scored. A worker
host that aggregates has one link for both roles, and its worker's part of
its own share never crosses it; such an aggregator is never a child. A tiny
cost on indirect routes keeps a tie flat.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from xagg.wire.planner_inputs import PlanInputs
from xagg.wire.planner_model import host_of

TREE_PENALTY = 1e-7     # seconds per unit of indirect route: a tie goes to the flat plan


@dataclass
class LpSolution:
    t: float                  # the relaxation's optimum (routable loads only), seconds
    weights: list[float]      # f[p]
    x: np.ndarray             # [w, c, p]

    @property
    def is_tree(self) -> bool:
        n_a = self.x.shape[1]
        off = ~np.eye(n_a, dtype=bool)
        return bool((self.x[:, off] > 1e-9).any())


class _Rows:
    """The LP's variables (T, f[p], x[w, c, p], y[c, p], in that order) and
    its "load / capacity <= T" rows, each {variable: coefficient} with its
    capacity in units of one worker's gradient per second."""

    def __init__(self, inputs: PlanInputs, trees: bool):
        self.inputs, self.trees = inputs, trees
        self.W, self.A = inputs.workers, inputs.aggregators
        self.n_w, self.n_a = len(self.W), len(self.A)
        self.n_var = 1 + self.n_a + self.n_w * self.n_a * self.n_a + self.n_a * self.n_a
        self.g = inputs.wire_bytes * 8
        self.pk = inputs.wire_bytes / inputs.frame_bytes
        self.fan = 1 if inputs.results.one_frame else self.n_w      # copies of each result per root
        self.w_host, self.a_host = host_of(inputs)
        self.rows: list[dict] = []
        self.caps: list[float] = []

    def fi(self, p):
        return 1 + p

    def xi(self, w, c, p):
        return 1 + self.n_a + (w * self.n_a + c) * self.n_a + p

    def yi(self, c, p):
        return 1 + self.n_a + self.n_w * self.n_a * self.n_a + c * self.n_a + p

    def add(self, row: dict, cap: float):
        self.rows.append(row)
        self.caps.append(cap)

    def into(self, a, link=False) -> dict:
        """What enters aggregator a, in shares of a worker's gradient (over
        its link: not its own host's worker's part)."""
        n_w, n_a = self.n_w, self.n_a
        row = {self.xi(w, a, p): 1.0 for w in range(n_w) for p in range(n_a)
               if not (link and self.w_host[w] == self.a_host[a])}
        row.update({self.yi(c, a): 1.0 for c in range(n_a) if c != a})
        if self.inputs.results.reaches_aggregators:        # the other roots' results reach a too
            row.update({self.fi(p): 1.0 for p in range(n_a) if p != a})
        return row

    def results_out(self, a) -> dict:
        row = {self.yi(a, p): 1.0 for p in range(self.n_a) if p != a}
        row[self.fi(a)] = float(self.fan)
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
        n_a, w_host, a_host = self.n_a, self.w_host, self.a_host
        agg_on = {a_host[a]: a for a in range(n_a) if self.A[a].on is not None}
        for w, n in enumerate(self.W):
            a = agg_on.get(w_host[w])
            if a is None:
                continue
            if n.up_bps is not None:
                row = {self.xi(w, c, p): 1.0 for c in range(n_a) for p in range(n_a) if a_host[c] != w_host[w]}
                for j, v in self.results_out(a).items():
                    row[j] = row.get(j, 0.0) + v
                self.add(row, n.up_bps / self.g)
            if n.down_bps is not None:
                row = {self.fi(p): 1.0 for p in range(n_a) if a_host[p] != w_host[w]}   # every other share's sum
                for j, v in self.into(a, link=True).items():
                    if j not in row:        # a broadcast reaches the host once
                        row[j] = v
                self.add(row, n.down_bps / self.g)

    def uplink(self, r: int, bps: float):
        W, A, n_a = self.W, self.A, self.n_a
        out, inn = {}, {}
        for w in range(self.n_w):
            for c in range(n_a):
                for p in range(n_a):
                    if W[w].rack == r and A[c].rack != r:
                        out[self.xi(w, c, p)] = 1.0
                    if W[w].rack != r and A[c].rack == r:
                        inn[self.xi(w, c, p)] = 1.0
        for c in range(n_a):
            for p in range(n_a):
                if c != p and A[c].rack == r and A[p].rack != r:
                    out[self.yi(c, p)] = 1.0
                if c != p and A[c].rack != r and A[p].rack == r:
                    inn[self.yi(c, p)] = 1.0
        several = len({h.rack for h in W + A}) > 1
        for p in range(n_a):
            f = self.fi(p)
            if self.inputs.results.one_frame:
                if A[p].rack == r and several:
                    out[f] = out.get(f, 0.0) + 1.0
                if A[p].rack != r:
                    inn[f] = inn.get(f, 0.0) + 1.0
            elif A[p].rack == r:
                out[f] = out.get(f, 0.0) + sum(1 for w in W if w.rack != r)
            else:
                inn[f] = inn.get(f, 0.0) + sum(1 for w in W if w.rack == r)
        self.add(out, bps / self.g)
        self.add(inn, bps / self.g)


def _constraints(lp: _Rows):
    """(A_ub, b_ub, A_eq, b_eq): every row as load / capacity - T <= 0, a
    partial at least every part it sums, the shares summing to 1 and each
    worker sending all of each share."""
    from scipy.sparse import lil_matrix
    n_w, n_a, n_var = lp.n_w, lp.n_a, lp.n_var
    n_tie = n_w * n_a * max(n_a - 1, 0) if lp.trees else 0
    a_ub = lil_matrix((len(lp.rows) + n_tie, n_var))
    b_ub = np.zeros(len(lp.rows) + n_tie)
    for i, (row, cap) in enumerate(zip(lp.rows, lp.caps)):
        for j, v in row.items():
            a_ub[i, j] = v / cap          # load / capacity - T <= 0
        a_ub[i, 0] = -1.0
    i = len(lp.rows)
    if lp.trees:
        for w in range(n_w):
            for c in range(n_a):
                for p in range(n_a):
                    if c != p:            # x[w, c, p] - y[c, p] <= 0
                        a_ub[i, lp.xi(w, c, p)], a_ub[i, lp.yi(c, p)] = 1.0, -1.0
                        i += 1
    a_eq = lil_matrix((1 + n_w * n_a, n_var))
    b_eq = np.zeros(1 + n_w * n_a)
    for p in range(n_a):
        a_eq[0, lp.fi(p)] = 1.0
    b_eq[0] = 1.0
    for w in range(n_w):
        for p in range(n_a):
            r = 1 + w * n_a + p
            a_eq[r, lp.fi(p)] = -1.0
            for c in range(n_a):
                a_eq[r, lp.xi(w, c, p)] = 1.0
    return a_ub, b_ub, a_eq, b_eq


def _bounds_and_cost(lp: _Rows, routes: list[list[int]] | None):
    """Variables held at 0 (routes the plan may not use) and the objective: T,
    plus TREE_PENALTY per unit of indirect route."""
    A, n_a = lp.A, lp.n_a
    bounds = [(0, None)] * lp.n_var
    cost = np.zeros(lp.n_var)
    cost[0] = 1.0
    for c in range(n_a):
        for p in range(n_a):
            if c == p or A[c].on is not None:       # a worker host roots a share, never sums for another
                bounds[lp.yi(c, p)] = (0, 0)
            elif lp.trees:
                cost[lp.yi(c, p)] = TREE_PENALTY
            for w in range(lp.n_w):
                if ((routes is not None and routes[w][p] != c) or (routes is None and c != p and not lp.trees)
                        or (c != p and A[c].on is not None and routes is None)):
                    bounds[lp.xi(w, c, p)] = (0, 0)
    return bounds, cost


def solve(inputs: PlanInputs, routes: list[list[int]] | None = None) -> LpSolution | None:
    """The LP optimum, or None when nothing routable is limited (every
    aggregator link, packet rate and uplink unshaped: any split is as good).
    With ``routes`` (whole routes, as in Plan) only the split is free: the
    best weights for those routes."""
    from scipy.optimize import linprog

    n_a = len(inputs.aggregators)
    lp = _Rows(inputs, trees=(inputs.trees or routes is not None) and n_a > 1)
    lp.aggregators()
    lp.worker_hosts()
    for r, bps in inputs.uplinks.items():
        if bps is not None:
            lp.uplink(r, bps)
    if not lp.rows:
        return None
    a_ub, b_ub, a_eq, b_eq = _constraints(lp)
    bounds, cost = _bounds_and_cost(lp, routes)
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=b_ub, A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=bounds,
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"planner LP failed: {res.message}")
    v, n_w = res.x, lp.n_w
    x = np.array([[[v[lp.xi(w, c, p)] for p in range(n_a)] for c in range(n_a)] for w in range(n_w)])
    return LpSolution(float(v[0]), [float(v[lp.fi(p)]) for p in range(n_a)], x)


def round_routes(lp: LpSolution, samples: int, seed: int) -> list[list[list[int]]]:
    """Whole tree edges from the LP's fractional routes, GRID-style: for each
    (worker w, root p) pick child c with probability x[w, c, p] / f[p];
    ``samples`` such draws (seeded: every host draws the same) plus the most
    likely choice. The caller keeps the best under the exact model."""
    n_w, n_a, _ = lp.x.shape
    rng = random.Random(seed)

    def probs(w, p):
        col = [max(lp.x[w, c, p], 0.0) for c in range(n_a)]
        s = sum(col)
        return [1.0 if c == p else 0.0 for c in range(n_a)] if s <= 1e-12 else [v / s for v in col]

    table = [[probs(w, p) for p in range(n_a)] for w in range(n_w)]
    likely = [[max(range(n_a), key=lambda c: (table[w][p][c], c == p)) for p in range(n_a)]
              for w in range(n_w)]
    out = [likely]
    for _ in range(samples):
        out.append([[rng.choices(range(n_a), weights=table[w][p])[0] for p in range(n_a)]
                    for w in range(n_w)])
    return out

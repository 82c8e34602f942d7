"""The planner's LP relaxation (scipy HiGHS) and the rounding of its routes.

Variables, as fractions of one worker's gradient (ROUTING.md):

    T                 the time to minimise (seconds)
    f[p]              share of the chunks rooted at aggregator p, sum 1
    x[w, c, p]        worker w's part of p's chunks sent through c (c == p:
                      direct), sum over c = f[p]
    y[c, p]           c's partial of p's chunks, >= every x[w, c, p] (c != p):
                      one partial per chunk, however many workers c sums

Every row is "resource load / capacity <= T" for the loads of planner.loads
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

from xagg.wire.planner import PlanInputs, host_of

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


def solve(inputs: PlanInputs, routes: list[list[int]] | None = None) -> LpSolution | None:
    """The LP optimum, or None when nothing routable is limited (every
    aggregator link, packet rate and uplink unshaped: any split is as good).
    With ``routes`` (whole routes, as in Plan) only the split is free: the
    best weights for those routes."""
    from scipy.optimize import linprog
    from scipy.sparse import lil_matrix

    W, A = inputs.workers, inputs.aggregators
    n_w, n_a = len(W), len(A)
    trees = (inputs.trees or routes is not None) and n_a > 1
    nf, nx = n_a, n_w * n_a * n_a
    n_var = 1 + nf + nx + n_a * n_a

    def fi(p):
        return 1 + p

    def xi(w, c, p):
        return 1 + nf + (w * n_a + c) * n_a + p

    def yi(c, p):
        return 1 + nf + nx + c * n_a + p

    g, pk = inputs.wire_bytes * 8, inputs.wire_bytes / inputs.frame_bytes
    bcast = inputs.fanout == "bcast"            # results also reach the other aggregators
    once = inputs.fanout != "unicast"           # one copy of each result per link
    fan = 1 if once else n_w
    racks = sorted({h.rack for h in W + A})
    w_host, a_host = host_of(inputs)
    agg_on = {a_host[a]: a for a in range(n_a) if A[a].on is not None}    # worker host -> its aggregator
    rows, caps = [], []      # each row: {var: coefficient in "units of load"}, and the capacity

    def into(a, link=False) -> dict:
        """What enters aggregator a, in shares of a worker's gradient (over
        its link: not its own host's worker's part)."""
        row = {xi(w, a, p): 1.0 for w in range(n_w) for p in range(n_a) if not (link and w_host[w] == a_host[a])}
        row.update({yi(c, a): 1.0 for c in range(n_a) if c != a})
        if bcast:        # the other roots' broadcast results reach a too
            row.update({fi(p): 1.0 for p in range(n_a) if p != a})
        return row

    def results_out(a) -> dict:
        row = {yi(a, p): 1.0 for p in range(n_a) if p != a}
        row[fi(a)] = float(fan)
        return row

    for a, n in enumerate(A):
        if n.on is None and n.down_bps is not None:
            rows.append(into(a, link=True))
            caps.append(n.down_bps / g)
        if n.on is None and n.up_bps is not None:
            rows.append(results_out(a))
            caps.append(n.up_bps / g)
        if n.pps is not None:
            rows.append(into(a))
            caps.append(n.pps / pk)
    # A worker host that aggregates: what its link carries for both roles.
    # (Any other worker's sends the whole gradient and receives every sum,
    # whatever the plan: the floor its link puts under T is no routing's to
    # change, and left out here it lets the LP balance what routing does.)
    for w, n in enumerate(W):
        a = agg_on.get(w_host[w])
        if a is None:
            continue
        if n.up_bps is not None:
            row = {xi(w, c, p): 1.0 for c in range(n_a) for p in range(n_a) if a_host[c] != w_host[w]}
            for j, v in results_out(a).items():
                row[j] = row.get(j, 0.0) + v
            rows.append(row)
            caps.append(n.up_bps / g)
        if n.down_bps is not None:
            row = {fi(p): 1.0 for p in range(n_a) if a_host[p] != w_host[w]}    # every other share's sum
            for j, v in into(a, link=True).items():
                if j not in row:        # a broadcast reaches the host once
                    row[j] = v
            rows.append(row)
            caps.append(n.down_bps / g)
    for r, bps in inputs.uplinks.items():
        if bps is None:
            continue
        out, inn = {}, {}
        for w in range(n_w):
            for c in range(n_a):
                for p in range(n_a):
                    if W[w].rack == r and A[c].rack != r:
                        out[xi(w, c, p)] = 1.0
                    if W[w].rack != r and A[c].rack == r:
                        inn[xi(w, c, p)] = 1.0
        for c in range(n_a):
            for p in range(n_a):
                if c != p and A[c].rack == r and A[p].rack != r:
                    out[yi(c, p)] = 1.0
                if c != p and A[c].rack != r and A[p].rack == r:
                    inn[yi(c, p)] = 1.0
        for p in range(n_a):
            if once:
                if A[p].rack == r and len(racks) > 1:
                    out[fi(p)] = out.get(fi(p), 0.0) + 1.0
                if A[p].rack != r:
                    inn[fi(p)] = inn.get(fi(p), 0.0) + 1.0
            else:
                if A[p].rack == r:
                    out[fi(p)] = out.get(fi(p), 0.0) + sum(1 for w in W if w.rack != r)
                else:
                    inn[fi(p)] = inn.get(fi(p), 0.0) + sum(1 for w in W if w.rack == r)
        rows += [out, inn]
        caps += [bps / g, bps / g]
    if not rows:
        return None

    n_tie = n_w * n_a * max(n_a - 1, 0) if trees else 0
    a_ub = lil_matrix((len(rows) + n_tie, n_var))
    b_ub = np.zeros(len(rows) + n_tie)
    for i, (row, cap) in enumerate(zip(rows, caps)):
        for j, v in row.items():
            a_ub[i, j] = v / cap          # load / capacity - T <= 0
        a_ub[i, 0] = -1.0
    i = len(rows)
    if trees:
        for w in range(n_w):
            for c in range(n_a):
                for p in range(n_a):
                    if c != p:            # x[w, c, p] - y[c, p] <= 0
                        a_ub[i, xi(w, c, p)], a_ub[i, yi(c, p)] = 1.0, -1.0
                        i += 1
    a_eq = lil_matrix((1 + n_w * n_a, n_var))
    b_eq = np.zeros(1 + n_w * n_a)
    for p in range(n_a):
        a_eq[0, fi(p)] = 1.0
    b_eq[0] = 1.0
    for w in range(n_w):
        for p in range(n_a):
            r = 1 + w * n_a + p
            a_eq[r, fi(p)] = -1.0
            for c in range(n_a):
                a_eq[r, xi(w, c, p)] = 1.0
    bounds = [(0, None)] * n_var
    cost = np.zeros(n_var)
    cost[0] = 1.0
    for c in range(n_a):
        for p in range(n_a):
            if c == p or A[c].on is not None:       # a worker host roots a share, never sums for another
                bounds[yi(c, p)] = (0, 0)
            elif trees:
                cost[yi(c, p)] = TREE_PENALTY
            for w in range(n_w):
                if ((routes is not None and routes[w][p] != c) or (routes is None and c != p and not trees)
                        or (c != p and A[c].on is not None and routes is None)):
                    bounds[xi(w, c, p)] = (0, 0)
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=b_ub, A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=bounds,
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"planner LP failed: {res.message}")
    v = res.x
    x = np.array([[[v[xi(w, c, p)] for p in range(n_a)] for c in range(n_a)] for w in range(n_w)])
    return LpSolution(float(v[0]), [float(v[fi(p)]) for p in range(n_a)], x)


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

"""Where a job's gradient goes: which aggregator roots which share of the
chunks, which aggregator each worker sends each share through, or gloo's
ring when no xagg plan beats it.

The candidates come from the LP (planner_lp.py), the rack tree and a few
closed forms; each is scored by the exact model (planner_model.py) under
each result path the inputs allow, and the fastest wins. ``xagg plan``
shows the answer.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from xagg.wire import chunks
from xagg.wire.fanout import ResultPath
from xagg.wire.planner_inputs import PlanInputs
from xagg.wire.planner_model import flat_closed_form, flat_routes, gloo_predict, predict, rack_tree_routes

KINDS = ("flat", "tree", "gloo")
# Plans predicted within this fraction of the fastest count as tied; the tie goes to
# the most concentrated split: splits the model puts at the same workers' floor differ
# in what it does not see (each extra data stream adds retransmits; docs/planner.md
# "Ties" has the lab's figures).
TIE = 0.01
# Rounded trees given their own split (an LP each); the rest are ranked under the
# relaxation's split only.
OWN_SPLITS = 4


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
    results: ResultPath | None = None   # how results go back under this plan


    def children(self, p: int) -> list[tuple[int, int]]:
        """(child aggregator c, worker mask) for p's chunk range: who sends partials to p."""
        out = {}
        for w, row in enumerate(self.routes):
            if row[p] != p:
                out[row[p]] = out.get(row[p], 0) | (1 << w)
        return sorted(out.items())

    def to_dict(self) -> dict:
        """JSON-ready; the result path as the file format spells it ("fanout": a model name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "results"}
        return {**out, "fanout": self.results.model if self.results else ""}


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


def _is_tree(routes) -> bool:
    return any(c != p for row in routes for p, c in enumerate(row))


def _candidates(inputs: PlanInputs, samples: int, seed: int) -> list[tuple[list, list]]:
    """(weights, routes) worth scoring: the equal, closed-form and LP flat splits,
    everything on one aggregator, the rack tree and the LP's tree rounded (each
    tree with its own split)."""
    if importlib.util.find_spec("scipy") is None:          # an install without the extra
        raise ModuleNotFoundError("the planner solves a linear program with scipy, which this install "
                                  "lacks: pip install 'xagg[plan]'", name="scipy")
    from xagg.wire.planner_lp import round_routes, solve   # scipy only when planning
    n_w, n_a = len(inputs.workers), len(inputs.aggregators)
    flat = flat_routes(n_w, n_a)
    out = [([1.0] * n_a, flat), (flat_closed_form(inputs), flat)]
    # everything on one aggregator (the others keep one chunk each): see TIE
    out += [([1.0 if q == p else 0.0 for q in range(n_a)], flat) for p in range(n_a)] if n_a > 1 else []
    lp = solve(inputs)
    if lp is None:
        return out
    out.append((_clean(lp.weights), flat))
    out.append((_clean(solve(inputs, flat).weights), flat))
    rack = rack_tree_routes(inputs) if inputs.trees else flat
    if rack != flat:
        # the rack tree as the scaling model draws it, and with its own best split
        out += [(flat_closed_form(inputs), rack), (_clean(solve(inputs, rack).weights), rack)]
    if lp.is_tree:
        # whole tree edges drawn from the LP's fractions; the most promising under the
        # LP's own split (exact model) each get their own best split
        rounded = [r for r in round_routes(lp, n_w, samples, seed) if r != flat and r != rack]
        lp_w = registrable(_clean(lp.weights), inputs.n_chunks)
        rounded.sort(key=lambda r: predict(inputs, lp_w, r)[0])
        out += [(_clean(solve(inputs, r).weights), r) for r in rounded[:OWN_SPLITS]]
    return out


def make_plan(inputs: PlanInputs, samples: int = 64, seed: int = 0) -> Plan:
    """The best plan for ``inputs``: the LP's split and routes, rounded to whole
    chunks and tree edges, scored by the exact model (so never worse than the
    flat splits it also scores), under each result path the inputs allow; or gloo
    when its ring is predicted faster. Deterministic for the same inputs
    (seeded rounding)."""
    inputs.validate()
    flat_s, _ = predict(inputs, [1.0] * len(inputs.aggregators))
    gloo_s, gloo_why = gloo_predict(inputs)
    scored = []
    for fi, results in enumerate(inputs.result_choices or (inputs.results,)):
        inp = dataclasses.replace(inputs, results=results)
        for i, (w, r) in enumerate(_candidates(inp, samples, seed)):
            scored.append((predict(inp, registrable(w, inp.n_chunks), r)[0], fi, i, w, r, inp))
    # the fastest; among those within TIE of it: the first result path listed, a flat
    # plan (a tree's extra hop and partial sums are not worth a tie), among flat plans
    # the fewest data streams (the most concentrated split; not among trees, where it
    # would leave a child aggregator rooting nothing, which the job plans out and its
    # tree with it), the earlier candidate
    fastest = min(s[0] for s in scored)

    def tie_key(s):
        tree = _is_tree(s[4])
        return s[1], tree, 0.0 if tree else -max(s[3]) / sum(s[3]), s[2]

    _, _, _, weights, routes, inp = min((s for s in scored if s[0] <= fastest * (1 + TIE)), key=tie_key)
    # rounded routes share a row list per group: the plan's rows are its own
    weights, routes = registrable(weights, inputs.n_chunks), [list(row) for row in routes]
    best_s, why = predict(inp, weights, routes)
    kind = "tree" if _is_tree(routes) else "flat"
    if gloo_s < best_s:
        return Plan("gloo", weights, routes, gloo_s, flat_s, gloo_s, best_s, gloo_why,
                    f"gloo's ring ({gloo_s * 1e3:.0f} ms, bound by {gloo_why}) beats the best xagg plan "
                    f"({best_s * 1e3:.0f} ms, bound by {why})", inp.results)
    return Plan(kind, weights, routes, best_s, flat_s, gloo_s, best_s, why,
                f"{kind} xagg plan ({best_s * 1e3:.0f} ms, bound by {why}; results {inp.results.model}) "
                f"beats gloo's ring ({gloo_s * 1e3:.0f} ms)", inp.results)


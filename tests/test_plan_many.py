"""The planner at many workers and aggregators: the LP's loads are the data
plane's down a tree (a unicast root pays one copy per worker it serves
directly and one per child, not one per worker), it is solved over groups of
alike workers, and the plan it picks is at least as good as the rack tree.
Shapes and predicted costs only: no clocks (python -m xagg.bench.plan_speed
times it)."""
from __future__ import annotations

import pytest

from xagg.wire import planner, planner_model, scaling
from xagg.wire.fanout import ResultPath
from xagg.wire.planner_inputs import CpuCosts, Node, PlanInputs
from xagg.wire.planner_model import flat_closed_form, flat_routes, predict, rack_tree_routes

pytest.importorskip("scipy")
from xagg.wire.planner_lp import solve, worker_groups  # noqa: E402

G = 1e9


def racks(workers: int, aggs: int, fanout: str = "unicast", n_racks: int = 4, choices=()) -> PlanInputs:
    """Workers of 100 Gbit/s in n_racks racks behind 4:1 uplinks, the
    aggregators spread over the racks, each with its workers' bandwidth."""
    per = workers // n_racks
    nic, agg_nic = 100 * G, 100 * G * workers / aggs
    return PlanInputs([Node(f"w{i}", nic, nic, i // per) for i in range(workers)],
                      [Node(f"a{k}", agg_nic, agg_nic, k % n_racks) for k in range(aggs)],
                      elements=6_250_000, vals=2233, results=ResultPath.from_model(fanout),
                      result_choices=tuple(map(ResultPath.from_model, choices)),
                      uplinks={r: per * nic / 4 for r in range(n_racks)},
                      cpu=CpuCosts(0.0, 0.0, None, 0.0, 0.0)).validate()


def routable(inputs: PlanInputs, weights, routes) -> float:
    """The exact model's busiest term that routing can change (every term but
    the links of workers that do not aggregate: the LP leaves those out)."""
    terms = planner_model.loads(inputs, planner_model.chunk_counts(inputs, weights), routes)
    plain = {w.name for w in inputs.workers}
    return max(v for k, v in terms.items() if k.split(" ")[0] not in plain)


# (workers, aggregators, racks): one aggregator per rack, several, one rack
SHAPES = [(8, 2, 2), (16, 8, 2), (32, 16, 4), (12, 3, 1)]


@pytest.mark.parametrize("fanout", ["unicast", "mcast", "bcast"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "%dw-%da-%dr" % s)
def test_the_lp_charges_a_tree_what_the_exact_model_does(shape, fanout):
    # with the routes fixed the LP's optimum is the exact model's busiest routable
    # term at the LP's split (whole chunks aside): results go down the tree as the
    # data plane sends them, a unicast root's copies to the workers it serves and
    # to its children, each child's to its own workers
    w, a, r = shape
    inputs = racks(w, a, fanout, r)
    for routes in (rack_tree_routes(inputs), flat_routes(w, a)):
        lp = solve(inputs, routes)
        assert routable(inputs, lp.weights, routes) == pytest.approx(lp.t, rel=0.005)


def test_a_unicast_root_pays_one_copy_per_child_not_per_worker():
    # two racks of 8 workers, everything rooted at a0 in rack 0, rack 1's workers
    # through a1: a0 sends 8 results to its rack's workers and 1 to its child, a1
    # its partial up and 8 results to its workers; the uplink carries one partial
    # up and one result down, not rack 1's 8 workers' results
    inputs = racks(16, 2, "unicast", 2)
    tree = [[0, 0]] * 8 + [[1, 1]] * 8
    counts = planner_model.chunk_counts(inputs, [1.0, 0.0])
    terms = planner_model.loads(inputs, counts, tree)
    share = counts[0] * inputs.frame_bytes * 8
    agg_nic, uplink = inputs.aggregators[0].up_bps, inputs.uplinks[0]
    assert terms["a0 out"] == pytest.approx(9 * share / agg_nic)
    assert terms["a1 out"] == pytest.approx(9 * share / agg_nic)
    assert terms["a0 in"] == pytest.approx(9 * share / agg_nic)       # 8 workers, 1 partial
    for way in ("out", "in"):
        assert terms[f"rack0 uplink {way}"] == pytest.approx(share / uplink)
    # and the LP, its split free over the same routes, charges what the model does
    lp = solve(inputs, tree)
    assert routable(inputs, lp.weights, tree) == pytest.approx(lp.t, rel=0.005)


def test_alike_workers_are_one_group():
    inputs = racks(1024, 16)
    assert [len(g) for g in worker_groups(inputs)] == [256] * 4
    inputs.workers[5].up_bps = 25 * G                 # a slower worker stands alone
    assert sorted(len(g) for g in worker_groups(inputs)) == [1, 255, 256, 256, 256]
    # with routes, workers split by their route row too
    routes = rack_tree_routes(inputs)
    routes[7] = list(range(16))
    assert sorted(len(g) for g in worker_groups(inputs, routes)) == [1, 1, 254, 256, 256, 256]


@pytest.mark.parametrize("workers, aggs", [(64, 4), (64, 16), (256, 8), (1024, 4), (1024, 16)])
def test_many_workers_and_aggregators_get_a_tree_no_worse_than_the_rack_tree(workers, aggs):
    inputs = racks(workers, aggs, choices=("mcast", "unicast"))
    p = planner.make_plan(inputs)
    assert p.kind == "tree" and p.results.model == "unicast"
    # every worker sends another rack's roots' chunks through an aggregator of its own rack
    for w, row in enumerate(p.routes):
        mine = inputs.workers[w].rack
        for q, c in enumerate(row):
            assert inputs.aggregators[c].rack == mine or c == q
    rack = rack_tree_routes(inputs)
    uni = planner.dataclasses.replace(inputs, results=ResultPath.from_model("unicast"))
    rack_s = predict(uni, flat_closed_form(uni), rack)[0]
    flat_s = min(predict(planner.dataclasses.replace(inputs, results=r), flat_closed_form(inputs))[0]
                 for r in inputs.result_choices)
    assert p.xagg_predicted_s <= rack_s * (1 + planner.TIE)
    assert p.xagg_predicted_s < flat_s / 2 and p.xagg_predicted_s < p.gloo_predicted_s
    assert solve(uni).t <= p.xagg_predicted_s          # the relaxation is a lower bound


def test_several_aggregators_per_rack_and_hosts_as_workers_pick_the_tree_over_gloo():
    # scaling's 64 ranks on 8 hosts of 8 (reduced in the host), 2 racks of 4
    # hosts with 4 aggregators each, 100 Gbit/s, unicast: the rack tree beats
    # gloo's ring, and the planner finds it (it used to charge the root a copy
    # per worker and fall back to gloo)
    c = scaling.Cluster(64, 8, nic_bps=100 * G, aggs_per_rack=4)
    inputs = c.inputs(True, ResultPath.from_model("unicast"))
    p = planner.make_plan(inputs)
    rack_s = predict(inputs, flat_closed_form(inputs), rack_tree_routes(inputs))[0]
    assert rack_s < p.gloo_predicted_s
    assert p.kind == "tree" and p.predicted_s <= rack_s * (1 + planner.TIE)


def test_group_results_keep_the_tree_off_where_they_cross_twice():
    # with a group fan-out a child's frame crosses every uplink again: the same
    # shape's tree with mcast only is no better than its flat plan and unicast wins
    inputs = racks(64, 8, "mcast")
    rack = rack_tree_routes(inputs)
    tree_mcast = predict(inputs, flat_closed_form(inputs), rack)[0]
    uni = planner.dataclasses.replace(inputs, results=ResultPath.from_model("unicast"))
    assert predict(uni, flat_closed_form(uni), rack)[0] < tree_mcast
    p = planner.make_plan(planner.dataclasses.replace(inputs, result_choices=(inputs.results, uni.results)))
    assert p.results.model == "unicast" and p.kind == "tree"


@pytest.mark.parametrize("uplink", [None, 500e6])
def test_a_tie_keeps_a_plan_flat_and_a_tree_rooted_at_every_aggregator(uplink):
    # two racks of two 1 Gbit/s workers, an aggregator of 4 Gbit/s in each, unicast:
    # unshaped, the flat plan and the rack tree both sit at the workers' floor and the
    # tie stays flat; behind 500 Mbit/s uplinks the rack tree wins, and of its tied
    # splits the one that leaves each aggregator a real share (a child rooting nothing
    # would be planned out of the job, and the tree with it)
    inputs = PlanInputs([Node(f"w{i}", G, G, i // 2) for i in range(4)],
                        [Node(f"a{r}", 4 * G, 4 * G, r) for r in range(2)],
                        elements=4_000_000, vals=2233, results=ResultPath.from_model("unicast"),
                        uplinks={0: uplink, 1: uplink} if uplink else {}).validate()
    rack = rack_tree_routes(inputs)
    assert predict(inputs, [0.5, 0.5], rack)[0] <= predict(inputs, [0.5, 0.5])[0] * (1 + planner.TIE)
    p = planner.make_plan(inputs)
    if uplink is None:
        assert p.kind == "flat"
    else:
        assert p.kind == "tree" and p.routes == rack and min(p.weights) > 0.1

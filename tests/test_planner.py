"""The planner (xagg.wire.planner): its model, LP, rounding and decision,
on figures alone (no lab: the hetero bench measures the lab)."""
from __future__ import annotations

import pytest

from xagg.wire import chunks, planner, planner_inputs, planner_model
from xagg.wire.fanout import Fanout, ResultPath
from xagg.wire.planner_inputs import CpuCosts, Node, PlanInputError, PlanInputs
from xagg.wire.planner_lp import solve

G, M = 1e9, 1e6
MB16 = 4_000_000          # float32 values in 16 MB
VALS = 2233               # MTU 9000


def cluster(workers, aggs, fanout="bcast", racks_w=None, racks_a=None, uplinks=None, pps=None,
            cores=None, elements=MB16) -> PlanInputs:
    W = [Node(f"w{i}", r, r, (racks_w or [0] * len(workers))[i]) for i, r in enumerate(workers)]
    A = [Node(f"a{i}", r, r, (racks_a or [0] * len(aggs))[i], pps) for i, r in enumerate(aggs)]
    return PlanInputs(W, A, elements=elements, vals=VALS, results=ResultPath.from_model(fanout), uplinks=uplinks or {},
                      cpu=CpuCosts(shared_cores=cores)).validate()


def test_flat_closed_form_matches_the_lp():
    # unicast: no aggregator hears another's results, so the closed form holds
    inputs = cluster([G] * 4, [4 * G, G, 2 * G], fanout="unicast", pps=400_000)
    lp = solve(inputs, planner_model.flat_routes(4, 3))
    closed = planner_model.flat_closed_form(inputs)
    assert lp.weights == pytest.approx(closed, abs=1e-6)
    # and the LP's T is every aggregator's load at that split (all balanced)
    n, g = 4, inputs.wire_bytes * 8
    loads = [max(n * f * g / a.down_bps, n * f * g / a.up_bps, n * f * inputs.wire_bytes / inputs.frame_bytes / a.pps)
             for f, a in zip(closed, inputs.aggregators)]
    assert lp.t == pytest.approx(max(loads), rel=1e-6) and max(loads) == pytest.approx(min(loads), rel=1e-6)


@pytest.mark.parametrize("fanout", ["unicast", "bcast"])
def test_a_slow_aggregator_gets_proportionally_less(fanout):
    p = planner.make_plan(cluster([G] * 4, [G, 250 * M], fanout=fanout, cores=None))
    assert p.kind in ("flat", "gloo")
    if fanout == "unicast":     # 4x the rate, 4x the share
        assert p.weights[0] / p.weights[1] == pytest.approx(4.0, rel=0.02)
    else:                       # the fast one also hears the slow one's broadcasts: even less for a1
        assert p.weights[0] / p.weights[1] > 4.0
    assert p.xagg_predicted_s < p.flat_predicted_s


def test_a_shared_500mbit_uplink_makes_a_tree_win():
    inputs = cluster([G] * 4, [4 * G, 4 * G], racks_w=[0, 0, 1, 1], racks_a=[0, 1],
                     uplinks={0: 500 * M, 1: 500 * M})
    inputs.result_choices = (ResultPath.from_model("mcast"), ResultPath(Fanout.UNICAST))
    p = planner.make_plan(inputs)
    # unicast results: the root's copy to the child is all that crosses down (a group
    # frame would cross too, and the child's would cross back: see the next test)
    assert p.kind == "tree" and p.results.fanout is Fanout.UNICAST
    inputs.results = ResultPath(Fanout.UNICAST)
    best_flat, _ = planner_model.predict(inputs, solve(inputs, planner_model.flat_routes(4, 2)).weights)
    assert p.predicted_s < 0.75 * best_flat and p.predicted_s < 0.75 * p.gloo_predicted_s
    # a rack's workers go through their own rack's aggregator for the other rack's root
    for q in range(2):
        for c, mask in p.children(q):
            assert c != q and inputs.aggregators[c].rack != inputs.aggregators[q].rack
            assert all(inputs.workers[w].rack == inputs.aggregators[c].rack for w in range(4) if mask >> w & 1)
    # without trees the planner can only offer a flat plan, which loses to gloo here
    inputs.trees, inputs.result_choices = False, ()
    assert planner.make_plan(inputs).kind == "gloo"


def test_one_1gbit_aggregator_for_1gbit_workers_picks_gloo():
    p = planner.make_plan(cluster([G] * 4, [G], cores=2))
    assert p.kind == "gloo" and p.predicted_s == p.gloo_predicted_s
    # its link carries 4x a worker's gradient: about 4 G/B vs the ring's 1.5 G/B
    assert p.xagg_predicted_s / p.gloo_predicted_s == pytest.approx(4 / 1.5, rel=0.1)
    assert "gloo's ring" in p.reason


def test_a_fast_aggregator_beats_gloo_and_the_plan_beats_equal():
    p = planner.make_plan(cluster([G] * 4, [4 * G, G], cores=2))
    assert p.kind == "flat" and p.weights[0] > 0.9
    assert p.flat_predicted_s / p.predicted_s >= 1.3
    assert p.predicted_s < p.gloo_predicted_s


def test_unshaped_lab_is_cpu_bound_and_gloo_is_cheaper_per_byte():
    p = planner.make_plan(cluster([None] * 4, [None], cores=2))
    assert p.bottleneck == "cpu" and p.kind == "gloo"
    inputs = cluster([None] * 4, [None], cores=2)
    assert planner_model.gloo_predict(inputs)[0] == pytest.approx(
        4 * inputs.gradient_bytes / 1e9 * inputs.cpu.gloo_s_per_gb / 2 + inputs.cpu.gloo_latency_s)


def test_gloo_ring_prediction():
    inputs = cluster([G] * 4, [G])
    t, why = planner_model.gloo_predict(inputs)
    ring = 2 * 3 / 4 * inputs.gradient_bytes * inputs.gloo_wire_factor * 8 / G
    assert t == pytest.approx(ring + inputs.cpu.gloo_latency_s) and why.startswith("w")


@pytest.mark.parametrize("aggs", [[4 * G, G], [G, 250 * M, 2 * G], [G] * 4])
def test_split_is_monotone_and_fits_the_registered_capacity(aggs):
    inputs = cluster([G] * 4, aggs)
    p = planner.make_plan(inputs)
    cap = chunks.capacity(inputs.elements, VALS, p.weights)
    assert all(c >= 1 for c in cap)          # every aggregator registrable (n_chunks >= 1)
    full = chunks.split(inputs.n_chunks, p.weights)
    for n in range(1, inputs.n_chunks + 1, 7):
        for (lo, hi), (flo, fhi) in zip(chunks.split(n, p.weights), full):
            assert hi - lo <= fhi - flo
        sizes = [hi - lo for lo, hi in chunks.split(n, p.weights)]
        assert all(s + chunks.meta_chunks(s, VALS) <= c for s, c in zip(sizes, cap))


def test_rounded_plan_never_worse_than_flat_and_deterministic():
    inputs = cluster([G, G, 2 * G, G, G, G], [2 * G, G, 3 * G], racks_w=[0, 0, 0, 1, 1, 1], racks_a=[0, 1, 1],
                     uplinks={0: 700 * M, 1: 700 * M}, pps=300_000)
    a, b = planner.make_plan(inputs), planner.make_plan(inputs)
    assert a == b
    best_flat, _ = planner_model.predict(inputs, solve(inputs, planner_model.flat_routes(6, 3)).weights)
    # within planner.TIE of the fastest a more concentrated split wins the tie
    assert a.xagg_predicted_s <= best_flat * (1 + planner.TIE) and a.xagg_predicted_s <= a.flat_predicted_s + 1e-9
    lp = solve(inputs)
    assert lp.t <= a.xagg_predicted_s        # the relaxation is a lower bound


def test_the_model_counts_broadcasts_at_every_other_aggregator():
    inputs = cluster([G] * 4, [G, G])
    terms = planner_model.loads(inputs, planner_model.chunk_counts(inputs, [1, 1]), planner_model.flat_routes(4, 2))
    # each aggregator: 4 workers x half + the other's half of results
    assert terms["a0 in"] == pytest.approx(2.5 * inputs.wire_bytes * 8 / G, rel=1e-3)
    inputs.results = ResultPath(Fanout.UNICAST)
    terms = planner_model.loads(inputs, planner_model.chunk_counts(inputs, [1, 1]), planner_model.flat_routes(4, 2))
    assert terms["a0 in"] == pytest.approx(2.0 * inputs.wire_bytes * 8 / G, rel=1e-3)
    assert terms["a0 out"] == pytest.approx(2.0 * inputs.wire_bytes * 8 / G, rel=1e-3)


GOOD = {"workers": [{"name": "w0", "rate": "1gbit"}, {"name": "w1", "rate": "1gbit"}],
        "aggregators": [{"name": "a0", "rate": "4gbit", "queues": 2}, {"name": "a1", "up": "1gbit", "down": 1e9}],
        "mb": 16, "vals": VALS, "cpu": {"shared_cores": 2}}


def test_inputs_file_format_round_trips():
    inputs = planner_inputs.inputs_from_dict(GOOD)
    assert inputs.aggregators[0].pps == 2 * planner_inputs.DEFAULT_AGG_PPS_PER_QUEUE
    assert inputs.aggregators[1].down_bps == 1e9 and inputs.elements == MB16
    again = planner_inputs.inputs_from_dict(planner_inputs.inputs_to_dict(inputs))
    assert planner.make_plan(again) == planner.make_plan(inputs)


@pytest.mark.parametrize("change,field", [
    (lambda d: d["aggregators"][1].update(up="fast"), "aggregators[1].up"),
    (lambda d: d["workers"][0].update(rate="10mbps"), "workers[0].rate"),
    (lambda d: d["aggregators"][0].update(pps=-5), "aggregators.a0.pps"),
    (lambda d: d["workers"][1].update(speed=3), "workers[1].speed"),
    (lambda d: d.update(fanout="multicast"), "fanout"),
    (lambda d: d.update(mb=0), "mb"),
    (lambda d: d.pop("vals"), "vals"),
    (lambda d: d.update(uplinks={"3": "500mbit"}), "uplinks.3"),
    (lambda d: d.update(cpu={"cores": 2}), "cpu.cores"),
    (lambda d: d.update(cpu={"shared_cores": 0}), "cpu.shared_cores"),
    (lambda d: d.update(aggregators=[]), "aggregators"),
    (lambda d: d["workers"][1].update(name="w0"), "hosts"),
    (lambda d: d["aggregators"].append({"name": "h0", "on": "w9"}), "aggregators.h0.on"),
    (lambda d: d["aggregators"].append({"name": "h0", "on": "w0", "rate": "1gbit"}), "aggregators[2].rate"),
    (lambda d: d["aggregators"].extend([{"name": "h0", "on": "w0"}, {"name": "h1", "on": "w0"}]), "aggregators"),
])
def test_bad_inputs_name_the_field(change, field):
    import copy
    d = copy.deepcopy(GOOD)
    change(d)
    with pytest.raises(PlanInputError) as e:
        planner_inputs.inputs_from_dict(d)
    assert e.value.field == field and str(e.value).startswith(field)


def test_a_worker_only_group_spares_the_other_aggregators():
    inputs = cluster([G] * 4, [G, G], fanout="mcast")
    terms = planner_model.loads(inputs, planner_model.chunk_counts(inputs, [1, 1]), planner_model.flat_routes(4, 2))
    assert terms["a0 in"] == pytest.approx(2.0 * inputs.wire_bytes * 8 / G, rel=1e-3)
    assert terms["a0 out"] == pytest.approx(0.5 * inputs.wire_bytes * 8 / G, rel=1e-3)
    # so 4 aggregators at 1 Gbit/s reach the workers' floor, and beat the ring
    p = planner.make_plan(cluster([G] * 4, [G] * 4, fanout="mcast"))
    assert p.kind == "flat" and p.weights == pytest.approx([0.25] * 4, abs=0.01)
    assert solve(inputs, planner_model.flat_routes(4, 2)).weights == pytest.approx([0.5, 0.5])


def test_a_tie_goes_to_the_fewest_streams():
    # a0 alone reaches the workers' floor: so does 0.8/0.2, but a second stream costs
    # more than the model says (measured, see planner.TIE): the plan concentrates
    p = planner.make_plan(cluster([G] * 4, [4 * G, G], fanout="mcast"))
    assert p.kind == "flat" and p.weights[0] > 0.99
    # where both are needed, both are used
    p = planner.make_plan(cluster([G] * 4, [2 * G, 2 * G], fanout="mcast"))
    assert p.weights == pytest.approx([0.5, 0.5], abs=0.01)


def test_a_tree_with_group_results_pays_the_uplink_twice():
    # as the data plane sends them: the root's group frame and its copy to the child
    # both cross into the child's rack, and the child's group frame crosses back
    inputs = cluster([G] * 4, [4 * G, 4 * G], racks_w=[0, 0, 1, 1], racks_a=[0, 1],
                     uplinks={0: 500 * M, 1: 500 * M}, fanout="mcast")
    tree = [[0, 0], [0, 0], [0, 1], [0, 1]]       # w0, w1 send a1's chunks through a0
    terms = planner_model.loads(inputs, planner_model.chunk_counts(inputs, [0.001, 0.999]), tree)
    g = inputs.wire_bytes * 8 / (500 * M)
    assert terms["rack0 uplink in"] == pytest.approx(2 * g, rel=0.01)
    assert terms["rack0 uplink out"] == pytest.approx(2 * g, rel=0.01)
    assert terms["w0 in"] == pytest.approx(2 * inputs.wire_bytes * 8 / G, rel=0.01)   # results twice
    assert planner.make_plan(inputs).kind != "tree"


def with_worker_hosts(inputs: PlanInputs) -> PlanInputs:
    """The same cluster, every worker's host offered as an aggregator too."""
    extra = [Node(f"{w.name}agg", rack=w.rack, pps=inputs.aggregators[0].pps, on=w.name) for w in inputs.workers]
    return PlanInputs(inputs.workers, inputs.aggregators + extra, elements=inputs.elements, vals=inputs.vals,
                      results=inputs.results, cpu=inputs.cpu).validate()


def test_worker_hosts_that_aggregate_beat_the_ring_where_one_spare_aggregator_loses():
    """Every link 1 Gbit/s, one spare aggregator: alone it carries 4x a
    worker's gradient (gloo wins); with the worker hosts rooting shares too,
    a worker host's own part never crosses its link and the plan beats the ring."""
    spare = cluster([G] * 4, [G])
    both = with_worker_hosts(spare)
    p = planner.make_plan(both)
    assert planner.make_plan(spare).kind == "gloo" and p.kind == "flat", p.reason
    assert p.predicted_s < p.gloo_predicted_s
    # broadcast results reach every host: per unit gradient a worker host's link
    # takes 1 + 2f in (the other shares' sums, 3 workers' parts of its own), the
    # spare's 1 + 3f_a (4 parts of its share, every other sum): balanced at
    # f = 3/14 per worker host, f_a = 1/7: 1.43 G/B against the ring's 1.5
    assert p.weights[0] == pytest.approx(1 / 7, abs=0.02)
    assert all(w == pytest.approx(3 / 14, abs=0.02) for w in p.weights[1:])
    g = both.wire_bytes * 8 / G
    assert p.predicted_s - both.cpu.xagg_latency_s == pytest.approx(10 / 7 * g, rel=0.03)


def test_a_worker_hosts_own_part_never_crosses_its_link():
    inputs = with_worker_hosts(cluster([G] * 2, [G], pps=400_000))
    counts = planner_model.chunk_counts(inputs, [0.0, 1.0, 0.0])       # all on w0's host
    terms = planner_model.loads(inputs, counts, planner_model.flat_routes(2, 3))
    k = counts[1] * inputs.frame_bytes * 8 / G
    # w0 sends nothing and w1 all of it; w0's link takes w1's part in, its sums out once
    assert terms["w0 out"] == pytest.approx(k) and terms["w1 out"] == pytest.approx(k)
    assert terms["w0 in"] == pytest.approx(k) and terms["w1 in"] == pytest.approx(k)
    # its program sums both parts: w1's off the link, w0's through test runs
    assert terms["w0agg packets"] == pytest.approx(2 * counts[1] / 400_000)


def test_the_lp_never_makes_a_worker_host_a_child():
    inputs = with_worker_hosts(cluster([G] * 4, [G, G], racks_w=[0, 0, 1, 1], racks_a=[0, 1],
                                       uplinks={0: 500 * M, 1: 500 * M}))
    lp = solve(inputs)
    for c, a in enumerate(inputs.aggregators):
        if a.on is not None:
            assert all(lp.part(w, c, p) < 1e-9 for w in range(4) for p in range(len(inputs.aggregators)) if p != c)

"""The scaling model (xagg/wire/scaling.py) and its command
(python -m xagg.bench.scaling): the arithmetic of rings, trees and
oversubscribed uplinks against hand-derived byte counts, agreement with
the planner's own model where both apply, and internal consistency
(more ranks never faster, faster links never slower, twice the links
half the time)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from xagg.bench import scaling as bench
from xagg.wire import scaling
from xagg.wire.fanout import ResultPath
from xagg.wire.planner_inputs import PlanInputError
from xagg.wire.planner_model import chunk_counts, flat_closed_form, gloo_predict, predict

FREE = scaling.Costs(hop_s=0.0, client_pps=None, host_mem_bps=None)   # links and aggregators only
UNICAST, MCAST = ResultPath.from_model("unicast"), ResultPath.from_model("mcast")


def seconds(nbytes, bps):
    return nbytes * 8 / bps


@pytest.mark.parametrize("ranks,per_host", [(16, 1), (16, 8), (64, 8), (256, 8), (1024, 8)])
def test_ring_puts_one_edge_on_each_host_nic(ranks, per_host):
    # ranks ordered by host: one ring edge leaves each host, whatever its ranks
    c = scaling.Cluster(ranks, per_host, nic_bps=25e9, hosts_per_rack=10_000)
    inputs = c.inputs(False, UNICAST)
    p = scaling.ring(inputs, FREE)
    ring_bytes = 2 * (ranks - 1) / ranks * inputs.gradient_bytes * inputs.gloo_wire_factor
    assert p.seconds == pytest.approx(seconds(ring_bytes, 25e9))
    assert p.bound.endswith(("out", "in"))


@pytest.mark.parametrize("ranks", [64, 256, 1024])
def test_hierarchical_ring_rings_the_hosts(ranks):
    c = scaling.Cluster(ranks, 8, nic_bps=100e9, hosts_per_rack=10_000)
    inputs = c.inputs(True, UNICAST)
    h = c.hosts
    p = scaling.ring(inputs, FREE, "hier. ring", ranks_per_host=8)
    assert p.seconds == pytest.approx(seconds(2 * (h - 1) / h * inputs.gradient_bytes * inputs.gloo_wire_factor,
                                              100e9))


def test_ring_pays_a_hop_per_step():
    c = scaling.Cluster(64, 8, hosts_per_rack=10_000)
    hop = scaling.Costs(hop_s=1e-3, client_pps=None, host_mem_bps=None)
    flat = scaling.ring(c.inputs(False, UNICAST), FREE).seconds
    assert scaling.ring(c.inputs(False, UNICAST), hop).seconds == pytest.approx(flat + 2 * 63 * 1e-3)
    hosts = scaling.ring(c.inputs(True, UNICAST), FREE, ranks_per_host=8).seconds
    assert scaling.ring(c.inputs(True, UNICAST), hop, ranks_per_host=8).seconds == pytest.approx(hosts + 2 * 7 * 1e-3)


def test_ring_across_racks_crosses_each_uplink_once_each_way():
    # 4 racks, uplink 1/8 of a rack's NICs: one ring edge per uplink binds
    c = scaling.Cluster(256, 8, nic_bps=100e9, hosts_per_rack=8, oversub=8.0)
    inputs = c.inputs(False, UNICAST)
    p = scaling.ring(inputs, FREE)
    ring_bytes = 2 * 255 / 256 * inputs.gradient_bytes * inputs.gloo_wire_factor
    assert c.uplink_bps == 100e9
    assert p.seconds == pytest.approx(seconds(ring_bytes, c.uplink_bps))


def _shape(ranks=128, **kw):
    # hosts as ranks (1 per host) unless told: each worker its own link
    base = dict(ranks_per_host=1, nic_bps=10e9, hosts_per_rack=8, oversub=4.0, aggs_per_rack=1,
                agg_nic_bps=1e12, agg_cores=1000)
    return scaling.Cluster(ranks, **{**base, **kw})


def test_flat_uplink_carries_every_other_racks_share_and_the_results():
    c = _shape()
    inputs = c.inputs(False, UNICAST)
    p = scaling.xagg(inputs, FREE)
    counts = chunk_counts(inputs, flat_closed_form(inputs))
    fb, hpr, n = inputs.frame_bytes, c.hosts_per_rack, len(inputs.workers)
    # rack 0's workers send every other rack's root its chunks; rack 0's root
    # unicasts its results to every worker outside the rack
    out = hpr * sum(counts[1:]) * fb + (n - hpr) * counts[0] * fb
    assert p.terms["rack0 uplink out"] == pytest.approx(seconds(out, c.uplink_bps))
    assert p.bound.startswith("rack")


def test_tree_uplink_carries_one_partial_and_one_result_per_other_root():
    c = _shape()
    inputs = c.inputs(False, UNICAST)
    p = scaling.xagg(inputs, FREE, tree=True)
    counts = chunk_counts(inputs, flat_closed_form(inputs))
    racks, fb = c.racks, inputs.frame_bytes
    # up: rack 0's child's partial of each other root's chunks; down-going
    # copies of rack 0's root's results to the other racks' children
    out = sum(counts[1:]) * fb + (racks - 1) * counts[0] * fb
    assert p.terms["rack0 uplink out"] == pytest.approx(seconds(out, c.uplink_bps))
    assert p.seconds < scaling.xagg(inputs, FREE).seconds / 4     # the tree spares the uplinks


@pytest.mark.parametrize("tree", [False, True])
def test_oversubscription_scales_the_uplink_term(tree):
    terms = [scaling.xagg(_shape(oversub=o).inputs(False, UNICAST), FREE, tree=tree).terms["rack1 uplink in"]
             for o in (2.0, 4.0, 8.0)]
    assert terms[1] == pytest.approx(2 * terms[0]) and terms[2] == pytest.approx(2 * terms[1])
    assert _shape(oversub=4.0).uplink_bps == 8 * 10e9 / 4


def test_ranks_share_their_hosts_nic():
    c = scaling.Cluster(64, 8, nic_bps=25e9, hosts_per_rack=10_000, agg_nic_bps=1e12, agg_cores=1000)
    one_rank = scaling.Cluster(8, 1, nic_bps=25e9, hosts_per_rack=10_000, agg_nic_bps=1e12, agg_cores=1000)
    for results, copies_in in ((UNICAST, 8), (MCAST, 1)):
        shared = scaling.xagg(c.inputs(False, results), FREE, ranks_per_host=8).terms
        alone = scaling.xagg(one_rank.inputs(False, results), FREE).terms
        assert "h0r0 out" not in shared
        assert shared["h0 out"] == pytest.approx(8 * alone["h0r0 out"])
        assert shared["h0 in"] == pytest.approx(copies_in * alone["h0r0 in"])
    # reducing inside the host first: the NIC carries one gradient
    hosts = scaling.xagg(c.inputs(True, UNICAST), FREE, ranks_per_host=8, hosts_as_workers=True).terms
    assert hosts["h0 out"] == pytest.approx(alone["h0r0 out"])


def test_per_packet_and_memory_terms():
    c = scaling.Cluster(64, 8, mtu=1500)
    costs = scaling.Costs(hop_s=0.0, client_pps=1e6, host_mem_bps=1e12)
    inputs = c.inputs(False, UNICAST)
    packets = inputs.wire_bytes / inputs.frame_bytes
    ranks = scaling.xagg(inputs, costs, ranks_per_host=8)
    hosts = scaling.xagg(c.inputs(True, UNICAST), costs, ranks_per_host=8, hosts_as_workers=True)
    assert ranks.terms["client packets"] == pytest.approx(packets / 1e6)
    assert hosts.terms["client packets"] == pytest.approx(packets / 8 / 1e6)    # 8 processes share a host's
    assert hosts.terms["host memory"] == pytest.approx(2 * 8 * inputs.gradient_bytes * 8 / 1e12)
    assert "host memory" not in ranks.terms
    pkts = [t for t in scaling.xagg(inputs, FREE, ranks_per_host=8).terms if t.endswith("packets")]
    assert pkts and all(t.startswith("a") for t in pkts)      # the aggregators' XDP packet rate


def test_one_rank_per_host_is_the_planners_model():
    # the lab's case: the scaling model adds nothing to the planner's
    for kw in ({}, {"aggs_per_rack": 2, "oversub": 2.0}):
        c = scaling.Cluster(32, 1, nic_bps=10e9, hosts_per_rack=8, **kw)
        for results in (UNICAST, MCAST):
            inputs = c.inputs(False, results)
            assert scaling.xagg(inputs, scaling.LAB_COSTS).seconds == pytest.approx(
                predict(inputs, flat_closed_form(inputs))[0])
            assert scaling.ring(inputs, scaling.LAB_COSTS).seconds == pytest.approx(gloo_predict(inputs)[0])


def test_the_planner_draws_the_rack_tree():
    # a small shape the LP solves: two racks behind a thin uplink, each with an aggregator
    pytest.importorskip("scipy")
    from xagg.wire.planner import make_plan
    c = scaling.Cluster(8, 1, nic_bps=10e9, hosts_per_rack=4, oversub=8.0, agg_nic_bps=40e9)
    inputs = c.inputs(False, UNICAST)
    plan = make_plan(inputs)
    assert plan.kind == "tree"
    assert plan.routes == scaling.rack_tree_routes(inputs)
    assert scaling.xagg(inputs, FREE, tree=True).seconds == pytest.approx(plan.predicted_s, rel=0.01)


SHAPES = [dict(nic_bps=n, aggs_per_rack=a, mtu=m) for n in (25e9, 100e9) for a in (1, 4) for m in (1500, 9000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['nic_bps'] / 1e9:g}g-{s['aggs_per_rack']}agg-{s['mtu']}")
def test_more_ranks_are_never_faster(shape):
    times = [{p.algorithm: p.seconds for p in scaling.predict_all(scaling.Cluster(n, **shape))}
             for n in (16, 64, 256, 1024)]
    for a in scaling.ALGORITHMS:
        series = [t[a] for t in times]
        assert series == sorted(series), (a, series)


@pytest.mark.parametrize("ranks", [16, 256, 1024])
def test_twice_the_bandwidth_half_the_time(ranks):
    # links and aggregators only: every term is bytes or packets over a rate
    def run(k):
        c = scaling.Cluster(ranks, nic_bps=25e9 * k, agg_pps_per_core=1e6 * k)
        return {p.algorithm: p.seconds for p in scaling.predict_all(c, FREE)}
    one, two = run(1), run(2)
    for a in scaling.ALGORITHMS:
        assert two[a] == pytest.approx(one[a] / 2), a


def test_faster_nics_never_slower_with_every_cost():
    times = [{p.algorithm: p.seconds for p in scaling.predict_all(scaling.Cluster(256, nic_bps=b))}
             for b in (10e9, 25e9, 100e9, 400e9)]
    for a in scaling.ALGORITHMS:
        series = [t[a] for t in times]
        assert series == sorted(series, reverse=True), (a, series)


def test_in_host_reduce_takes_ranks_off_the_nic():
    for n in (16, 64, 256, 1024):
        by = {p.algorithm: p for p in scaling.predict_all(scaling.Cluster(n), FREE)}
        assert by["xagg flat/host"].seconds < by["xagg flat"].seconds
        assert by["hier. ring"].seconds <= by["gloo ring"].seconds


@pytest.mark.parametrize("kw,name", [(dict(ranks=12), "ranks"), (dict(ranks=16, ranks_per_host=0), "ranks_per_host"),
                                     (dict(ranks=16, oversub=0.5), "oversub"),
                                     (dict(ranks=16, mtu=4000), "agg_pps_per_core")])
def test_bad_cluster_named(kw, name):
    with pytest.raises(PlanInputError) as e:
        scaling.Cluster(**kw).check()
    assert e.value.field == name


# -- the command ----------------------------------------------------------------------


def test_command_prints_a_table_per_cluster(capsys):
    assert bench.main(["--ranks", "16,64", "--nic", "25gbit,100gbit"]) == 0
    out = capsys.readouterr().out
    assert out.count("== 25 MB all-reduce") == 2 and "NIC 25gbit" in out and "NIC 100gbit" in out
    for a in scaling.ALGORITHMS:
        assert a in out


def test_command_json_follows_the_flags(capsys):
    assert bench.main(["--ranks", "64", "--nic", "25gbit", "--aggs-per-rack", "1,4", "--mtu", "1500", "--mb", "4",
                       "--fanout", "unicast", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [len(c["rows"]) for c in d["clusters"]] == [1, 1] and d["lab"] == []
    rows = [c["rows"][0] for c in d["clusters"]]
    assert [r["aggregators"] for r in rows] == [2, 8]
    assert all(r["mtu"] == 1500 and r["mb"] == 4 and r["hosts"] == 8 for r in rows)
    assert {p["results"] for r in rows for p in r["predicted"].values() if p["results"]} == {"unicast"}
    want = {p.algorithm: p.seconds * 1e3 for p in scaling.predict_all(
        dataclasses.replace(scaling.Cluster(64, nic_bps=25e9, mtu=1500, mb=4)), results=("unicast",))}
    assert {a: p["ms"] for a, p in rows[0]["predicted"].items()} == pytest.approx(want)


@pytest.mark.parametrize("argv,named", [(["--ranks", "12"], "ranks"), (["--fanout", "foo"], "--fanout"),
                                        (["--nic", "fast"], "--nic"), (["--aggs-per-rack", "x"], "--aggs-per-rack")])
def test_command_names_a_bad_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_command_help_teaches(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for word in ("gloo ring", "hier. ring", "xagg tree", "--oversub", "--aggs-per-rack", "--lab", "--hop-us",
                 "busiest resource"):
        assert word in out


def test_command_plots(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "s.svg"
    assert bench.main(["--ranks", "16,64", "--nic", "25gbit", "--plot", str(path)]) == 0
    assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()


def test_docs_show_what_the_model_predicts(capsys):
    # docs/scaling.md's tables are the command's own output, not numbers typed in
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "scaling.md").read_text()
    assert bench.main(["--aggs-per-rack", "1,4", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("| ranks (hosts, racks) |") == 4
    missing = [line for line in out.splitlines() if line.strip() and line not in doc]
    assert missing == [], "docs/scaling.md differs from `python -m xagg.bench.scaling --aggs-per-rack 1,4 --markdown`"


LAB_ROW = {"mtu": 9000, "setting": "mcast group", "shape": "1g/agg4g", "workers": 4, "aggregators": 1, "mb": 16,
           "load": 3.0, "gloo": {"model_ms": 201.0, "bound": "w0 out", "lab_ms": 204.5},
           "xagg": {"model_ms": 141.0, "bound": "w0 in", "lab_ms": 131.5}}


def test_lab_rows_print_and_plot(tmp_path):
    # the lab's half of the command, on a row as lab_check writes it (the lab itself needs root)
    table = bench.lab_markdown([LAB_ROW])
    assert "| 9000, mcast group | 1g/agg4g | 201.0 | 204.5 | 141.0 (w0 in) | 131.5 | 3 |" in table
    pytest.importorskip("matplotlib")
    rows = bench.table(scaling.Cluster(16), [16, 64], scaling.Costs(), ("mcast",))
    path = tmp_path / "lab.svg"
    bench.plot([("a cluster", rows)], [LAB_ROW], str(path))
    assert "1g/agg4g" in path.read_text() and "model vs measured" in path.read_text()

"""Re-planning on a drift the real probe measures: a lab whose aggregators'
links tc shapes as the plan's figures say, xaggd (XDP) on both, and the
re-planner's own rates source (xagg.torch.replan.ProbeRates, which probes
every aggregator from its worker's host through xagg.client.probe) run on
the worker. While the links match the figures the split stays; once tc
slows a0's link to a fifth, the probe sees it and the proposal moves most
chunks to a1."""
from __future__ import annotations

import json
import os
import sys

import pytest

from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators
from xagg.wire import planner, planner_inputs
from xagg.wire.proto import C

AGG_RATE, SLOW = "50mbit", "10mbit"     # low: a busy machine still drives them at full rate

# On the worker's host: the re-planner's probe source, once; its new figures
# for a0 and a1 and the re-plan it proposes from the job's current weights.
PROBE = r"""
import json, sys
from types import SimpleNamespace
from xagg.torch.replan import ProbeRates, proposal
a = json.loads(sys.argv[1])
src = ProbeRates(a["path"], SimpleNamespace(aggregators=a["aggs"], control=a["controls"], token=None), a["mb"])
new = src()
print(json.dumps({"rates": new and {n.name: n.down_bps for n in new.aggregators},
                  "proposal": new and proposal(new, a["weights"])}))
"""


@pytest.fixture(scope="module")
def lab():
    spec = LabSpec(name=f"rp{os.getpid() % 100000}", workers=1, aggregators=2, rate="1gbit",
                   rate_of={"a0": AGG_RATE, "a1": AGG_RATE})
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=4096) as aggs:
        yield lab, aggs


def probe_on_worker(lab, aggs, path, weights) -> dict:
    arg = {"path": str(path), "aggs": [f"{a.ip}:{C.XAGG_PORT}" for a in lab.aggregators],
           "controls": [c.address for c in aggs.controls], "mb": 2, "weights": weights}
    r = lab.exec("w0", [sys.executable, "-c", PROBE, json.dumps(arg)], capture_output=True, text=True,
                 timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_link_tc_slows_is_measured_and_moves_the_split(lab, tmp_path):
    lab, aggs = lab
    figures = {"workers": [{"name": "w0", "rate": "1gbit"}],
               "aggregators": [{"name": "a0", "rate": AGG_RATE}, {"name": "a1", "rate": AGG_RATE}],
               "mb": 16, "vals": aggs.vals, "fanout": "unicast"}
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(figures))
    weights = planner.make_plan(planner_inputs.inputs_from_dict(figures)).weights
    assert weights[0] == weights[1]

    got = probe_on_worker(lab, aggs, path, weights)
    assert got["proposal"] is None, got             # the links are as the figures say: the split stays

    lab.set_rate(SLOW, hosts=["a0"])
    try:
        got = probe_on_worker(lab, aggs, path, weights)
    finally:
        lab.set_rate(AGG_RATE, hosts=["a0"])
    slow = planner_inputs.inputs_from_dict({**figures, "aggregators": [{"name": "a0", "rate": SLOW}]
                                            + figures["aggregators"][1:]}).aggregators[0].down_bps
    assert got["rates"]["a0"] <= 1.1 * slow, got    # measured at tc's rate, not the figure's
    new, routes = got["proposal"]
    assert routes is None and new[1] > 2 * new[0], got

"""Measured planner inputs: the probe's estimates (xagg/wire/probe.py) and
`xagg plan --lab NAME --probe` on a real lab (xagg/lab/probe.py)."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from xagg.cli.main import main as xagg
from xagg.wire import planner_inputs, probe

G = 1e9


def two_racks() -> planner_inputs.PlanInputs:
    return planner_inputs.inputs_from_dict({
        "workers": [{"name": "w0", "rack": 0}, {"name": "w1", "rack": 1}],
        "aggregators": [{"name": "a0", "rack": 0}, {"name": "a1", "rack": 1}],
        "uplinks": {"0": "10gbit", "1": "10gbit"}, "mb": 16, "vals": 2233})


def sample(agg, workers, gbps, rtt=0.001):
    # the bytes that take (1 s - rtt) at gbps per worker
    return probe.Sample(agg, workers, gbps * G / 8, 1.0 + rtt, rtt_s=rtt)


def test_estimates_take_each_hosts_best_sample_and_find_a_binding_uplink():
    inp = two_racks()
    samples = [sample("a0", ["w0"], 1.0), sample("a1", ["w1"], 1.0),      # in-rack: the workers' 1g
               sample("a1", ["w0"], 0.5, rtt=0.003), sample("a0", ["w1"], 0.5),   # across: the uplink
               sample("a0", ["w0"], 4.0 / 1)]                              # a0's own rack, together
    samples[-1].workers = ["w0"] * 4                                       # four senders, 1g each
    samples[-1].wire_bytes = 1.0 * G / 8
    est = probe.estimate(inp, samples)
    assert est.rates["w0"] == pytest.approx(1 * G) and est.rates["w1"] == pytest.approx(1 * G)
    assert est.rates["a0"] == pytest.approx(4 * G) and est.rates["a1"] == pytest.approx(1 * G)
    assert est.uplinks == {0: pytest.approx(0.5 * G), 1: pytest.approx(0.5 * G)}
    assert est.rtt_s[("w0", "a1")] == 0.003
    # an operator's figures win over the probe's
    out = probe.apply(inp, est, given={"a1"}, given_uplinks={1})
    byname = {n.name: n for n in out.workers + out.aggregators}
    assert byname["a0"].up_bps == byname["a0"].down_bps == pytest.approx(4 * G)
    assert byname["a1"].up_bps is None                      # given (here: unlimited), kept
    assert out.uplinks == {0: pytest.approx(0.5 * G), 1: 10 * G}


def test_a_cross_rack_sample_the_ends_explain_is_not_an_uplink():
    inp = two_racks()
    est = probe.estimate(inp, [sample("a0", ["w0"], 1.0), sample("a1", ["w1"], 1.0),
                               sample("a1", ["w0"], 0.95), sample("a0", ["w1"], 0.97)])
    assert est.uplinks == {}


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="labs need root")


@needs_root
@pytest.mark.slow
def test_xagg_plan_probe_measures_a_labs_shaped_links():
    """A lab whose a1 is shaped to 100 Mbit/s and a0 to 4 Gbit/s (workers
    unshaped): the probe sees a1 far slower than a0 and the plan built on the
    measured rates roots most chunks at a0; a figure given with --host
    overrides the measured one."""
    from xagg.lab import Lab, LabSpec
    spec = LabSpec(name="i14probe", workers=2, aggregators=2, rate_of={"a0": "4gbit", "a1": "100mbit"}, mtu=9000)
    with Lab(spec):
        r = CliRunner().invoke(xagg, ["plan", "--lab", "i14probe", "--probe", "1", "--json",
                                      "--host", "w1=2gbit"])
        assert r.exit_code == 0, (r.output, r.stderr)
    out = json.loads(r.stdout)
    rates = out["probe"]["rates"]
    assert rates["a1"] < rates["a0"] / 4, rates
    assert set(out["probe"]["rtt_ms"]) == {"w0->a0", "w1->a0", "w0->a1", "w1->a1"}
    byname = {n["name"]: n for n in out["inputs"]["workers"] + out["inputs"]["aggregators"]}
    assert byname["a1"]["up"] == byname["a1"]["down"]            # measured both ways alike
    assert byname["w1"]["up"] == byname["w1"]["down"] == 2e9     # the operator's figure
    assert out["plan"]["weights"][0] > out["plan"]["weights"][1]
    assert "probe w0 -> a1" in r.stderr
    # each aggregator's packet rate: what its xaggd measured of its program at
    # start, x the lab's 2 RX queues (no longer the built-in figure)
    pps = out["probe"]["pps"]
    assert set(pps) == {"a0", "a1"} and all(1e5 < v < 1e8 for v in pps.values()), pps
    assert byname["a0"]["pps"] == pps["a0"] != 2 * planner_inputs.DEFAULT_AGG_PPS_PER_QUEUE


def test_xagg_plan_probes_from_this_host_through_real_daemons(tmp_path):
    """Outside a lab: `xagg plan --inputs F --probe --as w0 -a ... --control ...`
    registers a probe job at each (userspace) xaggd, runs the calls from
    here, removes the jobs, and plans on the measured figures; a --host
    figure still wins."""
    from test_torch_hook import Xaggd
    dirs = [tmp_path / "a0", tmp_path / "a1"]
    for d in dirs:
        d.mkdir()
    daemons = [Xaggd(d) for d in dirs]
    f = tmp_path / "in.json"
    f.write_text(json.dumps({"workers": [{"name": "w0"}, {"name": "w1", "rate": "1gbit"}],
                             "aggregators": [{"name": "a0"}, {"name": "a1"}], "mb": 1, "vals": 256}))
    try:
        r = CliRunner().invoke(xagg, ["plan", "--inputs", str(f), "--probe", "0.25", "--as", "w0",
                                      "-a", ",".join(f"127.0.0.1:{d.port}" for d in daemons),
                                      "--control", ",".join(d.control for d in daemons),
                                      "--host", "a1=3gbit", "--json"])
        left = [d.stats()["jobs"] for d in daemons]
    finally:
        for d in daemons:
            d.kill()
    assert r.exit_code == 0, (r.output, r.stderr)
    out = json.loads(r.stdout)
    assert set(out["probe"]["rtt_ms"]) == {"w0->a0", "w0->a1"}
    assert all(v > 0 for v in out["probe"]["rtt_ms"].values())
    byname = {n["name"]: n for n in out["inputs"]["workers"] + out["inputs"]["aggregators"]}
    assert byname["w0"]["up"] == out["probe"]["rates"]["w0"] > 0          # measured
    assert byname["a0"]["up"] == out["probe"]["rates"]["a0"] > 0
    assert byname["a1"]["up"] == 3e9                                       # the operator's
    assert byname["w1"]["up"] == 1e9                                       # not probed: the file's
    assert left == [{}, {}], left                                          # probe jobs removed
    assert "probe w0 -> a1" in r.stderr

"""Re-planning between steps when rates drift (xagg/torch/replan.py, issue 14 item 5)."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist
from test_torch_hook import HEALTHY, P_TINY, WORLD, Xaggd, checked_steps, free_port
from torch.nn.parallel import DistributedDataParallel as DDP
from train_digits import make_model

from xagg.torch import attach
from xagg.torch.replan import FileRates, ProbeRates, Replanner, proposal
from xagg.wire import planner, planner_inputs, planner_model, probe

VALS = 256          # the userspace daemons' values per packet (test_torch_hook.Xaggd)


def figures(a0: str, a1: str) -> dict:
    """Plan inputs: 4 workers at 1 Gbit/s, two aggregators at these rates."""
    return {"workers": [{"name": f"w{i}", "rate": "1gbit"} for i in range(WORLD)],
            "aggregators": [{"name": "a0", "rate": a0}, {"name": "a1", "rate": a1}],
            "mb": 16, "vals": VALS, "fanout": "unicast"}


def inputs(a0, a1) -> planner_inputs.PlanInputs:
    return planner_inputs.inputs_from_dict(figures(a0, a1))


# -- the decision ---------------------------------------------------------------------

def test_a_drift_that_makes_the_split_slow_proposes_the_new_best_split():
    before = planner.make_plan(inputs("4gbit", "1gbit")).weights
    assert before[0] > before[1]
    after, routes = proposal(inputs("1gbit", "4gbit"), before)
    assert after[1] > after[0] and routes is None
    # the proposal is the planner's flat split for the new figures, and predicted faster
    drifted = inputs("1gbit", "4gbit")
    assert planner_model.predict(drifted, after)[0] < 0.9 * planner_model.predict(drifted, before)[0]


def test_small_drift_keeps_the_split():
    """Hysteresis: a change the new split would gain less than MIN_GAIN from is ignored."""
    before = planner.make_plan(inputs("4gbit", "1gbit")).weights
    assert proposal(inputs("4gbit", "1100mbit"), before) is None
    assert proposal(inputs("4gbit", "1gbit"), before) is None


def test_the_file_source_reports_only_changes(tmp_path):
    f = tmp_path / "in.json"
    f.write_text(json.dumps(figures("4gbit", "1gbit")))
    src = FileRates(str(f))
    assert src() is None                          # what the job was planned from
    f.write_text(json.dumps({"inputs": figures("1gbit", "4gbit")}))    # `xagg plan --json` shape
    got = src()
    assert got is not None and got.aggregators[1].down_bps == 4e9
    assert src() is None                          # read once
    f.write_text("{not json")
    assert src() is None                          # a bad file keeps the split (and is logged)


def test_only_auto_planned_registering_jobs_replan():
    class Cfg:
        plan, routes, registers = "auto", None, True

    class St:
        config = Cfg()

    env = {"XAGG_PLAN_INPUTS": "/nonexistent.json"}
    assert isinstance(Replanner.from_env(St(), env), Replanner)
    assert Replanner.from_env(St(), {**env, "XAGG_REPLAN_EVERY": "0"}) is None
    assert Replanner.from_env(St(), {}) is None
    Cfg.routes = [[0, 0]] * WORLD                 # a tree: re-planned too
    assert isinstance(Replanner.from_env(St(), env), Replanner)
    Cfg.routes, Cfg.plan = None, "off"
    assert Replanner.from_env(St(), env) is None


# -- four real ranks, two real daemons ---------------------------------------------------

_log: list[str] = []


class _ListHandler(logging.Handler):
    def emit(self, record):
        _log.append(record.getMessage())


def _rank(rank, port, q, kw, task="task_drift"):
    torch.set_num_threads(1)
    lg = logging.getLogger("xagg.torch")
    lg.addHandler(_ListHandler())
    lg.setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        q.put((rank, globals()[task](rank, **kw)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback
        q.put((rank, traceback.format_exc() + repr(e)))
    dist.destroy_process_group()


def task_drift(rank, aggs, controls, path, weights, every, before, after, lanes=1):
    """Train with the planned split; after ``before`` steps rank 0 rewrites the
    figures (a0 slowed down, a1 sped up); train ``after`` more steps. Every
    step is checked against DDP's own sum."""
    os.environ["XAGG_PLAN_INPUTS"] = path
    os.environ["XAGG_REPLAN_EVERY"] = str(every)
    A, X = DDP(make_model("tiny", 0)), DDP(make_model("tiny", 0))
    sX = attach(X, aggs, control=controls, weights=weights, plan="auto", fanout="unicast",
                timeout=HEALTHY, rto=0.02, lanes=lanes)
    p1, _ = checked_steps(rank, A, X, sX, before, {}, lr=0.3, slack=0)
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(figures("1gbit", "4gbit"), f)
        os.replace(path + ".tmp", path)
    dist.barrier()
    p2, _ = checked_steps(rank, A, X, sX, after, {}, lr=0.3, slack=0)
    out = dict(path=p1 + p2, stats=sX.snapshot(), log=list(_log),
               weights=[list(lane.client.cfg.weights) for lane in sX._engine.lanes],
               replans=sX._engine.replanner.replans)
    sX.close()
    return out


def run_ranks(tmp_path, task, figs, every, before, after, **extra):
    """Four ranks running ``task`` on two userspace xaggds with the job planned
    from ``figs``: (each rank's result, each daemon's stats)."""
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(figs))
    weights = planner.make_plan(planner_inputs.inputs_from_dict(figs)).weights
    dirs = [tmp_path / "a0", tmp_path / "a1"]
    for d in dirs:
        d.mkdir()
    daemons = [Xaggd(d) for d in dirs]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    kw = dict(aggs=[f"127.0.0.1:{d.port}" for d in daemons], controls=[d.control for d in daemons],
              path=str(path), weights=weights, every=every, before=before, after=after, **extra)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q, kw, task), daemon=True) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        res = dict(q.get(timeout=300) for _ in range(WORLD))
        stats = [d.stats() for d in daemons]
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.terminate()
        for d in daemons:
            d.kill()
    for r in range(WORLD):
        assert isinstance(res[r], dict), f"rank {r} failed:\n{res[r]}"
    return [res[r] for r in range(WORLD)], stats, weights


@pytest.mark.parametrize("lanes", [1, 2])
def test_ranks_switch_to_the_new_split_at_the_same_step(tmp_path, lanes):
    """With one lane, and with two (each its own job and client: both re-planned)."""
    every, before, after = 4, 6, 8          # checks after steps 3 (no change), 7 (drift), 11
    res, stats, weights = run_ranks(tmp_path, "task_drift", figures("4gbit", "1gbit"), every, before, after,
                                    lanes=lanes)
    steps = before + after
    assert all(r["path"] == "x" * steps for r in res), [r["path"] for r in res]
    new, _ = proposal(inputs("1gbit", "4gbit"), weights)
    for r in res:
        # one switch, at the check after the drift (step 7), to the planner's new split
        assert r["replans"] == 1, r["log"]
        assert [m for m in r["log"] if "re-planned" in m] == [m for m in r["log"] if "after step 7" in m], r["log"]
        assert r["weights"] == [[round(w * 10**9) / 10**9 for w in new]] * lanes
    # the registration that switched reset both daemons: from then on (steps 8..13)
    # the chunks went by the new split, most of them to a1
    job = str(res[0]["stats"]["job_id"])
    done = [s["jobs"][job]["completed"] for s in stats]
    assert done[1] > done[0], done
    assert sum(done) >= (1 + -(-P_TINY // VALS)) * (steps - 8), done


# -- measured drift: rank 0's probe -----------------------------------------------------------

def solo(agg, gbps):
    return probe.Sample(agg, ["w0"], gbps * 1e9 / 8, 1.0)


def test_a_solo_probe_proves_only_what_it_can_see():
    base = inputs("4gbit", "1gbit")         # workers at 1 Gbit/s
    # a 4 Gbit/s aggregator seen at 1 Gbit/s from a 1 Gbit/s worker: nothing learnt
    assert probe.drifted(base, [solo("a0", 1.0), solo("a1", 1.0)], "w0") is None
    # a0 throttled to 300 Mbit/s: seen below both figures
    got = probe.drifted(base, [solo("a0", 0.3), solo("a1", 0.98)], "w0")
    assert got.aggregators[0].down_bps == got.aggregators[0].up_bps == pytest.approx(0.3e9)
    assert got.aggregators[1].down_bps == 1e9
    # a1 back from 500 Mbit/s: seen above its figure, believed up to the worker's own rate
    got = probe.drifted(inputs("4gbit", "500mbit"), [solo("a0", 1.0), solo("a1", 1.3)], "w0")
    assert got.aggregators[1].down_bps == 1e9 and got.aggregators[0].down_bps == 4e9


def test_probe_rates_reports_a_measured_drift_and_a_file_change_first(tmp_path):
    f = tmp_path / "in.json"
    f.write_text(json.dumps(figures("4gbit", "1gbit")))

    class Cfg:
        aggregators, control, token = ["127.0.0.1:1", "127.0.0.1:2"], ["c0", "c1"], None

    src = ProbeRates(str(f), Cfg(), mb=1)
    seen = {"a0": 1.0, "a1": 1.0}
    calls = []

    def fake_probe(aggs, controls, token, names, me, mb):
        calls.append((tuple(aggs), tuple(controls), tuple(names), me, mb))
        return [solo(n, seen[n]) for n in names]
    src.probe = fake_probe
    assert src() is None                                  # nothing the probe can see changed
    assert calls[0] == (("127.0.0.1:1", "127.0.0.1:2"), ("c0", "c1"), ("a0", "a1"), "w0", 1)
    seen["a0"] = 0.25
    got = src()
    assert got.aggregators[0].down_bps == pytest.approx(0.25e9)
    assert proposal(got, planner.make_plan(inputs("4gbit", "1gbit")).weights) is not None
    assert src() is None                                  # the same again: already known
    f.write_text(json.dumps(figures("2gbit", "2gbit")))   # the operator's new figures win
    n = len(calls)
    got = src()
    assert got.aggregators[0].down_bps == 2e9 and len(calls) == n

    def broken(*a):
        raise OSError("daemon gone")
    src.probe = broken
    assert src() is None                                  # a failed probe keeps the split


def test_probe_mb_turns_on_rank_0s_probe(tmp_path):
    f = tmp_path / "in.json"
    f.write_text(json.dumps(figures("4gbit", "1gbit")))

    class Cfg:
        plan, routes, registers = "auto", None, True

    class St:
        config = Cfg()

    env = {"XAGG_PLAN_INPUTS": str(f)}
    plain = Replanner.from_env(St(), env)
    assert isinstance(plain.source, FileRates) and plain.first is None
    probing = Replanner.from_env(St(), {**env, "XAGG_REPLAN_PROBE_MB": "1"})
    assert isinstance(probing.source, ProbeRates) and probing.first == 0     # the probe at registration


def task_probe_drift(rank, aggs, controls, path, weights, every, before, after):
    """As task_drift, but the figures never change: every rank's probe (real,
    through the daemons, at the check after step 3) sees nothing wrong; then a
    stand-in probe on every rank reports a0 throttled to 2 Mbit/s."""
    os.environ.update(XAGG_PLAN_INPUTS=path, XAGG_REPLAN_EVERY=str(every), XAGG_REPLAN_PROBE_MB="0.25")
    A, X = DDP(make_model("tiny", 0)), DDP(make_model("tiny", 0))
    sX = attach(X, aggs, control=controls, weights=weights, plan="auto", fanout="unicast",
                timeout=HEALTHY, rto=0.02)
    src = sX._engine.replanner.source
    p1, _ = checked_steps(rank, A, X, sX, before, {}, lr=0.3, slack=0)
    src.probe = lambda aggs, ctl, token, names, me, mb: [
        probe.Sample("a0", [me], 2e6 / 8, 1.0), probe.Sample("a1", [me], 10e6 / 8, 1.0)]
    p2, _ = checked_steps(rank, A, X, sX, after, {}, lr=0.3, slack=0)
    out = dict(path=p1 + p2, log=list(_log), weights=list(sX._engine.client.cfg.weights),
               replans=sX._engine.replanner.replans, stats=sX.snapshot())
    sX.close()
    return out


def task_probe_first(rank, aggs, controls, path, weights, every, before, after):
    """The figures are wrong from the start: every rank's probe (a stand-in
    reporting what its host sees: a0 at 2 Mbit/s, the file says 40; ``seen``
    per worker, or the same from all) runs after the first step."""
    os.environ.update(XAGG_PLAN_INPUTS=path, XAGG_REPLAN_EVERY=str(every), XAGG_REPLAN_PROBE_MB="0.25")
    A, X = DDP(make_model("tiny", 0)), DDP(make_model("tiny", 0))
    sX = attach(X, aggs, control=controls, weights=weights, plan="auto", fanout="unicast",
                timeout=HEALTHY, rto=0.02)
    seen = json.loads(os.environ.get("TEST_SEEN", "{}"))
    sX._engine.replanner.source.probe = lambda aggs, ctl, token, names, me, mb: [
        probe.Sample(n, [me], seen.get(me, {"a0": 2e6, "a1": 10e6})[n] / 8, 1.0) for n in names]
    p1, _ = checked_steps(rank, A, X, sX, before, {}, lr=0.3, slack=0)
    out = dict(path=p1, log=list(_log), weights=list(sX._engine.client.cfg.weights),
               replans=sX._engine.replanner.replans)
    sX.close()
    return out


def test_the_probe_at_registration_replans_after_the_first_step(tmp_path):
    """XAGG_REPLAN_PROBE_MB (`xagg-client run --probe MB`): the first check is
    at the end of step 0, so a job planned from wrong figures runs one step on
    them, not XAGG_REPLAN_EVERY."""
    every, before = 50, 4
    figs = {**figures("40mbit", "10mbit"), "workers": [{"name": f"w{i}", "rate": "10mbit"} for i in range(WORLD)]}
    res, _, weights = run_ranks(tmp_path, "task_probe_first", figs, every, before, 0)
    assert weights[0] > weights[1]                      # planned from the file: a0 the faster
    for r in res:
        assert r["path"] == "x" * before, r["path"]
        assert r["replans"] == 1 and any("re-planned after step 0" in m for m in r["log"]), r["log"]
        assert r["weights"] == res[0]["weights"] and r["weights"][0] < r["weights"][1]


def test_a_drift_the_ranks_measure_switches_every_rank_at_the_same_step(tmp_path):
    """XAGG_REPLAN_PROBE_MB: every rank's real probe through the daemons at the
    first check (loopback: faster than the file's 10 Mbit/s workers, which it
    may conclude; whatever it concludes, every rank acts on it alike); a
    stand-in probe then reports a0 at 2 Mbit/s and every rank moves most
    chunks to a1 after the same step."""
    every, before, after = 4, 6, 4          # checks after steps 3 (real probe), 7 (a0 slow)
    figs = {**figures("40mbit", "10mbit"), "workers": [{"name": f"w{i}", "rate": "10mbit"} for i in range(WORLD)]}
    res, _, weights = run_ranks(tmp_path, "task_probe_drift", figs, every, before, after)
    assert all(r["path"] == "x" * (before + after) for r in res), [r["path"] for r in res]

    def replanned(r):
        return [m.split("re-planned after step ")[1].split(":")[0] for m in r["log"] if "re-planned" in m]
    for r in res:
        assert replanned(r) == replanned(res[0]) and replanned(r)[-1] == "7", r["log"]
        assert r["weights"] == res[0]["weights"] and r["weights"][0] < r["weights"][1], [m[:400] for m in res[0]["log"]]
    assert not any("probe failed" in m for r in res for m in r["log"]), [r["log"] for r in res]
    # the 16 MB plan gave a1 one chunk, none of this tiny model's: it started planned
    # out, and the re-plan, which registers every aggregator, took it back in
    assert any("share of job" in m and "is empty" in m for m in res[0]["log"]), res[0]["log"]
    assert all(any("every aggregator again" in m for m in r["log"]) for r in res)


def test_a_drift_only_other_ranks_can_see_is_found(tmp_path, monkeypatch):
    """Rank 0's own link (1 Mbit/s) hides a0's throttling (to 2 Mbit/s, the
    file says 40): from w0 both aggregators look like 1 Mbit/s. The other
    ranks, at 10 Mbit/s, see a0 at 2: every rank's probe at registration
    proves a0 slow, and the job moves most chunks to a1."""
    seen = {"w0": {"a0": 1e6, "a1": 1e6}, **{f"w{i}": {"a0": 2e6, "a1": 10e6} for i in range(1, WORLD)}}
    monkeypatch.setenv("TEST_SEEN", json.dumps(seen))
    every, before = 50, 3
    figs = {**figures("40mbit", "10mbit"),
            "workers": [{"name": f"w{i}", "rate": "1mbit" if i == 0 else "10mbit"} for i in range(WORLD)]}
    res, _, weights = run_ranks(tmp_path, "task_probe_first", figs, every, before, 0)
    assert weights[0] > weights[1]
    for r in res:
        assert r["replans"] == 1 and any("re-planned after step 0" in m for m in r["log"]), r["log"]
        assert r["weights"] == res[0]["weights"] and r["weights"][0] < r["weights"][1]
    # rank 0 alone would have learnt nothing
    from xagg.wire.planner_inputs import inputs_from_dict
    base = inputs_from_dict(figs)
    assert probe.drifted(base, [probe.Sample(a, ["w0"], bps / 8, 1.0) for a, bps in seen["w0"].items()]) is None


# -- trees ---------------------------------------------------------------------------------

def racked(uplink: str | None) -> dict:
    """Two racks (w0 w1 a0 | w2 w3 a1), aggregators at 4 Gbit/s, each rack's
    uplink at ``uplink`` (None: unshaped)."""
    return {"workers": [{"name": f"w{i}", "rate": "1gbit", "rack": i // 2} for i in range(WORLD)],
            "aggregators": [{"name": f"a{i}", "rate": "4gbit", "rack": i} for i in range(2)],
            **({"uplinks": {"0": uplink, "1": uplink}} if uplink else {}),
            "mb": 16, "vals": VALS, "fanout": "unicast"}


def test_a_shared_uplink_turns_a_flat_plan_into_a_tree_and_back():
    flat = planner.make_plan(planner_inputs.inputs_from_dict(racked(None)))
    assert flat.kind == "flat"
    weights, routes = proposal(planner_inputs.inputs_from_dict(racked("500mbit")), flat.weights)
    assert routes is not None and any(c != p for row in routes for p, c in enumerate(row))
    # the uplink freed again: the tree's detour no longer pays, but costs no more
    # than 10% either: kept (hysteresis)
    assert proposal(planner_inputs.inputs_from_dict(racked(None)), weights, routes=routes) is None


def task_tree_drift(rank, aggs, controls, path, weights, every, before, after):
    """Start flat (the racks' uplinks unshaped in the file); after ``before``
    steps rank 0 writes 500 Mbit/s uplinks: the re-plan makes a tree."""
    os.environ.update(XAGG_PLAN_INPUTS=path, XAGG_REPLAN_EVERY=str(every))
    A, X = DDP(make_model("tiny", 0)), DDP(make_model("tiny", 0))
    sX = attach(X, aggs, control=controls, weights=weights, plan="auto", fanout="unicast", timeout=HEALTHY, rto=0.02)
    p1, _ = checked_steps(rank, A, X, sX, before, {}, lr=0.3, slack=0)
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            json.dump(racked("500mbit"), f)
        os.replace(path + ".tmp", path)
    dist.barrier()
    p2, _ = checked_steps(rank, A, X, sX, after, {}, lr=0.3, slack=0)
    out = dict(path=p1 + p2, log=list(_log), replans=sX._engine.replanner.replans,
               route=sX._engine.client.cfg.route, send_to=[list(a) for a in sX._engine.client.cfg.send_to],
               stats=sX.snapshot())
    sX.close()
    return out


def test_every_rank_moves_to_a_tree_at_the_same_step(tmp_path):
    """A flat job whose racks' uplinks become shared: every rank switches to
    the planner's tree after the same step (each its own row of the routes:
    rack 1's workers send a0's chunks through a1), and every step, before
    and after, equals DDP's."""
    every, before, after = 4, 6, 6          # checks after steps 3 (no change), 7 (the tree), 11
    res, stats, weights = run_ranks(tmp_path, "task_tree_drift", racked(None), every, before, after)
    assert all(r["path"] == "x" * (before + after) for r in res), [r["path"] for r in res]
    _, routes = proposal(planner_inputs.inputs_from_dict(racked("500mbit")), weights)
    for rank, r in enumerate(res):
        assert r["replans"] == 1 and any("re-planned after step 7" in m and "tree routes" in m for m in r["log"]), \
            r["log"]
        assert r["route"] == routes[rank]
        assert r["stats"]["fallbacks"] == 0, r["log"]
    # partial sums went up: a child aggregator summed for the other rack's root
    assert any(s["counters"].get("partial_sent", 0) > 0 for s in stats), stats

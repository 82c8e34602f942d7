"""`xagg plan` and `xagg-client run --plan auto`: the planner's two doors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from xagg.cli.main import main as xagg
from xagg.torch.cli import plan_job

HOSTS_A = ["--host", "w0=1gbit", "--host", "w1=1gbit", "--host", "w2=1gbit", "--host", "w3=1gbit",
           "--host", "a0=4gbit,pps=730000", "--host", "a1=1gbit,pps=730000", "--cores", "2"]


def test_xagg_plan_prints_inputs_plan_and_predictions():
    r = CliRunner().invoke(xagg, ["plan", *HOSTS_A])
    assert r.exit_code == 0, r.output
    assert "aggregator a0   rack 0  4gbit, 0.73 Mpps" in r.output
    assert "plan: flat" in r.output and "equal-split flat" in r.output and "gloo ring" in r.output


def test_xagg_plan_json_feeds_back_as_inputs(tmp_path):
    r = CliRunner().invoke(xagg, ["plan", *HOSTS_A, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["plan"]["kind"] == "flat" and out["plan"]["weights"][0] > 0.9
    f = tmp_path / "plan.json"
    f.write_text(r.output)
    again = CliRunner().invoke(xagg, ["plan", "--inputs", str(f), "--json"])
    assert json.loads(again.output)["plan"] == out["plan"]
    # flags override the file: two 2 Gbit/s aggregators, each needed, take half each
    r = CliRunner().invoke(xagg, ["plan", "--inputs", str(f), "--host", "a0=2gbit", "--host", "a1=2gbit", "--json"])
    assert json.loads(r.output)["plan"]["weights"] == pytest.approx([0.5, 0.5], abs=0.01)


def test_xagg_plan_tree_across_racks_shows_the_edges():
    r = CliRunner().invoke(xagg, ["plan", "--host", "w0=1gbit", "--host", "w1=1gbit", "--host", "w2=1gbit,rack=1",
                                  "--host", "w3=1gbit,rack=1", "--host", "a0=4gbit", "--host", "a1=4gbit,rack=1",
                                  "--uplink", "0=500mbit", "--uplink", "1=500mbit", "--cores", "0",
                                  "--fanout", "mcast,unicast"])
    assert r.exit_code == 0, r.output
    assert "plan: tree, results unicast" in r.output and "tree: " in r.output


@pytest.mark.parametrize("args,says", [
    (["--host", "w0=1gbit", "--host", "a0=fast"], "--host a0: bad rate 'fast'"),
    (["--host", "w0=1gbit", "--host", "a0=1gbit,speed=3"], "unknown key 'speed'"),
    (["--host", "w0=1gbit", "--host", "a0=1gbit", "--uplink", "x=1gbit"], "expected RACK=RATE"),
    (["--host", "w0=1gbit", "--host", "a0=1gbit", "--uplink", "4=1gbit"], "uplinks.4: no host is in rack 4"),
    (["--host", "w0=1gbit"], "aggregators: at least one aggregator"),
    ([], "no inputs"),
])
def test_xagg_plan_bad_input_names_it(args, says):
    r = CliRunner().invoke(xagg, ["plan", *args])
    assert r.exit_code != 0 and says in r.output, r.output


def _inputs_file(tmp_path, *agg_rates):
    d = {"workers": [{"name": f"w{i}", "rate": "1gbit"} for i in range(4)],
         "aggregators": [{"name": f"a{i}", "rate": r} for i, r in enumerate(agg_rates)],
         "mb": 16, "vals": 2233, "cpu": {"shared_cores": 2}}
    f = tmp_path / "inputs.json"
    f.write_text(json.dumps(d))
    return str(f)


def test_plan_job_applies_weights_or_picks_gloo(tmp_path):
    settings = {"aggregators": "10.0.0.1,10.0.0.2", "weights": None}
    transport, s, why = plan_job(_inputs_file(tmp_path, "2gbit", "2gbit"), settings)
    assert transport == "xagg" and s["weights"] == pytest.approx([0.5, 0.5]) and s["plan"] == "auto"
    assert why.startswith("plan: flat xagg (a0 0.50, a1 0.50)")
    # 4 workers, one 1 Gbit/s aggregator: gloo, the settings untouched
    settings = {"aggregators": "10.0.0.1", "weights": None}
    transport, s, why = plan_job(_inputs_file(tmp_path, "1gbit"), settings)
    assert transport == "gloo" and s == settings and "gloo's ring" in why


def test_plan_job_refuses_what_does_not_fit(tmp_path):
    import click
    with pytest.raises(click.BadParameter, match="needs the cluster's figures"):
        plan_job(None, {"aggregators": "10.0.0.1"})
    with pytest.raises(click.BadParameter, match="both set the split"):
        plan_job(_inputs_file(tmp_path, "1gbit"), {"aggregators": "10.0.0.1", "weights": "1"})
    with pytest.raises(click.BadParameter, match="describes 2 aggregators, --aggregators lists 1"):
        plan_job(_inputs_file(tmp_path, "1gbit", "1gbit"), {"aggregators": "10.0.0.1", "weights": None})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"workers": [{"name": "w0", "rate": "1gbit"}],
                               "aggregators": [{"name": "a0", "rate": "x"}], "mb": 1, "vals": 100}))
    with pytest.raises(click.BadParameter, match=r"aggregators\[0\].rate"):
        plan_job(str(bad), {"aggregators": "10.0.0.1", "weights": None})


def test_xagg_client_plan_auto_runs_the_ranks_on_the_plans_choice(tmp_path):
    """Real torchrun, two ranks (of a planned 4-worker job): the plan's weights reach the ranks as XAGG_WEIGHTS and
    the figures' file as XAGG_PLAN_INPUTS (the re-planner re-reads it), --probe as XAGG_REPLAN_PROBE_MB; a plan
    that says gloo sends them XAGG_TRANSPORT=gloo and says why, once."""
    script = tmp_path / "show.py"
    script.write_text(textwrap.dedent("""
        import json, os
        # one write of a line under PIPE_BUF: the two ranks' rows cannot interleave (print writes its
        # arguments and the newline apart, and once gave "RANK-ENVRANK-ENV {...}")
        os.write(1, ("RANK-ENV " + json.dumps({k: os.environ.get(k) for k in
                     ("RANK", "XAGG_TRANSPORT", "XAGG_WEIGHTS", "XAGG_PLAN", "XAGG_PLAN_INPUTS",
                      "XAGG_REPLAN_PROBE_MB")}) + "\\n").encode())
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("XAGG_PLAN", None)
    env.pop("XAGG_PLAN_INPUTS", None)
    env.pop("XAGG_REPLAN_PROBE_MB", None)
    common = ["run", "--job-id", "7", "--cookie", "9", "--nproc-per-node", "2", "--progress", "0",
              "--status-dir", str(tmp_path / "st"), "--plan", "auto"]

    def ranks(inputs, aggs, *extra):
        r = subprocess.run([sys.executable, "-m", "xagg.torch.cli", *common, "--plan-inputs", inputs,
                            "-a", aggs, *extra, "--", str(script)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        # anywhere in a line: two ranks share the pipe, and another's unfinished line may precede a row
        rows = [json.loads(m) for m in re.findall(r"RANK-ENV (\{[^{}]*\})", r.stdout)]
        assert len(rows) == 2, r.stdout[-2000:] + r.stderr[-3000:]
        return rows, r.stderr

    two = _inputs_file(tmp_path, "2gbit", "2gbit")
    rows, err = ranks(two, "127.0.0.1:9000,127.0.0.1:9001", "--probe", "0.5")
    assert len(rows) == 2 and all(r["XAGG_TRANSPORT"] == "xagg" and r["XAGG_PLAN"] == "auto" for r in rows)
    assert all(r["XAGG_PLAN_INPUTS"] == os.path.abspath(two) and r["XAGG_REPLAN_PROBE_MB"] == "0.5" for r in rows)
    assert all([float(w) for w in r["XAGG_WEIGHTS"].split(",")] == pytest.approx([0.5, 0.5]) for r in rows)
    rows, err = ranks(_inputs_file(tmp_path, "1gbit"), "127.0.0.1:9000")
    assert all(r["XAGG_TRANSPORT"] == "gloo" and r["XAGG_WEIGHTS"] is None for r in rows)
    assert err.count("plan: gloo") == 1, err


def test_probe_needs_plan_auto_and_a_size():
    from xagg.torch.cli import run
    for args, says in ((["--probe", "4"], "needs --plan auto"), (["--plan", "auto", "--probe", "0"], "size > 0")):
        r = CliRunner().invoke(run, ["-a", "127.0.0.1:9000", *args, "--", "train.py"])
        assert r.exit_code == 2 and "--probe" in r.output and says in r.output, r.output


def test_a_labs_state_file_is_a_source(tmp_path, monkeypatch):
    """--lab NAME reads what the lab recorded: shaped rates, racks, uplink, MTU
    (no namespaces needed: the state file is what `xagg plan` reads)."""
    from xagg.lab import cluster
    from xagg.lab.plan_inputs import lab_inputs
    monkeypatch.setattr(cluster, "STATE_DIR", tmp_path)
    spec = cluster.LabSpec(name="xplcli", workers=4, aggregators=2, rate="1gbit",
                           rate_of={"a0": "4gbit", "a1": "4gbit"}, mtu=9000, racks=2, uplink="500mbit")
    cluster.Lab(spec)._save()
    inputs = lab_inputs(cluster.Lab.load("xplcli"))
    assert [w.rack for w in inputs.workers] == [0, 0, 1, 1] and [a.rack for a in inputs.aggregators] == [0, 1]
    assert inputs.uplinks == {0: 5e8, 1: 5e8} and inputs.aggregators[0].down_bps == 4e9 and inputs.vals == 2233
    assert inputs.cpu.shared_cores == os.cpu_count()
    r = CliRunner().invoke(xagg, ["plan", "--lab", "xplcli", "--fanout", "mcast,unicast"])
    assert r.exit_code == 0 and "uplink     rack 1  500mbit each way" in r.output and "plan: tree" in r.output, r.output


def test_plan_job_hands_a_tree_to_the_ranks(tmp_path):
    d = {"workers": [{"name": f"w{i}", "rate": "1gbit", "rack": i // 2} for i in range(4)],
         "aggregators": [{"name": "a0", "rate": "4gbit", "rack": 0}, {"name": "a1", "rate": "4gbit", "rack": 1}],
         "uplinks": {"0": "500mbit", "1": "500mbit"}, "mb": 16, "vals": 2233, "fanouts": ["mcast", "unicast"]}
    f = tmp_path / "racks.json"
    f.write_text(json.dumps(d))
    transport, s, why = plan_job(str(f), {"aggregators": "10.0.0.1,10.0.0.2", "weights": None})
    assert transport == "xagg" and why.startswith("plan: tree xagg") and "XAGG_ROUTES" in why
    assert any(c != p for row in s["routes"] for p, c in enumerate(row)) and s["fanout"] == "unicast"
    from xagg.torch.config import HookConfig
    env = HookConfig(**s, job_id=1, cookie=2).to_env()
    assert json.loads(env["XAGG_ROUTES"]) == s["routes"]

"""The hook's settings (one default and one check for every door) and its
fallback policy (one rule for the hook and the compression transport), as
units. tests/test_torch_hook.py runs both through real ranks."""
from __future__ import annotations

import logging

import pytest

from xagg.client.config import DEFAULT_TIMEOUT, ClientConfig
from xagg.torch.config import ENV, HookConfig, HookConfigError
from xagg.torch.fallback import Fallback, Wording
from xagg.torch.result_path import agree

BASE = dict(aggregators="127.0.0.1:9000,127.0.0.1:9001", job_id=7, cookie=9)


def test_settings_go_to_the_ranks_and_come_back_equal():
    cfg = HookConfig(**BASE, weights="1,3", control="a:1,b:2", token="t" * 16, fanout="bcast", timeout=2.5,
                     vals=768, backoff_steps=3, status_dir="/tmp/s", progress_every=10.0, window=99)
    env = cfg.to_env()
    assert set(env) <= set(ENV.values()) and "XAGG_RTO" not in env      # defaults stay out
    assert HookConfig.from_env(env) == cfg


def test_defaults_are_the_clients():
    cfg = HookConfig(**BASE)
    assert cfg.timeout == DEFAULT_TIMEOUT == ClientConfig.timeout
    assert cfg.rto == ClientConfig.rto
    # the fan-out is chosen at registration; a job the operator registered takes the client's
    assert cfg.fanout == "auto" and agree(cfg, None, 1, [0]).path.fanout.label == ClientConfig.fanout
    assert cfg.max_backoff_steps >= cfg.backoff_steps
    assert HookConfig(**BASE, backoff_steps=5000).max_backoff_steps == 5000     # never below the back-off


@pytest.mark.parametrize("env,message", [
    ({"XAGG_AGGREGATORS": "127.0.0.1", "XAGG_JOB_ID": "1", "XAGG_COOKIE": "2", "XAGG_TIMEOUT": "x"},
     "XAGG_TIMEOUT='x': expected a number"),
    ({"XAGG_AGGREGATORS": "127.0.0.1", "XAGG_JOB_ID": "one", "XAGG_COOKIE": "2"},
     "XAGG_JOB_ID='one': expected an integer"),
    ({"XAGG_AGGREGATORS": "127.0.0.1"}, "give XAGG_CONTROL .* or XAGG_JOB_ID and XAGG_COOKIE"),
    ({"XAGG_AGGREGATORS": "127.0.0.1", "XAGG_CONTROL": "a:1", "XAGG_RTO": "9"},
     r"XAGG_RTO='9': \(9.0s\) must be shorter than XAGG_TIMEOUT"),
    ({"XAGG_AGGREGATORS": "127.0.0.1,127.0.0.2", "XAGG_CONTROL": "a:1"}, "XAGG_CONTROL='a:1': one control endpoint"),
    ({}, "XAGG_AGGREGATORS: not set"),
    ({"XAGG_AGGREGATORS": "127.0.0.1", "XAGG_CONTROL": "a:1", "XAGG_METRICS": "9100"},
     "XAGG_METRICS='9100': must be HOST:PORT"),
])
def test_a_bad_variable_is_named(env, message):
    with pytest.raises(HookConfigError, match=message):
        HookConfig.from_env(env)


def test_a_bad_setting_names_the_others_the_way_each_door_calls_them():
    with pytest.raises(HookConfigError) as e:
        HookConfig(aggregators="127.0.0.1")
    assert e.value.field == "control" and "give control" in str(e.value)
    assert "give --control" in e.value.explain({"control": "--control", "job_id": "--job-id"})


def drive(fb: Fallback, script: str, rank: int = 0, wording: Wording | None = None) -> str:
    """Run the policy through a script of units: x succeeded, f failed,
    r a retry whose agreement fails, R one that succeeds; returns the modes."""
    kw = {} if wording is None else {"wording": wording}
    modes = ""
    for c in script:
        if fb.mode == "gloo":
            if fb.due():
                fb.retry(rank, lambda: (True, ""), lambda failed: c == "r", **kw)
            modes += fb.mode[0]
            continue
        if c == "f":
            fb.fail(rank, "no answer", **kw)
        else:
            fb.succeeded(rank, **kw)
        modes += "x"
    return modes


def test_the_fallback_backs_off_doubles_and_recovers(caplog):
    fb = Fallback(backoff_steps=2, max_backoff_steps=4)
    with caplog.at_level(logging.INFO, logger="xagg.torch"):
        # a failure; 2 units on gloo, the 2nd retries and fails; 4 more (doubled, the cap),
        # the 4th retries and succeeds; the next success is the recovery
        modes = drive(fb, "f" + "gr" + "gggR" + "x")
    assert modes == "x" + "gg" + "gggx" + "x"
    assert fb.counters() == {"fallbacks": 1, "retries": 2, "recoveries": 1}
    assert fb.backoff == 2 and not fb.retrying                       # the back-off starts over
    assert sum("falling back to gloo" in r.message for r in caplog.records) == 1
    assert any("retry failed" in r.message for r in caplog.records)
    assert any("answer again" in r.message for r in caplog.records)


def test_the_compression_transport_words_it_its_way(caplog):
    w = Wording("compressed sums fall back", "sums", "compressed sums are back")
    fb = Fallback(backoff_steps=1, max_backoff_steps=1)
    with caplog.at_level(logging.WARNING, logger="xagg.torch"):
        drive(fb, "fRx", wording=w)
    assert "tried again in 1 sums" in caplog.records[0].message and "are back" in caplog.records[-1].message


def test_a_restored_state_starts_on_xagg():
    fb = Fallback(backoff_steps=3, max_backoff_steps=8)
    fb.fail(0, "no answer")
    fb.restored()
    assert fb.mode == "xagg" and fb.left == 0 and not fb.retrying and fb.fallbacks == 1


def test_xagg_client_takes_the_cookie_from_the_environment(tmp_path):
    """The cookie is the job's secret: XAGG_COOKIE keeps it off the command line."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XAGG_JOB_ID": "7", "XAGG_COOKIE": "notanumber"}
    r = subprocess.run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", "127.0.0.1", "--nproc-per-node",
                        "1", "--", "nonexistent.py"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--cookie" in r.stderr and "notanumber" in r.stderr


def test_lanes_go_to_the_ranks_and_a_bad_count_is_named():
    cfg = HookConfig(**BASE, lanes=3)
    assert cfg.to_env()["XAGG_LANES"] == "3" and HookConfig.from_env(cfg.to_env()).lanes == 3
    with pytest.raises(HookConfigError, match="lanes: must be 1..8 buckets in flight, got 0"):
        HookConfig(**BASE, lanes=0)


def test_each_lane_is_a_job_of_its_own_with_its_own_result_port():
    from xagg.torch.lanes import lane_jobs
    from xagg.wire.jobspec import DEFAULT_RESULT_PORT
    assert lane_jobs(7, 3) == [(7, DEFAULT_RESULT_PORT), (8, DEFAULT_RESULT_PORT + 1), (9, DEFAULT_RESULT_PORT + 2)]
    ids = [j for j, _ in lane_jobs(2**32 - 2, 4)]
    assert ids == [2**32 - 2, 2**32 - 1, 1, 2]        # wraps past job id 0


@pytest.mark.parametrize("args,env,want", [(["--max-backoff", "32"], {}, "32"),
                                           ([], {"XAGG_MAX_BACKOFF": "48"}, "48"),
                                           ([], {}, "1000")])
def test_client_run_hands_the_retry_cap_to_the_ranks(tmp_path, args, env, want):
    """`xagg-client run` clears every XAGG_* variable and sets its own: the
    cap on the back-off reaches the ranks from --max-backoff or the caller's
    XAGG_MAX_BACKOFF (a VM run's cap was once dropped there, and the job
    never retried xagg in time after a restart). Run as a rank under an
    outer torchrun (RANK set), so the script runs in that process. Without
    either, the ranks get the default (1000 steps)."""
    import os
    import subprocess
    import sys
    script, seen = tmp_path / "show.py", tmp_path / "seen"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ.get('XAGG_MAX_BACKOFF', ''))\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("XAGG_")}
    r = subprocess.run([sys.executable, "-m", "xagg.torch.cli", "run", "-a", "127.0.0.1", "--job-id", "7",
                        "--cookie", "9", *args, "--status-dir", str(tmp_path / "status"), "--progress", "0",
                        "--", str(script), str(seen)],
                       env={**base, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **env},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert seen.read_text() == want


def test_values_per_packet_are_checked_by_one_rule_at_every_door():
    """The hook's keyword, its variable and a hand-built ClientConfig refuse
    the same value with the same reason, each naming it its own way."""
    from xagg.client import XaggError
    from xagg.wire.proto import MAX_VALS
    why = f"must be 1..{MAX_VALS} values per packet, got 0"
    with pytest.raises(HookConfigError, match=f"^vals: {why}$"):
        HookConfig(**BASE, vals=0)
    with pytest.raises(HookConfigError, match=f"^XAGG_VALS='0': {why}$"):
        HookConfig.from_env({**HookConfig(**BASE).to_env(), "XAGG_VALS": "0"})
    with pytest.raises(XaggError, match=f"^config.vals: {why}$"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1"], vals=0)


def test_a_checked_hook_config_builds_its_client_config_without_checking_again(monkeypatch):
    from xagg.client import config as client_config
    cfg = HookConfig(**BASE, weights="1,3", fanout="bcast", timeout=2.0, rto=0.1, vals=512, window=64)
    agreed = dict(job_id=8, cookie=9, worker_id=1, n_workers=2, result_port=9979, weights=[1.0, 0.0], vals=512,
                  route=[0, 0])
    by_hand = ClientConfig(aggregators=cfg.aggregators, fanout="bcast", timeout=2.0, rto=0.1, window=64, **agreed)
    assert cfg.client_config(**agreed) == by_hand

    def refuse(v):
        raise ValueError("checked again")
    monkeypatch.setattr(client_config, "check_vals", refuse)
    assert cfg.client_config(**agreed) == by_hand
    with pytest.raises(client_config.XaggError, match="config.vals: checked again"):
        ClientConfig(aggregators=cfg.aggregators, **{**agreed, "route": None})


def test_xagg_client_run_takes_its_flags_from_the_table():
    """Every setting with a flag is an option of `xagg-client run` with that
    flag, its XAGG_* variable and its help; nothing else sets a hook setting."""
    from xagg.client.config import name_others
    from xagg.torch.cli import FLAGS, run
    from xagg.torch.config import SETTINGS
    options = {p.name: p for p in run.params}
    flagged = [s for s in SETTINGS if s.flag]
    assert {s.name for s in SETTINGS} & set(options) == {s.name for s in flagged}
    for s in flagged:
        o = options[s.name]
        assert set(o.opts) == set(s.flags) and o.help == name_others(s.help, FLAGS)
        assert o.envvar == (None if s.flag_file else s.env)


def test_xagg_client_run_names_a_bad_variable_it_read():
    from click.testing import CliRunner

    from xagg.torch.cli import run
    r = CliRunner().invoke(run, ["-a", "127.0.0.1", "--job-id", "7", "--cookie", "9", "--", "x.py"],
                           env={"XAGG_LANES": "0"})
    assert r.exit_code == 2 and "--lanes (from XAGG_LANES): must be 1..8 buckets in flight, got 0" in r.output

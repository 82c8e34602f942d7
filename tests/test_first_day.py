"""A user's first day with xagg-client: every misconfiguration is named in
one line at the first step, by the setting to fix; --require-xagg fails
instead of training on gloo; a run the aggregators never answered stops
paying a timeout per retry; rank 0 says at exit how many buckets went
through xagg; a job the operator registered takes its values per packet
from its aggregators' answer to a probe packet; rank 0 keeps its
registered jobs' leases.

Real `xagg-client run` with 2 gloo ranks against a userspace xaggd on
loopback; the fallback policy and the keepalive schedule as units.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from xagg.torch.config import HookConfig, HookConfigError
from xagg.torch.patch import EXIT_REQUIRED
from xagg.torch.state import GIVE_UP_AFTER, RunFallback, XaggRequired
from xagg.wire.control import DEFAULT_CONTROL, ControlClient
from xagg.wire.fanout import Fanout, ResultPath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "xagg.torch.cli", "run"]
STEPS = 8
SCRIPT = f"""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(300, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range({STEPS}):
        opt.zero_grad()
        model(torch.randn(16, 300, generator=g)).pow(2).mean().backward()
        opt.step()
    print("SCRIPT-OK rank", dist.get_rank(), flush=True)
    dist.destroy_process_group()
"""
N_PARAMS = 300 * 10 + 10


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(SCRIPT))
    return str(p)


def run_client(args, script, timeout=300):
    return subprocess.run(CLI + ["--nproc-per-node", "2", "--progress", "0", *args, "--", script],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


class LocalXaggd:
    """A userspace xaggd whose control socket is where a client on this host
    looks (the root run dir), under a name of its own; stopped by its pid."""

    def __init__(self, vals, extra=(), run_dir=None):
        self.name = f"firstday{os.getpid()}"
        self.run_dir = run_dir or os.path.dirname(DEFAULT_CONTROL)
        self.control = os.path.join(self.run_dir, f"{self.name}.sock")
        self.proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "xaggd"), "start",
                                      "--userspace", "--bind", "127.0.0.1", "--port", "0", "--vals", str(vals),
                                      "--memory", "8M", "--name", self.name, "--run-dir", self.run_dir, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while True:                       # until it answers (pytest-timeout guards a hang)
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                with ControlClient(self.control, timeout=5) as c:
                    self.port = c.status()["port"]
                    return
            except Exception:  # noqa: BLE001 - not up yet
                import time
                time.sleep(0.1)

    def register(self, job_id, cookie):
        """The operator registers a job for 2 workers."""
        with ControlClient(self.control) as c:
            c.register(job_id, cookie=cookie, max_elements=N_PARAMS, n_workers=2, fanout="unicast")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        for suffix in (".sock", ".pid", ".jobs.json"):
            try:
                os.unlink(os.path.join(self.run_dir, self.name + suffix))
            except FileNotFoundError:
                pass


@pytest.fixture
def local_xaggd():
    daemons = []

    def start(vals, **kw):
        daemons.append(LocalXaggd(vals, **kw))
        return daemons[-1]
    yield start
    for d in daemons:
        d.stop()


# -- addresses: a port out of range is named at the door --------------------------------
@pytest.mark.parametrize("kw,field", [(dict(aggregators=["127.0.0.1:99999"], job_id=1, cookie=2), "aggregators"),
                                      (dict(aggregators=["127.0.0.1"], control=["127.0.0.1:70000"]), "control")])
def test_a_port_out_of_range_is_named(kw, field):
    with pytest.raises(HookConfigError) as e:
        HookConfig(**kw)
    assert e.value.field == field and "is not 0..65535" in str(e.value)


def test_xagg_client_names_a_port_out_of_range_before_any_rank_starts(script):
    r = run_client(["-a", "127.0.0.1:99999", "--job-id", "1", "--cookie", "2"], script, timeout=60)
    assert r.returncode == 2 and "--aggregators" in r.stderr and "port 99999 is not 0..65535" in r.stderr
    assert "OverflowError" not in r.stderr and "SCRIPT-OK" not in r.stdout


# -- the fallback policy of a run ---------------------------------------------------------
def drive(fb, script):
    """f: a step that failed after sending; r: a retry refused at registration;
    x: a step that succeeded. Each failure waits its back-off out."""
    for c in script:
        while fb.mode == "gloo":
            if fb.gave_up:
                return
            if fb.due():
                fb.retry(0, lambda: (c != "r", "daemon away"), lambda failed: failed)
        if c == "f":
            fb.fail(0, "no answer")
        elif c == "x":
            fb.succeeded(0)


def test_a_run_never_answered_gives_up_after_its_tries(caplog):
    fb = RunFallback(backoff_steps=1, max_backoff_steps=1)
    drive(fb, "f" * (GIVE_UP_AFTER - 1))
    assert fb.mode == "gloo" and not fb.gave_up
    drive(fb, "f")
    assert fb.gave_up and fb.mode == "gloo" and not fb.due()       # no retry, no timeout, from now on
    assert sum("giving up on the aggregators" in r.message for r in caplog.records) == 1


def test_registration_refusals_and_a_run_once_answered_never_give_up():
    fb = RunFallback(backoff_steps=1, max_backoff_steps=1)
    drive(fb, "r" * (GIVE_UP_AFTER + 2))            # the daemon away: each retry is cheap
    assert not fb.gave_up and fb.unanswered == 0
    fb = RunFallback(backoff_steps=1, max_backoff_steps=1)
    drive(fb, "x" + "f" * (GIVE_UP_AFTER + 2))      # the aggregators worked once: it may come back
    assert not fb.gave_up


def test_require_xagg_is_a_setting_of_every_door():
    env = HookConfig(["127.0.0.1"], job_id=1, cookie=2, require_xagg=True).to_env()
    assert env["XAGG_REQUIRE"] == "1" and HookConfig.from_env(env).require_xagg
    with pytest.raises(HookConfigError, match="XAGG_REQUIRE='maybe': expected 1/true/yes or 0/false/no"):
        HookConfig.from_env({**env, "XAGG_REQUIRE": "maybe"})


def test_require_xagg_raises_instead_of_falling_back():
    fb = RunFallback(backoff_steps=1, max_backoff_steps=1, require=True, explain=lambda r, reg: r + " (hint)")
    with pytest.raises(XaggRequired, match=r"no answer \(hint\)"):
        fb.fail(0, "no answer")
    assert fb.fallbacks == 1 and pickle.loads(pickle.dumps(fb)).explain is None


# -- xagg-client run, misconfigured ----------------------------------------------------------
def test_a_wrong_address_is_named_at_the_first_step_and_stops_costing_timeouts(script):
    """Nothing listens at -a: the first fallback's line says the aggregator
    did not answer the probe and names the setting, the run gives up after its
    tries instead of paying a timeout per retry, trains on gloo, and says at
    exit that no bucket went through xagg."""
    r = run_client(["-a", "127.0.0.1:9", "--job-id", "5", "--cookie", "6", "--timeout", "1",
                    "--backoff", "1", "--max-backoff", "1"], script)
    assert r.returncode == 0 and r.stdout.count("SCRIPT-OK") == 2, r.stderr
    first = [ln for ln in r.stderr.splitlines() if "rank 0: falling back" in ln]
    assert len(first) == 1 and "aggregator 127.0.0.1:9 did not answer a probe" in first[0], r.stderr
    assert "-a/--aggregators" in first[0]
    assert r.stderr.count("giving up on the aggregators") == 1
    assert f"0 of {STEPS} buckets through xagg, {STEPS} through gloo" in r.stderr


def test_require_xagg_exits_non_zero_at_the_first_unanswered_step(script):
    r = run_client(["-a", "127.0.0.1:9", "--job-id", "5", "--cookie", "6", "--timeout", "1", "--require-xagg"],
                   script)
    assert r.returncode == EXIT_REQUIRED and "SCRIPT-OK" not in r.stdout
    assert "ChildFailedError" not in r.stderr and "exited with status 3" in r.stderr   # one line, not torchrun's 25
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("xagg-client: --require-xagg:")]
    assert len(said) == 1 and "-a/--aggregators" in said[0], r.stderr


def test_require_xagg_exits_non_zero_when_the_control_endpoint_is_unreachable(script, tmp_path):
    r = run_client(["-a", "127.0.0.1:9", "--control", str(tmp_path / "nosuch.sock"), "--require-xagg"], script)
    assert r.returncode != 0 and "SCRIPT-OK" not in r.stdout
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("xagg-client: --require-xagg:")]
    assert len(said) == 1 and "nosuch.sock" in said[0] and "DaemonUnavailable" in said[0], r.stderr
    assert "check --control" in said[0] and "-a/--aggregators" not in said[0]


# -- values per packet of a job the operator registered ----------------------------------------
def test_a_job_the_operator_registered_takes_its_daemons_values_per_packet(script, local_xaggd, tmp_path):
    """xaggd runs 100 values per packet, the client's default is 256: rank 0's
    probe packet brings the aggregator's number, and every step goes through."""
    d = local_xaggd(100)
    d.register(81, 0xC0DE)
    status = tmp_path / "status"
    r = run_client(["-a", f"127.0.0.1:{d.port}", "--job-id", "81", "--cookie", str(0xC0DE), "--timeout", "30",
                    "--status-dir", str(status)], script)
    assert r.returncode == 0 and r.stdout.count("SCRIPT-OK") == 2, r.stderr
    rows = [json.loads((status / f"rank{k}.json").read_text()) for k in range(2)]
    assert all(row["buckets_xagg"] == STEPS and row["fallbacks"] == 0 for row in rows), r.stderr
    assert f"{STEPS} of {STEPS} buckets through xagg, 0 through gloo" in r.stderr


def test_values_per_packet_that_differ_are_named_with_both_numbers(script, local_xaggd):
    d = local_xaggd(100)
    d.register(82, 0xC0DE)
    r = run_client(["-a", f"127.0.0.1:{d.port}", "--job-id", "82", "--cookie", str(0xC0DE), "--vals", "120",
                    "--timeout", "1", "--require-xagg"], script)
    assert r.returncode != 0
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("xagg-client: --require-xagg:")]
    assert len(said) == 1 and "this client sends 120 (--vals), the aggregators sum 100" in said[0], r.stderr


@pytest.mark.parametrize("job, cookie, named", [(84, 1, "another cookie (check --cookie)"),
                                                (85, 0xC0DE, "has no job 85 (check --job-id")])
def test_a_wrong_job_id_or_cookie_is_named_by_the_aggregator(script, local_xaggd, job, cookie, named):
    d = local_xaggd(100)
    d.register(84, 0xC0DE)
    r = run_client(["-a", f"127.0.0.1:{d.port}", "--job-id", str(job), "--cookie", str(cookie),
                    "--timeout", "1", "--require-xagg"], script)
    assert r.returncode != 0
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("xagg-client: --require-xagg:")]
    assert len(said) == 1 and named in said[0], r.stderr


# -- leases -----------------------------------------------------------------------------------
def test_rank_0_keeps_its_jobs_alive_within_the_daemons_lease(local_xaggd, tmp_path, monkeypatch):
    """Registered with a daemon whose lease is 30 s, rank 0 renews every 10 s
    (a third of it), counted on a clock the test gives, and the daemon takes
    each keepalive; an aggregator planned out gets none."""
    from xagg.torch.aggregator_set import AggregatorSet
    d = local_xaggd(256, extra=["--job-lease", "30s"], run_dir=str(tmp_path))
    cfg = HookConfig([f"127.0.0.1:{d.port}"], control=[d.control], job_id=83, cookie=7)
    state = SimpleNamespace(config=cfg, job_id=83, cookie=7, vals=None, max_elements=N_PARAMS)
    aggs = AggregatorSet(state, group=None, rank=0, world=2)
    aggs.workers_by_agg = [["", ""]]
    aggs.results = ResultPath(Fanout.UNICAST)      # what agree_job would have chosen
    aggs.request = aggs._job_request()
    assert aggs.register() == (1, "")
    sent = []
    real = ControlClient.keepalive
    monkeypatch.setattr(ControlClient, "keepalive",
                        lambda self, job_id, **kw: sent.append(real(self, job_id, **kw)) or sent[-1])
    for now in (1000.0, 1005.0, 1011.0, 1015.0, 1021.5):
        aggs.keep_alive(now)
    assert [s["lease_s"] for s in sent] == [30.0, 30.0, 30.0] and aggs.keepalive_every == 10.0
    aggs.out = 1                                     # planned out: nothing to keep there
    aggs.keep_alive(1040.0)
    assert len(sent) == 3

"""A worker host that aggregates too (issue 14, item 4): its xaggd serves a
share of the chunks on the worker's own interface, and the worker there puts
its packets for that share through the program (client/local.py) instead of
the network, reading those sums from the program's slots. Real lab, real
daemons, real XDP; sums checked against numpy's float64 ones."""
from __future__ import annotations

import os
import sys

import pytest
from test_lab_allreduce import check

from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, start_xagg

SIZES = [1, 257, 300_001]


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"lc{os.getpid() % 100000}", workers=3, aggregators=1, mtu=9000)) as lab:
        yield lab


@pytest.fixture(scope="module")
def aggs(lab):
    with Aggregators(lab, "xdp", max_slots=1 << 14, hosts=["a0", "w0"]) as a:
        yield a


@pytest.mark.parametrize("fast", [True, False], ids=["c-loop", "numpy-loop"])
def test_a_worker_host_roots_a_share_and_every_sum_is_exact(lab, aggs, tmp_path, fast, monkeypatch):
    monkeypatch.setenv("XAGG_FASTPATH", "1" if fast else "0")
    again = lambda c: c["duplicate"] + c["retransmit"]         # noqa: E731 - a packet the program had
    before = [(c["completed"], again(c)) for c in aggs.counters()]
    reports = collect(start_xagg(lab, aggs, SIZES, rounds=3, fanout="bcast", out_dir=str(tmp_path),
                                 weights=[1.0, 1.0])[1], timeout=300)
    check(tmp_path, 3, 3, sizes=SIZES)
    after = aggs.counters()
    done = [c["completed"] - b[0] for c, b in zip(after, before)]
    assert done[0] > 0 and done[1] > 0, done          # both hosts summed chunks
    stats = [r["stats"] for r in reports]
    # w0's packets for its own host's share went through the program, none of
    # the others' did
    assert stats[0]["local_packets"] > 0 and stats[1]["local_packets"] == stats[2]["local_packets"] == 0
    assert stats[0]["local_packets"] < stats[0]["packets_sent"]
    # and none of them had to be sent again: every packet w0's program saw
    # twice is one of w1's or w2's resends (w0 cannot resend to itself)
    seen_again = again(after[1]) - before[1][1]
    assert seen_again <= stats[1]["retransmits"] + stats[2]["retransmits"], (seen_again, stats)


def test_a_late_local_worker_completes_chunks_and_sends_their_results(lab, aggs, tmp_path):
    """w0 starts last: its test runs complete its host's chunks, and the
    program's XDP_TX verdicts go out on the wire from w0's AF_PACKET socket,
    so w1 and w2 get those sums as from any aggregator."""
    size = 300_001
    reports = collect(start_xagg(lab, aggs, size, rounds=2, fanout="bcast", out_dir=str(tmp_path),
                                 late={0: 0.6})[1], timeout=300)
    check(tmp_path, 3, 2, sizes=[size])
    w0 = reports[0]["stats"]
    # in the first call, every chunk of the share w1 and w2 had sent (a window's worth) at least
    assert w0["local_sent"] >= 10, w0
    assert w0["local_sent"] <= w0["local_packets"]


def test_the_daemon_hands_its_data_plane_only_to_its_own_namespace(lab, aggs):
    """Asked from w1's namespace for w0's address, xaggd refuses: an ifindex
    and an address mean another interface there."""
    code = ("from xagg.client.local import LocalDataplane; "
            f"dp, why = LocalDataplane.find({lab.host('w0').ip!r}, 9977); print(dp, why)")
    r = lab.exec("w1", [sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.startswith("None") and "not in eth0's network namespace" in r.stdout, r.stdout + r.stderr


WORKER = r'''
import json, sys, time
import numpy as np
from xagg.client import Client, ClientConfig, XaggError
from xagg.lab.traffic import inputs
cfg = json.loads(sys.argv[1])
me, calls, out, go = cfg["worker"], cfg["calls"], cfg["out"], cfg["go"]
with Client(ClientConfig(job_id=cfg["job"], cookie=cfg["cookie"], worker_id=me, n_workers=2,
                         aggregators=cfg["aggs"], fanout="bcast", vals=cfg["vals"], timeout=0.5)) as c:
    failed = 0
    for r in range(calls):
        if r == cfg["pause_at"]:            # the test restarts w0's xaggd meanwhile
            open(f"{out}/w{me}.paused", "w").close()
            while not __import__("os").path.exists(go):
                time.sleep(0.05)
        while True:
            try:
                got = c.allreduce(inputs(0, me, r, cfg["size"]))
                break
            except XaggError:               # a round the restart broke: the call again
                failed += 1
                assert failed < 40, "never recovered"
                time.sleep(0.2)
        np.save(f"{out}/w{me}_r{r}_s{cfg['size']}.npy", got)
    print(json.dumps({"failed": failed, "stats": vars(c.stats)}))
'''


def test_a_restarted_local_xaggd_is_found_again(lab, aggs, tmp_path):
    """w0's xaggd is restarted mid-job (the module's last test: it replaces
    that daemon): w0's client held the old program and maps, which the
    network no longer feeds, so its next round fails; it then asks the
    daemons again, gets the new program, and every later call sums exactly,
    through the new daemon."""
    import json
    import subprocess
    import time

    from xagg.wire.control import ControlClient

    size, calls, pause, job, cookie = 200_003, 4, 2, 4242, 99
    aggs.register(job, cookie, 2, size, "bcast")
    go = tmp_path / "go"
    base = {"job": job, "cookie": cookie, "calls": calls, "out": str(tmp_path), "go": str(go), "size": size,
            "aggs": [h.ip for h in aggs.hosts], "vals": aggs.vals, "pause_at": pause}
    procs = [lab.spawn(f"w{w}", [sys.executable, "-c", WORKER, json.dumps({**base, "worker": w})],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"w{w}.paused").exists() for w in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    old = aggs.daemons[1]                       # w0's
    old.terminate()
    old.wait(15)
    name = f"{lab.name}-w0"
    aggs.daemons[1] = lab.spawn("w0", [sys.executable, "-m", "xaggd.cli", "start", "--name", name, "--vals",
                                       str(aggs.vals), "--max-slots", str(1 << 14), "--log-level", "warning",
                                       "--iface", lab.host("w0").ifname, "--lock", "on"])
    aggs.controls[1] = ctl = ControlClient(f"/run/xaggd/{name}.sock")
    ctl.wait_ready(timeout=60)
    aggs.register(job, cookie, 2, size, "bcast")
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    new = ctl.stats()
    check(tmp_path, 2, calls, sizes=[size])
    assert reports[0]["failed"] >= 1, reports          # the stale data plane failed a round ...
    assert new["jobs"][str(job)]["aggregated"] > 0, new     # ... and the new program summed after

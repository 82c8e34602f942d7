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
    before = [c["completed"] for c in aggs.counters()]
    reports = collect(start_xagg(lab, aggs, SIZES, rounds=3, fanout="bcast", out_dir=str(tmp_path),
                                 weights=[1.0, 1.0])[1], timeout=300)
    check(tmp_path, 3, 3, sizes=SIZES)
    done = [c["completed"] - b for c, b in zip(aggs.counters(), before)]
    assert done[0] > 0 and done[1] > 0, done          # both hosts summed chunks
    stats = [r["stats"] for r in reports]
    # w0's packets for its own host's share went through the program, none of
    # the others' did; and none of them had to be sent again
    assert stats[0]["local_packets"] > 0 and stats[1]["local_packets"] == stats[2]["local_packets"] == 0
    assert stats[0]["local_packets"] < stats[0]["packets_sent"]


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

"""All-reduce end to end in the lab through xaggd's XDP aggregators: worker
counts that are not powers of two, one and two aggregators, both fan-out
modes, random loss, and two jobs sharing an aggregator."""
from __future__ import annotations

import os

import pytest

from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, start_xagg
from xagg.lab.traffic import check_sums
from xagg.wire.proto import C

SIZES = [1, 255, 257, 1_000_003]


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"la{os.getpid() % 100000}", workers=5, aggregators=2)) as lab:
        yield lab


@pytest.fixture(scope="module")
def aggs(lab):
    with Aggregators(lab, "xdp", max_slots=65536) as a:
        yield a


def check(out_dir, n, rounds, seed=0, sizes=SIZES):
    check_sums(out_dir, n, rounds, sizes, seed)


@pytest.mark.parametrize("n,fanout", [(3, "bcast"), (4, "unicast"), (5, "bcast")])
def test_two_aggregators_split_the_chunks(lab, aggs, n, fanout, tmp_path):
    before = [c["completed"] for c in aggs.counters()]
    collect(start_xagg(lab, aggs, SIZES, rounds=3, fanout=fanout, n_workers=n,
                       out_dir=str(tmp_path))[1], timeout=300)
    check(tmp_path, n, 3)
    done = [c["completed"] - b for c, b in zip(aggs.counters(), before)]
    assert all(d > 0 for d in done) and abs(done[0] - done[1]) <= 0.1 * sum(done), done


def test_results_to_a_multicast_group_reach_the_workers_and_no_aggregator(lab, aggs, tmp_path):
    """bcast fan-out to a group the workers join: exact sums everywhere, and
    no aggregator's link carries another's results (the lab's aggregator
    ports take no multicast; broadcast floods each one's results to the other)."""
    def port_bytes(h, d):      # the switch port's tx is what the host receives
        r = lab.exec("switch", ["cat", f"/sys/class/net/{h.port}/statistics/{d}_bytes"],
                     capture_output=True, text=True)
        return int(r.stdout)
    hosts = lab.workers[:4] + lab.aggregators
    before = {(h.name, d): port_bytes(h, d) for h in hosts for d in ("rx", "tx")}
    collect(start_xagg(lab, aggs, [1_000_003], rounds=2, fanout="bcast", n_workers=4,
                       result_group="239.77.0.9", out_dir=str(tmp_path))[1], timeout=300)
    check(tmp_path, 4, 2, sizes=[1_000_003])
    moved = {k: port_bytes(lab.host(k[0]), k[1]) - v for k, v in before.items()}
    sent_by_workers = sum(moved[(h.name, "rx")] for h in lab.workers[:4])
    results = sum(moved[(h.name, "rx")] for h in lab.aggregators)
    into_aggs = sum(moved[(h.name, "tx")] for h in lab.aggregators)
    assert results > 0.2 * sent_by_workers
    # broadcast: + every result (each reaches the other aggregator); the group: a few %
    assert into_aggs < sent_by_workers + 0.25 * results, (into_aggs, sent_by_workers, results)


def test_one_percent_loss_both_directions_still_exact(lab, aggs, tmp_path):
    lab.set_loss(1.0, direction="both")
    try:
        before = sum(c["retransmit"] + c["duplicate"] for c in aggs.counters())
        reports = collect(start_xagg(lab, aggs, SIZES, rounds=2, n_workers=4, fanout="bcast",
                                     out_dir=str(tmp_path))[1], timeout=300)
    finally:
        lab.set_loss(0, direction="both")
    check(tmp_path, 4, 2)
    assert sum(r["stats"]["retransmits"] for r in reports) > 0       # loss really happened
    assert sum(c["retransmit"] + c["duplicate"] for c in aggs.counters()) > before


def test_two_jobs_on_one_aggregator_stay_isolated(lab, aggs, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, pa = start_xagg(lab, aggs, SIZES, rounds=2, n_workers=4, fanout="unicast", seed=1,
                    out_dir=str(tmp_path / "a"))
    _, pb = start_xagg(lab, aggs, SIZES, rounds=2, n_workers=4, fanout="bcast", seed=2,
                    out_dir=str(tmp_path / "b"), result_port=C.XAGG_PORT + 7)
    collect(pa + pb, timeout=300)
    check(tmp_path / "a", 4, 2, seed=1)
    check(tmp_path / "b", 4, 2, seed=2)


FORGE = """
import socket, sys, numpy as np
from xagg.wire.proto import make_packets
job, cookie, wid, dst, vals, n_aggs = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                       int(sys.argv[5]), int(sys.argv[6]))
p = make_packets(job_id=job, cookie=cookie, worker_id=wid, round_=0, chunks=np.array([0]),
                 values=np.full((1, vals), 1 << 20, np.int32), agg_id=0, n_aggs=n_aggs).tobytes()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(10):
    s.sendto(p, (dst, 9977))
"""


def test_forged_cookie_and_foreign_worker_change_nothing(lab, aggs, tmp_path):
    """Traffic from a host that is not the job's worker, and with the wrong
    cookie, arrives at the aggregator during a real job and is refused."""
    import sys
    replies = aggs.register(job_id=4242, cookie=99, n_workers=3, max_elements=1000, fanout="bcast")
    before = aggs.counters()[0]
    a0 = lab.aggregators[0].ip
    # w4 is no worker of this 3-worker job: claims to be worker 0; then w0 with a wrong cookie
    # well-formed for this daemon (its size, its place among the job's aggregators):
    # refused for who sent it
    vals, n_aggs = str(aggs.vals), str(len(lab.aggregators))
    lab.exec("w4", [sys.executable, "-c", FORGE, "4242", "99", "0", a0, vals, n_aggs], check=True)
    lab.exec("w0", [sys.executable, "-c", FORGE, "4242", "98", "0", a0, vals, n_aggs], check=True)
    after = aggs.counters()[0]
    assert after["bad_worker"] - before["bad_worker"] == 10
    assert after["bad_cookie"] - before["bad_cookie"] == 10
    assert after["aggregated"] == before["aggregated"]
    assert all(r["created"] for r in replies)

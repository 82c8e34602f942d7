"""The round loop's congestion window on a link slower than its fixed
window assumes (csrc/retransmit.c).

Workers at 100 Mbit/s, a public cloud's share of a link: the switch port
queues about 150 KB, less than the 256 KB the default window puts in
flight, so a fixed window lost its excess at every call, every worker
resent what one lost, and the resends filled the same queues again (here
46% of the packets sent were resends). The window is now halved at a loss event
and grown back as results come: a few loss events, resends a small share
of what is sent, sums still exact, and the window each worker ends with
smaller than the fixed one, never below its floor.
"""
from __future__ import annotations

import os

from xagg.client.config import ClientConfig
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, run_xagg
from xagg.lab.traffic import check_sums
from xagg.wire.proto import max_vals

ELEMENTS = 1_000_000            # 4 MB: ~2,800 datagrams per worker each way at MTU 1500
ROUNDS = 4
WORKERS = 4
CWND_MIN = 8                    # csrc/retransmit.c


def test_a_window_larger_than_the_links_queue_is_cut_instead_of_resent_in_a_storm(tmp_path):
    spec = LabSpec(name=f"cw{os.getpid() % 100000}", workers=WORKERS, aggregators=1, rate="100mbit",
                   rate_of={"a0": "400mbit"}, mtu=1500)
    with Lab(spec) as lab, Aggregators(lab, "xdp", max_slots=65536) as aggs:
        r = run_xagg(lab, aggs, ELEMENTS, rounds=ROUNDS, timeout=30, out_dir=str(tmp_path))
    stats = [rep["stats"] for rep in r.reports]
    sent = sum(s["packets_sent"] for s in stats)
    resent = sum(s["retransmits"] for s in stats)
    assert sent >= WORKERS * ROUNDS * 2_700, sent
    assert resent < 0.05 * sent, (resent, sent)                 # a fixed window: 46%
    assert sum(s["window_cuts"] for s in stats) >= 1, stats     # the window was too large, and was cut
    fixed = ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=WORKERS, aggregators=["127.0.0.1"],
                         vals=max_vals(1500)).window
    for s in stats:
        assert CWND_MIN <= s["window"] <= fixed, (s["window"], fixed)
    assert min(s["window"] for s in stats) < fixed, [s["window"] for s in stats]
    check_sums(tmp_path, WORKERS, ROUNDS, [ELEMENTS])          # every round's sum exact, on every worker

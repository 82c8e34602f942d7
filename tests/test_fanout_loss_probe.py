"""A stalled round probes before it resends (xagg/client/csrc/retransmit.c).

A round stalls when results stop coming: a loss the gaps cannot show (the
tail), or a worker that has not sent yet, so every chunk waits on it. Only
the answer to a probe tells them apart: resending every late chunk at the
retransmit timeout floods each aggregator with duplicates of a window while
a worker is late, which is every training step whose ranks come to the
all-reduce at different times. Through the userspace twin of the XDP
program, over loopback."""
from __future__ import annotations

import threading
import time

import numpy as np
from test_native_loop import _serve_behind, _sum_and_bound

from xagg.client import Client, ClientConfig
from xagg.wire.proto import HDR_SIZE, packet_dtype
from xaggd.dataplane.userspace import UserspaceAggregator

VALS = 256
WINDOW = 32


def _clients(n, port, **cfg):
    return [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n, fanout="unicast",
                                aggregators=[f"127.0.0.1:{port}"], vals=VALS, window=WINDOW, **cfg))
            for w in range(n)]


def _call_all(clients, xs, late=None):
    """One all-reduce by every client, each in its own thread; ``late``:
    (worker, seconds) that worker waits before its call."""
    outs = [None] * len(clients)

    def run(w):
        if late and late[0] == w:
            time.sleep(late[1])
        outs[w] = clients[w].allreduce(xs[w], key=0)
    ts = [threading.Thread(target=run, args=(w,)) for w in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return outs


def _late_call(seed, late_s):
    """Two workers through the userspace aggregator: two calls settle the
    exponents, then a third with worker 1 ``late_s`` seconds late, its sum
    checked. Returns worker 0's counters over that call and the duplicates
    the aggregator dropped meanwhile."""
    n, size = 2, 100 * VALS
    agg = UserspaceAggregator()
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(seed)
    calls = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for _ in range(3)]
    clients = _clients(n, srv.port, timeout=20, rto=0.02)
    try:
        for xs in calls[:2]:                        # the first call and its exponents settle
            _call_all(clients, xs)
        before = vars(clients[0].stats).copy()
        dups = agg.counters["duplicate"]
        outs = _call_all(clients, calls[2], late=(1, late_s))
        want, tol = _sum_and_bound([[x] for x in calls[2]], 0)
        assert all(np.abs(o - want).max() <= tol for o in outs)
        s0 = {k: v - before[k] for k, v in vars(clients[0].stats).items() if isinstance(v, int)}
        return s0, agg.counters["duplicate"] - dups
    finally:
        for c in clients:
            c.close()
        srv.stop()


def test_a_late_worker_gets_probes_not_a_window_of_duplicates():
    """Worker 1 calls long after worker 0, whose round stalls past its
    retransmit timeout with a window of chunks out and nothing lost: it
    probes, the aggregator drops each probe as the duplicate it is, and
    nothing else goes again."""
    s0, dropped = _late_call(1, 0.5)
    assert s0["rto_resends"] >= 1, s0                  # the round did stall
    assert s0["rto_resends"] < WINDOW, s0             # but no window went again
    assert s0["retransmits"] == s0["rto_resends"] + s0["probe_resends"], s0    # and nothing else
    assert dropped >= s0["retransmits"]                                        # each dropped there


class RoundResultsLost(UserspaceAggregator):
    """Loses the first answer to worker 0 of every chunk of round ``rnd``:
    a burst of results lost, with none back to show a gap. Answers to its
    resends go through."""

    def __init__(self, rnd: int):
        super().__init__()
        self.rnd, self.dropped, self.addr0 = rnd, set(), None

    def handle(self, payload, src, **kw):
        h = np.frombuffer(payload[:HDR_SIZE], packet_dtype(1)["hdr"])[0]
        if int(h["worker_id"]) == 0:
            self.addr0 = src
        verdict, replies = super().handle(payload, src, **kw)
        if verdict == "completed" and int(h["round"]) == self.rnd:
            self.dropped.add(int(h["chunk"]))
            replies = [r for r in replies if r.dest != self.addr0]
        return verdict, replies


def test_a_probe_answered_as_a_loss_releases_the_rest():
    """Every result of a round is lost to worker 0, its whole window out.
    At the retransmit timeout it probes; the answer comes marked as a
    retransmit (the chunk was finished: its result was lost), which shows
    the stall is a loss: the other chunks go again at once, without waiting
    for more timeouts, and the timeout itself sent only the probe."""
    n, size = 2, 24 * VALS                      # 24 data chunks and the meta chunk: one window
    agg = RoundResultsLost(rnd=2)               # rounds 0-1: the first call and its redo
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(2)
    calls = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for _ in range(2)]
    clients = _clients(n, srv.port, timeout=20, rto=0.05)
    try:
        for xs in calls:
            outs = _call_all(clients, xs)
            want, tol = _sum_and_bound([[x] for x in xs], 0)
            assert all(np.abs(o - want).max() <= tol for o in outs)
        s0 = clients[0].stats
    finally:
        for c in clients:
            c.close()
        srv.stop()
    lost = len(agg.dropped)
    assert lost > WINDOW // 2, agg.dropped
    assert s0.retransmits >= lost, vars(s0)                  # every lost result fetched again
    assert s0.rto_resends < lost // 2, vars(s0)              # the timeout probed, the answer released

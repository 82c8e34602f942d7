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


def test_a_late_worker_gets_probes_not_a_window_of_duplicates():
    """Worker 1 calls long after worker 0, whose round stalls past its
    retransmit timeout with a window of chunks out and nothing lost: it
    probes, the aggregator drops each probe as the duplicate it is, and
    nothing else goes again."""
    n, size = 2, 100 * VALS
    agg = UserspaceAggregator()
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(1)
    calls = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for _ in range(3)]
    clients = _clients(n, srv.port, timeout=20, rto=0.02)
    try:
        for xs in calls[:2]:                        # the first call and its exponents settle
            _call_all(clients, xs)
        before = [vars(c.stats).copy() for c in clients]
        dups = agg.counters["duplicate"]
        outs = _call_all(clients, calls[2], late=(1, 0.5))
        want, tol = _sum_and_bound([[x] for x in calls[2]], 0)
        assert all(np.abs(o - want).max() <= tol for o in outs)
        s0 = {k: v - before[0][k] for k, v in vars(clients[0].stats).items() if isinstance(v, int)}
    finally:
        for c in clients:
            c.close()
        srv.stop()
    assert s0["rto_resends"] >= 1, s0                  # the round did stall
    assert s0["rto_resends"] < WINDOW, s0             # but no window went again
    assert s0["retransmits"] == s0["rto_resends"] + s0["probe_resends"], s0    # and nothing else
    assert agg.counters["duplicate"] - dups == s0["retransmits"] + \
        clients[1].stats.retransmits - before[1]["retransmits"]                 # each dropped


class TailResultsLost(UserspaceAggregator):
    """Loses the first answers to worker 0 for the last ``lost`` chunks of
    round ``rnd``: a burst of results lost at the end of a call, which no
    later result shows. Answers to its resends go through."""

    def __init__(self, lost: int, rnd: int):
        super().__init__()
        self.lost, self.rnd, self.dropped, self.addr0 = lost, rnd, set(), None

    def handle(self, payload, src, **kw):
        h = np.frombuffer(payload[:HDR_SIZE], packet_dtype(1)["hdr"])[0]
        if int(h["worker_id"]) == 0:
            self.addr0 = src
        verdict, replies = super().handle(payload, src, **kw)
        chunk, width = int(h["chunk"]), self.jobs[5].spec.n_chunks
        if verdict == "completed" and int(h["round"]) == self.rnd and chunk >= width - self.lost:
            self.dropped.add(chunk)
            replies = [r for r in replies if r.dest != self.addr0]
        return verdict, replies


def test_a_probe_answered_as_a_loss_releases_the_rest_of_the_tail():
    """The last 20 results of a call are lost to worker 0. Its first probe's
    answer comes marked as a retransmit (the chunk was finished: its result
    was lost), which shows the stall is a loss: the other late chunks go
    again at once, not two per probe."""
    n, size, lost = 2, 60 * VALS, 20
    agg = TailResultsLost(lost, rnd=2)          # rounds 0-1: the first call and its redo
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(2)
    calls = [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for _ in range(2)]
    clients = _clients(n, srv.port, timeout=20, rto=1.0)
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
    assert len(agg.dropped) == lost, agg.dropped
    probed = s0.probe_resends + s0.rto_resends
    assert s0.retransmits >= lost, vars(s0)                  # every lost result fetched again
    assert probed < lost // 2, vars(s0)                       # the most of them released, not probed

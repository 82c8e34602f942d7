"""The compiled round loop (xagg/csrc/exchange.c) against its numpy
reference: the same sums through a lossy aggregator, the same refusal of
results that are not this round's, and the fallback when it cannot load."""
from __future__ import annotations

import socket
import threading
import time
import types

import numpy as np
import pytest
from test_client_loopback import start_aggregators

from xagg.client import Client, ClientConfig, fixedpoint, native
from xagg.wire.proto import HDR_SIZE, C, make_packets, packet_dtype
from xaggd.dataplane.userspace import UserspaceAggregator, UserspaceServer


class LossyTwin(UserspaceAggregator):
    """Loses every ``every``-th packet it receives, before adding it. With
    ``answer_repeats`` False it does not answer a repeat of a finished chunk
    (nothing it loses needs that answer: a lost packet's chunk completes
    with its sender's resend, and the result goes to every worker)."""

    def __init__(self, every: int, answer_repeats: bool = True):
        super().__init__()
        self.every, self.seen, self.answer_repeats = every, 0, answer_repeats

    def handle(self, payload, src, **kw):
        self.seen += 1
        if self.seen % self.every == 0:
            return "lost", []
        verdict, replies = super().handle(payload, src, **kw)
        return verdict, replies if verdict != "retransmit" or self.answer_repeats else []


def _job_specs(n, m, size):
    """The loopback job's spec at each of its m aggregators (test_client_loopback's, job 5)."""
    servers = start_aggregators(n, m, size)
    for s in servers:
        s.stop()
    return [s.agg.jobs[5].spec for s in servers]


def _serve_behind(agg, n, size, spec=None):
    """The job (aggregator 0 of 1 unless ``spec``) served by ``agg``: a twin
    that loses, holds or reorders."""
    agg.set_job(spec or _job_specs(n, 1, size)[0])
    return UserspaceServer(agg, "127.0.0.1", 0).start()


def _sum_and_bound(inputs, c):
    """Call c's float64 sum over the workers, and the fixed-point error bound."""
    n = len(inputs)
    want = np.sum([inputs[w][c].astype(np.float64) for w in range(n)], axis=0)
    return want, fixedpoint.tolerance(max(float(np.abs(inputs[w][c]).max()) for w in range(n)), n)


def _run_workers(ports, n, inputs, fast, **cfg):
    """Each worker's calls in a thread of its own; ``cfg`` overrides ClientConfig fields."""
    cfg = {"timeout": 20, "rto": 0.02, **cfg}
    clients = [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n, fanout="unicast", fast=fast,
                                   aggregators=[f"127.0.0.1:{p}" for p in ports], **cfg))
               for w in range(n)]
    assert all(c._exchange.compiled == fast for c in clients)
    outs = [[] for _ in range(n)]

    def run(w):
        for x in inputs[w]:
            outs[w].append(clients[w].allreduce(x, key=0))
    ts = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    stats = [c.stats for c in clients]
    for c in clients:
        c.close()
    return outs, stats


def test_compiled_and_numpy_loops_sum_alike_through_lossy_aggregators():
    assert native.load() is not None, "the C round loop must build on this machine"
    n, size, calls = 3, 30_000, 4
    rng = np.random.default_rng(7)
    inputs = [[(rng.standard_normal(size) * (c + 1)).astype(np.float32) for c in range(calls)] for _ in range(n)]
    results = {}
    for fast in (True, False):
        # the same job behind two aggregators that lose packets
        lossy = [_serve_behind(LossyTwin(every=9), n, size, spec) for spec in _job_specs(n, 2, size)]
        try:
            outs, stats = _run_workers([s.port for s in lossy], n, inputs, fast)
        finally:
            for s in lossy:
                s.stop()
        assert all(len(o) == calls for o in outs)
        for c in range(calls):
            want, tol = _sum_and_bound(inputs, c)
            for w in range(n):
                assert np.abs(outs[w][c] - want).max() <= tol
                assert np.array_equal(outs[w][c], outs[0][c])      # every worker, bit for bit
        assert sum(s.retransmits for s in stats) > 0                # the loss was felt and repaired
        results[fast] = outs[0]
    for a, b in zip(results[True], results[False]):
        assert np.array_equal(a, b)                                 # C and numpy: the same sums


def _forge(h, vals, **change):
    """A result packet like header ``h`` with fields changed."""
    f = dict(job_id=int(h["job_id"]), cookie=int(h["cookie"]), worker_id=0, round_=int(h["round"]),
             chunks=[int(h["chunk"])], values=vals[None], flags=C.XAGG_F_RESULT, agg_id=int(h["agg_id"]),
             n_aggs=1)
    f.update(change)
    return make_packets(**f).tobytes()


@pytest.mark.parametrize("fast", [True, False], ids=["c", "numpy"])
def test_only_whole_results_of_this_job_and_round_are_taken(fast):
    """A fake aggregator answers every packet first with forgeries (short,
    long, wrong cookie, job, round, flags, aggregator, chunk), then with the
    true result: the sum is the true one and only true results are counted."""
    vals = 64
    agg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg.bind(("127.0.0.1", 0))
    agg.settimeout(10)
    cfg = ClientConfig(job_id=9, cookie=1234, worker_id=0, n_workers=1, fanout="unicast", vals=vals, fast=fast,
                       aggregators=[f"127.0.0.1:{agg.getsockname()[1]}"], timeout=10)
    x = np.arange(5 * vals, dtype=np.int32) - 100         # 5 chunks
    dt = packet_dtype(vals)

    def serve():
        for _ in range(5):
            buf, src = agg.recvfrom(65536)
            p = np.frombuffer(buf, dt)[0]
            h, true = p["hdr"], p["vals"] * 2
            for bad in (_forge(h, true)[:-4], _forge(h, true) + b"\0\0\0\0",
                        _forge(h, true + 1, cookie=int(h["cookie"]) ^ 1),
                        _forge(h, true + 1, job_id=int(h["job_id"]) + 1),
                        _forge(h, true + 1, round_=int(h["round"]) + 1),
                        _forge(h, true + 1, flags=0),
                        _forge(h, true + 1, agg_id=3),
                        _forge(h, true + 1, chunks=[int(h["chunk"]) + 100])):
                agg.sendto(bad, src)
            agg.sendto(_forge(h, true), src)
            agg.sendto(_forge(h, true + 1), src)             # a late duplicate: the first result won
    t = threading.Thread(target=serve)
    t.start()
    try:
        with Client(cfg) as c:
            assert c._exchange.compiled == fast
            got = c.allreduce_int(x)
            assert np.array_equal(got, 2 * x)
            assert c.stats.results == 5
    finally:
        t.join(10)
        agg.close()


def test_fastpath_off_or_unbuildable_falls_back_to_numpy(monkeypatch, tmp_path, caplog):
    cfg = ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1"])
    try:
        monkeypatch.setenv("XAGG_FASTPATH", "0")
        native.load.cache_clear()
        with Client(cfg) as c:
            assert not c._exchange.compiled
        monkeypatch.delenv("XAGG_FASTPATH")
        bad = tmp_path / "codec.c"
        bad.write_text("this is not C\n")
        monkeypatch.setattr(native, "SOURCES", (native.SOURCES[0], bad))
        monkeypatch.setattr(native, "CACHE", tmp_path / "cache")
        native.load.cache_clear()
        assert native.load() is None
        assert "numpy loop" in caplog.text and "failed" in caplog.text
    finally:
        native.load.cache_clear()


def test_a_struct_layout_that_differs_from_c_is_refused():
    def fake_layout(out, n):        # as if the C struct had grown a field at the front
        real = native.load().xagg_exchange_layout(out, n)
        out[2] += 8
        return real
    real = native.load()
    with pytest.raises(OSError, match="layout differs"):
        native.check_layout(types.SimpleNamespace(xagg_exchange_layout=fake_layout,
                                                  xagg_local_layout=real.xagg_local_layout))

    def fake_local(out, n):         # struct xagg_local likewise
        have = real.xagg_local_layout(out, n)
        out[3] += 4
        return have
    with pytest.raises(OSError, match="layout differs from its ctypes twin Local"):
        native.check_layout(types.SimpleNamespace(xagg_exchange_layout=real.xagg_exchange_layout,
                                                  xagg_local_layout=fake_local))
    native.check_layout(real)        # the real one agrees


class ReorderingTwin(UserspaceAggregator):
    """Loses nothing, but finishes chunks out of order, as an aggregator whose
    receive queues run on several CPUs. In round 0 it holds chunk
    ``every``'s result until every worker has resent it (the gap rule's
    needless resend, whatever the machine's load), and the results of the
    chunks from ``hold_below`` on until then: each worker gets both answers
    to that chunk, the held one and its resend's, within the round. From
    round 1 on it holds every ``every``-th completed chunk's results back
    until ``by`` more chunks have completed; not the last chunks of a call
    (from ``hold_below`` on): no more would come to release them."""

    def __init__(self, n_workers: int, every: int, by: int, hold_below: int):
        super().__init__()
        self.n_workers, self.every, self.by, self.hold_below = n_workers, every, by, hold_below
        self.completed, self.held = 0, []
        self.first, self.resent_by, self.deferred = None, set(), []

    def handle(self, payload, src, **kw):
        verdict, replies = super().handle(payload, src, **kw)
        h = np.frombuffer(payload[:HDR_SIZE], packet_dtype(1)["hdr"])[0]
        chunk = int(h["chunk"])
        if int(h["round"]) == 0:
            return verdict, self._round_0(verdict, replies, chunk, int(h["worker_id"]))
        if verdict != "completed":
            return verdict, replies
        time.sleep(0.002)       # results trickle out, as from a loaded aggregator
        self.completed += 1
        out = []
        for held in [held for held in self.held if held[0] <= self.completed]:
            self.held.remove(held)
            out += held[1]
        if self.completed % self.every == 0 and chunk < self.hold_below:
            self.held.append((self.completed + self.by, replies))
        else:
            out = replies + out
        return verdict, out

    def _round_0(self, verdict, replies, chunk, worker) -> list:
        if verdict == "completed" and chunk == self.every:
            self.first = replies
            return []
        if verdict == "completed" and chunk >= self.hold_below and self.first is not None:
            self.deferred += replies
            return []
        if verdict == "retransmit" and chunk == self.every and self.first is not None:
            self.resent_by.add(worker)
            if len(self.resent_by) == self.n_workers:       # the last resend: both answers, then the rest
                out, self.first, self.deferred = self.first + replies + self.deferred, None, []
                return out
        return replies


def _reordering_calls(n: int = 2, calls: int = 10):
    """``calls`` all-reduces of 40 chunks by ``n`` workers through a twin that
    reorders (ReorderingTwin: chunk 5 until resent, then every 5th result by
    6 chunks): per call, the resends of all workers; per call and worker,
    the gap rule's resends so far (what neither a tail probe nor the rto
    sent); each worker's reorder estimate."""
    size = 40 * 256
    agg = ReorderingTwin(n, every=5, by=6, hold_below=20)
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(3)
    inputs = [[rng.standard_normal(size).astype(np.float32) for _ in range(calls)] for _ in range(n)]
    per_call, per_worker = [], []
    try:
        clients = [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n, fanout="unicast",
                                       aggregators=[f"127.0.0.1:{srv.port}"], timeout=20, rto=0.5, vals=256))
                   for w in range(n)]
        assert all(c._exchange.compiled for c in clients)
        for c in range(calls):
            before = [cl.stats.retransmits for cl in clients]
            outs = [None] * n

            def run(w):
                outs[w] = clients[w].allreduce(inputs[w][c], key=0)
            ts = [threading.Thread(target=run, args=(w,)) for w in range(n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            want, tol = _sum_and_bound(inputs, c)
            assert all(np.abs(o - want).max() <= tol for o in outs)
            per_call.append(sum(cl.stats.retransmits for cl in clients) - sum(before))
            per_worker.append([cl.stats.retransmits - cl.stats.probe_resends - cl.stats.rto_resends
                               for cl in clients])
        reorder = [cl.stats.reorder for cl in clients]
        for cl in clients:
            cl.close()
    finally:
        srv.stop()
    return per_call, per_worker, reorder


def test_reordered_results_teach_the_gap_rule_to_wait_instead_of_resending():
    """Results out of order, nothing lost: in the first call every worker
    resends a chunk needlessly (later results looked like a loss); the loop
    learns the reordering from that resend's second answer (the chunk was
    answered twice: nothing had been lost) and its gap rule resends nothing
    in the later calls, whose results come back to 6 chunks out of order."""
    per_call, per_worker, reorder = _reordering_calls()
    assert per_call[0] >= 2, per_call                       # each worker's needless resend
    assert all(r >= 6 for r in reorder), reorder            # as far as the results wander
    # the gap rule's resends stopped: none in any call after the first
    assert all(later == per_worker[0] for later in per_worker[1:]), (per_worker, reorder)


def test_losses_do_not_teach_the_gap_rule_reordering():
    """Packets lost on the way in, nothing reordered: each lost chunk is
    completed by its sender's resend, later than chunks sent after it, for
    every worker. The aggregator marks such results (XAGG_F_RESENT) and the
    loop does not take them for reordering: its estimate stays below the gap
    rule's own 3 (unmarked, every loss would raise it by a whole recovery)."""
    n, size, calls = 3, 60 * 256, 4
    agg = LossyTwin(every=23, answer_repeats=False)     # a needless resend gets no second answer
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(size).astype(np.float32) for _ in range(calls)] for _ in range(n)]
    try:
        outs, stats = _run_workers([srv.port], n, inputs, True, rto=0.5, vals=256)
    finally:
        srv.stop()
    for c in range(calls):
        want, tol = _sum_and_bound(inputs, c)
        assert all(np.abs(outs[w][c] - want).max() <= tol for w in range(n))
    assert sum(s.retransmits for s in stats) >= calls * n        # losses, repaired by resends
    assert max(s.reorder for s in stats) < 3, [s.reorder for s in stats]


class TailLosingTwin(UserspaceAggregator):
    """Loses the first ``copies`` packets of worker 0 for chunk ``chunk``
    (the last one sent in a call: no later result shows the gap) in every
    round from ``from_round`` on."""

    def __init__(self, chunk: int, copies: int, from_round: int):
        super().__init__()
        self.chunk, self.copies, self.from_round, self.lost = chunk, copies, from_round, {}

    def handle(self, payload, src, **kw):
        h = np.frombuffer(payload[:HDR_SIZE], packet_dtype(1)["hdr"])[0]
        rnd = int(h["round"])
        if (int(h["worker_id"]), int(h["chunk"])) == (0, self.chunk) and rnd >= self.from_round \
                and self.lost.get(rnd, 0) < self.copies:
            self.lost[rnd] = self.lost.get(rnd, 0) + 1
            return "lost", []
        return super().handle(payload, src, **kw)


def test_a_lost_tail_probe_is_probed_again_before_the_retransmit_timeout():
    """The last packet of a call is lost, and so is its first resend (the
    tail probe's): the loop probes again after twice the pause instead of
    stalling until the retransmit timeout, and the sums are right. (The
    timeout is 2 s, the most there is: the probes' pauses, 4 gaps between
    results, stay far below it even on a loaded machine.)"""
    n, vals, size, calls = 2, 256, 40 * 256, 4     # 40 data chunks and 1 meta chunk (id 40), sent last
    agg = TailLosingTwin(chunk=40, copies=2, from_round=2)     # rounds 0-1: the first call and its redo
    srv = _serve_behind(agg, n, size)
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(size).astype(np.float32) for _ in range(calls)] for _ in range(n)]
    try:
        outs, stats = _run_workers([srv.port], n, inputs, True, rto=2.0, vals=vals)
    finally:
        srv.stop()
    assert all(len(o) == calls for o in outs)
    for c in range(calls):
        want, tol = _sum_and_bound(inputs, c)
        assert all(np.abs(outs[w][c] - want).max() <= tol for w in range(n))
    lost_rounds = [r for r, k in agg.lost.items() if k == 2]
    assert len(lost_rounds) >= calls - 2, agg.lost          # the tail and its first probe were lost
    assert stats[0].probe_resends >= 2 * len(lost_rounds), vars(stats[0])   # each loss probed twice

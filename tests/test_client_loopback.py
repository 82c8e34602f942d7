"""The client against the userspace aggregator on loopback: real UDP sockets,
worker processes, several rounds, one and two aggregators."""
from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import replace

import numpy as np
import pytest

from xagg.client import Client, ClientConfig, XaggTimeout
from xagg.client.fixedpoint import HISTORY, tolerance
from xagg.wire import chunks
from xagg.wire.jobspec import JobSpec
from xaggd.dataplane.userspace import UserspaceAggregator, UserspaceServer

SIZES = [1, 255, 257, 100_003]


def worker(wid, n, ports, sizes, rounds, q):
    cfg = ClientConfig(job_id=5, cookie=77, worker_id=wid, n_workers=n, fanout="unicast",
                       aggregators=[f"127.0.0.1:{p}" for p in ports], timeout=20)
    out = []
    with Client(cfg) as c:
        for r in range(rounds):
            for size in sizes:
                x = np.random.default_rng(1000 * r + 10 * wid + size).standard_normal(size).astype(np.float32)
                out.append(c.allreduce(x * (r + 1)))
    q.put((wid, out))


def expected(n, sizes, rounds):
    res = []
    for r in range(rounds):
        for size in sizes:
            xs = [np.random.default_rng(1000 * r + 10 * w + size).standard_normal(size).astype(np.float32) * (r + 1)
                  for w in range(n)]
            res.append((np.sum(np.array(xs, np.float64), axis=0), max(float(np.abs(x).max()) for x in xs)))
    return res


def start_aggregators(n, m, max_elems):
    caps = chunks.capacity(max_elems, 256, [1] * m)
    servers = []
    for k in range(m):
        agg = UserspaceAggregator()
        agg.set_job(JobSpec(job_id=5, cookie=77, n_workers=n, n_chunks=caps[k], fanout="unicast"))
        servers.append(UserspaceServer(agg, "127.0.0.1", 0).start())
    return servers


@pytest.mark.parametrize("n,m", [(3, 1), (4, 2)])
def test_allreduce_matches_float64_sum(n, m):
    servers = start_aggregators(n, m, max(SIZES))
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(w, n, [s.port for s in servers], SIZES, 2, q)) for w in range(n)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(10)
        exp = expected(n, SIZES, 2)
        for wid in range(n):
            for got, (want, amax) in zip(results[wid], exp):
                assert got.shape == want.shape
                assert np.max(np.abs(got - want)) <= tolerance(amax, n)
        # every worker got bit-identical results
        for wid in range(1, n):
            for a, b in zip(results[0], results[wid]):
                assert np.array_equal(a, b)
        for s in servers:
            assert s.agg.counters["malformed"] == 0 and s.agg.counters["completed"] > 0
    finally:
        for s in servers:
            s.stop()


def test_dead_aggregator_raises_instead_of_returning_a_wrong_sum():
    servers = start_aggregators(2, 1, 1000)
    port = servers[0].port
    servers[0].stop()
    cfg = ClientConfig(job_id=5, cookie=77, worker_id=0, n_workers=2, fanout="unicast",
                       aggregators=[f"127.0.0.1:{port}"], timeout=0.5, rto=0.05)
    with Client(cfg) as c, pytest.raises(XaggTimeout, match="no result"):
        c.allreduce(np.ones(1000, np.float32))


def test_config_errors_name_the_field():
    with pytest.raises(Exception, match="worker_id"):
        ClientConfig(job_id=1, cookie=1, worker_id=3, n_workers=2, aggregators=["127.0.0.1"])
    with pytest.raises(Exception, match="HOST"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=2, aggregators=["no such host:x"])
    with pytest.raises(Exception, match="result_group: must be an IPv4 multicast"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=2, aggregators=["127.0.0.1"],
                     fanout="bcast", result_group="10.0.0.255")
    with pytest.raises(Exception, match="result_group: needs fanout 'bcast'"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=2, aggregators=["127.0.0.1"],
                     fanout="unicast", result_group="239.1.2.3")


def _int_worker(wid, n, port, q):
    cfg = ClientConfig(job_id=5, cookie=77, worker_id=wid, n_workers=n, fanout="unicast",
                       aggregators=[f"127.0.0.1:{port}"], timeout=20)
    x = np.random.default_rng(wid).integers(-2**31, 2**31, size=70_001, dtype=np.int64).astype(np.int32)
    xs = [x, x * np.int32(3), x[:1_234], x[::-1].copy()]
    with Client(cfg) as c:
        sums = [c.allreduce_int(x)]
        # keyed: the packets and result rows of a size are kept and written over by the next call
        for y in xs:
            sums.append(c.allreduce_int(y, key="b").copy())
        q.put((wid, sums, xs, len(c._int_rounds)))


def test_int32_allreduce_is_exact_modulo_2_32():
    servers = start_aggregators(3, 1, 70_001)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_int_worker, args=(w, 3, servers[0].port, q)) for w in range(3)]
        for p in procs:
            p.start()
        got = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(10)
        def total(i):
            t = np.sum([xs[i].astype(np.int64) for _, _, xs, _ in got], axis=0)
            return ((t + 2**31) % 2**32 - 2**31).astype(np.int32)
        for _, sums, _, rounds in got:
            assert np.array_equal(sums[0], total(0))
            for i in range(4):      # keyed calls: each the sum of its own round, a size's buffers reused
                assert np.array_equal(sums[1 + i], total(i)), i
            assert rounds == 2, "a keyed size built its packets again"
    finally:
        servers[0].stop()


def _loopback_clients(n, port):
    return [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n, fanout="unicast",
                                aggregators=[f"127.0.0.1:{port}"], timeout=10)) for w in range(n)]


def _calls_on_threads(clients, make_inputs, **kw):
    """One allreduce(x, **kw) on every client at once; returns (inputs, outputs)."""
    xs = [make_inputs(w) for w in range(len(clients))]
    outs = [None] * len(clients)

    def run(w):
        outs[w] = clients[w].allreduce(xs[w], **kw)
    ts = [threading.Thread(target=run, args=(w,)) for w in range(len(clients))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return xs, outs


def test_exact_sums_agree_exponents_first_at_full_precision():
    n, size = 3, 20 * 256
    servers = start_aggregators(n, 1, size)
    clients = _loopback_clients(n, servers[0].port)
    try:
        for _ in range(2):                  # no prediction either time: two rounds each
            xs, outs = _calls_on_threads(
                clients, lambda w: np.random.default_rng(w).standard_normal(size).astype(np.float32), exact=True)
            want = np.sum(np.array(xs, np.float64), axis=0)
            for c, o in zip(clients, outs):
                assert c.last_rounds == 2 and c.stats.redone == 0 and not c._history
                assert np.max(np.abs(o - want)) <= tolerance(float(np.abs(np.array(xs)).max()), n, slack=0)
    finally:
        for c in clients:
            c.close()
        servers[0].stop()


def test_keyed_exact_sums_write_over_their_kept_packets_and_result():
    """Exact sums under one key: the second round's packets and book and the
    result buffer (``out``) are the last call's, written over (a fresh
    bucket-sized array page-faults on every call), while the chunks redone
    are the same; a call whose live chunks differ (a zero chunk sends only
    its marker) builds them again. Every sum is the sum of its own call."""
    n, size = 3, 20 * 256
    servers = start_aggregators(n, 1, size)
    clients = _loopback_clients(n, servers[0].port)
    outs_kept = [np.empty(size, np.float32) for _ in range(n)]

    def make(scale, zero_chunk=False):
        def inputs(w):
            x = np.random.default_rng(w).standard_normal(size).astype(np.float32) * scale
            if zero_chunk:
                x[256:512] = 0
            return x
        return inputs
    try:
        kept = []
        for inputs in (make(1.0), make(3.0), make(2.0, zero_chunk=True), make(5.0, zero_chunk=True)):
            xs = [inputs(w) for w in range(n)]
            outs = [None] * n

            def run(w):
                outs[w] = clients[w].allreduce(xs[w], key="b", exact=True, out=outs_kept[w])
            ts = [threading.Thread(target=run, args=(w,)) for w in range(n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            want = np.sum(np.array(xs, np.float64), axis=0)
            for w, (c, o) in enumerate(zip(clients, outs)):
                assert o is outs_kept[w] and c.last_rounds == 2
                assert np.max(np.abs(o - want)) <= tolerance(float(np.abs(np.array(xs)).max()), n, slack=0)
            kept.append([next(iter(c._redo_rounds.values())) for c in clients])
        for c in clients:
            assert len(c._redo_rounds) == 1
        assert all(a is b for a, b in zip(kept[0], kept[1]))          # the same chunks redone: reused
        assert not any(a is b for a, b in zip(kept[1], kept[2]))      # a zero chunk not redone: built again
        assert all(a is b for a, b in zip(kept[2], kept[3]))
    finally:
        for c in clients:
            c.close()
        servers[0].stop()


def test_a_client_goes_on_from_what_the_last_one_of_its_worker_in_its_job_learned():
    """Clients closed after two calls (the first summed twice: nothing to
    predict from), their successors given what they learned: predicted at
    once, the same layouts, the 16-bit residual still to send. A client of
    another job takes none of it."""
    n, size = 3, 20 * 256
    servers = start_aggregators(n, 1, size)
    first = _loopback_clients(n, servers[0].port)
    base = [np.random.default_rng(w).standard_normal(size).astype(np.float32) for w in range(n)]
    try:
        for rounds in (2, 1):
            _calls_on_threads(first, lambda w: base[w], key="bucket0")
            assert all(c.last_rounds == rounds for c in first)
        _calls_on_threads(first, lambda w: base[w], key="bucket1", wire_bits=16, feedback=True)
        learned = [c.learned() for c in first]
        for c in first:
            c.close()
        then = [Client(c.cfg, k) for c, k in zip(first, learned)]
        for c, was in zip(then, first):
            c.round = was.round         # on from the rounds its job reached, as a lane's next client is
        xs, outs = _calls_on_threads(then, lambda w: base[w] * np.float32(1.25), key="bucket0")
        want = np.sum(np.array(xs, np.float64), axis=0)
        for c, was, o in zip(then, first, outs):
            assert c.last_rounds == 1 and c.stats.redone == 0
            assert np.max(np.abs(o - want)) <= tolerance(float(np.abs(np.array(xs)).max()), n)
            assert c._layouts.shapes() is was._layouts.shapes()
            assert c.residual(size, "bucket1") is was.residual(size, "bucket1") is not None
        other = Client(replace(first[0].cfg, job_id=6), learned[0])
        assert other._history == {} and other.residual(size, "bucket1") is None and not other._layouts.shapes()
        other.close()
        for c in then:
            c.close()
    finally:
        servers[0].stop()


def test_predicted_exponents_take_one_round_and_a_missed_chunk_is_summed_again_exactly():
    n, size = 3, 20 * 256
    servers = start_aggregators(n, 1, size)
    clients = _loopback_clients(n, servers[0].port)
    base = [np.random.default_rng(w).standard_normal(size).astype(np.float32) for w in range(n)]

    def call(make_inputs, rounds=None, redone=None):
        before = [c.stats.redone for c in clients]
        xs, outs = _calls_on_threads(clients, make_inputs, key="bucket0")
        want = np.sum(np.array(xs, np.float64), axis=0).reshape(20, 256)
        amax = np.max(np.abs(np.array(xs)), axis=0).reshape(20, 256).max(axis=1)
        for c, b, o in zip(clients, before, outs):
            assert rounds is None or (c.last_rounds == rounds and c.stats.redone - b == redone)
            assert c.last_rounds == clients[0].last_rounds and c.stats.redone - b == clients[0].stats.redone - before[0]
            assert np.array_equal(o, outs[0], equal_nan=True)       # bit-identical everywhere
            err = np.abs(o.reshape(20, 256) - want)
            finite = np.isfinite(want).all(axis=1)
            for ch in np.flatnonzero(finite):
                assert err[ch].max() <= tolerance(float(amax[ch]), n), ch
        return outs[0]

    def zero_and_nan(w):
        x = base[w].copy()
        x[3 * 256:4 * 256] = 0
        if w == 0:
            x[4 * 256 + 9] = np.nan
        return x

    def grown(w):       # chunk 7 1000x larger than on the calls before
        return np.where(np.arange(size) // 256 == 7, 1000, 1).astype(np.float32) * base[w]

    try:
        call(lambda w: base[w], rounds=2, redone=20)                # no history yet: all summed twice
        call(lambda w: base[w] * 1.5, rounds=1, redone=0)           # the prediction holds
        special = call(zero_and_nan, rounds=1, redone=0)            # an all-zero chunk, a NaN chunk: they stand
        assert (special[3 * 256:4 * 256] == 0).all() and np.isnan(special[4 * 256:5 * 256]).all()
        out = call(grown, rounds=2, redone=2)       # chunk 7 outgrew its prediction; chunk 4 had none (NaN)
        assert np.abs(out[7 * 256:8 * 256]).max() > 100
        clients[2]._history.clear()                                 # one worker lost its history:
        call(lambda w: base[w], rounds=2, redone=20)                # predictions differ, every chunk again
        for _ in range(HISTORY - 1):                                # some still differ: the others' history
            call(lambda w: base[w])                                 # holds the grown chunk, the NaN, x1.5
        call(lambda w: base[w], rounds=1, redone=0)                 # in step again
        call(lambda w: base[w] * np.float32(1e-6), rounds=2, redone=20)   # shrank 2**20: too coarse, again
    finally:
        for c in clients:
            c.close()
        servers[0].stop()

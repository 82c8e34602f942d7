"""16-bit lanes on the wire (fixedpoint.py bits=16, csrc/codec.c's *16
functions): the compiled codec equal to the numpy reference bit for bit,
error feedback included; lane totals that can never carry into the next
lane under the aggregator's 64-bit adds; and the client summing with
them through loopback aggregators: C and numpy alike, within the 16-bit
bound, half the packets each way, the residual carried from call to call."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from test_client_loopback import start_aggregators
from test_codec import NONFINITE, ZERO, bits, calls, exponents_to_send, packet_rows, padded, tensor

from xagg.client import Client, ClientConfig, XaggError, codec, fixedpoint, native
from xagg.wire.chunks import meta_chunks

WORDS = 256                 # int32 words per packet
VALS = 2 * WORDS            # 16-bit values per chunk
SIZES = [1, 3, 511, 512, 513, 3 * 512 + 77]
N_WORKERS = [1, 2, 3, 4, 8, 33, 64, 1024]


@pytest.fixture(scope="module")
def dll():
    lib = native.load()
    assert lib is not None, "the C codec must build on this machine"
    return lib


def residual(rng, n: int) -> np.ndarray:
    """A residual as error feedback leaves one: small against the values, some NaN-free zeros."""
    r = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 0)).astype(np.float32)
    r[rng.random(n) < 0.2] = 0.0
    return r


@pytest.mark.parametrize("fb", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_exponents_of_x_plus_residual_equal_numpys(dll, n, fb):
    rng = np.random.default_rng(n)
    for _ in range(5):
        x = tensor(rng, n, VALS)
        r = residual(rng, n) if fb else None
        got = codec.chunk_exponents16(dll, x, VALS, codec.Feedback(r, np.empty(n, np.float32)) if fb else None)
        want = fixedpoint.chunk_exponents(padded(x + r if fb else x, VALS))
        assert np.array_equal(got, want)


@pytest.mark.parametrize("fb", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_quantise16_into_packets_and_residual_equal_numpys(dll, n, fb):
    """Lanes two to a word, every value biased, the padding bias too; the
    new residual (v - q * unit, all of v for a chunk sent as zeros, 0 for
    one holding NaN/Inf) the same bits as fixedpoint.feedback."""
    rng = np.random.default_rng(100 + n)
    for nw in N_WORKERS:
        x = tensor(rng, n, VALS)
        r = residual(rng, n)
        v = x + r if fb else x
        exps = exponents_to_send(rng, v, VALS)
        pkts, rows = packet_rows(rng, exps.size)
        pkts = np.ascontiguousarray(pkts)
        before = pkts.copy()
        out = np.full(n, 12345.0, np.float32)
        feedback = codec.Feedback(r, out) if fb else None
        codec.quantise16_into(dll, x, exps, nw, pkts, rows, feedback)
        q = fixedpoint.quantise(padded(v, VALS), exps, nw, biased=True, bits=16)
        assert np.array_equal(pkts["vals"][rows], fixedpoint.to_words(q, 16)), f"{nw} workers"
        spare = np.setdiff1d(np.arange(len(pkts)), rows)
        assert np.array_equal(pkts[spare], before[spare])
        assert pkts["hdr"].tobytes() == before["hdr"].tobytes()
        if fb:
            want = fixedpoint.feedback(padded(v, VALS), q, exps, nw, biased=True, bits=16).reshape(-1)[:n]
            assert np.array_equal(bits(out), bits(want)), f"{nw} workers"
            live = (exps != ZERO) & (exps != NONFINITE)
            finite = np.isfinite(padded(v, VALS)).all(axis=1)
            kept = np.repeat(~live & finite, VALS)[:n]
            assert np.all(np.isfinite(out))                       # a NaN chunk starts afresh at 0
            assert np.array_equal(bits(out[kept]), bits(v[kept]))    # a chunk sent as zeros keeps all of v


@pytest.mark.parametrize("n", SIZES)
def test_one_pass_encoding16_equals_exponent_then_quantise(dll, n):
    """xagg_encode16_one (the round loop's: quantise with the prediction
    while the max is taken, the residual written in the same pass, zeros if
    the prediction does not hold) equals the numpy reference's steps."""
    rng = np.random.default_rng(300 + n)
    own_c = ctypes.c_int32()
    for nw, fb in ((1, False), (2, True), (4, True), (64, True), (1024, False)):
        x = tensor(rng, n, VALS)
        r = residual(rng, n)
        v = x + r if fb else x
        chunks = padded(v, VALS)
        own = fixedpoint.chunk_exponents(chunks).astype(np.int64)
        live = (own != ZERO) & (own != NONFINITE)
        pred = np.where(live, own + rng.integers(-2, 4, own.size), rng.integers(-160, 140, own.size))
        pred[rng.random(own.size) < 0.1] = ZERO
        pred = pred.astype(np.int32)
        send = fixedpoint.send_exponents(own.astype(np.int32), pred)
        q = fixedpoint.quantise(chunks, send, nw, biased=True, bits=16)
        want_r = fixedpoint.feedback(chunks, q, send, nw, biased=True, bits=16).reshape(-1)[:n]
        lanes = np.full(VALS, 0x5A5A, np.uint16)
        out = np.full(n, 7.0, np.float32)
        for c in range(own.size):
            got = dll.xagg_encode16_one(x.ctypes.data, 0, r.ctypes.data if fb else None,
                                        out.ctypes.data if fb else None, x.size, VALS, c, int(pred[c]),
                                        fixedpoint.headroom_bits(nw, 16), fixedpoint.bias(nw, 16), lanes.ctypes.data,
                                        ctypes.byref(own_c))
            assert (own_c.value, got) == (own[c], send[c]), f"chunk {c}, prediction {pred[c]}"
            assert np.array_equal(lanes, q[c].astype(np.uint16)), f"chunk {c}, {nw} workers"
        if fb:
            assert np.array_equal(bits(out), bits(want_r))


@pytest.mark.parametrize("n", SIZES)
def test_dequantise16_from_rows_equals_numpys(dll, n):
    """Lane totals of N biased values: C's floats are numpy's, NaN and
    zeros from the markers alone, nothing written past n."""
    rng = np.random.default_rng(200 + n)
    count = codec.n_chunks(n, VALS)
    for nw in N_WORKERS:
        s = fixedpoint.headroom_bits(nw, 16)
        exps = rng.integers(-160, 129, count).astype(np.int32)
        exps[rng.random(count) < 0.1] = ZERO
        exps[rng.random(count) < 0.1] = NONFINITE
        signed = rng.integers(-(nw << s), (nw << s) + 1, (count, VALS))
        totals = (signed + fixedpoint.unbias(nw, 16)).astype(np.int32)      # in [0, 2**16)
        assert totals.min() >= 0 and totals.max() < 1 << 16
        rows = rng.permutation(count + 2)[:count].astype(np.int64)
        table = rng.integers(-5, 5, (count + 2, WORDS)).astype(np.int32)
        table[rows] = fixedpoint.to_words(totals, 16)
        room = np.full(n + 7, 12345.0, np.float32)
        codec.dequantise16_into(dll, table, rows, exps, nw, room[:n])
        with np.errstate(over="ignore"):
            want = fixedpoint.dequantise(totals, exps, nw, biased=True, bits=16).reshape(-1)[:n]
        assert np.array_equal(bits(room[:n]), bits(want)), f"{nw} workers"
        assert np.all(room[n:] == 12345.0)


def test_lane_totals_never_carry_under_the_aggregators_64_bit_adds():
    """N workers' biased lanes at their extremes (every value +2**S, or
    every value -2**S, the bias alone or a chunk sent as zeros), packed two
    to a word and added as XAGG_OP_SUM64 adds them (64-bit words, carries
    free to run): every lane comes back as its own total, and that total
    less N * bias is the exact signed sum."""
    rng = np.random.default_rng(7)
    for nw in N_WORKERS:
        s = fixedpoint.headroom_bits(nw, 16)
        assert nw * (2 << s) < 1 << 16                          # the bound, by construction
        q = rng.choice([-(1 << s), 1 << s, 0], (nw, 1, VALS)).astype(np.int64)
        q[:, :, :8] = 1 << s                                    # the worst case in some lanes
        lanes = (q + fixedpoint.bias(nw, 16)).astype(np.int32)
        lanes[rng.random(nw) < 0.2] = 0                         # some workers send the chunk as zeros
        words = np.stack([fixedpoint.to_words(lanes[w], 16) for w in range(nw)])
        total = words.view(np.uint64).sum(axis=0, dtype=np.uint64)          # the kernel's adds, wrapping
        got = fixedpoint.from_words(total.view(np.int32), 16)
        assert np.array_equal(got, lanes.astype(np.int64).sum(axis=0)), f"{nw} workers"


def test_headroom_and_the_precision_kept():
    for nw in N_WORKERS:
        s16, s32 = fixedpoint.headroom_bits(nw, 16), fixedpoint.headroom_bits(nw)
        assert s32 - s16 == 16
        assert s16 - fixedpoint.slack_bits(nw, 16) >= min(s16, fixedpoint.KEPT_BITS[16])
    with pytest.raises(ValueError, match="bits per value"):
        fixedpoint.headroom_bits(4, 8)
    with pytest.raises(XaggError, match="wire_bits"):
        ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1:9"], wire_bits=8)


def test_feedback_needs_16_bit_lanes():
    with Client(ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1:9"])) as c:
        with pytest.raises(ValueError, match="16-bit lanes"):
            c.allreduce(np.ones(4, np.float32), feedback=True)


# -- the client through loopback aggregators ------------------------------------------


def clients(ports, n_workers, fast, wire_bits=16):
    return [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n_workers, fanout="unicast", fast=fast,
                                aggregators=[f"127.0.0.1:{p}" for p in ports], timeout=20, wire_bits=wire_bits))
            for w in range(n_workers)]


def run_plan(n_workers, m, n, plan, fast, wire_bits=16, feedback=False):
    """Each worker's results of every call of ``plan``, its residual after
    each, and its client's counters."""
    servers = start_aggregators(n_workers, m, n)
    cs = clients([s.port for s in servers], n_workers, fast, wire_bits)
    outs, res = [[] for _ in cs], [[] for _ in cs]

    def run(w):
        for xs, kw in plan:
            kw = {k: v for k, v in kw.items() if k != "out"}
            outs[w].append(cs[w].allreduce(xs[w].copy(), feedback=feedback, **kw).copy())
            r = cs[w].residual(n, kw.get("key"))
            res[w].append(None if r is None else r.copy())
    try:
        ts = [threading.Thread(target=run, args=(w,)) for w in range(n_workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert all(len(o) == len(plan) for o in outs)
        return outs, res, [c.stats for c in cs]
    finally:
        for c in cs:
            c.close()
        for s in servers:
            s.stop()


@pytest.mark.parametrize("n_workers,m,n", [(3, 1, 16 * 256 + 77), (4, 2, 40_001)])
def test_client16_c_and_numpy_paths_sum_bit_for_bit_alike(dll, n_workers, m, n):
    """Predictions that hold and miss, exact calls, NaN and zero chunks:
    C and numpy give the same bits on every worker, within the 16-bit bound."""
    plan = calls(np.random.default_rng(n), n_workers, n)
    (c_outs, _, c_stats), (np_outs, _, np_stats) = (run_plan(n_workers, m, n, plan, fast) for fast in (True, False))
    assert c_stats[0].redone == np_stats[0].redone > 0
    for w in range(n_workers):
        for i, (a, b) in enumerate(zip(c_outs[w], np_outs[w])):
            assert np.array_equal(bits(a), bits(b)), f"worker {w} call {i}: C and numpy differ"
            assert np.array_equal(bits(a), bits(c_outs[0][i]))
    for i, (xs, kw) in enumerate(plan):
        got = c_outs[0][i]
        nan_chunk = np.any([np.isnan(padded(x, VALS)).any(axis=1) for x in xs], axis=0)
        nan_want = np.repeat(nan_chunk, VALS)[:n]
        assert np.array_equal(np.isnan(got), nan_want)
        want = np.sum([x.astype(np.float64) for x in xs], axis=0)
        chunk_max = np.max([np.nanmax(np.abs(padded(x, VALS)), axis=1, initial=0) for x in xs], axis=0)
        slack = 0 if kw.get("exact") else None
        tol = np.repeat([fixedpoint.tolerance(float(a), n_workers, slack, bits=16) for a in chunk_max], VALS)[:n]
        assert np.all(np.abs(got.astype(np.float64) - want)[~nan_want] <= tol[~nan_want]), f"call {i}"


def test_sixteen_bit_lanes_take_half_the_packets_each_way(dll):
    """The same calls with 32- and 16-bit lanes (these picked per call by
    clients set up for 32): once the exponents are predicted (no second
    round), a call sends and receives the data chunks of twice the values
    per packet, plus their meta chunks."""
    nw, n, steps = 2, 200 * VALS, 4
    rng = np.random.default_rng(5)
    plan = [([rng.standard_normal(n).astype(np.float32) for _ in range(nw)], dict(key=0)) for _ in range(steps)]
    sent, got = {}, {}
    for wire in (32, 16):
        servers = start_aggregators(nw, 1, n)
        cs = clients([s.port for s in servers], nw, True, 32)
        try:
            counts = [[] for _ in cs]

            def run(w):
                for xs, kw in plan:
                    st = cs[w].stats
                    before = (st.packets_sent - st.retransmits, st.results)     # a loss's resend is no chunk of its own
                    cs[w].allreduce(xs[w], wire_bits=wire, **kw)
                    counts[w].append((cs[w].last_rounds, st.packets_sent - st.retransmits - before[0],
                                      st.results - before[1]))
            ts = [threading.Thread(target=run, args=(w,)) for w in range(nw)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
        finally:
            for c in cs:
                c.close()
            for s in servers:
                s.stop()
        steady = [c for c in counts[0][1:] if c[0] == 1]
        assert steady, counts[0]
        sent[wire], got[wire] = steady[-1][1], steady[-1][2]
    data = {wire: codec.n_chunks(n, WORDS * 32 // wire) for wire in (32, 16)}
    for wire in (32, 16):
        assert sent[wire] == got[wire] == data[wire] + meta_chunks(data[wire], WORDS)
    assert data[16] * 2 == data[32]
    assert sent[16] <= sent[32] / 2 + 1, (sent, got)


def test_error_feedback_carries_each_rounding_into_the_next_call(dll):
    """With feedback the residual after each call is what that call's
    rounding left out, so over T calls the results add up to the inputs'
    sum less the workers' last residuals (to float rounding), each residual
    within half a unit of the chunk's scale; and a worker's residual is
    what it alone left out, so the workers' differ."""
    nw, n, steps = 3, 5000, 6
    rng = np.random.default_rng(11)
    plan = [([(rng.standard_normal(n) * (1 + t)).astype(np.float32) for _ in range(nw)], dict(key=3))
            for t in range(steps)]
    outs, res, _ = run_plan(nw, 1, n, plan, True, feedback=True)
    total_in = np.sum([np.sum([x.astype(np.float64) for x in xs], axis=0) for xs, _ in plan], axis=0)
    total_out = np.sum([o.astype(np.float64) for o in outs[0]], axis=0)
    last = np.sum([res[w][-1].astype(np.float64) for w in range(nw)], axis=0)
    amax = max(float(np.abs(x).max()) for xs, _ in plan for x in xs)
    assert np.max(np.abs(total_out + last - total_in)) <= steps * nw * amax * 2.0 ** -22
    unit = 2.0 ** (np.ceil(np.log2(amax)) + fixedpoint.slack_bits(nw, 16) - fixedpoint.headroom_bits(nw, 16) + 1)
    for w in range(nw):
        assert np.all(np.abs(res[w][-1]) <= unit / 2) and np.any(res[w][-1] != 0)
    assert not np.array_equal(res[0][-1], res[1][-1])
    # without feedback the same calls leave the rounding where it fell: a larger total error
    plain, _, _ = run_plan(nw, 1, n, plan, True)
    plain_total = np.sum([o.astype(np.float64) for o in plain[0]], axis=0)
    assert np.abs(total_out - total_in).sum() < np.abs(plain_total - total_in).sum()


def test_a_failed_call_keeps_the_residual_as_it_was(dll):
    """No aggregator answers: the call raises and the residual is the one
    the last good call left (a redo over gloo must not count it as sent)."""
    servers = start_aggregators(1, 1, 1000)
    port = servers[0].port
    try:
        with Client(ClientConfig(job_id=5, cookie=77, worker_id=0, n_workers=1, fanout="unicast", timeout=1.0,
                                 rto=0.05, aggregators=[f"127.0.0.1:{port}"], wire_bits=16)) as c:
            x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
            c.allreduce(x, key=0, feedback=True)
            kept = c.residual(1000, 0).copy()
            servers[0].stop()
            with pytest.raises(XaggError):
                c.allreduce(x * 3, key=0, feedback=True)
            assert np.array_equal(bits(c.residual(1000, 0)), bits(kept))
    finally:
        for s in servers:
            s.stop()



# -- int16 as --compress names it ------------------------------------------------------


def test_compress_int16_is_the_hooks_16_bit_lanes():
    """xagg-client run --compress int16 runs the DDP hook itself with
    wire_bits=16; int8 stays a compressor; a warm-up cannot apply."""
    from xagg.torch.patch import PatchError, _wire_bits
    assert _wire_bits("int16") == 16
    assert _wire_bits("int8") is None and _wire_bits(None) is None
    with pytest.raises(PatchError, match="warmup does not apply"):
        _wire_bits("int16:warmup=3")


def test_int16_in_the_compression_framework_asks_the_transport_for_lanes():
    """Within xagg.compress (auto's candidates), Int16 asks the collectives
    for a 16-bit lane sum keyed by the bucket (the aggregators' transport
    has one); torch.distributed has none, and there the sum is dense and exact."""
    import torch

    from xagg.compress import ThreadGroup, get_compressor

    asked = []

    def body(c):
        x = torch.arange(10, dtype=torch.float32) * (c.rank + 1)
        dense = get_compressor("int16").reduce("b", x, 0, c)
        c.SUMS_LANES = True     # as the aggregators' transport says it
        c.allreduce_sum_lanes = lambda t, key, bits: (asked.append((key, bits)), c.allreduce_sum(t))[1]
        lanes = get_compressor("int16").reduce("b", x, 0, c)
        return dense, lanes
    (dense, lanes), *_ = ThreadGroup(2).run(body)
    want = torch.arange(10, dtype=torch.float32) * 3
    assert torch.equal(dense, want) and torch.equal(lanes, want)
    assert asked == [("b", 16), ("b", 16)]

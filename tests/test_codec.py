"""The compiled codec (xagg/client/csrc/codec.c) against fixedpoint.py's
numpy functions, bit for bit; and the client's two paths (C codec + C round
loop, numpy + numpy) giving the same sums through loopback aggregators."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from test_client_loopback import start_aggregators

from xagg.client import Client, ClientConfig, codec, fixedpoint, native
from xagg.wire.proto import HDR_SIZE, make_packets

ZERO, NONFINITE = fixedpoint.EXP_ZERO, fixedpoint.EXP_NONFINITE
SIZES = [1, 3, 255, 256, 257, 1000, 16 * 256 + 77]
VALS = 256


@pytest.fixture(scope="module")
def dll():
    lib = native.load()
    assert lib is not None, "the C codec must build on this machine"
    return lib


def bits(a: np.ndarray) -> np.ndarray:
    """float32 as its bits, so NaN == NaN and -0.0 != 0.0 in comparisons."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def padded(flat: np.ndarray, vals: int) -> np.ndarray:
    """The numpy reference's chunks: zero-padded to whole chunks, [C, vals]."""
    out = np.zeros(codec.n_chunks(flat.size, vals) * vals, np.float32)
    out[:flat.size] = flat
    return out.reshape(-1, vals)


def tensor(rng, n: int, vals: int = VALS, top: int = 126) -> np.ndarray:
    """Chunks of every kind: magnitudes from subnormal to 2**top (near
    float32's maximum by default), all-zero (+0 and -0), NaN, +-Inf, lone
    subnormals."""
    c = codec.n_chunks(n, vals)
    x = rng.standard_normal(c * vals).astype(np.float32).reshape(c, vals)
    e = rng.integers(-150, top, c)                      # one magnitude per chunk
    x *= np.ldexp(np.float32(1), e.astype(np.int32))[:, None].astype(np.float32)
    kinds = rng.integers(0, 9, c)
    for i, k in enumerate(kinds):
        if k == 0:
            x[i] = 0.0
        elif k == 1:
            x[i] = -0.0
        elif k == 2:
            x[i, rng.integers(vals)] = np.nan
        elif k == 3:
            x[i, rng.integers(vals)] = rng.choice([np.inf, -np.inf])
        elif k == 4:                                    # subnormals only
            x[i] = (rng.integers(-(1 << 23) + 1, 1 << 23, vals) * np.float64(2.0 ** -149)).astype(np.float32)
        elif k == 5:                                    # one value in a chunk of zeros
            x[i] = 0.0
            x[i, rng.integers(vals)] = np.float32(rng.choice([1e-45, 1.5 * 2.0 ** top, -1.0, 2.0 ** -126]))
    return x.reshape(-1)[:n].copy()


@pytest.mark.parametrize("n", SIZES)
def test_chunk_exponents_equal_numpys(dll, n):
    rng = np.random.default_rng(n)
    for _ in range(5):
        x = tensor(rng, n)
        want = fixedpoint.chunk_exponents(padded(x, VALS))
        got = codec.chunk_exponents(dll, x, VALS)
        assert got.dtype == np.int32 and np.array_equal(got, want)


def test_chunk_exponents_at_every_power_of_two(dll):
    """Exactly 2**k and the float below it, for every float32 exponent: the
    boundary where E steps, subnormals included."""
    k = np.arange(-149, 128)
    p = np.ldexp(np.float64(1), k).astype(np.float32)
    below = np.nextafter(p, np.float32(0))
    x = np.stack([p, below, -p, -below], axis=1).reshape(-1)     # one value per chunk of 1
    assert np.array_equal(codec.chunk_exponents(dll, x, 1), fixedpoint.chunk_exponents(x[:, None]))


def exponents_to_send(rng, x: np.ndarray, vals: int) -> np.ndarray:
    """Exponents a worker may quantise with: its own or above (a prediction),
    markers as they are, some live chunks sent as zeros."""
    own = fixedpoint.chunk_exponents(padded(x, vals)).astype(np.int64)
    live = (own != ZERO) & (own != NONFINITE)
    e = np.where(live, own + rng.integers(0, 4, own.size), own)
    e[live & (rng.random(own.size) < 0.1)] = ZERO
    return e.astype(np.int32)


def packet_rows(rng, count: int):
    """Packets for ``count`` chunks at shuffled rows among spare ones, filled
    with a pattern that must survive where nothing is to be written."""
    rows = rng.permutation(count + 3)[:count].astype(np.int64)
    pkts = make_packets(job_id=1, cookie=2, worker_id=0, round_=0, chunks=np.arange(count + 3),
                        values=np.full((count + 3, VALS), 0x5A5A5A5A, np.int32))
    return pkts, rows


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_quantise_into_packets_equals_numpys(dll, n, biased):
    rng = np.random.default_rng(100 + n)
    for nw in range(1, 65):
        x = tensor(rng, n)
        exps = exponents_to_send(rng, x, VALS)
        pkts, rows = packet_rows(rng, exps.size)
        before = pkts.copy()
        codec.quantise_into(dll, x, exps, nw, pkts, rows, biased=biased)
        want = fixedpoint.quantise(padded(x, VALS), exps, nw, biased=biased)
        assert np.array_equal(pkts["vals"][rows], want), f"{nw} workers"
        spare = np.setdiff1d(np.arange(len(pkts)), rows)
        assert np.array_equal(pkts[spare], before[spare])          # no other row touched
        assert pkts["hdr"].tobytes() == before["hdr"].tobytes()    # nor any header


@pytest.mark.parametrize("n", SIZES)
def test_one_pass_encoding_equals_exponent_then_quantise(dll, n):
    """xagg_encode_one (the round loop's fused pass: quantise with the
    prediction while taking the chunk's max, zero it if the prediction does
    not hold) gives the numpy reference's own exponent, send exponent and
    values, for predictions that hold, miss by one or more, are markers, or
    scale off float32's normal range."""
    rng = np.random.default_rng(300 + n)
    own_c = ctypes.c_int32()
    for nw, biased in ((1, False), (2, True), (4, False), (4, True), (64, True)):
        x = tensor(rng, n)
        chunks = padded(x, VALS)
        own = fixedpoint.chunk_exponents(chunks).astype(np.int64)
        live = (own != ZERO) & (own != NONFINITE)
        pred = np.where(live, own + rng.integers(-2, 4, own.size), rng.integers(-160, 140, own.size))
        pred[rng.random(own.size) < 0.1] = ZERO
        pred[rng.random(own.size) < 0.05] = NONFINITE
        pred = pred.astype(np.int32)
        send = fixedpoint.send_exponents(own.astype(np.int32), pred)
        want = fixedpoint.quantise(chunks, send, nw, biased=biased)
        q = np.full(VALS, 0x5A5A5A5A, np.int32)
        for c in range(own.size):
            got = dll.xagg_encode_one(x.ctypes.data, 0, x.size, VALS, c, int(pred[c]),
                                      fixedpoint.headroom_bits(nw), fixedpoint.bias(nw) if biased else 0,
                                      q.ctypes.data, ctypes.byref(own_c))
            assert (own_c.value, got) == (own[c], send[c]), f"chunk {c}, prediction {pred[c]}"
            assert np.array_equal(q, want[c]), f"chunk {c}, prediction {pred[c]}, {nw} workers"


def test_quantise_rounds_ties_to_even_on_both_scale_paths(dll):
    """Values exactly halfway between two integers once scaled, with a
    normal float32 scale (E = 3) and with one that is not (E = -120, scale
    2**150): numpy rounds to even, so must C."""
    vals, nw = 64, 4
    m = np.arange(-vals // 2, vals // 2, dtype=np.float64)
    s = fixedpoint.headroom_bits(nw)
    x = np.concatenate([(m + 0.5) * 2.0 ** (3 - s), (m + 0.5) * 2.0 ** (-120 - s)]).astype(np.float32)
    exps = np.array([3, -120], np.int32)
    pkts = make_packets(job_id=1, cookie=2, worker_id=0, round_=0, chunks=np.arange(2),
                        values=np.zeros((2, vals), np.int32))
    codec.quantise_into(dll, x, exps, nw, pkts, np.arange(2, dtype=np.int64))
    want = fixedpoint.quantise(x.reshape(2, vals), exps, nw)
    assert np.array_equal(pkts["vals"], want)
    assert np.all(pkts["vals"] % 2 == 0)                          # every one a tie, to even


def test_quantise_skips_chunks_whose_row_is_negative(dll):
    rng = np.random.default_rng(3)
    x = tensor(rng, 1000)
    exps = exponents_to_send(rng, x, VALS)
    pkts, rows = packet_rows(rng, exps.size)
    before = pkts.copy()
    rows[[0, 2]] = -1
    codec.quantise_into(dll, x, exps, 3, pkts, rows)
    assert np.array_equal(pkts[[r for r in range(len(pkts)) if r not in rows]],
                          before[[r for r in range(len(pkts)) if r not in rows]])


def sums_for(rng, exps: np.ndarray, nw: int, vals: int) -> np.ndarray:
    """What N workers' quantised chunks may add up to; 0 for ZERO chunks."""
    limit = nw << fixedpoint.headroom_bits(nw)
    sums = rng.integers(-limit, limit + 1, (exps.size, vals), dtype=np.int64).astype(np.int32)
    small = rng.random(exps.size) < 0.3                 # small sums: exact in float32
    sums[small] = rng.integers(-1000, 1000, (int(small.sum()), vals))
    sums[exps == ZERO] = 0
    return sums


def result_exponents(rng, count: int) -> np.ndarray:
    """Agreed exponents: live ones over the whole range (2**(E - S) normal,
    subnormal or below), and markers."""
    e = rng.integers(-160, 129, count).astype(np.int32)
    e[rng.random(count) < 0.1] = ZERO
    e[rng.random(count) < 0.1] = NONFINITE
    return e


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_dequantise_from_rows_equals_numpys(dll, n, biased):
    """The same floats from C as from numpy; biased sums (each N * bias over
    the signed sum, modulo 2**32) give the signed sums' floats."""
    rng = np.random.default_rng(200 + n)
    count = codec.n_chunks(n, VALS)
    for nw in range(1, 65):
        exps = result_exponents(rng, count)
        sums = sums_for(rng, exps, nw, VALS)
        rows = rng.permutation(count + 2)[:count].astype(np.int64)
        table = rng.integers(-5, 5, (count + 2, VALS)).astype(np.int32)
        table[rows] = (sums.view(np.uint32) + np.uint32(fixedpoint.unbias(nw) if biased else 0)).view(np.int32)
        room = np.full(n + 7, 12345.0, np.float32)          # guard past n: nothing written there
        codec.dequantise_into(dll, table, rows, exps, nw, room[:n], biased=biased)
        with np.errstate(over="ignore"):        # E = 128: N sums near float32's maximum are Inf
            want = fixedpoint.dequantise(sums, exps, nw).reshape(-1)[:n]
            if biased:
                assert np.array_equal(bits(fixedpoint.dequantise(table[rows], exps, nw, biased=True)),
                                      bits(fixedpoint.dequantise(sums, exps, nw)))
        assert np.array_equal(bits(room[:n]), bits(want)), f"{nw} workers"
        assert np.all(room[n:] == 12345.0)


def test_dequantise_leaves_chunks_of_another_round_alone(dll):
    """A negative row: a live chunk is left as it is; ZERO and NONFINITE
    chunks are written from their exponent alone (no row read)."""
    vals, nw = 8, 2
    exps = np.array([5, ZERO, NONFINITE, 5], np.int32)
    rows = np.array([0, -1, -1, -1], np.int64)
    out = np.full(4 * vals - 3, 7.0, np.float32)
    table = np.full((1, vals), 1 << 20, np.int32)
    codec.dequantise_into(dll, table, rows, exps, nw, out)
    assert np.all(out[:vals] == fixedpoint.dequantise(table, exps[:1], nw)[0])
    assert np.all(bits(out[vals:2 * vals]) == bits(np.zeros(vals, np.float32)))
    assert np.all(np.isnan(out[2 * vals:3 * vals])) and np.all(out[3 * vals:] == 7.0)


def test_a_row_past_the_table_is_refused_before_c_writes(dll):
    x = np.ones(300, np.float32)
    pkts = make_packets(job_id=1, cookie=2, worker_id=0, round_=0, chunks=np.arange(2),
                        values=np.zeros((2, VALS), np.int32))
    with pytest.raises(ValueError, match="past the 2 rows"):
        codec.quantise_into(dll, x, np.array([1, 1], np.int32), 2, pkts, np.array([0, 2], np.int64))
    with pytest.raises(ValueError, match="past the 1 rows"):
        codec.dequantise_into(dll, np.zeros((1, VALS), np.int32), np.array([0, 1], np.int64),
                              np.array([1, 1], np.int32), 2, np.empty(300, np.float32))
    with pytest.raises(ValueError, match="float32"):
        codec.chunk_exponents(dll, x.astype(np.float64), VALS)
    assert HDR_SIZE % 4 == 0


# -- the client's two paths through loopback aggregators -----------------------------


def calls(rng, n_workers: int, n: int) -> list:
    """Per call (x per worker, kwargs). Each worker's chunks keep their
    magnitudes from call to call (so predictions hold) but for a jump by 16
    (so some miss and are summed again); zero, NaN and subnormal chunks;
    exact calls; sums written into x itself, or into another array (summed
    into as results arrive) that holds garbage before."""
    base = [tensor(rng, n, top=100) for _ in range(n_workers)]
    for b in base:
        b[np.isinf(b)] = 0.0                    # NaN chunks stay: their sum is NaN
    factors = [1, 1, 2, 1, 16, 1, 1, 16]
    kws = [dict(key=0), dict(key=0), dict(key=0, out="x"), dict(key=1, exact=True),
           dict(key=0, out="other"), dict(key=0, exact=True, out="x"), dict(key=0), dict(key=0, out="other")]
    return [([b * np.float32(f) * (1 + 0.1 * rng.standard_normal(n)).astype(np.float32) for b in base], kw)
            for f, kw in zip(factors, kws)]


def run_workers(ports, n_workers, plan, fast):
    clients = [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=n_workers, fanout="unicast",
                                   fast=fast, aggregators=[f"127.0.0.1:{p}" for p in ports], timeout=20))
               for w in range(n_workers)]
    assert all(c._exchange.compiled == fast for c in clients)
    outs = [[] for _ in range(n_workers)]
    redone = [0] * n_workers

    def run(w):
        for xs, kw in plan:
            x = xs[w].copy()
            if kw.get("out") == "x":
                got = clients[w].allreduce(x, **{**kw, "out": x})
                assert got is x
            elif kw.get("out") == "other":
                other = np.full_like(x, np.float32(-7.5))
                got = clients[w].allreduce(x, **{**kw, "out": other})
                assert got is other and np.array_equal(bits(x), bits(xs[w]))
            else:
                got = clients[w].allreduce(x, **kw)
                assert np.array_equal(bits(x), bits(xs[w]))        # the input is left alone
            outs[w].append(got.copy())
        redone[w] = clients[w].stats.redone
    ts = [threading.Thread(target=run, args=(w,)) for w in range(n_workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for c in clients:
        c.close()
    assert all(len(o) == len(plan) for o in outs)
    return outs, redone


@pytest.mark.parametrize("n_workers,m,n", [(3, 1, 16 * 256 + 77), (4, 2, 40_001)])
def test_client_c_and_numpy_paths_sum_bit_for_bit_alike(dll, n_workers, m, n):
    plan = calls(np.random.default_rng(n), n_workers, n)
    got = {}
    for fast in (True, False):
        servers = start_aggregators(n_workers, m, n)
        try:
            got[fast] = run_workers([s.port for s in servers], n_workers, plan, fast)
        finally:
            for s in servers:
                s.stop()
    (c_outs, c_redone), (np_outs, np_redone) = got[True], got[False]
    assert c_redone == np_redone and c_redone[0] > 0            # second rounds were exercised
    for w in range(n_workers):
        for i, (a, b) in enumerate(zip(c_outs[w], np_outs[w])):
            assert a.dtype == np.float32 and a.shape == (n,)
            assert np.array_equal(bits(a), bits(b)), f"worker {w} call {i}: C and numpy differ"
            assert np.array_equal(bits(a), bits(c_outs[0][i]))   # every worker alike
    for i, (xs, _) in enumerate(plan):                           # and the sums are sums
        got_i = c_outs[0][i]
        nan_chunk = np.any([np.isnan(padded(x, VALS)).any(axis=1) for x in xs], axis=0)
        nan_want = np.repeat(nan_chunk, VALS)[:n]
        assert nan_chunk.any() and np.array_equal(np.isnan(got_i), nan_want)
        want = np.sum([x.astype(np.float64) for x in xs], axis=0)
        chunk_max = np.max([np.nanmax(np.abs(padded(x, VALS)), axis=1, initial=0) for x in xs], axis=0)
        tol = np.repeat([fixedpoint.tolerance(float(a), n_workers) for a in chunk_max], VALS)[:n]
        assert np.all(np.abs(got_i.astype(np.float64) - want)[~nan_want] <= tol[~nan_want])


def test_out_must_be_float32_of_the_same_size():
    with Client(ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=1, aggregators=["127.0.0.1:9"])) as c:
        for bad in (np.empty(10, np.float64), np.empty(9, np.float32), np.empty((10, 2), np.float32)[:, 0]):
            with pytest.raises(ValueError, match="out="):
                c.allreduce(np.ones(10, np.float32), out=bad)
        assert c.round == 0                  # refused before a round was taken

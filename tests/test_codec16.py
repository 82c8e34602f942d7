"""16-bit tensors (bfloat16, float16) through the codec without a float32
copy: the compiled codec reads them in place and rounds sums straight into
them. Held against the float32 path of the same values (every bf16/fp16
value is a float32 one): the same exponents and the same packet words, bit
for bit, 32- and 16-bit lanes, error feedback included; and sums written
into a 16-bit tensor equal to torch's .to() of the float32 path's sum
(divided first, as the DDP hook averages). Then the client through
loopback aggregators: C and numpy (the reference, which widens copies)
alike, and equal to the float32 path's sums rounded by torch."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch
from test_client_loopback import start_aggregators
from test_codec import bits, calls, exponents_to_send, packet_rows, tensor

from xagg.client import Client, ClientConfig, codec, fixedpoint, native
from xagg.wire.proto import make_packets

SIZES = [1, 3, 511, 512, 513, 16 * 256 + 77]
WORDS = 256                                  # int32 words per packet
TYPES = {"bfloat16": (fixedpoint.BFLOAT16, torch.bfloat16), "float16": (np.dtype(np.float16), torch.float16)}


@pytest.fixture(scope="module")
def dll():
    lib = native.load()
    assert lib is not None, "the C codec must build on this machine"
    return lib


def half(rng, n: int, dtype) -> np.ndarray:
    """test_codec's tensor of every kind of chunk, rounded to ``dtype`` (fp16's range overflows to Inf)."""
    return fixedpoint.narrow(tensor(rng, n), dtype)


def torch_rounded(v: np.ndarray, tdtype, divide: float = 1) -> np.ndarray:
    """torch's rounding of float32 ``v`` / ``divide`` to ``tdtype``, as uint16 bits."""
    t = torch.from_numpy(v.copy())
    if divide != 1:
        t.div_(divide)
    return t.to(tdtype).view(torch.int16).numpy().view(np.uint16)


def same_rounding(got: np.ndarray, want_bits: np.ndarray, where: str) -> None:
    """16-bit ``got`` is ``want_bits`` bit for bit, but where both are NaN (torch's
    vector and scalar paths spell NaN differently)."""
    g = got.view(np.uint16)
    nan_g, nan_w = np.isnan(fixedpoint.widen(got)), np.isnan(fixedpoint.widen(want_bits.view(got.dtype)))
    assert np.array_equal(nan_g, nan_w), f"{where}: NaN in other places"
    bad = np.flatnonzero((g != want_bits) & ~nan_g)
    assert bad.size == 0, f"{where}: {bad.size} values differ, first at {bad[:5]}: {g[bad[:5]]} != {want_bits[bad[:5]]}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", SIZES)
def test_exponents_and_packet_words_equal_the_float32_paths(dll, name, n):
    rng = np.random.default_rng(n)
    dtype = TYPES[name][0]
    for _ in range(3):
        x = half(rng, n, dtype)
        x32 = fixedpoint.widen(x).copy()
        assert np.array_equal(codec.chunk_exponents(dll, x, WORDS), codec.chunk_exponents(dll, x32, WORDS))
        exps = exponents_to_send(rng, x32, WORDS)
        got, rows = packet_rows(rng, exps.size)
        want = got.copy()
        codec.quantise_into(dll, x, exps, 4, got, rows, biased=True)
        codec.quantise_into(dll, x32, exps, 4, want, rows, biased=True)
        assert got.tobytes() == want.tobytes()
        # the round loop's fused pass: exponent, send exponent and words from one
        # read, with predictions that hold, that miss, and markers
        own = codec.chunk_exponents(dll, x32, WORDS)
        marker = (own == fixedpoint.EXP_ZERO) | (own == fixedpoint.EXP_NONFINITE)
        pred = np.where(marker, own, own + rng.integers(-1, 3, own.size)).astype(np.int32)
        q16, q32 = np.empty(WORDS, np.int32), np.empty(WORDS, np.int32)
        own16, own32 = ctypes.c_int32(), ctypes.c_int32()
        elem = fixedpoint.ELEMS[dtype]
        for c in range(exps.size):
            s16 = dll.xagg_encode_one(x.ctypes.data, elem, n, WORDS, c, int(pred[c]), fixedpoint.headroom_bits(4),
                                      fixedpoint.bias(4), q16.ctypes.data, ctypes.byref(own16))
            s32 = dll.xagg_encode_one(x32.ctypes.data, 0, n, WORDS, c, int(pred[c]), fixedpoint.headroom_bits(4),
                                      fixedpoint.bias(4), q32.ctypes.data, ctypes.byref(own32))
            assert (s16, own16.value) == (s32, own32.value) and np.array_equal(q16, q32), f"chunk {c}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", SIZES)
def test_16_bit_lanes_with_feedback_equal_the_float32_paths(dll, name, n):
    rng = np.random.default_rng(n + 1)
    x = half(rng, n, TYPES[name][0])
    x32 = fixedpoint.widen(x).copy()
    r = (rng.standard_normal(n) * 2.0 ** -20).astype(np.float32)
    vals = 2 * WORDS
    outs = {}
    for src in (x, x32):
        fb = codec.Feedback(r, np.full(n, 7.0, np.float32))
        exps = codec.chunk_exponents16(dll, src, vals, fb)
        pkts, rows = packet_rows(np.random.default_rng(0), exps.size)
        codec.quantise16_into(dll, src, exponents_to_send(np.random.default_rng(1), x32 + r, vals), 4, pkts, rows,
                              fb)
        outs[src.dtype] = (exps, pkts.tobytes(), bits(fb.out))
    (e16, p16, r16), (e32, p32, r32) = outs.values()
    assert np.array_equal(e16, e32) and p16 == p32 and np.array_equal(r16, r32)


def sum_rows(rng, count: int, vals: int, lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Summed rows of 4 workers for ``count`` chunks in shuffled rows, and
    exponents from deep subnormal to float32's top (past fp16's and, rounded
    up, bf16's range), markers among them."""
    nw = 4
    top = (1 << (fixedpoint.headroom_bits(nw, lanes) + 1)) * nw
    sums = rng.integers(-top // 2, top // 2, (count + 2, vals), dtype=np.int64)
    sums = (sums + fixedpoint.unbias(nw, lanes)) if lanes == 16 else sums + fixedpoint.unbias(nw)
    rows = rng.permutation(count + 2)[:count].astype(np.int64)
    exps = rng.integers(-140, 129, count).astype(np.int32)
    exps[rng.random(count) < 0.1] = fixedpoint.EXP_ZERO
    exps[rng.random(count) < 0.1] = fixedpoint.EXP_NONFINITE
    return sums, rows, exps


@pytest.mark.parametrize("lanes", [32, 16])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sums_written_into_16_bits_equal_torchs_rounding_of_the_float32_sums(dll, lanes, name, n):
    dtype, tdtype = TYPES[name]
    rng = np.random.default_rng(n + lanes)
    vals = WORDS * 32 // lanes
    count = codec.n_chunks(n, vals)
    sums, rows, exps = sum_rows(rng, count, vals, lanes)
    table = (sums.astype(np.uint32).view(np.int32) if lanes == 32
             else np.ascontiguousarray(sums.astype(np.uint16)).view(np.int32))
    compiled, numpy_codec = codec.CompiledCodec(dll, WORDS, lanes), codec.NumpyCodec(WORDS, lanes)
    sum32 = np.full(n, -7.5, np.float32)
    compiled.dequantise_into(table, rows, exps, 4, sum32)
    for divide in (1, 3, 4):
        got, ref = np.zeros(n, dtype), np.zeros(n, dtype)
        compiled.dequantise_into(table, rows, exps, 4, got, divide)
        same_rounding(got, torch_rounded(sum32, tdtype, divide), f"{name} / {divide}")
        with np.errstate(over="ignore"):                                  # the reference alike
            numpy_codec.dequantise_into(table, rows, exps, 4, ref, divide)
        assert np.array_equal(got.view(np.uint16), ref.view(np.uint16))
        mean32 = np.empty(n, np.float32)                                  # float32 out: torch's division
        compiled.dequantise_into(table, rows, exps, 4, mean32, divide)
        want = torch.from_numpy(sum32.copy()).div_(divide).numpy() if divide != 1 else sum32
        assert np.array_equal(bits(mean32), bits(want))


def test_every_16_bit_value_widens_exactly_and_rounds_back_to_itself(dll):
    """All 65,536 patterns of each type, one per chunk, quantised by C with
    their own exponents (S bits keep all of a 16-bit value) and back: into
    float32 they are torch's widening, into their own type themselves
    (subnormals and the largest included; NaN/Inf chunks come back NaN)."""
    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    rows = np.arange(pats.size, dtype=np.int64)
    for name, (dtype, tdtype) in TYPES.items():
        x = pats.view(dtype)
        want = torch.from_numpy(pats.view(np.int16)).view(tdtype).float().numpy()
        finite = np.isfinite(want)
        assert np.array_equal(bits(fixedpoint.widen(x))[finite], bits(want)[finite]), name
        e = codec.chunk_exponents(dll, x, 1)
        assert np.array_equal(e, fixedpoint.chunk_exponents(want[:, None])), name
        pkts = make_packets(job_id=1, cookie=1, worker_id=0, round_=0, chunks=rows,
                            values=np.zeros((pats.size, 1), np.int32))
        codec.quantise_into(dll, x, e, 1, pkts, rows)
        sums = np.ascontiguousarray(pkts["vals"])
        out32, out16 = np.empty(pats.size, np.float32), np.zeros(pats.size, dtype)
        codec.dequantise_into(dll, sums, rows, e, 1, out32)
        codec.dequantise_into(dll, sums, rows, e, 1, out16)
        keep = finite & (pats != 0x8000)            # -0 is a ZERO chunk: +0 comes back
        assert np.array_equal(bits(out32)[keep], bits(want)[keep]) and np.isnan(out32[~finite]).all(), name
        assert np.array_equal(out16.view(np.uint16)[keep], pats[keep]), name
        assert np.isnan(fixedpoint.widen(out16)[~finite]).all(), name


def test_bad_dtypes_are_refused_by_name(dll):
    with pytest.raises(ValueError, match="out: a C-contiguous float32, float16 or bfloat16"):
        codec.dequantise_into(dll, np.zeros((1, 4), np.int32), np.zeros(1, np.int64), np.zeros(1, np.int32), 2,
                              np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="tensor: a C-contiguous float32, float16 or bfloat16"):
        codec.chunk_exponents(dll, np.zeros(4, np.uint16), 4)
    pkts = make_packets(job_id=1, cookie=1, worker_id=0, round_=0, chunks=np.arange(1),
                        values=np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="not contiguous"):
        codec.quantise_into(dll, np.zeros(8, np.float16)[::2], np.zeros(1, np.int32), 2, pkts,
                            np.zeros(1, np.int64))


# -- the client: 16-bit in, 16-bit out, through loopback aggregators ------------------------------


def run_clients(ports, nw, plan, fast, lanes, convert):
    """Every call of ``plan`` on nw clients; ``convert`` makes each input
    (float32 -> the dtype under test). Per worker, per call: the result."""
    clients = [Client(ClientConfig(job_id=5, cookie=77, worker_id=w, n_workers=nw, fanout="unicast", fast=fast,
                                   aggregators=[f"127.0.0.1:{p}" for p in ports], timeout=20, wire_bits=lanes))
               for w in range(nw)]
    assert all(c._exchange.compiled == fast for c in clients)
    outs = [[] for _ in range(nw)]

    def run(w):
        for xs, kw in plan:
            x = convert(xs[w])
            before = x.copy()
            kw = dict(kw, feedback=lanes == 16)
            if kw.get("out") == "x":
                got = clients[w].allreduce(x, **{**kw, "out": x})
                assert got is x
            elif kw.get("out") == "other":
                got = clients[w].allreduce(x, **{**kw, "out": np.zeros_like(x)})
                assert x.tobytes() == before.tobytes()
            else:
                got = clients[w].allreduce(x, **kw)
                assert got.dtype == np.float32 and x.tobytes() == before.tobytes()
            outs[w].append(got.copy())
    ts = [threading.Thread(target=run, args=(w,)) for w in range(nw)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for c in clients:
        c.close()
    assert all(len(o) == len(plan) for o in outs)
    return outs


def plan16(rng, nw: int, n: int) -> list:
    """test_codec's calls (predictions that hold and miss, exact calls, out
    the tensor or another array) with magnitudes fp16 holds, a NaN and a
    zero chunk, and each call's divisor."""
    count = codec.n_chunks(n, 256)
    plan = []
    for i, (_, kw) in enumerate(calls(rng, nw, n)):
        scale = np.repeat(2.0 ** rng.integers(-12, 6, count), 256)[:n] * (16 if i in (4, 7) else 1)
        xs = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(nw)]
        xs[1][2 * 256 + 5] = np.nan
        xs[0][3 * 256:4 * 256] = 0
        plan.append((xs, dict(kw, divide=(1, nw, 2)[i % 3])))
    return plan


@pytest.mark.parametrize("lanes", [32, 16])
@pytest.mark.parametrize("name", TYPES)
def test_client_sums_16_bit_tensors_as_the_float32_path_rounded_by_torch(dll, name, lanes):
    dtype, tdtype = TYPES[name]
    nw, n = 3, 16 * 256 + 77
    plan = plan16(np.random.default_rng(7), nw, n)
    to16 = lambda x: fixedpoint.narrow(x, dtype)        # noqa: E731
    runs = {}
    for label, fast, convert in (("float32", True, lambda x: fixedpoint.widen(to16(x)).copy()),
                                 ("C", True, to16), ("numpy", False, to16)):
        servers = start_aggregators(nw, 1, n)
        try:
            runs[label] = run_clients([s.port for s in servers], nw, plan, fast, lanes, convert)
        finally:
            for s in servers:
                s.stop()
    for w in range(nw):
        for i, (_, kw) in enumerate(plan):
            c, ref, f32 = runs["C"][w][i], runs["numpy"][w][i], runs["float32"][w][i]
            assert c.tobytes() == ref.tobytes(), f"worker {w} call {i}: C and numpy differ"
            assert c.tobytes() == runs["C"][0][i].tobytes(), f"call {i}: workers differ"
            if c.dtype == np.float32:       # no out: float32, as the float32 path's
                assert np.array_equal(bits(c), bits(f32)), f"call {i}"
            else:                           # the float32 path divides alike: its result, rounded by torch
                same_rounding(c, torch_rounded(f32, tdtype), f"worker {w} call {i}")
    assert all(np.isnan(fixedpoint.widen(r)).any() for r in runs["C"][0])      # a NaN chunk came through

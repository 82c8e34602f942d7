"""xagg.compress without processes: N ranks simulated by threads (ThreadGroup)."""
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch

from xagg.client import native
from xagg.compress import METHODS, ThreadGroup, bitmap, countsketch, get_compressor, mstopk, parse_spec
from xagg.compress.countsketch import CountSketch
from xagg.compress.ddp import HookState
from xagg.compress.fusion import layer_fusion
from xagg.compress.intsum import levels, pack, pow2_scale, unpack
from xagg.compress.lossless import MARGIN as LL_MARGIN
from xagg.compress.registry import split_specs
from xagg.compress.select import select
from xagg.compress.rng import bucket_hash, generator

N = 4
# auto picks dense or one of these per bucket (tests/test_compress_auto.py)
# int16 is the aggregators' 16-bit lanes, no torch compressor: tests/test_wire16*.py
COMPRESSED = [m for m in METHODS if m not in ("dense", "auto", "int16")]


def grads(n, ranks=N, seed=0, steps=3):
    g = torch.Generator().manual_seed(seed)
    # heavy-ish tails, like real gradients
    return [[torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4 for _ in range(ranks)]
            for _ in range(steps)]


def run(spec, gs, *, weight=None, layers=None, ranks=N, comps=None):
    """Every step through every rank; returns per step (outputs, residuals before, after)."""
    comps = comps or [get_compressor(spec) for _ in range(ranks)]

    def body(c):
        comp, hist = comps[c.rank], []
        for step, g in enumerate(gs):
            before = _copy(comp.memory.get("t"))      # residual buffers are reused from step to step
            out = comp.reduce("t", g[c.rank], step, c, weight=weight, layers=layers)
            # a result holds until the name's next reduce (a scratch buffer), a residual likewise
            hist.append((out.clone(), before, _copy(comp.memory.get("t"))))
        return hist, c.bytes_sent

    return ThreadGroup(ranks).run(body), comps


def _copy(t):
    return None if t is None else t.clone()


# -- registry -------------------------------------------------------------------

def test_registry_parses_specs_and_round_trips():
    assert parse_spec("rgc:ratio=0.02, warmup=5") == ("rgc", {"ratio": "0.02", "warmup": "5"})
    c = get_compressor("rgc:ratio=0.02,warmup=5")
    assert (c.ratio, c.warmup, c.min_size) == (0.02, 5, 1024)
    for m in METHODS:
        c = get_compressor(m)
        assert get_compressor(c.spec()) == c
    assert get_compressor("none").NAME == "dense"


def test_a_list_of_specs_keeps_each_methods_options_with_it():
    got = split_specs("rgc, sketch:ratio=0.1,cols=2,iwp:ratio=0.02,eps=2 ,none")
    assert got == ["rgc", "sketch:ratio=0.1,cols=2", "iwp:ratio=0.02,eps=2", "none"]
    assert [get_compressor(s).spec() for s in got[1:3]] == [get_compressor("sketch:cols=2,ratio=0.1").spec(),
                                                            get_compressor("iwp:eps=2,ratio=0.02").spec()]


@pytest.mark.parametrize("spec,msg", [
    ("nope", "unknown compressor 'nope'"),
    ("rgc:k=3", "rgc: unknown option 'k'"),
    ("rgc:ratio=abc", "rgc: option ratio='abc' is not a valid float"),
    ("rgc:ratio=2", "rgc: option ratio=2.0 must be in"),
    ("int8:warmup=-1", "int8: option warmup=-1 must be >= 0"),
    ("sketch:bits=4", "sketch: option bits=4 must be 8 or 16"),
    ("rgc:ratio", "is not opt=value"),
    ("rgc:ratio=0.1,ratio=0.2", "given twice"),
    (":ratio=1", "missing method name"),
])
def test_registry_errors_name_the_bad_part(spec, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        get_compressor(spec)


# -- residual accounting, identical results --------------------------------------

@pytest.mark.parametrize("method", COMPRESSED)
def test_residual_accounting_sent_plus_kept_is_accumulated(method):
    n = 50_000
    gs = grads(n)
    (res, _) = run(method, gs, weight=torch.randn(n))
    for step, g in enumerate(gs):
        outs = [r[0][step][0] for r in res]
        assert all(torch.equal(outs[0], o) for o in outs), "ranks disagree on the sum"
        before = sum(r[0][step][1] if r[0][step][1] is not None else torch.zeros(n) for r in res)
        after = sum(r[0][step][2] for r in res)
        # sum over ranks of (sent + kept) == sum over ranks of (residual + gradient)
        lhs, rhs = outs[0] + after, before + sum(g)
        assert torch.allclose(lhs, rhs, rtol=1e-5, atol=1e-5 * float(rhs.abs().max())), method
        assert outs[0].count_nonzero() > 0
        assert float(after.abs().sum()) > 0


@pytest.mark.parametrize("method", COMPRESSED)
def test_a_bucket_reuses_its_buffers_from_step_to_step(method):
    """A compressed bucket's result and scratch live in buffers kept for it
    (a fresh bucket-sized tensor page-faults every step): the second and
    third steps return the same storage, and what step 2 returned is the
    same sum as a fresh compressor's (the buffer is only reused, not stale)."""
    n, layers = 60_000, [30_000, 500, 29_500]          # a small middle layer: the split path
    gs = grads(n, steps=3)

    def body(c):
        comp = get_compressor(method)
        ptrs, outs = [], []
        for step, g in enumerate(gs):
            out = comp.reduce("t", g[c.rank], step, c, layers=layers, weight=torch.ones(n))
            ptrs.append(out.data_ptr())
            outs.append(out.clone())
        return ptrs, outs
    res = ThreadGroup(N).run(body)
    (fresh, _) = run(method, gs, weight=torch.ones(n), layers=layers)
    for ptrs, outs in res:
        assert ptrs[1] == ptrs[2], f"{method}: step 3's result is a fresh tensor"
        assert all(torch.equal(o, f[0]) for o, f in zip(outs, fresh[0][0]))


def test_a_sum_is_staged_in_a_tensor_kept_for_its_place_in_the_step():
    """exchange() stages a sum's parts (allreduce_sum may write over them):
    under a sum_key in one tensor kept from call to call (a fresh one
    page-faults every step), holding this call's parts; a new size, or no
    key, gets a fresh tensor."""
    from xagg.compress.calibrate import Loopback
    coll = Loopback(4)
    a, b = torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.float32) + 10
    coll.sum_key = ("bucket0", "torch.float32", "vals")
    first = coll.stage([a, b])
    assert torch.equal(first, torch.cat([a, b]))
    again = coll.stage([b * 2, a * 2])
    assert again is first and torch.equal(again, torch.cat([b, a]) * 2)
    assert torch.equal(a, torch.arange(5, dtype=torch.float32))     # the parts themselves untouched
    assert coll.stage([a]) is not first                              # another size
    coll.sum_key = None
    assert coll.stage([a, b]) is not coll.stage([a, b])


def test_control_parts_are_summed_apart_and_the_small_layers_ride_with_them():
    """A round's control sums (head-room bounds) go to allreduce_control as
    one sum, the gradient's to allreduce_sum; the bucket's small dense
    layers ride along with a round whose float sums are all control, in
    that same sum, and nothing but sums is a control part."""
    from xagg.compress.base import Part
    from xagg.compress.calibrate import Loopback

    class Routed(Loopback):
        def __init__(self):
            super().__init__(N)
            self.routes = []

        def allreduce_control(self, t):
            self.routes.append(("control", t.numel(), t.dtype))
            return Loopback.allreduce_sum(self, t)      # the base's sum, not the route recorded below

        def allreduce_sum(self, t):
            self.routes.append(("sum", t.numel(), t.dtype))
            return super().allreduce_sum(t)
    layers = [5000, 10, 3000]                               # the 10 go dense (min_size 1024)
    x = torch.randn(sum(layers), generator=torch.Generator().manual_seed(3))
    for spec in ("sketch", "int8"):
        coll = Routed()
        comp = get_compressor(spec)
        out = comp.reduce("b", x.clone(), 0, coll, layers=layers)
        first = [r for r in coll.routes if r[2] == torch.float32]
        # the first float round: the bounds and the 10 dense values in one control sum, no float sum apart
        assert first and all(r[0] == "control" for r in first), (spec, coll.routes)
        assert first[0][1] >= 10 and len(first) == 1, (spec, coll.routes)
        assert torch.allclose(out[5000:5010], x[5000:5010] * N), spec     # the dense layer's sum, as ever
        assert {r[0] for r in coll.routes if r[2] == torch.int32} == {"sum"}, (spec, coll.routes)
        assert coll.calls["sum"] == len(coll.routes)     # Loopback: a control sum is counted as a sum
    with pytest.raises(ValueError, match="control part is a sum"):
        Part("or", torch.zeros(1, dtype=torch.uint8), control=True)


def test_sparse_sums_land_at_their_layers_among_the_small_ones():
    # a sparse method's sum over the big layers is written straight into the bucket's
    # result: its indices (into the big layers' concatenation) move past the small layers
    from xagg.compress.base import Sparse, layer_runs, _to_layout
    layers = [5, 300, 2, 2, 400, 1, 250, 7]
    big = [sz >= 100 for sz in layers]
    runs = layer_runs(layers, big)
    n_big = sum(sz for sz, b in zip(layers, big) if b)
    idx = torch.tensor([0, 1, 299, 300, 301, 699, 700, 949, 500, 0])
    vals = torch.arange(1.0, 11.0)
    full = torch.zeros(sum(layers))
    mask = torch.cat([torch.full((sz,), b) for sz, b in zip(layers, big)])
    dense_big = Sparse(idx, vals, n_big, add=True).into(torch.zeros(n_big))
    full[mask] = dense_big                              # what assembling a dense result gives
    assert torch.equal(Sparse(idx, vals, n_big, add=True).into(torch.zeros(sum(layers)), runs), full)
    assert _to_layout(idx, runs).tolist() == mask.nonzero().squeeze(1)[idx].tolist()


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("divide", [1, 3])
def test_a_sparse_sum_is_written_by_the_compiled_pass_as_torch_writes_it(add, divide):
    # the compiled scatter (csrc/scatter.c) against torch's indexing, bit for bit: positions moved
    # past the small layers, repeated ones (ranks choosing alike) added in rank order, each divided once
    from xagg.compress.base import Sparse, layer_runs
    assert native.load() is not None, "no compiled library: the pass under test is not there"
    layers = [3, 5000, 7, 1, 8000, 2, 3000, 5]
    runs = layer_runs(layers, [sz >= 100 for sz in layers])
    n_big, g = 16000, torch.Generator().manual_seed(3)
    if add:     # four ranks' ascending picks, overlapping
        idx = torch.cat([torch.randperm(n_big, generator=g)[:4000].sort().values for _ in range(4)])
    else:
        idx = torch.randperm(n_big, generator=g)[:6000]
    vals = torch.randn(idx.numel(), generator=g) * 1e3
    sp = Sparse(idx, vals, n_big, add=add)
    seen = torch.zeros((sum(layers) + 7) // 8, dtype=torch.uint8)
    out = sp.into(torch.zeros(sum(layers)), runs, divide, seen)
    assert torch.equal(out, sp._into_torch(torch.zeros(sum(layers)), runs, divide))
    assert int(seen.sum()) == 0, "the marks were not cleared for the next sum"
    assert torch.count_nonzero(out) == idx.unique().numel()


@pytest.mark.parametrize("layers", [[60_000], [300, 40_000, 7, 20_000, 3]])
def test_int8s_sum_is_read_back_into_its_layers_divided_as_torch_does_it(layers, monkeypatch):
    # int8's summed lanes are read back straight into the bucket's result, past its small
    # layers and divided for DDP's mean, by the compiled pass: the same bits as the torch path,
    # which reads them back whole and divides after
    assert native.load() is not None, "no compiled library: the pass under test is not there"
    n = sum(layers)
    gs = grads(n, steps=3)

    def body(c):
        comp = get_compressor("int8:min_size=1000")
        return [comp.reduce("t", g[c.rank], step, c, layers=layers, mean=True).clone() for step, g in enumerate(gs)]
    got = ThreadGroup(N).run(body)
    monkeypatch.setattr(native, "load", lambda: None)
    want = ThreadGroup(N).run(body)
    for step in range(3):
        assert torch.equal(got[0][step].view(torch.int32), want[0][step].view(torch.int32))
        assert torch.equal(got[0][step], got[N - 1][step])
    # and it is the mean: within int8's rounding of the summed values
    mean = _ordered_sum(gs[0]) / N
    assert torch.allclose(got[0][0], mean, atol=float(mean.abs().max()) * 0.05)


def test_a_sparse_index_outside_its_tensor_is_refused_before_anything_is_written():
    from xagg.compress.base import Sparse
    out = torch.zeros(100)
    for bad in (100, -1):
        with pytest.raises(IndexError, match="outside its 100 elements"):
            Sparse(torch.tensor([5, bad]), torch.tensor([1.0, 2.0]), 100, add=True).into(out, divide=4)
        with pytest.raises(IndexError, match="outside its 100 elements"):
            Sparse(torch.tensor([5, bad]), torch.tensor([1.0, 2.0]), 100, add=True)._into_torch(out, None, 4)
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("method", COMPRESSED)
def test_stated_ratio_is_what_goes_on_the_wire(method):
    n = 200_000
    (res, comps) = run(method, grads(n, steps=2))
    sent = sum(r[1] for r in res) / N / 2
    stated = comps[0].ratio_for(n, N)
    # ThreadCollectives ORs bitmaps as 3-bit lanes of an int32 sum; torch sends 1 bit
    if method == "lossless":
        bitmap_extra = math.ceil(n / 10) * 4 - math.ceil(n / 8)
        sent -= bitmap_extra
    assert sent == pytest.approx(4 * n / stated, rel=0.02), (method, sent, stated)


# -- lossless ---------------------------------------------------------------------

def _lossless_expected(gs0, comp, n):
    """What the sum must be, computed without the bitmap, the table or peeling
    (the same selection: it is the aggregation that is under test)."""
    k = max(1, round(comp.ratio * n))
    idx = [select(g, k) for g in gs0]
    S = sum(float(g[i].abs().max()) for g, i in zip(gs0, idx))
    scale = pow2_scale(S * LL_MARGIN, 2**30)
    total = torch.zeros(n, dtype=torch.int64)
    for g, i in zip(gs0, idx):
        total.index_add_(0, i, torch.round(g[i] / scale).to(torch.int64))
    assert total.abs().max() < 2**31
    return total.to(torch.float32) * scale


@pytest.mark.parametrize("ratio", [0.005, 0.02, 0.05])     # unions of ~2 000 to ~20 000
def test_lossless_is_bit_exact_at_claimed_density(ratio):
    n = 100_000
    gs = grads(n, steps=1, seed=3)
    (res, comps) = run(f"lossless:ratio={ratio}", gs)
    out = res[0][0][0][0]
    assert torch.equal(out, _lossless_expected(gs[0], comps[0], n))
    assert comps[0].stats["union"] > 0.9 * N * round(ratio * n)     # supports barely overlap: the worst case
    assert comps[0].stats.get("fallback_indices", 0) == 0


def test_lossless_carries_its_scale_and_sums_exactly_in_one_round_after_the_first_step():
    n, ratio = 100_000, 0.01
    gs = grads(n, steps=4, seed=5)
    gs[2] = [g * 64 for g in gs[2]]                 # past the carried bound: clamped, the excess kept
    comps = [get_compressor(f"lossless:ratio={ratio}") for _ in range(N)]

    def body(c):
        hist = []
        for step, g in enumerate(gs):
            acc = g[c.rank] + (comps[c.rank].memory["t"] if "t" in comps[c.rank].memory else 0)
            scale = comps[c.rank].scales.get("t", (n, None))[1]
            sums = c.calls["sum"]
            out = comps[c.rank].reduce("t", g[c.rank], step, c).clone()
            hist.append((acc, scale, out, c.calls["sum"] - sums))
        return hist

    hist = ThreadGroup(N).run(body)
    k = round(ratio * n)
    for step in range(1, len(gs)):
        scale = hist[0][step][1]
        assert scale is not None and all(h[step][1] == scale for h in hist)
        limit = 2**30 // N
        total = torch.zeros(n, dtype=torch.int64)
        for h in hist:
            acc = h[step][0]
            i = select(acc, k)
            total.index_add_(0, i, torch.round(acc[i] / scale).clamp(-limit, limit).to(torch.int64))
        assert torch.equal(hist[0][step][2], total.to(torch.float32) * scale), step
        # the table with its exponent votes, and the bitmap (an int32 sum between threads): no scale round
        assert all(h[step][3] == 2 for h in hist)
    assert hist[0][0][3] == 3
    assert comps[0].stats["clamped"] > 0


def test_lossless_falls_back_exactly_when_the_union_is_too_dense_to_peel():
    n = 20_000
    gs = grads(n, steps=1, seed=4)
    # load 1.0: more union members per cell than 3-hash peeling can take (threshold ~1.23)
    (res, comps) = run("lossless:ratio=0.05,load=1.0", gs)
    assert comps[0].stats["fallback_indices"] > 0
    assert all(c.stats["fallback_indices"] == comps[0].stats["fallback_indices"] for c in comps)
    assert torch.equal(res[0][0][0][0], _lossless_expected(gs[0], comps[0], n))


# -- sketches and fixed point ---------------------------------------------------------

def test_sketch_of_sum_is_sum_of_sketches_bit_for_bit():
    n = 30_000
    g = torch.Generator().manual_seed(5)
    qs = [torch.randint(-2**20, 2**20, (n,), generator=g, dtype=torch.int32) for _ in range(N)]
    cs = CountSketch(n, 3, 700, seed=1, salt="lin")
    summed = sum(cs.sketch(q) for q in qs)
    assert summed.dtype == torch.int32
    assert torch.equal(summed, cs.sketch(sum(qs)))
    # and a float sketch is only approximately linear, which is why the wire uses integers
    xs = [q.float() * 1e-3 for q in qs]
    assert torch.allclose(sum(cs.sketch(x) for x in xs), cs.sketch(sum(xs)), rtol=1e-4, atol=1e-2)


def test_count_sketch_recovers_heavy_hitters(monkeypatch):
    n = 50_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.01
    hh = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:50]
    x[hh] = 5.0
    # 8000 cells a row: a non-hitter's median reads a hitter only if 3 of its 5 rows hit one of the
    # 50 with one sign, ~0.03 such indices expected (at 2000 cells, ~2: the test would pass by luck).
    # One table, the textbook sketch: blocks hold as much (test_compress_sketch_c) with other collisions
    monkeypatch.setattr(countsketch, "BLOCK_CELLS", 1 << 20)
    cs = CountSketch(n, 5, 8000, seed=0, salt="hh")
    assert cs.blocks == 1
    est = cs.query(cs.sketch(x))
    assert set(torch.topk(est.abs(), 50).indices.tolist()) == set(hh.tolist())


@pytest.mark.parametrize("bits", [8, 16])
def test_packed_lanes_sum_exactly_at_the_headroom_limit(bits):
    qmax, n = (1 << (bits - 1)) - 1, 1001
    alt = torch.where(torch.arange(n) % 2 == 0, 1, -1)      # neighbouring lanes at opposite extremes
    for sign in (1, -1):
        per = qmax // N
        qs = [torch.full((n,), sign * per) * alt for _ in range(N - 1)]
        qs.append(torch.full((n,), sign * (qmax - (N - 1) * per)) * alt)    # lane sums are exactly +-qmax
        words = sum(pack(q, bits).to(torch.int64) for q in qs)
        assert words.abs().max() < 2**31                      # an int32 sum, no wrap
        assert torch.equal(unpack(words.to(torch.int32), bits, n).long(), sum(qs))
    L = levels(bits, N)
    g = torch.Generator().manual_seed(bits)
    qs = [torch.randint(-L // N, L // N + 1, (n,), generator=g) for _ in range(N)]
    assert torch.equal(unpack(sum(pack(q, bits) for q in qs), bits, n).long(), sum(qs))


@pytest.mark.parametrize("residual", [True, False])
def test_the_int8_passes_compiled_give_torchs_bits(residual, monkeypatch):
    # client/csrc/int8.c against the torch expressions it stands for: the accumulation and
    # its chunks' maxima (NaN and inf included, a short last chunk), the quantisation with
    # what stays in the residual, and the summed words read back, on four ranks' values
    from xagg.compress import intsum
    assert native.load() is not None, "no compiled library: the passes under test are not there"
    n, chunk, L = 10_000 + 77, 1024, levels(8, N)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g) for _ in range(N)]
    r = torch.randn(n, generator=g) * 0.01 if residual else None
    odd = xs[0].clone()
    odd[5], odd[3000] = math.nan, math.inf                 # chunk 0's max is NaN, chunk 2's inf
    for x in xs:
        x[10] = -0.0                                        # -0 stays -0, in the sum and the residual
    if r is not None:
        r[10] = -0.0

    def both(f):
        got = f()
        monkeypatch.setattr(native, "load", lambda: None)
        want = f()
        monkeypatch.undo()
        return got, want
    for x in (odd, xs[0]):
        (acc, m), (acc_t, m_t) = both(lambda: (lambda o: (o, intsum.accumulate_amax(r, x, o, chunk)))(torch.empty(n)))
        assert torch.equal(acc.view(torch.int32), acc_t.view(torch.int32))     # NaN's bits too
        assert torch.allclose(m, m_t, rtol=0, atol=0, equal_nan=True) and m.numel() == -(-n // chunk)
        assert (m[0].isnan() and m[2].isinf()) == (x is odd)
    bound = sum(intsum.chunk_amax(x, chunk) for x in xs)
    scale = intsum.headroom_scale(bound, L)
    words, accs = [], []
    for x in xs:
        (w, a), (w_t, a_t) = both(lambda: (lambda a: (intsum.quantise_packed(a, scale, L, chunk), a))(x.clone()))
        assert torch.equal(w, w_t) and torch.equal(a.view(torch.int32), a_t.view(torch.int32))
        words.append(w)
        accs.append(a)
    total = sum(words)
    out, out_t = both(lambda: intsum.unpack_scaled(total, chunk, scale, torch.empty(n)))
    assert torch.equal(out.view(torch.int32), out_t.view(torch.int32))
    # a run of lanes read back on its own (starting inside a word and a chunk), divided: the
    # same bits as that run of the whole read-back divided after
    for start, count, divide in ((0, n, 4), (1023, 3001, 3), (4097, n - 4097, 1), (n - 1, 1, 4), (5, 0, 4)):
        run, run_t = both(lambda: intsum.unpack_scaled(total, chunk, scale, torch.empty(count), start, divide))
        assert torch.equal(run.view(torch.int32), run_t.view(torch.int32))
        assert torch.equal(run.view(torch.int32), (out[start:start + count] / divide).view(torch.int32))
    with pytest.raises(IndexError, match="past the"):
        intsum.unpack_scaled(total, chunk, scale, torch.empty(8), 4 * total.numel() - 7)
    # and it is the sum: every rank's value less what it kept, within the rounding of the lanes
    sent = sum(x - a for x, a in zip(xs, accs))
    assert torch.allclose(out, sent, rtol=1e-5, atol=float(scale.max()) * 1e-3)


def test_sixteen_bit_lanes_quantise_and_read_back_as_the_torch_expressions():
    # the sketch's cells in 16-bit lanes go through quantise_packed and unpack_scaled too: the same
    # rounding, packing and read-back as the torch expressions, and the sum of four ranks' words
    from xagg.compress import intsum
    n, chunk, L = 5_000 + 3, 1024, levels(16, N)
    g = torch.Generator().manual_seed(16)
    xs = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g) for _ in range(N)]
    scale = intsum.headroom_scale(sum(intsum.chunk_amax(x, chunk) for x in xs), L)
    qs = [torch.round(intsum.chunked(x, chunk) / scale[:, None]).clamp_(-L, L).reshape(-1)[:n] for x in xs]
    words = [intsum.quantise_packed(x.clone(), scale, L, chunk, bits=16) for x in xs]
    assert all(torch.equal(w, pack(q, 16)) for w, q in zip(words, qs)) and words[0].numel() == -(-n // 2)
    out = intsum.unpack_scaled(sum(words), chunk, scale, torch.empty(n), bits=16)
    want = (intsum.chunked(sum(qs), chunk) * scale[:, None]).reshape(-1)[:n]
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    with pytest.raises(IndexError, match="past the"):
        intsum.unpack_scaled(sum(words), chunk, scale, torch.empty(8), 2 * words[0].numel() - 7, bits=16)


@pytest.mark.parametrize("method", ["int8"])
def test_quantised_sum_of_identical_maxima_does_not_overflow(method):
    n = 4096
    x = torch.linspace(-3, 3, n)
    (res, comps) = run(method, [[x.clone() for _ in range(N)]])
    out = res[0][0][0][0]
    scale = float(x.abs().max()) * N * 1.001 / levels(comps[0].BITS, N)
    # identical inputs round identically: N half-steps at most; an overflow would be ~2**bits steps
    assert (out - N * x).abs().max() <= N * scale / 2 * 1.0001, "a lane overflowed or the scale is wrong"


def test_hashes_do_not_depend_on_the_process():
    code = ("from xagg.compress.rng import bucket_hash;c,s=bucket_hash(1000,97,3,7,'x');"
            "print(int(c.long().sum()), int(s.sum()))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(h))).stdout for h in (1, 2)}
    c, s = bucket_hash(1000, 97, 3, 7, "x")
    assert outs == {f"{int(c.long().sum())} {int(s.sum())}\n"}


def test_hash_fills_the_table_evenly():
    c, s = bucket_hash(200_000, 17_867, 3, 11, "even")
    for r in range(3):
        counts = torch.bincount(c[r].long() - r * 17_867, minlength=17_867).float()
        assert counts.min() > 0 and counts.std() < 2 * counts.mean().sqrt()
        assert abs(float(s[r].mean())) < 0.01


# -- MSTopK -----------------------------------------------------------------------------

@pytest.mark.parametrize("dist", ["normal", "heavy", "ties", "zeros", "small"])
@pytest.mark.parametrize("iters", [8, 24])
def test_mstopk_returns_k_within_the_band(dist, iters):
    n = 300_000 if dist != "small" else 1000
    g = torch.Generator().manual_seed(iters)
    x = {"normal": lambda: torch.randn(n, generator=g),
         "heavy": lambda: torch.randn(n, generator=g) / torch.rand(n, generator=g),
         "ties": lambda: torch.randint(-5, 6, (n,), generator=g).float(),
         "zeros": lambda: torch.zeros(n),
         "small": lambda: torch.randn(n, generator=g)}[dist]()
    for k in (1, n // 1000 or 3, n // 100, n // 3):
        info = {}
        idx = mstopk(x, k, iters=iters, info=info)
        assert idx.numel() == k and idx.unique().numel() == k
        a = x.abs()
        tk = float(torch.topk(a, k).values.min())        # exact top-k threshold
        if info["exact"]:
            assert float(a[idx].min()) == tk
            continue
        band = (info["hi0"] - info["lo0"]) * 2.0 ** -iters
        assert info["hi"] - info["lo"] <= band * (1 + 1e-9)
        ulp = 1e-6 * float(a.max())                          # thresholds are compared in float32
        assert float(a[idx].min()) >= tk - band - ulp       # nothing much smaller than the k-th largest
        missed = torch.ones(n, dtype=torch.bool)
        missed[idx] = False
        assert not bool((a[missed] > tk + band + ulp).any())   # nothing much larger left out


def test_mstopk_and_topk_selectors_agree_on_distinct_values():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    exact = set(torch.topk(x.abs(), 1000).indices.tolist())
    assert set(mstopk(x, 1000, iters=40).tolist()) == exact


# -- LayerFusion --------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[10], [5, 5, 5], [1, 100, 1, 1, 3], [100, 1, 1], [3, 3, 3, 10, 2],
                                   [16384, 256, 65536, 256, 2560, 10]])
def test_layer_fusion_units_are_contiguous_and_at_least_the_largest_layer(sizes):
    units = layer_fusion(sizes)
    assert units[0][0] == 0 and sum(ln for _, ln in units) == sum(sizes)
    assert all(a[0] + a[1] == b[0] for a, b in zip(units, units[1:]))
    bounds = {sum(sizes[:i]) for i in range(len(sizes) + 1)}
    assert all(off in bounds for off, _ in units), "a unit splits a layer"
    assert all(max(sizes) <= ln < 3 * max(sizes) for _, ln in units)
    assert layer_fusion([5, 5, 5]) == [(0, 5), (5, 5), (10, 5)]
    assert layer_fusion([1, 100, 1, 1, 3]) == [(0, 106)]


def test_layer_fusion_rejects_empty_layers():
    with pytest.raises(ValueError, match="positive"):
        layer_fusion([3, 0])


# -- the features users ask for ---------------------------------------------------------------

@pytest.mark.parametrize("method", COMPRESSED)
def test_warmup_is_dense_and_exact(method):
    n = 5000
    gs = grads(n, steps=3)
    (res, comps) = run(f"{method}:warmup=2", gs)
    for step in range(2):
        assert torch.equal(res[0][0][step][0], _ordered_sum([g for g in gs[step]]))
    assert "t" in comps[0].memory and not torch.equal(res[0][0][2][0], _ordered_sum(gs[2]))


def _ordered_sum(xs):
    out = xs[0].clone()
    for x in xs[1:]:
        out += x
    return out


@pytest.mark.parametrize("method", COMPRESSED)
def test_small_layers_go_uncompressed(method):
    layers = [300, 40_000, 7, 20_000]
    n = sum(layers)
    gs = grads(n, steps=2)
    (res, _) = run(f"{method}:min_size=1000", gs, layers=layers, weight=torch.randn(n) + 2)
    small = torch.zeros(n, dtype=torch.bool)
    small[:300] = True
    small[40_300:40_307] = True
    for step in range(2):
        out = res[0][0][step][0]
        assert torch.equal(out[small], _ordered_sum(gs[step])[small])
        assert res[0][0][step][2].numel() == n - 307          # residuals only for compressed layers


@pytest.mark.parametrize("method", COMPRESSED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_amp_half_gradients_keep_fp32_residuals(method, dtype):
    n = 8000
    gs = [[g.to(dtype) for g in step] for step in grads(n, steps=2)]
    (res, comps) = run(method, gs)
    assert res[0][0][1][0].dtype == dtype
    assert comps[0].memory["t"].dtype == torch.float32


@pytest.mark.parametrize("method", COMPRESSED)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("at", [0, 1])
def test_nonfinite_on_one_rank_gives_nan_everywhere_and_keeps_residuals(method, bad, at):
    """At step 0 (a method's first rounds: lossless's scale) and at step 1."""
    n = 6000
    gs = grads(n, steps=3)
    gs[at][2][17] = bad
    (res, comps) = run(method, gs)
    for r in res:
        assert torch.isnan(r[0][at][0]).all()
        if at:
            assert torch.equal(r[0][at][1], r[0][at][2]), "residual changed on a skipped step"
        assert torch.isfinite(r[0][at + 1][0]).all()
    assert all(c.stats["nonfinite_steps"] == 1 for c in comps)


def test_iwp_broadcasting_rank_is_shared_and_varies():
    from xagg.compress.rng import choice
    picks = [choice(N, 0, step, "bucket0") for step in range(64)]
    assert set(picks) == set(range(N))
    # the same draw from any rank: it only depends on (seed, step, name)
    assert picks == [choice(N, 0, step, "bucket0") for step in range(64)]


def test_iwp_uses_importance_not_magnitude():
    n = 10_000
    g = torch.ones(n)
    w = torch.full((n,), 100.0)
    w[:50] = 0.001          # tiny weights: largest relative change
    g[5000:5050] = 3.0      # largest magnitude, but on big weights
    (res, _) = run("iwp:ratio=0.005,eps=0.0001", [[g.clone() for _ in range(N)]], weight=w)
    assert set(res[0][0][0][0].nonzero().squeeze(1).tolist()) == set(range(50))


def test_rgc_sends_the_largest_entries():
    n = 20_000
    gs = grads(n, steps=1)
    (res, _) = run("rgc:ratio=0.001", gs)
    expect = torch.zeros(n)
    for g in gs[0]:
        i = torch.topk(g.abs(), 20).indices
        expect.index_add_(0, i, g[i])
    assert torch.allclose(res[0][0][0][0], expect)


# -- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("method", COMPRESSED)
def test_state_dict_resumes_exactly(method):
    n = 12_000
    gs = grads(n, steps=4)
    (full, _) = run(method, gs)
    (first, comps) = run(method, gs[:2])
    saved = [c.state_dict() for c in comps]
    fresh = [get_compressor(method) for _ in range(N)]
    for c, sd in zip(fresh, saved):
        c.load_state_dict(pickle.loads(pickle.dumps(sd)))

    def body(c):
        return [fresh[c.rank].reduce("t", gs[s][c.rank], s, c).clone() for s in (2, 3)]
    resumed = ThreadGroup(N).run(body)
    for s in (0, 1):
        assert torch.equal(resumed[0][s], full[0][0][2 + s][0])


def test_state_dict_refuses_another_method():
    sd = get_compressor("rgc").state_dict()
    with pytest.raises(ValueError, match="state is for 'rgc"):
        get_compressor("int8").load_state_dict(sd)


def test_hook_state_pickles_with_residuals_and_step():
    st = HookState(get_compressor("sketch:ratio=0.05"))
    st.step = 7
    st.compressor.memory["bucket0"] = torch.arange(5.0)
    back = pickle.loads(pickle.dumps(st))
    assert back.step == 7 and back.compressor == st.compressor
    assert torch.equal(back.compressor.memory["bucket0"], torch.arange(5.0))
    assert back._collectives is None


# -- collectives -------------------------------------------------------------------------------

@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 8])
def test_or_through_a_sum_only_transport(ranks, compiled, monkeypatch):
    """Lanes of world_size.bit_length() bits (8 ranks: 4 bits, 8 a word), n
    not a multiple of them; the compiled packing (client/csrc/orlanes.c)
    and the torch reference put the same words on the wire."""
    if not compiled:
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("no C compiler")
    n = 1003
    g = torch.Generator().manual_seed(ranks)
    flags = [torch.rand(n, generator=g) < 0.1 for _ in range(ranks)]
    flags[0][-1] = True          # the last, partial word carries a one

    def body(c):
        return c.allreduce_or(bitmap.pack(flags[c.rank])), dict(c.calls), c.bytes_sent
    res = ThreadGroup(ranks).run(body)
    expect = torch.stack(flags).any(0)
    assert all(torch.equal(bitmap.unpack(r[0], n), expect) for r in res)
    assert all(not bool(bitmap.unpack(r[0], 8 * r[0].numel())[n:].any()) for r in res)    # padding stays clear
    assert res[0][1] == {"sum": 1}
    assert res[0][2] == 4 * -(-8 * -(-n // 8) // (32 // ranks.bit_length()))


def test_or_takes_only_a_bitmap():
    def body(c):
        return c.allreduce_or(torch.ones(9, dtype=torch.bool))
    with pytest.raises(TypeError, match="a bitmap"):
        ThreadGroup(2).run(body)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("n", [1, 8, 63, 64, 65, 1003])
def test_bitmap_sets_and_lists_its_members(n, compiled, monkeypatch):
    """The compiled bitmap (client/csrc/orlanes.c) and numpy's: the same
    bytes for the same indices, members ascending, set twice is set once."""
    if not compiled:
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(n)
    idx = torch.randint(0, n, (max(1, n // 3),), generator=g)
    idx[0] = n - 1                      # the last index, in a partial byte where n is not a multiple of 8
    bits = bitmap.set_bits(bitmap.empty(n), idx)
    assert bits.numel() == -(-n // 8)
    assert torch.equal(bits, bitmap.pack(torch.zeros(n, dtype=torch.bool).index_fill_(0, idx, True)))
    assert torch.equal(bitmap.members(bits), idx.unique())


def test_lossless_sums_the_same_bits_with_and_without_a_compiler(monkeypatch):
    """The compiled bitmap, cell map and peel against numpy's and torch's,
    through whole sums: a step's scale round, then the carried scale's."""
    gs = grads(50_000, steps=3)

    def body(c):
        comp = get_compressor("lossless")
        return [comp.reduce("t", g[c.rank], step, c).clone() for step, g in enumerate(gs)]
    got = ThreadGroup(N).run(body)
    monkeypatch.setattr(native, "load", lambda: None)
    want = ThreadGroup(N).run(body)
    for step in range(3):
        assert torch.equal(got[0][step], want[0][step]) and torch.equal(got[0][step], got[N - 1][step])
        assert torch.count_nonzero(got[0][step]) > N * 500 // 2      # a union of four ranks' top 1%, not one's


def test_thread_group_surfaces_errors_without_hanging():
    def body(c):
        if c.rank == 1:
            raise RuntimeError("rank 1 broke")
        return c.allreduce_sum(torch.ones(3))
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        ThreadGroup(3).run(body)


def test_sum_rejects_other_dtypes():
    def body(c):
        return c.allreduce_sum(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or int32"):
        ThreadGroup(1).run(body)


def test_residuals_follow_parameters_when_ddp_regroups_buckets():
    st = HookState(get_compressor("rgc:min_size=10"))
    mem = st.compressor.memory
    st.relayout("bucket0", ["a", "b", "c"], [20, 5, 30])
    mem["bucket0"] = torch.cat([torch.full((20,), 1.0), torch.full((30,), 3.0)])   # b is small: dense
    st.relayout("bucket1", ["d"], [40])
    mem["bucket1"] = torch.full((40,), 4.0)
    st.step = 1                                   # DDP rebuilds: new order, new grouping
    st.relayout("bucket0", ["d", "c"], [40, 30])
    assert torch.equal(mem["bucket0"], torch.cat([torch.full((40,), 4.0), torch.full((30,), 3.0)]))
    st = pickle.loads(pickle.dumps(st))           # a checkpoint between two buckets of one step
    mem = st.compressor.memory
    st.relayout("bucket1", ["b", "a", "e"], [5, 20, 12])
    assert torch.equal(mem["bucket1"], torch.cat([torch.full((20,), 1.0), torch.zeros(12)]))
    assert st.stash == {}
    st.step = 2                                   # unchanged layouts: nothing moves
    before = dict(mem)
    st.relayout("bucket0", ["d", "c"], [40, 30])
    st.relayout("bucket1", ["b", "a", "e"], [5, 20, 12])
    assert all(mem[k] is before[k] for k in before)


def test_amax_is_the_largest_magnitude_without_a_temporary():
    from xagg.compress.intsum import amax
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(10_001, generator=g), -torch.rand(7, generator=g), torch.tensor([0.0, -0.0]),
              torch.tensor([1.0, -math.inf, 2.0])):
        assert torch.equal(amax(x), x.abs().max())
    assert amax(torch.tensor([1.0, math.nan, -3.0])).isnan()


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"auto"}))     # auto: its methods' reduce
def test_the_mean_is_the_sum_divided_bit_for_bit(method):
    """reduce(mean=True) divides where it writes (a sparse sum's values, the
    small layers as they are copied in): the same bits as the sum divided
    afterwards, on the warm-up's dense path, the split path and whole."""
    from xagg.compress.calibrate import Loopback
    from xagg.compress.rng import choice
    g = torch.Generator().manual_seed(len(method))
    for layers in ([3000, 20, 9000, 7, 4000], [6000, 9000]):
        summed, meaned = get_compressor(method), get_compressor(method)
        for c in (summed, meaned):
            c.min_size, c.warmup = 100, 1
        for step in range(3):
            x = torch.randn(sum(layers), generator=g) * 1e-2
            w = torch.randn(sum(layers), generator=g)
            rank = choice(3, 0, step, "b")      # iwp's broadcaster: a loopback holds every rank's tensor
            want = summed.reduce("b", x, step, Loopback(3, rank), layers=layers, weight=w).clone()
            got = meaned.reduce("b", x, step, Loopback(3, rank), layers=layers, weight=w, mean=True)
            assert torch.equal(got, want.div_(3)), (method, layers, step)


@pytest.mark.parametrize("method", ["iwp", "int8"])
@pytest.mark.parametrize("shape", ["compressed", "split", "dense"])
def test_redo_computes_the_result_again_from_the_last_sum_redone_in_place(shape, method):
    """What settle() relies on when it redoes a deferred last-round sum over
    gloo: ``redo()`` reads the sum tensor as it is now. Every path of the
    loop: one compressed tensor (every layer at least min_size), small
    layers summed dense beside it, and a dense step (warmup)."""
    from xagg.compress.calibrate import Loopback
    from xagg.compress.rng import choice

    class Kept(Loopback):
        def _sum(self, t):
            self.put, self.last, self.deferred = t.clone(), super()._sum(t), self.final_round
            return self.last
    n = 40_000
    layers = {"compressed": [n], "split": [n - 100, 100], "dense": [n]}[shape]
    opts = {"iwp": "ratio=0.05,", "int8": ""}[method]
    comp = get_compressor(f"{method}:{opts}warmup={int(shape == 'dense')}")
    coll = Kept(4, choice(4, 0, 0, "b"))     # the rank that picks iwp's indices (a loopback's others have none)
    x, w = torch.randn(n, generator=torch.Generator().manual_seed(3)), torch.randn(n)
    out = comp.reduce("b", x, 0, coll, layers=layers, weight=w, mean=True).clone()
    assert coll.deferred, "the last sum was not marked final: its agreement cannot wait for the step's"
    coll.last.zero_()                   # another sum in its place: the result follows it
    assert not torch.equal(comp.redo(), out)
    coll.last.copy_(coll._sum(coll.put))    # as settle() redoes it: the sum of what was put, in place
    assert torch.equal(comp.redo(), out)

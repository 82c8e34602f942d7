"""The compiled top-k pass (client/csrc/select.c) against its torch
reference (xagg/compress/select.py): the same residual update, the same
indices in the same order, the same values, bit for bit, on the inputs that
take each of its paths (sampled threshold, a sample that lied, everything a
candidate, ties, importance weights, infinities)."""
import math

import pytest
import torch

from xagg.client import native
from xagg.compress import get_compressor
from xagg.compress.select import reference_topk_update, select, topk_update

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the reference is all there is")


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _heavy(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (5_000, 50), (300_000, 3_000), (300_000, 15_000), (300_000, 150_000),
                                 (1_000_000, 1), (1_000_000, 1_000_000)])
@pytest.mark.parametrize("weighted", [False, True])
def test_compiled_pass_equals_the_reference(n, k, weighted):
    r, g = 0.1 * _heavy(n, 1), _heavy(n, 2)
    kw = {"weight": _heavy(n, 3), "c": 0.25} if weighted else {}
    got = topk_update(r, g, k, seed=7, **kw)
    _same(got, reference_topk_update(r, g, k, **kw))
    acc, idx, vals = got
    assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
    assert bool((acc[idx] == 0).all())


def test_result_does_not_depend_on_the_sample():
    r, g = _heavy(500_000, 4), _heavy(500_000, 5)
    outs = [topk_update(r, g, 5_000, seed=s) for s in range(4)]
    for o in outs[1:]:
        _same(o, outs[0])


def test_select_leaves_its_input_as_it_was():
    # the compiled pass writes its acc back into the input (no copy): the same bits
    x = _heavy(300_000, 6)
    x[::1000] = -x[::1000]
    before = x.clone()
    idx = select(x, 3_000)
    assert torch.equal(x, before)
    assert torch.equal(idx, reference_topk_update(None, before, 3_000, zero_sent=False)[1])


def test_ties_go_to_the_lowest_indices():
    g = torch.zeros(400_000)
    g[::7] = 1.0                    # 57 143 equal keys, 5 000 of them taken
    acc, idx, vals = topk_update(None, g, 5_000)
    assert torch.equal(idx, torch.arange(0, 7 * 5_000, 7))
    _same((acc, idx, vals), reference_topk_update(None, g, 5_000))


def test_a_sample_that_lied_costs_a_pass_not_the_result():
    # all the mass in a band the sample is unlikely to hit
    g = torch.full((1_000_000,), 1e-3)
    g[123_456:123_456 + 2_000] = torch.linspace(1.0, 2.0, 2_000)
    acc, idx, vals = topk_update(None, g, 10_000)
    _same((acc, idx, vals), reference_topk_update(None, g, 10_000))
    assert bool((acc[123_456:123_456 + 2_000] == 0).all())


def test_infinities_are_selected_first():
    g = _heavy(300_000, 6)
    g[[5, 77_777, 299_999]] = torch.tensor([math.inf, -math.inf, math.inf])
    idx = select(g, 3)
    assert idx.tolist() == [5, 77_777, 299_999]


def test_k_zero_is_the_update_alone_and_out_is_written():
    r, g = _heavy(100_000, 8), _heavy(100_000, 9)
    out = torch.empty(100_000)
    acc, idx, vals = topk_update(r, g, 0, out=out)
    assert acc.data_ptr() == out.data_ptr() and idx.numel() == vals.numel() == 0
    assert torch.equal(acc, r + g)


def test_bad_k_and_dtype_are_named():
    with pytest.raises(ValueError, match="k=11 must be in"):
        topk_update(None, torch.zeros(10), 11)
    with pytest.raises(TypeError, match="float32"):
        topk_update(None, torch.zeros(10, dtype=torch.float64), 1)


def test_residual_buffers_alternate_and_survive_a_rollback():
    """Two steps write acc into the residual kept two steps before, never into
    the one being read; a rolled-back step's residual is never overwritten."""
    comp = get_compressor("rgc:ratio=0.01")
    g = _heavy(100_000, 10)
    a1, _, _ = comp.accumulate_topk("t", g, 1_000, 0)
    comp.keep("t", a1)
    a2, _, _ = comp.accumulate_topk("t", g, 1_000, 1)
    assert a2.data_ptr() != a1.data_ptr()
    comp.keep("t", a2)
    a3, _, _ = comp.accumulate_topk("t", g, 1_000, 2)
    assert a3.data_ptr() == a1.data_ptr()           # the spare, reused
    comp.memory["t"] = a2                           # a rollback: a2 stays the residual
    comp.spare["t"] = a2
    kept = a2.clone()
    a4, _, _ = comp.accumulate_topk("t", g, 1_000, 3)
    assert a4.data_ptr() != a2.data_ptr() and torch.equal(a2, kept)

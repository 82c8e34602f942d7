"""The compiled count-sketch (client/csrc/sketch.c) against its torch
reference (countsketch.py): the same table and the same mean estimates, bit
for bit, so every rank's sketch adds up as the reference's would."""
import math

import pytest
import torch

from xagg.client import native
from xagg.compress import countsketch
from xagg.compress.countsketch import CountSketch
from xagg.compress.rng import CELL, blocked, cells_at_reference, hash_codes
from xagg.compress.select import reference_topk_update

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the reference is all there is")


@pytest.mark.parametrize("n,rows,width", [(1, 1, 1), (1000, 3, 17), (300_000, 3, 4_000), (100_000, 5, 999)])
def test_compiled_sketch_and_query_equal_the_reference(n, rows, width):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    cs = CountSketch(n, rows, width, 0, f"c/{n}")
    table = cs.sketch(x)
    assert torch.equal(table, cs.sketch_reference(x, torch.zeros(cs.size)))
    summed = table * 4                      # as if summed over ranks
    assert torch.equal(cs.query(summed, "mean"), cs.query_reference(summed, "mean"))
    assert torch.equal(cs.query(summed, "median"), cs.query_reference(summed, "median"))


@pytest.mark.parametrize("n,rows,width,k", [(1000, 1, 50, 40), (300_000, 1, 18_000, 15_000),
                                             (300_000, 3, 6_000, 15_000), (200_000, 1, 3, 70_000)])
def test_heavy_hitters_selected_off_the_table_are_the_reference_top_k(n, rows, width, k):
    """The compiled pass that selects while it estimates picks what a stable
    sort of the reference's estimates picks: the sampled floor (large n) and
    the exact pass (small n) alike, and ties (width 3: a third of the
    estimates each) to the lowest indices."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    cs = CountSketch(n, rows, width, 0, f"hh/{n}")
    table = cs.sketch(x) * 3
    want = reference_topk_update(None, cs.query_reference(table, "mean"), k, zero_sent=False)[1]
    got = cs.heavy_hitters(table, k, "mean")
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(cs.heavy_hitters(table, k, "median"),
                       reference_topk_update(None, cs.query_reference(table, "median"), k, zero_sent=False)[1])


@pytest.mark.parametrize("n,width,k", [(1, 1, 1), (5000, 1, 4999), (200_000, 4_000, 1), (200_000, 4_000, 200_000),
                                       (300_000, 18_000, 15_000), (300_000, 18_000, 150_000)])
def test_one_row_heavy_hitters_selected_over_the_cells_are_the_reference_top_k(n, width, k):
    """One row: every member of a cell shares its estimate, and the selection
    over the cells (each weighted by its members) picks what a stable sort
    of the estimates picks, with many cells tied at the k-th key (the table
    rounded to a few levels, zeros among them) going to the lowest indices."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g)
    cs = CountSketch(n, 1, width, 0, f"cells/{n}")
    start, members = cs._members()
    assert start[0] == 0 and start[-1] == n and bool((start[1:] >= start[:-1]).all())
    cell_of = torch.repeat_interleave(torch.arange(width), start[1:] - start[:-1])
    assert torch.equal(cs.cells[0][members.long()].long(), cell_of)     # each member is in its cell
    for table in (cs.sketch(x), torch.round(cs.sketch(x) / 4)):
        want = reference_topk_update(None, cs.query_reference(table, "mean"), k, zero_sent=False)[1]
        assert torch.equal(cs.heavy_hitters(table, k, "mean"), want)
        assert torch.equal(cs.heavy_hitters(table, k, "median"), want)     # one row: the same estimate


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_accumulating_sketches_and_bounds_as_the_three_passes_do(rows, residual, compiled, monkeypatch):
    n = 50_000
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(n, generator=g)
    r = torch.randn(n, generator=g) * 1e-3 if residual else None
    cs = CountSketch(n, rows, 1_000, 0, "acc")
    if not compiled:            # the torch path, where no C compiler is
        monkeypatch.setattr(native, "load", lambda: None)
    acc, table = torch.full((n,), 7.0), torch.zeros(cs.size)
    bound = cs.accumulate(r, x, acc, table)
    want = x + r if residual else x
    assert torch.equal(acc, want)
    assert torch.equal(table, cs.sketch_reference(want, torch.zeros(cs.size)))
    assert bound == float(want.abs().max())
    # a NaN or an infinity anywhere is in the bound, which is how the ranks learn of it
    for bad, check in ((math.nan, math.isnan), (math.inf, math.isinf)):
        y = x.clone()
        y[n // 2] = bad
        assert check(cs.accumulate(r, y, acc, torch.zeros(cs.size)))


def test_a_table_past_the_cache_is_cut_into_blocks_of_equal_shares():
    """10M indices onto 1.5M cells (the wide model's 9.4M layer at about
    the sketch's default width) are hashed in blocks whose tables fit L1."""
    cs = CountSketch(10_000_000, 1, 1_500_000, 0, "rule")
    assert cs.blocks == math.ceil(1_500_000 / countsketch.BLOCK_CELLS) and cs.width % cs.blocks == 0
    assert cs.width // cs.blocks <= countsketch.BLOCK_CELLS and cs.width >= 1_500_000
    assert countsketch.BLOCK_CELLS * 4 <= 32 * 1024       # float32 cells within a 32 KB L1d
    odd = CountSketch(1_000_003, 3, 100_001, 0, "odd")       # 3 rows of 100k: a block each row's share
    assert odd.blocks == math.ceil(3 * 100_001 / countsketch.BLOCK_CELLS)
    assert odd.width % odd.blocks == 0 and odd.width >= 100_001
    assert CountSketch(5_000, 1, countsketch.BLOCK_CELLS, 0, "fits").blocks == 1


@pytest.mark.parametrize("rows", [1, 3])
def test_a_blocked_map_is_the_reference_and_keeps_each_block_in_its_share(rows, monkeypatch):
    """Blocks small enough to have many: the compiled table, estimates,
    accumulation and heavy hitters equal the torch reference over the same
    map, and every index lands in its block's share of every row."""
    monkeypatch.setattr(countsketch, "BLOCK_CELLS", 4_096)
    n, width, k = 300_000, 18_000, 15_000
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    cs = CountSketch(n, rows, width, 0, f"blocks/{rows}")
    assert cs.blocks == math.ceil(rows * width / 4_096)
    for o, ln, at, wb in blocked(n, cs.width, cs.blocks):
        for r in range(rows):
            c = cs.cells[r][o:o + ln]
            assert int(c.min()) >= r * cs.width + at and int(c.max()) < r * cs.width + at + wb
    table, acc = torch.zeros(cs.size), torch.empty(n)
    cs.accumulate(None, x, acc, table)
    assert torch.equal(table, cs.sketch_reference(x, torch.zeros(cs.size)))
    assert torch.equal(cs.sketch(x), table)
    summed = table * 4
    assert torch.equal(cs.query(summed, "mean"), cs.query_reference(summed, "mean"))
    want = reference_topk_update(None, cs.query_reference(summed, "mean"), k, zero_sent=False)[1]
    assert torch.equal(cs.heavy_hitters(summed, k, "mean"), want)


def test_blocks_pick_heavy_hitters_as_well_as_one_table(monkeypatch):
    """The same cells in blocks find as much of the top k's mass as one
    table does: blocking moves where collisions fall, not how many."""
    n = 400_000
    g = torch.Generator().manual_seed(5)
    rows_scale = torch.rand(n // 1000, generator=g).pow(3).repeat_interleave(1000)   # rows of unequal size
    x = torch.randn(n, generator=g) * rows_scale
    k = n // 20
    best = float(x.abs().topk(k).values.pow(2).sum())

    def captured(cap):
        monkeypatch.setattr(countsketch, "BLOCK_CELLS", cap)
        cs = CountSketch(n, 1, 24_000, 0, f"mass/{cap}")
        return cs.blocks, float(x[cs.heavy_hitters(cs.sketch(x), k)].pow(2).sum()) / best
    (one, whole), (many, parts) = captured(1 << 20), captured(1_000)
    assert one == 1 and many == 24
    assert parts > 0.9 * whole > 0.05


@pytest.mark.parametrize("width,rows", [(1, 1), (97, 3), (17_867, 3), (2**31 // 3 - 1, 3)])
def test_compiled_hashes_equal_the_reference(width, rows):
    g = torch.Generator().manual_seed(width)
    idx = torch.cat([torch.arange(1000), torch.randint(0, 2**40, (5000,), generator=g), torch.tensor([2**63 - 1])])
    codes = hash_codes(idx, idx.numel(), width, rows, 3, "h")       # the cell, its sign in the top bit
    cells, signs = codes & CELL, torch.where(codes < 0, -1.0, 1.0)
    ref_c, ref_s = cells_at_reference(idx, width, rows, 3, "h")
    assert torch.equal(cells, ref_c) and torch.equal(signs, ref_s)
    for r in range(rows):
        assert int(cells[r].min()) >= r * width and int(cells[r].max()) < (r + 1) * width


def test_a_width_past_int32_cells_is_refused():
    with pytest.raises(ValueError, match="hash width"):
        hash_codes(torch.arange(3), 3, 2**31, 1, 0, "w")


@pytest.mark.parametrize("k", [0, 1, 5_000])
def test_sending_from_the_residual_equals_the_torch_passes(k, monkeypatch):
    """send_from (client/csrc/residual.c): the values at the indices,
    quantised (ties to even, the clamp hit on some) and taken out of the
    residual, the same bits as the torch reference."""
    from xagg.compress.intsum import send_from
    g = torch.Generator().manual_seed(k)
    n = 20_000
    acc = torch.randn(n, generator=g)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    scale = torch.rand(k, generator=g) * 0.02 + 1e-4
    if k > 10:                  # ties to even (exact: a power-of-two scale), one far past L
        scale[:4] = 2.0 ** -7
        acc[idx[:4]] = torch.tensor([2.5, -2.5, 3.5, 1e6]) * 2.0 ** -7
    want_acc = acc.clone()
    monkeypatch.setattr(native, "load", lambda: None)
    want_q = send_from(want_acc, idx, scale, 63)
    monkeypatch.undo()
    got_q = send_from(acc, idx, scale, 63)
    assert torch.equal(got_q, want_q) and torch.equal(acc, want_acc)
    if k > 10:
        assert got_q[:4].tolist() == [2.0, -2.0, 4.0, 63.0]

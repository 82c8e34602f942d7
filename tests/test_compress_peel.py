"""The compiled peeling (client/csrc/peel.c) against its torch reference
(lossless.peel_reference): the same solved members and the same values,
where the table is sized for the union and where it is too dense to peel
whole (the stuck core must be the same, since the fallback round sums it)."""
import pytest
import torch

from xagg.client import native
from xagg.compress.lossless import cell_map, peel, peel_reference, table_cells

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the reference is all there is")


@pytest.mark.parametrize("members,load", [(20_000, 1.3), (20_000, 1.0), (200, 1.3), (1, 1.3)])
def test_compiled_peel_equals_the_reference(members, load):
    n = 400_000
    cells = table_cells(n, members, 1, load)
    g = torch.Generator().manual_seed(members)
    union = torch.randperm(n, generator=g)[:int(members * 1.25)].sort().values   # denser than the table's sizing
    cmap = cell_map(union, cells, 0, f"peel/{members}/{load}")
    vals = torch.randint(-2**31, 2**31, (union.numel(),), generator=g, dtype=torch.int64).to(torch.int32)
    table = torch.zeros(cells, dtype=torch.int32)
    table.index_add_(0, cmap.reshape(-1), vals.repeat(3))   # wraps modulo 2**32
    got_v, got_s = peel(table, cmap)
    ref_v, ref_s = peel_reference(table, cmap)
    assert torch.equal(got_s, ref_s)
    assert torch.equal(got_v[got_s], ref_v[ref_s])
    assert torch.equal(got_v[got_s].to(torch.int32), vals[got_s])
    if load == 1.0 and members > 1000:
        assert not bool(got_s.all())        # the case the fallback round exists for

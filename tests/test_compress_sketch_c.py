"""The compiled count-sketch (client/csrc/sketch.c) against its torch
reference (countsketch.py): the same table and the same mean estimates, bit
for bit, so every rank's sketch adds up as the reference's would."""
import pytest
import torch

from xagg.client import native
from xagg.compress.countsketch import CountSketch

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

"""Count-Sketch: a linear map, so the sketches of N gradients add up to the
sketch of their sum (bit for bit when the entries are int32 fixed point).

Each of ``rows`` rows hashes index i to one of ``width`` cells and adds
sign_r(i) * x_i there; the estimate of x_i is the median (or the mean) over
rows of sign_r(i) * cell_r(i). The median is the textbook choice, robust to
one bad collision; on dense gradients with narrow sketches the mean ranks
heavy hitters better (more of the gradient's mass in the chosen k), which
is why the sketch method defaults to it. Hashes come from the shared seed
(rng.bucket_codes, built in C once per layout; rng.bucket_hash for the
torch references), so every rank uses the same map.

A table larger than BLOCK_CELLS is a ``blocked`` map (rng.blocked): the
indices cut into runs, each hashed onto its own share of every row. Every
index adds into a random cell, and past a core's L2 cache each add is a
miss (10M indices onto 600k cells: 75 ms a pass, against 16 ms onto
150k); in blocks, a pass in index order adds into one block at a time,
and a block within L1 rather than L2 takes about another third off
(10.7M indices onto 1.6M cells, the sketch's default on the bench's deep
model, in 392 blocks rather than 13). Each cell still holds ~n/width
indices and the heavy hitters are still read off the whole table.
"""
import math

import torch

from xagg.client import native
from xagg.compress.intsum import amax
from xagg.compress.rng import bucket_codes, bucket_hash, bucket_members
from xagg.compress.select import select

BLOCK_CELLS = 1 << 12       # a block's cells, every row's share: 16 KB of float32, half a 32 KB L1d (the
                            # rest holds the streams the pass reads)


def median_rows(v: torch.Tensor) -> torch.Tensor:
    """Median over dim 0; three rows without a sort."""
    if v.shape[0] == 1:
        return v[0]
    if v.shape[0] == 3:
        a, b, c = v
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    return v.median(dim=0).values


class CountSketch:
    def __init__(self, n: int, rows: int, width: int, seed, salt: str = ""):
        if rows < 1 or width < 1:
            raise ValueError(f"count sketch needs rows >= 1 and width >= 1, got {rows} x {width}")
        blocks = min(n, math.ceil(rows * width / BLOCK_CELLS))
        blocks = -(-n // -(-n // blocks))          # as many as runs of ceil(n / blocks) indices make
        width = -(-width // blocks) * blocks       # every block the same share of a row
        self.n, self.rows, self.width, self.blocks, self.seed, self.salt = n, rows, width, blocks, seed, salt
        self._map = self._cell_members = None
        if width >= 2**31 // rows:          # the cells must fit int32 (the map is built on first use)
            raise ValueError(f"count sketch of {rows} rows x {width} cells: more than 2**31 cells")

    def _codes(self) -> torch.Tensor:
        """The compiled passes' map, held here while they read it (the shared
        cache may drop it meanwhile)."""
        if self._map is None:
            self._map = bucket_codes(self.n, self.width, self.rows, self.seed, self.salt, self.blocks)
        return self._map

    def _members(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each cell's indices (rng.bucket_members), held as the map is."""
        if self._cell_members is None:
            self._cell_members = bucket_members(self.n, self.width, self.seed, self.salt, self.blocks)
        return self._cell_members

    @property
    def cells(self) -> torch.Tensor:
        """Cell of every index in every row (rows x n; the references')."""
        return bucket_hash(self.n, self.width, self.rows, self.seed, self.salt, self.blocks)[0]

    @property
    def signs(self) -> torch.Tensor:
        return bucket_hash(self.n, self.width, self.rows, self.seed, self.salt, self.blocks)[1]

    @property
    def size(self) -> int:
        return self.rows * self.width

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """Table (rows*width) of x (float32, or int32 for exact sums)."""
        table = torch.zeros(self.size, dtype=torch.int32 if x.dtype == torch.int32 else torch.float32)
        dll = native.load()
        if dll is not None and x.dtype == torch.float32:     # compiled, the same table bit for bit
            x = x.contiguous()
            dll.xagg_sketch_insert(x.data_ptr(), self.n, self._codes().data_ptr(), self.rows, table.data_ptr())
            return table
        return self.sketch_reference(x, table)

    def accumulate(self, r, g: torch.Tensor, acc: torch.Tensor, table: torch.Tensor) -> float:
        """acc = r + g (float32; r None: g) written into ``acc``, its sketch
        added into ``table`` (rows*width float32), and max |acc| returned
        (NaN where any element is NaN): compiled, one pass over r and g for
        all three, the same bits as ``sketch(acc)`` and ``intsum.amax(acc)``."""
        dll = native.load()
        if dll is not None:
            return dll.xagg_sketch_accumulate(r.data_ptr() if r is not None else None, g.data_ptr(), acc.data_ptr(),
                                              self.n, self._codes().data_ptr(), self.rows, table.data_ptr())
        if r is None:
            acc.copy_(g)
        else:
            torch.add(r, g, out=acc)
        self.sketch_reference(acc, table)
        return float(amax(acc))

    def sketch_reference(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``sketch`` in torch, into ``table`` (zeros)."""
        x = x if x.dtype == torch.int32 else x.to(torch.float32)
        for r in range(self.rows):           # row by row: one n-sized temporary, not rows of them
            signed = torch.where(self.signs[r] > 0, x, -x) if x.dtype == torch.int32 else x * self.signs[r]
            table.index_add_(0, self.cells[r], signed)
        return table

    def query(self, table: torch.Tensor, estimator: str = "median", out: torch.Tensor | None = None) -> torch.Tensor:
        """Estimate of every x_i from a (summed) table, as float32 (the
        compiled mean into ``out``, n float32, where given)."""
        t = table.to(torch.float32)          # small: convert once, gather floats
        dll = native.load()
        if estimator == "mean" and dll is not None:         # compiled, the same estimates bit for bit
            t, est = t.contiguous(), out if out is not None else torch.empty(self.n)
            dll.xagg_sketch_query_mean(t.data_ptr(), self.n, self._codes().data_ptr(), self.rows, est.data_ptr())
            return est
        return self.query_reference(t, estimator)

    def heavy_hitters(self, table: torch.Tensor, k: int, estimator: str = "mean") -> torch.Tensor:
        """Indices (int64, ascending) of the k largest |estimates| from a
        (summed) table: ``select(query(table, estimator), k)``, compiled:
        with one row selected over the cells (every member of a cell has its
        estimate), with more rows the mean as one pass that selects while it
        estimates (no n-sized estimate written and read back)."""
        dll = native.load()
        if dll is None or not 0 < k <= self.n or self.n >= 2**31 or (estimator != "mean" and self.rows > 1):
            return select(self.query(table, estimator), k)
        t = table.to(torch.float32).contiguous()
        idx = torch.empty(k, dtype=torch.int32)
        if self.rows == 1:      # every member of a cell has its estimate: selected over the cells
            start, members = self._members()
            got = dll.xagg_sketch_select_cells(t.data_ptr(), self.width, self.n, start.data_ptr(),
                                               members.data_ptr(), k, idx.data_ptr())
        else:
            got = dll.xagg_sketch_select(t.data_ptr(), self.n, self._codes().data_ptr(), self.rows, k, 0,
                                         idx.data_ptr())
        if got != k:
            raise MemoryError(f"heavy hitters of {self.n} estimates: out of memory for the candidates")
        return idx.long()

    def query_reference(self, t: torch.Tensor, estimator: str = "median") -> torch.Tensor:
        """``query`` in torch, from a float32 table."""
        if estimator == "mean":
            est = t[self.cells[0]].mul_(self.signs[0])
            for r in range(1, self.rows):
                est.addcmul_(t[self.cells[r]], self.signs[r])
            return est.div_(self.rows)
        if estimator == "median":
            return median_rows(t[self.cells] * self.signs)
        raise ValueError(f"estimator must be mean or median, got {estimator!r}")

"""Lossless homomorphic compression (Li et al. 2024, arXiv 2402.07529).

Each rank sparsifies its residual+gradient to its k = ratio * n largest
entries (error feedback keeps the rest) and sends, in one round:

* a bitmap of its non-zero indices, OR-aggregated: the union U of supports;
* an int32 fixed-point table where each non-zero is added into one cell in
  each of 3 partitions (an invertible Bloom lookup table without key
  fields: the bitmap tells the decoder which keys exist), sum-aggregated.

Peeling: a cell that holds exactly one index of U that is still unknown
gives that index's summed value; subtract it from its other two cells and
repeat. The fixed-point sums are integers, so what comes out is bit for bit
the sum of the ranks' fixed-point values (peeling works modulo 2**32, so
cell sums may even wrap). The table has ``load`` * N * k cells, the most N
ranks can put in the union; with 3 hashes peeling succeeds w.h.p. up to
|U| ~ cells / 1.23, so it is exact at every density the table is sized for.

Fallback, when peeling stalls (a union denser than claimed, or an unlucky
small hypergraph): every rank knows the same stuck indices, from the same
bitmap and table, and one more int32 sum round carries the values at
exactly those indices. The result is then still exact; it only costs
4 bytes per stuck index. ``stats['fallback_indices']`` counts them.

A scale round before (one float32: the sum of the ranks' max |x|) fixes
the shared power-of-two scale so that every per-index sum fits in int32.
"""
import math
from dataclasses import dataclass

import torch

from xagg.client import native
from xagg.compress.base import Compressor, Part, Payload, count, nan_like
from xagg.compress.intsum import INT32_LIMIT, MARGIN, pow2_scale, to_fixed
from xagg.compress.rng import cells_at

HASHES = 3


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    """int64 -> the int32 value congruent modulo 2**32."""
    return ((v + 2**31) & 0xFFFFFFFF) - 2**31


def table_cells(n: int, k: int, world_size: int, load: float) -> int:
    """Cells for a union of at most N*k indices. The sqrt term is slack for
    small unions, where peeling fails more often at the asymptotic load."""
    m = min(n, world_size * k)
    return HASHES * max(1, math.ceil((load * m + 8 * math.sqrt(m)) / HASHES))


def cell_map(idx: torch.Tensor, cells: int, seed, salt: str) -> torch.Tensor:
    """(m, 3) cells of the indices ``idx``: one in each third of the table
    (hashed where asked, never a map of the whole tensor)."""
    return cells_at(idx, cells // HASHES, HASHES, seed, salt)[0].t()


def peel(table: torch.Tensor, cells_of: torch.Tensor):
    """Recover the values of the union members from the summed table.

    ``cells_of`` (m, 3): the cells of each union member. Returns (values
    int64 wrapped to int32 range, solved mask): client/csrc/peel.c, one
    queue of pure cells; ``peel_reference`` where no compiler is there."""
    dll = native.load()
    if dll is None:
        return peel_reference(table, cells_of)
    m = cells_of.shape[0]
    cells = cells_of.to(torch.int32).contiguous()
    t = table.to(torch.int32).contiguous()
    val = torch.empty(m, dtype=torch.int32)
    solved = torch.empty(m, dtype=torch.uint8)
    if dll.xagg_peel(t.data_ptr(), t.numel(), cells.data_ptr(), m, val.data_ptr(), solved.data_ptr()) < 0:
        raise MemoryError(f"peeling a table of {t.numel()} cells: out of memory")
    return val.to(torch.int64), solved.bool()


def peel_reference(table: torch.Tensor, cells_of: torch.Tensor, info: dict | None = None):
    """``peel`` in torch, in rounds: every pure cell of a round at once."""
    m, ncells = cells_of.shape[0], table.numel()
    t = table.to(torch.int64)
    val = torch.zeros(m, dtype=torch.int64)
    solved = torch.zeros(m, dtype=torch.bool)
    todo = torch.arange(m)
    rounds = 0
    while todo.numel():
        c = cells_of[todo]                                   # (u, 3)
        load = torch.bincount(c.reshape(-1), minlength=ncells)
        pure = load[c] == 1                                  # (u, 3): I am alone in that cell
        hit = pure.any(1)
        if not bool(hit.any()):
            break
        rounds += 1
        who, c_hit = todo[hit], c[hit]
        first = pure[hit].to(torch.int8).argmax(1)           # one pure cell per member is enough
        v = _wrap32(t[c_hit.gather(1, first[:, None]).squeeze(1)])
        val[who], solved[who] = v, True
        t.index_add_(0, c_hit.reshape(-1), (-v).repeat_interleave(HASHES))
        todo = todo[~hit]
    if info is not None:
        info.update(peel_rounds=rounds, stuck=int(todo.numel()))
    return val, solved


@dataclass
class Lossless(Compressor):
    """lossless:ratio=0.004,load=1.3 - bitmap (n bits) + 3*ceil(load*N*k/3)
    int32 cells + one float32: 19.2x with 4 ranks by default; never above 32x
    (the bitmap alone is 1/32 of the dense tensor)."""
    ratio: float = 0.004
    load: float = 1.3

    NAME = "lossless"
    SUMMABLE = True

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")
        self._check("load", self.load >= 1, "must be >= 1 (peeling needs > 1.23)")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        cells = table_cells(n, count(self.ratio, n), world_size, self.load)
        return 4 * n / (math.ceil(n / 8) + 4 * cells + 4)

    def compress(self, name, tensor, step, *, world_size=1, **ctx):
        k = count(self.ratio, tensor.numel())
        acc, idx, vals = self.accumulate_topk(name, tensor, k, step, zero_sent=False)
        idx = idx[vals != 0]                # naturally sparse input: no zeros in the union
        amax = acc[idx].abs().max() if idx.numel() else torch.tensor(0.0)
        return Payload({"amax": Part("sum", amax.reshape(1))},
                       {"acc": acc, "idx": idx, "k": k, "N": world_size})

    def decompress(self, name, p, step):
        ctx = p.ctx
        if "amax" in p.parts:                 # -> round 2: bitmap + table
            acc, idx = ctx.pop("acc"), ctx["idx"]
            n = acc.numel()
            S = float(p["amax"][0])
            if not math.isfinite(S):
                return nan_like(n)
            # |sum of N values| <= S, so S / scale <= 2**30 fits in int32
            scale = pow2_scale(S * MARGIN, INT32_LIMIT)
            q = to_fixed(acc[idx], scale)
            self.keep(name, acc.index_put_((idx,), acc[idx] - q.to(torch.float32) * scale))
            cells = table_cells(n, ctx["k"], ctx["N"], self.load)
            salt = f"{name}/{n}/{cells}"
            table = torch.zeros(cells, dtype=torch.int32)
            table.index_add_(0, cell_map(idx, cells, self.seed, salt).reshape(-1), q.repeat_interleave(HASHES))
            bitmap = torch.zeros(n, dtype=torch.bool)
            bitmap[idx] = True
            ctx.update(n=n, scale=scale, q=q, cells=cells, salt=salt)
            return Payload({"bitmap": Part("or", bitmap), "table": Part("sum", table)}, ctx)
        if "bitmap" in p.parts:               # peel; -> fallback round if stuck
            union = p["bitmap"].nonzero().squeeze(1)
            val, solved = peel(p["table"], cell_map(union, ctx["cells"], self.seed, ctx["salt"]))
            self.stats["union"] = union.numel()
            ctx.update(union=union, val=val)
            if bool(solved.all()):
                return self._result(ctx)
            stuck = union[~solved]
            self.stats["fallback_indices"] = self.stats.get("fallback_indices", 0) + stuck.numel()
            self.stats["fallback_steps"] = self.stats.get("fallback_steps", 0) + 1
            mine = torch.zeros(ctx["n"], dtype=torch.int32)
            mine[ctx["idx"]] = ctx["q"]
            ctx.update(stuck_pos=(~solved).nonzero().squeeze(1))
            return Payload({"stuck": Part("sum", mine[stuck])}, ctx, final=True)
        ctx["val"][ctx["stuck_pos"]] = p["stuck"].to(torch.int64)
        return self._result(ctx)

    @staticmethod
    def _result(ctx) -> torch.Tensor:
        out = torch.zeros(ctx["n"])
        out[ctx["union"]] = ctx["val"].to(torch.float32) * ctx["scale"]
        return out

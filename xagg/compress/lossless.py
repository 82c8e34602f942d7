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

The shared power-of-two scale must keep every per-index sum in int32. On
a tensor's first step a scale round fixes it (one float32: the sum of the
ranks' max |x|). After that the table round also sums a one-hot of each
rank's max |x| as a power of two (EXP_CELLS 8-bit counts), and the next
step's scale comes from the largest, with HEADROOM bits to grow: one round
a step. A value past that bound is clamped and the excess stays in the
rank's residual (error feedback), so it is delayed, never lost; and what
is summed is still exactly the sum of the ranks' fixed-point values.
"""
import math
from dataclasses import dataclass, field

import torch

from xagg.client import native
from xagg.compress import bitmap
from xagg.compress.base import Compressor, Part, Payload, Sparse, count, nan_like
from xagg.compress.intsum import INT32_LIMIT, MARGIN, lanes, pack, pow2_scale, send_from, unpack
from xagg.compress.rng import CELL, cells_at_reference, hash_codes

HASHES = 3
EXP_LO, EXP_HI = -64, 63        # a max outside is voted at the edge (a gradient past 2**63 is clamped)
EXP_CELLS = EXP_HI - EXP_LO + 2     # one a exponent, and the last: a rank's max is not finite
VOTE_BITS = 8                   # votes travel 4 to an int32 word (counts up to N < 128)
HEADROOM = 2                    # bits the carried bound leaves a tensor to grow by in a step


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    """int64 -> the int32 value congruent modulo 2**32."""
    return ((v + 2**31) & 0xFFFFFFFF) - 2**31


def table_cells(n: int, k: int, world_size: int, load: float) -> int:
    """Cells for a union of at most N*k indices. The sqrt term is slack for
    small unions, where peeling fails more often at the asymptotic load."""
    m = min(n, world_size * k)
    return HASHES * max(1, math.ceil((load * m + 8 * math.sqrt(m)) / HASHES))


def cell_map(idx: torch.Tensor, cells: int, seed, salt: str) -> torch.Tensor:
    """(3, m) cells of the indices ``idx``, int32: one in each third of the
    table (hashed where asked, never a map of the whole tensor)."""
    codes = hash_codes(idx, idx.numel(), cells // HASHES, HASHES, seed, salt)
    if codes is None:
        return cells_at_reference(idx, cells // HASHES, HASHES, seed, salt)[0]
    return codes.bitwise_and_(CELL)                 # the top bit is a sign the table has no use for


def peel(table: torch.Tensor, cmap: torch.Tensor):
    """Recover the values of the union members from the summed table.

    ``cmap`` (3, m): the cells of each union member (``cell_map``). Returns
    (values int64 wrapped to int32 range, solved mask): client/csrc/peel.c,
    one queue of pure cells; ``peel_reference`` where no compiler is there."""
    dll = native.load()
    if dll is None:
        return peel_reference(table, cmap)
    m = cmap.shape[1]
    cells = cmap.to(torch.int32).contiguous()
    t = table.to(torch.int32).contiguous()
    val = torch.empty(m, dtype=torch.int32)
    solved = torch.empty(m, dtype=torch.uint8)
    if dll.xagg_peel(t.data_ptr(), t.numel(), cells.data_ptr(), m, val.data_ptr(), solved.data_ptr()) < 0:
        raise MemoryError(f"peeling a table of {t.numel()} cells: out of memory")
    return val.to(torch.int64), solved.bool()


def peel_reference(table: torch.Tensor, cmap: torch.Tensor, info: dict | None = None):
    """``peel`` in torch, in rounds: every pure cell of a round at once."""
    cells_of = cmap.t()                                      # (m, 3)
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


def vote_words(world_size: int) -> int:
    """int32 words of the vote: 8-bit lanes while N ranks' counts fit them."""
    return math.ceil(EXP_CELLS / lanes(VOTE_BITS)) if world_size < 128 else EXP_CELLS


def exponent_vote(amax: float, world_size: int) -> torch.Tensor:
    """One-hot of the power of two just above ``amax``, in ``vote_words``
    int32 words; summed over ranks (``read_votes``), its highest non-zero
    cell bounds every rank's max."""
    vote = torch.zeros(EXP_CELLS, dtype=torch.int32)
    if not math.isfinite(amax):
        vote[-1] = 1
    elif amax > 0:
        vote[min(max(math.frexp(amax)[1], EXP_LO), EXP_HI) - EXP_LO] = 1     # amax < 2**e
    return pack(vote, VOTE_BITS) if world_size < 128 else vote


def read_votes(words: torch.Tensor, world_size: int) -> torch.Tensor:
    """The summed votes, one count a cell."""
    return unpack(words, VOTE_BITS, EXP_CELLS) if world_size < 128 else words


def carried_scale(votes: torch.Tensor, world_size: int) -> float | None:
    """The scale for the next step from the summed votes: each rank's values
    up to 2**(HEADROOM + the largest exponent) fit in INT32_LIMIT / N levels.
    None where no rank had a value."""
    hit = votes[:-1].nonzero()
    if not hit.numel():
        return None
    top = int(hit[-1]) + EXP_LO + HEADROOM
    return 2.0 ** (top - ((INT32_LIMIT // world_size).bit_length() - 1))


@dataclass
class Lossless(Compressor):
    """lossless:ratio=0.01,load=1.3 - bitmap (n bits) + 3*ceil(load*N*k/3)
    int32 cells + 33 int32 (the scale's votes): 11.9x with 4 ranks by default; never above
    32x (the bitmap alone is 1/32 of the dense tensor). Its sum is exactly
    rgc's at the same ratio (each rank's top k with error feedback), so it
    trains as rgc does; at 0.004 neither trained a 10 M-parameter model
    under SGD with momentum."""
    ratio: float = 0.01
    load: float = 1.3
    scales: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # name -> (n, next scale)

    NAME = "lossless"
    SPARSE = True
    STEPS = 1.5                 # rgc's selection, its sums exact: it trains as rgc does
    SUMMABLE = True
    # top k takes inf/NaN first (their magnitudes' bits are the largest keys), so a rank's non-finite
    # input is in its amax, which every rank reads (the scale round, or the vote's last cell): no pass to check
    FINDS_NONFINITE = True

    def __post_init__(self):
        super().__post_init__()
        self._check("ratio", 0 < self.ratio <= 1, "must be in (0, 1]")
        self._check("load", self.load >= 1, "must be >= 1 (peeling needs > 1.23)")

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        cells = table_cells(n, count(self.ratio, n), world_size, self.load)
        return 4 * n / (math.ceil(n / 8) + 4 * cells + 4 * vote_words(world_size))

    def compress(self, name, tensor, step, *, world_size=1, **ctx):
        k = count(self.ratio, tensor.numel())
        acc, idx, vals = self.accumulate_topk(name, tensor, k, step, zero_sent=False)
        idx = idx[vals != 0]                # naturally sparse input: no zeros in the union
        amax = acc[idx].abs().max() if idx.numel() else torch.tensor(0.0)
        ctx = {"acc": acc, "idx": idx, "k": k, "N": world_size, "amax": float(amax)}
        carried = self.scales.get(name)
        if carried is not None and carried[0] == acc.numel():
            return self._table_round(name, ctx, carried[1], INT32_LIMIT // world_size)
        return Payload({"amax": Part("sum", amax.reshape(1), control=True)}, ctx)

    def _table_round(self, name, ctx, scale: float, limit: int) -> Payload:
        """My values in fixed point at ``scale`` (at most ``limit`` each, the
        rest kept), as the bitmap, the table and my exponent vote."""
        acc, idx = ctx.pop("acc"), ctx["idx"]
        n = acc.numel()
        q = send_from(acc, idx, torch.full((idx.numel(),), scale), limit)    # scale: a power of two, exact
        clamped = int((q.abs() == limit).sum()) if idx.numel() else 0
        if clamped:
            self.stats["clamped"] = self.stats.get("clamped", 0) + clamped
        self.keep(name, acc)
        q = q.to(torch.int32)
        cells = table_cells(n, ctx["k"], ctx["N"], self.load)
        salt = f"{name}/{n}/{cells}"
        table = torch.zeros(cells, dtype=torch.int32)
        table.index_add_(0, cell_map(idx, cells, self.seed, salt).reshape(-1), q.repeat(HASHES))
        bits = bitmap.set_bits(self.scratch(name, "bitmap", -(-n // 8), torch.uint8, zero=True), idx)
        ctx.update(n=n, scale=scale, q=q, cells=cells, salt=salt)
        return Payload({"bitmap": Part("or", bits), "table": Part("sum", table),
                        "votes": Part("sum", exponent_vote(ctx["amax"], ctx["N"]))}, ctx)

    def decompress(self, name, p, step):
        ctx = p.ctx
        if "amax" in p.parts:                 # the first step's scale -> the table round
            S = float(p["amax"][0])
            if not math.isfinite(S):
                return nan_like(ctx["acc"].numel())
            # |sum of N values| <= S, so S / scale <= 2**30 fits in int32
            return self._table_round(name, ctx, pow2_scale(S * MARGIN, INT32_LIMIT), INT32_LIMIT)
        if "bitmap" in p.parts:               # peel; -> fallback round if stuck
            votes = read_votes(p["votes"], ctx["N"])
            if int(votes[-1]):                # a rank's values were not finite
                return nan_like(ctx["n"])
            nxt = carried_scale(votes, ctx["N"])
            if nxt is not None:
                self.scales[name] = (ctx["n"], nxt)
            union = bitmap.members(p["bitmap"])
            val, solved = peel(p["table"], cell_map(union, ctx["cells"], self.seed, ctx["salt"]))
            self.stats["union"] = union.numel()
            ctx.update(union=union, val=val)
            if bool(solved.all()):
                return self._result(name, ctx)
            stuck = union[~solved]
            self.stats["fallback_indices"] = self.stats.get("fallback_indices", 0) + stuck.numel()
            self.stats["fallback_steps"] = self.stats.get("fallback_steps", 0) + 1
            mine = torch.zeros(ctx["n"], dtype=torch.int32)
            mine[ctx["idx"]] = ctx["q"]
            ctx.update(stuck_pos=(~solved).nonzero().squeeze(1))
            return Payload({"stuck": Part("sum", mine[stuck])}, ctx, final=True)
        ctx["val"][ctx["stuck_pos"]] = p["stuck"].to(torch.int64)
        return self._result(name, ctx)

    def _result(self, name, ctx) -> Sparse:
        return Sparse(ctx["union"], ctx["val"].to(torch.float32) * ctx["scale"], ctx["n"])

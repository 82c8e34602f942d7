"""The compressor interface, the residual memory and the exchange loop.

A compressor speaks in rounds. ``compress`` turns a gradient into the first
``Payload``: named tensors, each with the collective that combines it across
ranks. ``exchange`` runs those collectives. ``decompress`` reads the
combined payload and returns either the summed gradient (a tensor, or a
``Written`` that reduce() writes straight into the bucket's result: a
``Sparse`` where it is zero but at the indices sent) or the next round's payload (a
broadcast index list before its values, a scale before the integers that
use it). ``Compressor.reduce`` runs that loop and wraps it in
what every method shares: dense warm-up, the minimum size, fp32 residuals
and rollback when the result is not finite.
"""
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from xagg.client import native
from xagg.compress.collectives import Collectives
from xagg.compress.intsum import all_finite
from xagg.compress.rng import stable_int
from xagg.compress.select import topk_update

OPS = ("sum", "or", "gather", "bcast")


@dataclass
class Part:
    op: str                 # sum | or | gather | bcast
    tensor: torch.Tensor
    src: int = 0            # bcast only
    control: bool = False   # sum only: a few values the method reads to choose its next round (head-room
                            # bounds), not the gradient: Collectives.allreduce_control

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Part op must be one of {OPS}, got {self.op!r}")
        if self.control and self.op != "sum":
            raise ValueError(f"a control part is a sum, got op {self.op!r}")


@dataclass
class Payload:
    parts: dict             # name -> Part; after exchange the tensors are the combined ones
    ctx: dict = field(default_factory=dict)   # local state between rounds, never sent
    final: bool = False     # the last round: its decompress reads ctx and the sums and changes neither

    def __getitem__(self, key) -> torch.Tensor:
        return self.parts[key].tensor


class Written:
    """A last round's sum that reduce() has written straight into the
    bucket's result, divided as it goes, where a summed tensor would be
    copied there and divided again."""
    n: int                  # elements of the sum
    WRITES_ALL = False      # True: into() writes every element; False: only some, into a zeroed result

    def into(self, out: torch.Tensor, runs: Optional[list] = None, divide: int = 1,
             seen: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the sum, divided by ``divide``, into ``out``, or into the
        elements of ``out`` that ``runs`` (layer_runs: the bucket's big
        layers among its small ones) give it; ``seen``: see Sparse.into."""
        raise NotImplementedError

    def finite(self) -> bool:
        """Whether every element of the sum is finite."""
        raise NotImplementedError


@dataclass
class Sparse(Written):
    """A sum that is zero but at ``idx`` (int64), where it is ``values``
    (float32; with ``add``, indices may repeat and their values are added
    in order, the same order on every rank): what a sparse method's last
    round decompresses to. reduce() writes it once, straight into the
    bucket's result, instead of a zeroed tensor that is then copied there."""
    idx: torch.Tensor
    values: torch.Tensor
    n: int
    add: bool = False

    def into(self, out: torch.Tensor, runs: Optional[list] = None, divide: int = 1,
             seen: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the values, divided by ``divide``, into ``out`` (zero where
        they are not) at their indices, or where ``runs`` (layer_runs: the
        bucket's big layers among its small ones) put them: the same bits as
        dividing the whole written sum. ``seen``: a bit per element of out,
        all clear (Compressor.clear_bits), for the compiled pass to mark with
        (it leaves them clear); it takes one where there is none."""
        dll = native.load()
        if (dll is None or out.dtype != torch.float32 or not out.is_contiguous()
                or self.values.dtype != torch.float32 or self.idx.dtype != torch.int64):
            return self._into_torch(out, runs, divide)
        idx, vals = self.idx.contiguous(), self.values.contiguous()
        start, shift = _run_shifts(runs)
        if seen is None:
            seen = torch.zeros((out.numel() + 7) // 8, dtype=torch.uint8)
        bad = dll.xagg_scatter_into(out.data_ptr(), idx.data_ptr(), vals.data_ptr(), idx.numel(), self.n,
                                    start.data_ptr(), shift.data_ptr(), start.numel(), int(self.add),
                                    float(divide), seen.data_ptr())
        if bad >= 0:
            raise IndexError(f"a sparse sum's index {int(idx[bad])} is outside its {self.n} elements")
        return out

    def _into_torch(self, out: torch.Tensor, runs: Optional[list], divide: int) -> torch.Tensor:
        """into() in torch: the reference the compiled pass matches bit for bit."""
        if self.idx.numel() and (int(self.idx.min()) < 0 or int(self.idx.max()) >= self.n):
            raise IndexError(f"a sparse sum's index is outside its {self.n} elements")
        idx = self.idx if runs is None else _to_layout(self.idx, runs)
        if self.add:
            out.index_add_(0, idx, self.values)
            return out if divide == 1 else out.index_put_((idx,), out[idx].div_(divide))
        return out.index_put_((idx,), self.values if divide == 1 else self.values / divide)

    def finite(self) -> bool:
        return all_finite(self.values)      # zero elsewhere


def exchange(p: Payload, coll: Collectives, key=None) -> Payload:
    """Run each part's collective. Sum parts of one dtype travel as a single
    allreduce (control parts as another: Collectives.allreduce_control), so
    a round costs one aggregation per dtype. ``key`` (the bucket's name)
    with the parts' names marks each sum's place in the step
    (Collectives.sum_key)."""
    out = {}
    for dtype, control in ((torch.float32, True), (torch.float32, False), (torch.int32, True), (torch.int32, False)):
        keys = [k for k, v in p.parts.items() if v.op == "sum" and v.tensor.dtype == dtype and v.control == control]
        if not keys:
            continue
        flat = [p.parts[k].tensor.reshape(-1) for k in keys]
        coll.final_round = p.final      # a last round's sums may be agreed at the step's end
        coll.sum_key = None if key is None else (key, str(dtype), *keys)
        try:
            staged = coll.stage(flat)
            total = coll.allreduce_control(staged) if control else coll.allreduce_sum(staged)
        finally:
            coll.final_round, coll.sum_key = False, None
        for k, piece in zip(keys, total.split([f.numel() for f in flat])):
            out[k] = Part("sum", piece.view(p.parts[k].tensor.shape))
    for k, v in p.parts.items():
        if k in out:
            continue
        if v.op == "sum":
            raise TypeError(f"part {k!r}: sums carry float32 or int32, got {v.tensor.dtype}")
        if v.op == "or":
            out[k] = Part("or", coll.allreduce_or(v.tensor))
        elif v.op == "gather":
            out[k] = Part("gather", coll.allgather(v.tensor))
        else:
            out[k] = Part("bcast", coll.broadcast(v.tensor.clone(), v.src), v.src)
    return Payload(out, p.ctx, p.final)


@dataclass
class Compressor:
    """Base of every method. Options common to all (``NAME:warmup=..,...``):

    warmup    dense steps before compression starts
    min_size  layers with fewer elements go uncompressed (dense sum)
    seed      shared seed of every random choice (identical on all ranks)
    """
    warmup: int = 0
    min_size: int = 1024
    seed: int = 0
    memory: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    spare: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # name -> a residual no longer kept
    buffers: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (name, what) -> scratch()

    NAME = "base"
    SUMMABLE = False        # True: reaches the network through allreduce_sum/or (+ bcast) only
    NEEDS_WEIGHT = False    # True: reduce() wants the parameters (importance weighting)
    FINDS_NONFINITE = False  # True: an inf/NaN in the input reaches every rank's sum through the method itself
    SPARSE = False          # True: a sum carries a few coordinates; the rest wait in the residual for a later one
    WIRE_BITS = None        # the hook's lane width this method is (int16: 16); None: a compressor of its own
    STEPS = 1.0             # its steps that train as far as one of exact sums: --compress auto counts its time
                            # this many times (measured under SGD at a learning rate where the loss is stable:
                            # scripts/steps_to_loss.py; a GPT under AdamW agrees; docs/compression.md)

    @property
    def DEFERS(self) -> bool:         # noqa: N802 - beside the interface's other capabilities
        """Whether its last rounds' agreement can wait for the step's one
        (Collectives.settle): this loop's ``redo`` computes a result again
        from its rounds. A method with a reduce of its own agrees at once."""
        return type(self).reduce is Compressor.reduce

    def summary(self) -> str | None:
        """A line for the run's end (what an adaptive method chose); None: nothing to say."""
        return None

    def __post_init__(self):
        self._check("warmup", self.warmup >= 0, "must be >= 0")
        self._check("min_size", self.min_size >= 0, "must be >= 0")

    def _check(self, opt: str, ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"{self.NAME}: option {opt}={getattr(self, opt)!r} {why}")

    # -- what a method implements ------------------------------------------
    def compress(self, name: str, tensor: torch.Tensor, step: int, *, rank: int = 0,
                 world_size: int = 1, layers: Optional[list] = None,
                 weight: Optional[torch.Tensor] = None) -> Payload:
        """First round for a flat fp32 ``tensor`` (a copy the method may keep)."""
        raise NotImplementedError

    def decompress(self, name: str, payload: Payload, step: int) -> Union[torch.Tensor, Payload]:
        """The combined payload -> the sum over ranks, or the next round."""
        raise NotImplementedError

    def ratio_for(self, n: int, world_size: int = 1) -> float:
        """Stated compression: dense bytes / bytes this rank sends per step
        for an n-element tensor (steady state, after warm-up)."""
        return 1.0

    # -- residual memory -----------------------------------------------------
    def residual(self, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The residual kept for ``name``, None where there is none for x's shape."""
        r = self.memory.get(name)
        if r is not None and r.shape != x.shape:   # the tensor behind this name changed: start over
            self.stats["residual_resets"] = self.stats.get("residual_resets", 0) + 1
            r = None
        return r

    def accumulate(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Residual + gradient, as a new fp32 tensor (never aliases either)."""
        r = self.residual(name, x)
        return x.clone() if r is None else r + x

    def accumulate_topk(self, name: str, x: torch.Tensor, k: int, step: int, *,
                        weight: Optional[torch.Tensor] = None, c: float = 0.0, zero_sent: bool = True):
        """(acc, idx, values): residual + x and its top k in one pass
        (select.topk_update; k = 0: acc alone). acc is written into the
        residual this name kept before the current one, so a step
        allocates nothing the size of the bucket."""
        r = self.residual(name, x)
        return topk_update(r, x, k, weight=weight, c=c, zero_sent=zero_sent, out=self.acc_buffer(name, x, r),
                           seed=stable_int("sample", self.seed, step, name))

    def acc_buffer(self, name: str, x: torch.Tensor, r: Optional[torch.Tensor]) -> torch.Tensor:
        """A float32 buffer of x's size for residual + x: the residual this
        name kept before the current one (keep() put it aside), else a new one."""
        out = self.spare.pop(name, None)
        if out is None or out.shape != x.shape or out is r:
            out = torch.empty(x.shape, dtype=torch.float32)
        return out

    def scratch(self, name: str, what: str, n: int, dtype=torch.float32, zero: bool = False) -> torch.Tensor:
        """n elements kept for ``name`` and ``what`` from step to step: a
        fresh tensor the size of a bucket costs a page fault per 4 KiB every
        step, several times the time to fill it. What reduce() returns may
        live in one, so it holds until the next reduce() of the same name
        (DDP copies a bucket's result out before its next step). A new one
        starts zeroed; ``zero`` zeroes a kept one."""
        t = self.buffers.get((name, what))
        if t is None or t.numel() != n or t.dtype != dtype:
            t = self.buffers[(name, what)] = torch.zeros(n, dtype=dtype)
        elif zero:
            t.zero_()
        return t

    def clear_bits(self, name: str, n: int) -> torch.Tensor:
        """A bit per element of ``name``'s n, all clear, kept from step to
        step: Sparse.into marks with them and leaves them clear."""
        return self.scratch(name, "seen", (n + 7) // 8, torch.uint8)

    def _time(self, phase: str, since: float) -> None:
        """Wall seconds spent in ``phase`` on this rank (stats['seconds_PHASE'])."""
        key = f"seconds_{phase}"
        self.stats[key] = self.stats.get(key, 0.0) + time.perf_counter() - since

    def keep(self, name: str, kept: torch.Tensor) -> None:
        old = self.memory.get(name)
        self.memory[name] = kept
        if old is not None and old is not kept:
            # free for the next step's acc; a rollback puts it back in memory,
            # and accumulate_topk never writes into the residual it reads
            self.spare[name] = old

    def state_dict(self) -> dict:
        return {"spec": self.spec(), "residuals": {k: v.clone() for k, v in self.memory.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("spec", self.spec()) != self.spec():
            raise ValueError(f"state is for {sd['spec']!r}, this compressor is {self.spec()!r}")
        self.memory = {k: v.to(torch.float32).clone() for k, v in sd["residuals"].items()}

    def spec(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.init)
        return f"{self.NAME}:{opts}" if opts else self.NAME

    # -- the loop ------------------------------------------------------------
    def reduce(self, name: str, tensor: torch.Tensor, step: int, coll: Collectives, *,
               layers: Optional[list] = None, weight: Optional[torch.Tensor] = None,
               mean: bool = False) -> torch.Tensor:
        """Sum of ``tensor`` over all ranks (same shape and dtype as ``tensor``),
        valid until the next reduce() of ``name`` (it may be a scratch buffer);
        with ``mean``, the sum divided by the ranks (a sparse sum's values
        divided where they are written: no pass over the whole result).

        ``layers``: sizes of the layers concatenated in ``tensor`` (min_size
        and LayerFusion act per layer); ``weight``: the parameters, same
        layout, for methods with ``NEEDS_WEIGHT``. Afterwards ``self.redo()``
        computes the result again from the same rounds, for a transport
        whose ``settle()`` redid a last round's sum in place.
        """
        flat = tensor.reshape(-1).to(torch.float32)   # AMP: compute and keep residuals in fp32
        n = flat.numel()
        layers = list(layers) if layers is not None else [n]
        if sum(layers) != n:
            raise ValueError(f"{name}: layers sum to {sum(layers)}, tensor has {n} elements")
        if weight is not None:
            weight = weight.reshape(-1).to(torch.float32)
        big = [sz >= self.min_size for sz in layers]
        divide = coll.world_size if mean else 1
        # tail: the result computed again from the last round's sums (redone in place at settle());
        # each closure holds its own name, never one rebound after it
        if step < self.warmup or not any(big):
            summed = self._dense(name, flat, coll)
            out = _divided(summed, divide)
            tail = lambda: _divided(summed, divide)     # noqa: E731
        elif all(big):
            out = self._dense_out(name, self._compressed(name, flat, step, coll, layers, weight), divide)
            compressed = self._tail
            tail = lambda: self._dense_out(name, compressed(), divide)      # noqa: E731
        else:
            out = self._split(name, flat, step, coll, layers, big, weight, divide)
            tail = self._tail
        self._tail = tail
        self.redo = lambda: tail().view(tensor.shape).to(tensor.dtype)
        return out.view(tensor.shape).to(tensor.dtype)

    def _dense_out(self, name: str, out, divide: int = 1):
        """A Written sum written into the bucket's kept result (zeroed first
        where it writes only some elements); a dense one as it is; either
        divided by ``divide``."""
        if isinstance(out, Written):
            some = not out.WRITES_ALL
            return out.into(self.scratch(name, "out", out.n, zero=some), divide=divide,
                            seen=self.clear_bits(name, out.n) if some else None)
        return _divided(out, divide)

    def _dense(self, name, flat, coll):
        return exchange(Payload({"dense": Part("sum", flat)}, final=True), coll, name)["dense"]

    def _split(self, name, flat, step, coll, layers, big, weight, divide=1):
        # small layers (biases, norms) are summed dense; the rest is compressed as one tensor.
        # Runs of layers are contiguous slices: copied with cat, never gathered through a mask
        runs = layer_runs(layers, big)
        sizes = [sz for sz, b in zip(layers, big) if b]

        def take(t, keep, what=None):
            parts = [t[o:e] for o, e, b in runs if b == keep]
            if what is None or len(parts) == 1:
                return _cat(parts)
            return torch.cat(parts, out=self.scratch(name, what, sum(sizes)))
        w = take(weight, True, "big_weight") if weight is not None else None
        pair = self._compressed(name, take(flat, True, "big"), step, coll, sizes, w, dense=take(flat, False))

        def assemble(comp, dense):
            out, at = self.scratch(name, "assembled", flat.numel()), {True: 0, False: 0}
            written = isinstance(comp, Written)
            for o, e, b in runs:
                if b and written:
                    if not comp.WRITES_ALL:
                        out[o:e].zero_()
                else:
                    src = comp if b else dense
                    torch.div(src[at[b]:at[b] + e - o], divide, out=out[o:e])
                at[b] += e - o
            if not written:
                return out
            return comp.into(out, runs, divide, None if comp.WRITES_ALL else self.clear_bits(name, flat.numel()))
        inner = self._tail
        self._tail = lambda: assemble(*inner())
        return assemble(*pair)

    def _compressed(self, name, x, step, coll, layers, weight, dense=None):
        """The compressed sum of x; with ``dense`` (the small layers), the pair
        (compressed sum, dense sum)."""
        split, before = dense is not None, self.memory.get(name)
        if not (self.FINDS_NONFINITE or all_finite(x)):
            # inf everywhere is selected by every method, so the sum turns
            # non-finite on all ranks (NaN alone would slip past threshold tests)
            x = torch.full_like(x, math.inf)
        t0 = time.perf_counter()
        p = self.compress(name, x, step, rank=coll.rank, world_size=coll.world_size,
                          layers=layers, weight=weight)
        self._time("compress", t0)
        dense_sum = None
        while True:
            if dense is not None and _has_float_sum(p):   # rides along with a float32 sum round
                p.parts["__dense__"], dense = Part("sum", dense.clone(), control=_float_control(p)), None
            elif dense is not None and _has_op(p, "gather"):   # or with a gather, summed here in rank order
                p.parts["__dense__"], dense = Part("gather", dense), None
            p = exchange(p, coll, name)
            if "__dense__" in p.parts:
                d = p.parts.pop("__dense__")
                dense_sum = d.tensor.sum(0) if d.op == "gather" else d.tensor
            last = Payload(dict(p.parts), dict(p.ctx), p.final)   # to decompress again if redone
            t0 = time.perf_counter()
            out = self.decompress(name, p, step)
            self._time("decompress", t0)
            if isinstance(out, (torch.Tensor, Written)):
                break
            p = out
        if dense is not None:           # no round to ride along with
            dense_sum = self._dense(name, dense, coll)

        def finish(out):
            finite = out.finite() if isinstance(out, Written) else all_finite(out)
            if not (finite and (not split or all_finite(dense_sum))):
                # every rank sees the same sums, so every rank rolls back: an AMP
                # GradScaler will skip this step, and the residuals must not keep inf/NaN
                if before is None:
                    self.memory.pop(name, None)
                else:
                    self.memory[name] = before
                self.stats["nonfinite_steps"] = self.stats.get("nonfinite_steps", 0) + 1
                out = nan_like(out.n) if isinstance(out, Written) else torch.full_like(out, math.nan)
            return (out, dense_sum) if split else out
        # the last round's sums, if redone in place at settle(): decompressed again
        self._tail = lambda: finish(self.decompress(name, Payload(dict(last.parts), dict(last.ctx), True), step))
        return finish(out)


def _divided(t: torch.Tensor, divide: int) -> torch.Tensor:
    """t divided by ``divide`` in place (a fresh sum: nobody else holds it)."""
    return t if divide == 1 else t.div_(divide)


def layer_runs(layers: list, big: list) -> list:
    """(start, end, big) of each run of consecutive layers on the same side of min_size."""
    runs, at = [], 0
    for sz, b in zip(layers, big):
        if runs and runs[-1][2] == b:
            runs[-1] = (runs[-1][0], at + sz, b)
        else:
            runs.append((at, at + sz, b))
        at += sz
    return runs


def _run_shifts(runs: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each big run of ``runs`` (start, end, big) starts in the big
    layers' concatenation, and how far it moves in the whole bucket (int64;
    empty without runs)."""
    big = [(o, e) for o, e, b in runs if b] if runs is not None else []
    lens = torch.tensor([e - o for o, e in big], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return starts, torch.tensor([o for o, _ in big], dtype=torch.int64) - starts


def _to_layout(idx: torch.Tensor, runs: list) -> torch.Tensor:
    """Indices into the big layers' concatenation as indices into the whole
    bucket, whose ``runs`` (start, end, big) interleave them with the small."""
    starts, shift = _run_shifts(runs)
    return idx + shift[torch.searchsorted(starts, idx, right=True) - 1]


def _cat(parts: list) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _has_float_sum(p: Payload) -> bool:
    return any(v.op == "sum" and v.tensor.dtype == torch.float32 for v in p.parts.values())


def _float_control(p: Payload) -> bool:
    """Whether every float32 sum of ``p`` is a control part (what rides
    along joins them, not a second aggregation)."""
    return all(v.control for v in p.parts.values() if v.op == "sum" and v.tensor.dtype == torch.float32)


def _has_op(p: Payload, op: str) -> bool:
    return any(v.op == op for v in p.parts.values())


def nan_like(n: int) -> torch.Tensor:
    """The agreed result of a step where some rank had inf/NaN."""
    return torch.full((n,), math.nan)


def count(ratio: float, n: int) -> int:
    """Elements kept for a density ``ratio`` of n (at least one)."""
    return max(1, min(n, int(round(ratio * n))))

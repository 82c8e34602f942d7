"""Any compressor as a DDP communication hook.

    state = attach(ddp_model, "rgc:ratio=0.01")          # or:
    state, hook = make_ddp_hook("rgc:ratio=0.01", model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

The hook splits each bucket back into its layers (``bucket.gradients()``)
so min_size and LayerFusion see layer boundaries, passes the parameters
(``bucket.parameters()``, same order as the flat buffer) to methods that
weigh by them, and returns the average, as DDP's default hook does (the
compressor divides as it writes the result: ``reduce(mean=True)``). It runs
synchronously; a bucket whose last-round sums wait for the step's one
agreement (``Collectives.settle``; xagg/torch/compressed.py) gets its future
completed at the step's last bucket, any other at once.

Residuals follow parameters, not bucket positions: DDP rebuilds its buckets
after the first iteration (and a restarted job starts from the initial
layout again), so whenever a bucket's parameter list changes, residuals are
cut per parameter and re-assembled in the new order. Parameters are named by
their index in ``model.parameters()``, which survives a restart; give the
model (``attach`` does) or residuals cannot follow a restart.

The compressors run on the host: a CUDA bucket is copied to host memory
on entry (gloo stages it the same way) and its average copied back.

The state pickles (residuals, layouts, step counter, method; not the
transport or the model) and has state_dict()/load_state_dict().
"""
import time

import torch
import torch.distributed as dist

from xagg.compress.base import Compressor
from xagg.compress.collectives import Collectives, TorchCollectives
from xagg.compress.registry import get_compressor


class HookState:
    def __init__(self, compressor: Compressor, collectives: Collectives | None = None, model=None):
        self.compressor = compressor
        self._collectives = collectives
        self.model = model
        self.step = 0
        self.layouts = {}     # bucket name -> (param keys, sizes, step last seen)
        self.stash = {}       # param key -> residual, between two layouts
        self._ids = {}
        self.weights = {}     # bucket name -> the buffer its parameters are copied into
        self.waiting = []     # this step's (future, result, its pending sums, redo, bucket) until the last bucket
        self.seconds_hook = 0.0   # wall time inside the hook: what a step waits for (nothing overlaps)

    @property
    def collectives(self) -> Collectives:
        if self._collectives is None:    # default transport, built on first use (after init_process_group)
            self._collectives = TorchCollectives()
        return self._collectives

    @collectives.setter
    def collectives(self, coll: Collectives) -> None:
        """A new transport for the sums to come (a job opened anew)."""
        self._collectives = coll

    # -- residuals that follow parameters ------------------------------------------
    def param_keys(self, params) -> list:
        if self.model is None:
            return [f"ptr{p.data_ptr()}" for p in params]     # good within one process only
        if any(id(p) not in self._ids for p in params):
            self._ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        return [self._ids.get(id(p), f"ptr{p.data_ptr()}") for p in params]

    def relayout(self, name: str, keys: list, sizes: list) -> None:
        """Before reducing bucket ``name``: make its residual match ``keys``."""
        known = self.layouts.get(name)
        if known is not None and known[:2] == (keys, sizes):
            self.layouts[name] = (keys, sizes, self.step)
            return
        memory, min_size = self.compressor.memory, self.compressor.min_size
        # every layout not yet confirmed this step is cut into per-parameter pieces
        for nm, (ks, szs, seen) in list(self.layouts.items()):
            if seen == self.step and nm != name:
                continue
            del self.layouts[nm]
            r = memory.pop(nm, None)
            big = [(k, s) for k, s in zip(ks, szs) if s >= min_size]
            if r is not None and sum(s for _, s in big) == r.numel():
                self.stash.update(zip([k for k, _ in big], r.split([s for _, s in big])))
        big = [(k, s) for k, s in zip(keys, sizes) if s >= min_size]
        if big and any(k in self.stash for k, _ in big):
            memory[name] = torch.cat([self.stash.pop(k, None) if k in self.stash else torch.zeros(s)
                                      for k, s in big])
        self.layouts[name] = (keys, sizes, self.step)

    def snapshot(self) -> dict:
        """Counters for a run's summary: steps, seconds in the hook, each
        phase's seconds (compress, decompress; per collective: sum, gather,
        bcast, or, and on the aggregators xagg_sum and agree), bytes sent."""
        coll = self._collectives
        xs = getattr(coll, "state", None)
        out = {"steps": self.step, "seconds_comm": self.seconds_hook, "method": self.compressor.spec(),
               "mode": xs.fallback.mode if xs is not None else "torch", "transport": type(coll).__name__,
               "fallbacks": xs.fallback.fallbacks if xs is not None else 0}
        out.update({k: v for k, v in self.compressor.stats.items() if k.startswith("seconds_")})
        if coll is not None:
            out.update({f"seconds_{op}": v for op, v in coll.seconds.items()},
                       bytes_sent=coll.bytes_sent, calls=dict(coll.calls))
        return out

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "compressor": self.compressor.state_dict(),
                "layouts": dict(self.layouts), "stash": {k: v.clone() for k, v in self.stash.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.compressor.load_state_dict(sd["compressor"])
        self.layouts = dict(sd.get("layouts", {}))
        self.stash = dict(sd.get("stash", {}))

    def __getstate__(self):
        return {"spec": self.compressor.spec(), "state": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(get_compressor(d["spec"]))
        self.load_state_dict(d["state"])


def ddp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    t0 = time.perf_counter()
    buf = bucket.buffer()
    params = bucket.parameters()
    layers = [p.numel() for p in params]
    name = f"bucket{bucket.index()}"
    if sum(layers) == buf.numel():
        state.relayout(name, state.param_keys(params), layers)
    else:                              # a layout we do not understand: one layer
        layers = None
    weight = None
    if state.compressor.NEEDS_WEIGHT and layers is not None:
        # into a buffer kept per bucket: a fresh one costs a page fault per 4 KiB every step
        kept = state.weights.get(name)
        if kept is None or kept.numel() != buf.numel():
            kept = state.weights[name] = torch.empty(buf.numel(), dtype=torch.float32)
        weight = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params], out=kept)
    coll = state.collectives
    # this hook settles every step's last rounds at its last bucket, where the compressor
    # can compute a result again from its rounds (Compressor.reduce's redo); else at once
    coll.deferring = type(state.compressor).reduce is Compressor.reduce
    first = coll.pending()
    # fp32 throughout (an fp16 sum of N ranks can overflow before the division)
    out = state.compressor.reduce(name, buf.to("cpu", torch.float32), state.step, coll, layers=layers,
                                  weight=weight, mean=True)
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    if coll.pending() == first:     # every sum of this bucket agreed already
        fut.set_result(out.to(buf.device, buf.dtype))
    else:
        state.waiting.append((fut, out, range(first, coll.pending()), state.compressor.redo, buf))
    if bucket.is_last():
        _settle(state, coll)
        state.step += 1
    state.seconds_hook += time.perf_counter() - t0
    return fut


def _settle(state: HookState, coll: Collectives) -> None:
    """The step's one agreement (Collectives.settle), then every bucket's
    result to DDP: computed again where one of its sums was redone."""
    redone = coll.settle()
    for fut, out, sums, redo, buf in state.waiting:
        if any(i in redone for i in sums):
            out = redo()
        fut.set_result(out.to(buf.device, buf.dtype))
    state.waiting = []


def make_ddp_hook(compressor, collectives: Collectives | None = None, model=None):
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``.

    ``compressor``: a Compressor, a spec string, or a HookState restored from
    a checkpoint; ``collectives``: the transport (default TorchCollectives on
    the default group); ``model``: the DDP model, so residuals follow its
    parameters across bucket rebuilds and restarts."""
    if isinstance(compressor, HookState):
        state = compressor
        state._collectives = collectives or state._collectives
    else:
        state = HookState(get_compressor(compressor), collectives)
    state.model = model if model is not None else state.model
    return state, ddp_hook


def attach(ddp_model, compressor, collectives: Collectives | None = None) -> HookState:
    """Register the hook on a DDP model; returns its state (checkpoint it)."""
    state, hook = make_ddp_hook(compressor, collectives, ddp_model)
    ddp_model.register_comm_hook(state, hook)
    return state

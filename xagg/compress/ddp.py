"""Any compressor as a DDP communication hook.

    state = attach(ddp_model, "rgc:ratio=0.01")          # or:
    state, hook = make_ddp_hook("rgc:ratio=0.01", model=ddp_model)
    ddp_model.register_comm_hook(state, hook)

The hook splits each bucket back into its layers (``bucket.gradients()``)
so min_size and LayerFusion see layer boundaries, passes the parameters
(``bucket.parameters()``, same order as the flat buffer) to methods that
weigh by them, and returns the average, as DDP's default hook does (the
compressor divides as it writes the result: ``reduce(mean=True)``).

The hook returns at once: the state's compression thread reduces the
buckets one after another, in DDP's order (the same on every rank, so the
ranks' collectives line up), while backward computes the next ones. A
bucket whose last-round sums wait for the step's one agreement
(``Collectives.settle``; xagg/torch/compressed.py) gets its future
completed at the step's last bucket, any other when its sum is done. DDP
waits for every future before backward returns, so the thread is idle, its
collectives done, whenever the training thread runs its own.

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
import queue
import threading
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
        self.waiting = []     # this step's (bucket, result, its pending sums, redo) until the last bucket
        self.seconds_hook = 0.0   # wall time of the compression thread on buckets
        self._thread = None
        self._queue = None
        self.failed = None    # what a bucket raised: the buckets after it fail with it, sending nothing

    def submit(self, b) -> None:
        """Reduce bucket ``b`` on the compression thread, after those before it."""
        if self._thread is None:    # started on first use; one thread, so buckets keep their order
            # a daemon: a rank whose step failed must still exit while a peer's collective hangs
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._queue,), name="xagg-compress",
                                            daemon=True)
            self._thread.start()
        self._queue.put(b)

    def _serve(self, q) -> None:
        while (b := q.get()) is not None:
            if isinstance(b, threading.Event):
                b.set()
            else:
                _reduce(self, b)

    def drain(self) -> None:
        """Wait until the compression thread has done every bucket given to it."""
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def close(self) -> None:
        """Stop the compression thread (after the buckets it holds)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

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
        xs = coll.state if coll is not None else None
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
    """Hand the bucket to the state's compression thread and return its
    future at once: backward goes on computing the next buckets meanwhile.
    Only the copy of a device bucket to host memory happens here, on the
    stream that produced it."""
    buf = bucket.buffer()
    host = buf.to("cpu", torch.float32)      # fp32 throughout (an fp16 sum of N ranks can overflow before the division)
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    state.submit(_Bucket(f"bucket{bucket.index()}", host, bucket.parameters(), bucket.is_last(), buf, fut))
    return fut


class _Bucket:
    """One bucket on its way through the compression thread."""

    def __init__(self, name, host, params, last, buf, fut):
        self.name, self.host, self.params, self.last, self.buf, self.fut = name, host, params, last, buf, fut

    def done(self, out: torch.Tensor) -> None:
        self.fut.set_result(out.to(self.buf.device, self.buf.dtype))


def _reduce(state: HookState, b: _Bucket) -> None:
    """A bucket's sum, on the compression thread (buckets in DDP's order,
    the same on every rank, so every rank's collectives line up)."""
    t0 = time.perf_counter()
    try:
        if state.failed is not None:     # the ranks' collectives no longer line up: enter none
            raise state.failed
        _reduce_bucket(state, b)
    except BaseException as e:       # DDP raises it where it waits for the bucket
        state.failed = e
        for fut in [w.fut for w, *_ in state.waiting] + [b.fut]:
            if not fut.done():
                fut.set_exception(e)
        state.waiting = []
    finally:
        state.seconds_hook += time.perf_counter() - t0


def _reduce_bucket(state: HookState, b: _Bucket) -> None:
    layers = [p.numel() for p in b.params]
    if sum(layers) == b.host.numel():
        state.relayout(b.name, state.param_keys(b.params), layers)
    else:                              # a layout we do not understand: one layer
        layers = None
    weight = None
    if state.compressor.NEEDS_WEIGHT and layers is not None:
        # into a buffer kept per bucket: a fresh one costs a page fault per 4 KiB every step
        kept = state.weights.get(b.name)
        if kept is None or kept.numel() != b.host.numel():
            kept = state.weights[b.name] = torch.empty(b.host.numel(), dtype=torch.float32)
        weight = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in b.params], out=kept)
    coll = state.collectives
    # this hook settles every step's last rounds at its last bucket, where the compressor
    # can compute a result again from its rounds (Compressor.reduce's redo); else at once
    coll.deferring = state.compressor.DEFERS
    first = coll.pending()
    out = state.compressor.reduce(b.name, b.host, state.step, coll, layers=layers, weight=weight, mean=True)
    if coll.pending() == first:     # every sum of this bucket agreed already
        done = [(b, out)]
    else:
        state.waiting.append((b, out, range(first, coll.pending()), state.compressor.redo))
        done = []
    if b.last:
        done += _settle(state, coll)
        state.step += 1             # before any result: DDP's wait for the last returns into the next step
    for d, result in done:
        d.done(result)


def _settle(state: HookState, coll: Collectives) -> list:
    """The step's one agreement (Collectives.settle), then every waiting
    bucket with its result: computed again where one of its sums was redone."""
    redone = coll.settle()
    out = [(b, redo() if any(i in redone for i in sums) else result) for b, result, sums, redo in state.waiting]
    state.waiting = []
    return out


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

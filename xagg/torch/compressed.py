"""The xagg aggregator as a compression transport: sums (float32 in fixed
point, int32 exact) go through the in-kernel aggregator; the non-summable
collectives (all-gather of top-k, index broadcast) stay on torch.distributed.

Given the job's ``XaggState`` (as ``xagg-client run --compress`` does), a
sum the aggregators cannot finish falls back to torch.distributed, never to
a wrong or partial sum: the ranks agree, with one small all-reduce on the
group, whether every rank got it (one rank may have every result while
another lost the last one). If any did not, every rank sums that tensor
again over torch.distributed, and the state's fallback controller
(fallback.py, the one the plain hook uses) decides when xagg is tried
again, counting its back-off in sums. Without a state, a failure raises.

When is that agreement? A sum whose result a method reads to choose its
next round (a scale, a sketch, a peeled table) is agreed at once: a rank
must not choose from a sum another rank lacks. A method's last round
(``Payload.final``) is only scattered into the bucket's result, so while
the DDP hook ``defers`` it is agreed at the step's end, all of the step's
at once in ``settle()``: a rank that failed returns zeros meanwhile, and
every rank redoes every sum any rank failed on torch.distributed, in place,
before the hook hands any result to DDP. One all-reduce a step, not one a
sum; a failed sum costs the rest of the step's sums their time-outs too.

A method's small float32 control sums (its head-room bounds,
``allreduce_control``) go on torch.distributed instead: one round trip
where the aggregators' exact float sum and its agreement take three.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from xagg.client import XaggError
from xagg.client.packets import MAX_LAYOUTS
from xagg.compress.collectives import TorchCollectives
from xagg.torch.fallback import Wording, agree_max

CONTROL_MAX = 16384     # elements of a control sum sent on torch.distributed: 64 KB, a round trip's worth
COMPRESSED = Wording("compressed sums fall back to torch.distributed", "sums",
                     "compressed sums go through the aggregators again")


class XaggCollectives(TorchCollectives):
    """``client``: an xagg.client.Client whose worker id is this rank;
    ``state``: the started XaggState it belongs to, for fallback (optional)."""
    SUMS_LANES = True

    def __init__(self, client, group=None, state=None):
        super().__init__(group)
        if client.cfg.n_workers != self.world_size or client.cfg.worker_id != self.rank:
            raise ValueError(f"XaggCollectives: client is worker {client.cfg.worker_id} of "
                             f"{client.cfg.n_workers}, but this is rank {self.rank} of {self.world_size}")
        self._client, self.state = client, state
        self._pending = []          # (tensor, its sum as returned, error) until settle()
        self._out = {}              # sum_key -> the result buffer of its float sums

    @property
    def client(self):
        """The job's client: with a state, its live one (a state closed and
        started again has a new client)."""
        return self.state.client if self.state is not None else self._client

    def allreduce_sum_lanes(self, t: torch.Tensor, key, bits: int) -> torch.Tensor:
        """A float32 sum in ``bits``-wide lanes (quant.Int16), predicted
        exponents and error feedback kept per ``key`` by the client: one
        round trip, ``bits``/32 of the bytes each way."""
        self._count("sum", t.numel() * bits // 8, t.numel() * bits // 8)
        return self._timed("sum", self._sum, t.contiguous(), (key, bits))

    def allreduce_control(self, t: torch.Tensor) -> torch.Tensor:
        """A small float32 control sum (head-room bounds: at most
        CONTROL_MAX elements) on torch.distributed: one reliable round
        trip, where the aggregators' exact float32 sum takes two (exponents
        agreed first) and then the ranks' agreement, which is itself a
        round trip on torch.distributed. Larger ones, and int32 ones (one
        round trip here), go through the aggregators as any sum."""
        if t.dtype != torch.float32 or t.numel() > CONTROL_MAX:
            return self.allreduce_sum(t)
        self._count("control", t.numel() * 4, t.numel() * 4)
        return self._timed("control", TorchCollectives._sum, self, t.contiguous())

    def _sum(self, t: torch.Tensor, lanes: tuple | None = None) -> torch.Tensor:
        st = self.state
        if st is None:
            return self._xagg_sum(t, lanes)
        fb = st.fallback
        if fb.mode == "gloo" and not (fb.due() and fb.retry(self.rank, st.reregister, self._agree, COMPRESSED)):
            st.stats["buckets_gloo"] += 1
            return super()._sum(t)
        t0 = time.perf_counter()
        try:
            s, err = self._xagg_sum(t, lanes), ""
        except XaggError as e:
            s, err = None, str(e)
        t1 = time.perf_counter()
        self.seconds["xagg_sum"] += t1 - t0
        if self.deferring and self.final_round:     # agreed at settle(), with the step's others
            self._pending.append((t, s if s is not None else torch.zeros_like(t), err))
            return self._pending[-1][1]
        failed = self._agree(bool(err))
        self.seconds["agree"] += time.perf_counter() - t1
        if not failed:
            st.stats["buckets_xagg"] += 1
            fb.succeeded(self.rank, COMPRESSED)
            return s
        fb.fail(self.rank, err or "another rank got no answer from the aggregators", COMPRESSED)
        st.stats["buckets_gloo"] += 1
        return super()._sum(t)          # ``t`` is untouched: the client sums a copy

    def pending(self) -> int:
        return len(self._pending)

    def settle(self) -> set:
        """The step's agreement on its pending sums (see the module's
        docstring): the positions of those redone on torch.distributed, whose
        returned tensors now hold the right sums."""
        if not self._pending:
            return set()
        pend, self._pending = self._pending, []
        st, fb = self.state, self.state.fallback
        t0 = time.perf_counter()
        *failed, top = agree_max([int(bool(err)) for _, _, err in pend] + [self.client.round], self.group)
        self.client.round = (top + (2 if any(failed) else 0)) & 0xFFFFFFFF
        self.seconds["agree"] += time.perf_counter() - t0
        redo = {i for i, f in enumerate(failed) if f}
        st.stats["buckets_xagg"] += len(pend) - len(redo)
        if not redo:
            fb.succeeded(self.rank, COMPRESSED)
            return redo
        err = next((e for _, _, e in pend if e), "")
        fb.fail(self.rank, err or "another rank got no answer from the aggregators", COMPRESSED)
        st.stats["buckets_gloo"] += len(redo)
        for i in sorted(redo):          # every rank, in the same order
            t, s, _ = pend[i]
            s.copy_(super()._sum(t))    # ``t`` is untouched: the client sums a copy
        return redo

    def _xagg_sum(self, t: torch.Tensor, lanes: tuple | None = None) -> torch.Tensor:
        x = t.detach().cpu().numpy()
        if lanes is not None:   # a gradient itself: its chunks' scales hold from call to call
            key, bits = lanes
            s = self.client.allreduce(x, key=key, wire_bits=bits, feedback=True)
            return torch.from_numpy(np.ascontiguousarray(s)).to(t.device)
        # exact: exponents agreed before the sum (every chunk at full precision); the
        # compressors' values jump between calls, so predicted exponents would miss.
        # A sum's packets and result kept per place in the step (sum_key): none page-faulted anew
        key = self.sum_key
        if t.dtype == torch.int32:
            s = self.client.allreduce_int(x, key)
        else:
            s = self.client.allreduce(x, key=key, exact=True, out=None if key is None else self._kept(key, x.size))
        return torch.from_numpy(np.ascontiguousarray(s)).to(t.device)

    def _kept(self, key, n: int) -> np.ndarray:
        """The float32 result buffer of the sums under ``key`` (n elements)."""
        out = self._out.get(key)
        if out is None or out.size != n:
            if len(self._out) >= MAX_LAYOUTS:
                self._out.clear()
            out = self._out[key] = np.empty(n, np.float32)
        return out

    def _agree(self, failed_here: bool) -> bool:
        """Did any rank fail? Rounds go on past the highest any rank used,
        so the slots an abandoned round left are superseded (as in engine.py)."""
        failed, top = agree_max([int(failed_here), self.client.round], self.group)
        self.client.round = (top + (2 if failed else 0)) & 0xFFFFFFFF
        return bool(failed)

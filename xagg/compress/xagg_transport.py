"""The xagg aggregator as a compression transport: sums (float32 in fixed
point, int32 exact) go through the in-kernel aggregator; the non-summable
collectives (all-gather of top-k, index broadcast) stay on torch.distributed.

Given the job's ``XaggState`` (as ``xagg-client run --compress`` does), a
sum the aggregators cannot finish falls back to torch.distributed, never to
a wrong or partial sum: after every sum the ranks agree, with one small
all-reduce on the group, whether every rank got it (one rank may have every
result while another lost the last one). If any did not, every rank sums
that tensor again over torch.distributed, logs the reason once, counts it
in the state, and stays there for ``backoff_steps`` sums (counted, so alike
on every rank), doubling on each failed retry as the plain hook does; rank
0 re-registers the job before a retry. Without a state, a failure raises.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from xagg.client import XaggError

from .collectives import TorchCollectives

log = logging.getLogger("xagg.torch")


class XaggCollectives(TorchCollectives):
    """``client``: an xagg.client.Client whose worker id is this rank;
    ``state``: the started XaggState it belongs to, for fallback (optional)."""

    def __init__(self, client, group=None, state=None):
        super().__init__(group)
        if client.cfg.n_workers != self.world_size or client.cfg.worker_id != self.rank:
            raise ValueError(f"XaggCollectives: client is worker {client.cfg.worker_id} of "
                             f"{client.cfg.n_workers}, but this is rank {self.rank} of {self.world_size}")
        self.client, self.state = client, state
        self.retrying = False

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        st = self.state
        if st is None:
            return self._xagg_sum(t)
        if st.mode == "gloo":
            st.backoff_left -= 1
            if st.backoff_left > 0 or not self._retry():
                st.stats["buckets_gloo"] += 1
                return super()._sum(t)
        try:
            s, err = self._xagg_sum(t), ""
        except XaggError as e:
            s, err = None, str(e)
        failed = self._agree(bool(err))
        if not failed:
            st.stats["buckets_xagg"] += 1
            if self.retrying:
                st.stats["recoveries"] += 1
                log.warning("xagg: rank %d: compressed sums go through the aggregators again", self.rank)
            self.retrying = False
            return s
        self._enter_gloo(err or "another rank got no answer from the aggregators")
        st.stats["buckets_gloo"] += 1
        return super()._sum(t)          # ``t`` is untouched: the client sums a copy

    def _xagg_sum(self, t: torch.Tensor) -> torch.Tensor:
        x = t.detach().cpu().numpy()
        # exact: exponents agreed before the sum (every chunk at full precision); the
        # compressors' values jump between calls, so predicted exponents would miss
        s = self.client.allreduce_int(x) if t.dtype == torch.int32 else self.client.allreduce(x, exact=True)
        return torch.from_numpy(np.ascontiguousarray(s)).to(t.device)

    def _agree(self, failed_here: bool) -> bool:
        """Did any rank fail? Rounds go on past the highest any rank used,
        so the slots an abandoned round left are superseded (as in engine.py)."""
        flags = torch.tensor([int(failed_here), self.client.round], dtype=torch.int64)
        self.dist.all_reduce(flags, op=self.dist.ReduceOp.MAX, group=self.group)
        failed = bool(flags[0])
        self.client.round = (int(flags[1]) + (2 if failed else 0)) & 0xFFFFFFFF
        return failed

    def _enter_gloo(self, reason: str) -> None:
        self.state.fall_back(self.rank, reason, first=not self.retrying,
                             what="compressed sums fall back to torch.distributed", unit="sums")
        self.retrying = False

    def _retry(self) -> bool:
        """After a back-off: rank 0 registers the job again (the daemon may
        have restarted without it), and every rank learns whether it did."""
        st = self.state
        st.stats["retries"] += 1
        self.retrying = True            # a failure from here on is a failed retry, not a new fallback
        ok, reason = 1, ""
        if self.rank == 0 and st.register and st.started:
            ok, reason = st._engine._register()
        if self._agree(not ok):
            self._enter_gloo(reason or "rank 0 could not register the job")
            return False
        st.mode = "xagg"
        return True

"""The xagg aggregator as a compression transport: sums (float32 in fixed
point, int32 exact) go through the in-kernel aggregator; the non-summable
collectives (all-gather of top-k, index broadcast) stay on torch.distributed."""
from __future__ import annotations

import numpy as np
import torch

from .collectives import TorchCollectives


class XaggCollectives(TorchCollectives):
    """``client``: an xagg.client.Client whose worker id is this rank."""

    def __init__(self, client, group=None):
        super().__init__(group)
        if client.cfg.n_workers != self.world_size or client.cfg.worker_id != self.rank:
            raise ValueError(f"XaggCollectives: client is worker {client.cfg.worker_id} of "
                             f"{client.cfg.n_workers}, but this is rank {self.rank} of {self.world_size}")
        self.client = client

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        x = t.detach().cpu().numpy()
        # exact: exponents agreed before the sum (every chunk at full precision); the
        # compressors' values jump between calls, so predicted exponents would miss
        s = self.client.allreduce_int(x) if t.dtype == torch.int32 else self.client.allreduce(x, exact=True)
        return torch.from_numpy(np.ascontiguousarray(s)).to(t.device)

    def _or(self, bits: torch.Tensor) -> torch.Tensor:
        # a sum-only transport: OR as a lane-packed int32 sum (Collectives._or)
        return super(TorchCollectives, self)._or(bits)

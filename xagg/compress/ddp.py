"""Any compressor as a DDP communication hook.

    state, hook = make_ddp_hook(get_compressor("rgc:ratio=0.01"))
    ddp_model.register_comm_hook(state, hook)

The hook splits each bucket back into its layers (``bucket.gradients()``)
so min_size and LayerFusion see layer boundaries, passes the parameters
(``bucket.parameters()``, same order as the flat buffer) to methods that
weigh by them, and returns the average, as DDP's default hook does. It runs
synchronously and hands DDP a completed future.

The state pickles (residuals, step counter, method; not the transport), and
also has state_dict()/load_state_dict() for checkpoints. Residuals are
keyed by bucket index; DDP rebuilds its buckets after the first iteration,
and a bucket whose size changed starts with an empty residual.
"""
import torch
import torch.distributed as dist

from .base import Compressor
from .collectives import Collectives, TorchCollectives
from .registry import get_compressor


class HookState:
    def __init__(self, compressor: Compressor, collectives: Collectives | None = None):
        self.compressor = compressor
        self._collectives = collectives
        self.step = 0

    @property
    def collectives(self) -> Collectives:
        if self._collectives is None:    # default transport, built on first use (after init_process_group)
            self._collectives = TorchCollectives()
        return self._collectives

    def state_dict(self) -> dict:
        return {"step": self.step, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.compressor.load_state_dict(sd["compressor"])

    def __getstate__(self):
        return {"spec": self.compressor.spec(), "state": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(get_compressor(d["spec"]))
        self.load_state_dict(d["state"])


def ddp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    grads = bucket.gradients()
    layers = [g.numel() for g in grads]
    if sum(layers) != buf.numel():     # layout we do not understand: treat the bucket as one layer
        layers = None
    weight = None
    if state.compressor.NEEDS_WEIGHT and layers is not None:
        weight = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in bucket.parameters()])
    coll = state.collectives
    # fp32 throughout (an fp16 sum of N ranks can overflow before the division)
    out = state.compressor.reduce(f"bucket{bucket.index()}", buf.to(torch.float32), state.step, coll,
                                  layers=layers, weight=weight)
    out = out.div_(coll.world_size).to(buf.dtype)
    if bucket.is_last():
        state.step += 1
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


def make_ddp_hook(compressor, collectives: Collectives | None = None):
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``.
    ``compressor``: a Compressor or a spec string; ``collectives``: the
    transport (default TorchCollectives on the default group)."""
    return HookState(get_compressor(compressor), collectives), ddp_hook


def attach(ddp_model, spec, collectives: Collectives | None = None) -> HookState:
    """Register the hook on a DDP model and return its state (for checkpoints)."""
    state, hook = make_ddp_hook(spec, collectives)
    ddp_model.register_comm_hook(state, hook)
    return state

"""The DDP communication hook, in the style of torch's ``ddp_comm_hooks``.

    ddp.register_comm_hook(state, xagg_hook)

It returns at once with a ``torch.futures.Future``; the bucket travels on
the state's I/O thread (engine.py), so backward goes on computing the next
buckets meanwhile.
"""

import logging

import torch
import torch.distributed as dist

from xagg.torch.state import XaggState

log = logging.getLogger("xagg.torch")
_warned_python_reducer = False


def xagg_hook(state: XaggState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks through the xagg aggregators (gloo if they fail)."""
    if isinstance(bucket, tuple):
        return _python_reducer(state, bucket)
    return state.submit(bucket)


def _python_reducer(state: XaggState, grad_param: tuple) -> torch.futures.Future[torch.Tensor]:
    # compiled autograd's Python reducer calls hooks per parameter, in an order
    # we cannot rely on across ranks: stay correct, like DDP's default
    global _warned_python_reducer
    if not _warned_python_reducer:
        _warned_python_reducer = True
        log.warning("xagg: DDP runs its Python reducer (compiled autograd); gradients use "
                    "torch.distributed all_reduce, not the aggregators")
    grad = grad_param[0]
    pg = state.process_group or dist.group.WORLD
    grad.div_(dist.get_world_size(pg))
    dist.all_reduce(grad, group=pg)
    fut = torch.futures.Future(devices=[grad.device]) if grad.is_cuda else torch.futures.Future()
    fut.set_result(grad)
    return fut


def trainable_elements(ddp) -> int:
    """Elements of the gradients DDP reduces: what a job for this model is sized by."""
    return max(1, sum(p.numel() for p in ddp.parameters() if p.requires_grad))


def bucket_elements(ddp) -> list[int]:
    """Elements of each bucket DDP sums once it has rebuilt its buckets: its
    gradients in reverse order, cut where a bucket would pass bucket_bytes_cap."""
    out, size, cap = [], 0, ddp.bucket_bytes_cap
    for p in reversed([p for p in ddp.parameters() if p.requires_grad]):
        if size and (size + p.numel()) * p.element_size() > cap:
            out.append(size)
            size = 0
        size += p.numel()
    return [*out, size] if size else out or [1]


def attach(ddp, aggregators, **kwargs) -> XaggState:
    """An XaggState sized for ``ddp``'s parameters, registered as its comm hook.

    ``kwargs`` go to XaggState; ``process_group`` defaults to the DDP's own.
    Call it on every rank, right after building the DDP model.
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"attach(ddp=...): expected a DistributedDataParallel, got {type(ddp).__name__}")
    kwargs.setdefault("max_elements", trainable_elements(ddp))
    kwargs.setdefault("process_group", ddp.process_group)
    state = XaggState(aggregators, **kwargs)
    ddp.register_comm_hook(state, xagg_hook)
    return state

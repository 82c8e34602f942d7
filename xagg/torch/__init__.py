"""xagg for PyTorch DDP: a communication hook that sums buckets on the aggregators.

    from xagg.torch import XaggState, xagg_hook, attach
    state = XaggState(["10.0.0.101:9000"], control=["10.0.0.101:9979"], token=T,
                      max_elements=sum(p.numel() for p in model.parameters()))
    ddp.register_comm_hook(state, xagg_hook)
    # or, the same in one line:
    state = attach(ddp, ["10.0.0.101:9000"], control=["10.0.0.101:9979"], token=T)

The hook averages like DDP's default, overlaps communication with backward
(a background I/O thread), and falls back to an all_reduce over gloo,
agreed by every rank, whenever the aggregators do not answer.

This package is named ``xagg.torch``; every module in it imports the real
``torch`` by absolute import, so nothing here shadows it.
"""
from xagg.torch.hook import attach, xagg_hook
from xagg.torch.state import XaggState, XaggStateError

__all__ = ["XaggState", "XaggStateError", "attach", "xagg_hook"]

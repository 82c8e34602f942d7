"""Gradient compression for xagg: one interface, seven methods.

    from xagg.compress import get_compressor, make_ddp_hook
    state, hook = make_ddp_hook(get_compressor("sketch:ratio=0.004,warmup=10"))
    ddp_model.register_comm_hook(state, hook)

Methods (``describe()`` lists their options): dense, rgc, mstopk, iwp,
sketch, lossless, int8, int16. All but rgc/mstopk reach the network only
through ``Collectives.allreduce_sum`` / ``allreduce_or`` (and one
``broadcast`` of indices for iwp), so an in-network aggregator can sum them.
See docs/compression.md.
"""
from .base import Compressor, Part, Payload, exchange
from .collectives import Collectives, ThreadGroup, TorchCollectives
from .ddp import HookState, attach, ddp_hook, make_ddp_hook
from .mstopk import mstopk, select
from .registry import METHODS, describe, get_compressor, parse_spec

__all__ = ["Collectives", "Compressor", "HookState", "METHODS", "Part", "Payload", "ThreadGroup",
           "TorchCollectives", "attach", "ddp_hook", "describe", "exchange", "get_compressor",
           "make_ddp_hook", "mstopk", "parse_spec", "select"]

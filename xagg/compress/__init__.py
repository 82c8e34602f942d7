"""Gradient compression for xagg: one interface, seven methods.

    from xagg.compress import get_compressor, make_ddp_hook
    state, hook = make_ddp_hook(get_compressor("sketch:ratio=0.004,warmup=10"))
    ddp_model.register_comm_hook(state, hook)

Methods (``describe()`` lists their options): dense, rgc, mstopk, iwp,
sketch, lossless, int8, int16. All but rgc/mstopk reach the network only
through ``Collectives.allreduce_sum`` / ``allreduce_or`` (and one
``broadcast`` of indices for iwp), so an in-network aggregator can sum them.
See docs/compression.md.

    base.py         Compressor: rounds of Payloads, residual memory, warm-up, rollback
    collectives.py  the only door to the network: Collectives, TorchCollectives, ThreadGroup
    bitmap.py       bitmaps of indices (a bit each): what an OR carries
    registry.py     "NAME[:opt=value,...]" -> a compressor (what --compress takes)
    ddp.py          any compressor as a DDP communication hook (residuals follow parameters)
    dense.py        no compression (the baseline)
    topk.py         rgc and mstopk: residual top-k (RedSync), all-gathered
    select.py       top-k fused with the residual update: one compiled pass (client/csrc/select.c)
    mstopk.py       MSTopK's bisection threshold search in torch (the bench's comparison)
    iwp.py          importance-weighted index sharing (Cheng & Xu)
    sketch.py       count sketch with LayerFusion (Sketch-fusion SGD)
    countsketch.py  the count sketch itself (linear, so sketches add)
    fusion.py       LayerFusion: which layers share one sketch
    lossless.py     index bitmap + count sketch + peeling (lossless homomorphic)
    quant.py        int16 (the aggregators' 16-bit lanes); int8 with error feedback, packed in int32 words
    intsum.py       integer sums: head-room scales for N ranks, narrow lanes packed in int32
    rng.py          randomness every rank agrees on
    selector.py     auto: per bucket, dense or the method predicted fastest, agreed by every rank
    auto.py         auto's cost model and decision (pure: agreed figures in, a choice out)
    optimizers.py   which optimizers train a model: auto can count sparse steps more under Adam's kind
    calibrate.py    what a method costs on this host: compute, bytes, collectives (Loopback)

Imports nothing else of xagg's but the client's compiled library (for the
top-k pass): the transport through the aggregators is
xagg.torch.compressed.XaggCollectives, which brings its fallback with it.
"""
from xagg.compress.base import Compressor, Part, Payload, exchange
from xagg.compress.collectives import Collectives, ThreadGroup, TorchCollectives
from xagg.compress.ddp import HookState, attach, ddp_hook, make_ddp_hook
from xagg.compress.mstopk import mstopk, select
from xagg.compress.registry import METHODS, describe, get_compressor, parse_spec

__all__ = ["Collectives", "Compressor", "HookState", "METHODS", "Part", "Payload", "ThreadGroup",
           "TorchCollectives", "attach", "ddp_hook", "describe", "exchange", "get_compressor",
           "make_ddp_hook", "mstopk", "parse_spec", "select"]

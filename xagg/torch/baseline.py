"""DDP's default all_reduce, timed the way the xagg hook times itself.

``xagg-client run --transport gloo`` attaches this instead of the xagg hook,
so the demo and the bench compare xagg and gloo through the same wrapper
and the same counters (comm time per step: from the step's first bucket
handed to the hook to its last bucket reduced).
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


class TimedAllreduce:
    def __init__(self, process_group=None):
        self.process_group = process_group
        self.stats = {"steps": 0, "buckets_gloo": 0, "seconds_comm": 0.0, "last_step_comm": 0.0}
        self._t_first = None

    def snapshot(self) -> dict:
        return {**self.stats, "mode": "gloo", "transport": "gloo", "fallbacks": 0}


def timed_allreduce_hook(state: TimedAllreduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if state._t_first is None:
        state._t_first = time.perf_counter()
    state.stats["buckets_gloo"] += 1
    fut = allreduce_hook(state.process_group, bucket)
    if not bucket.is_last():
        return fut

    def done(f):
        dt = time.perf_counter() - state._t_first
        state._t_first = None
        state.stats["steps"] += 1
        state.stats["seconds_comm"] += dt
        state.stats["last_step_comm"] = dt
        return f.value()
    return fut.then(done)


def attach_timed_allreduce(ddp) -> TimedAllreduce:
    state = TimedAllreduce(ddp.process_group)
    ddp.register_comm_hook(state, timed_allreduce_hook)
    return state

"""``--compress auto`` where its start-up figures cannot tell the plain hook
from the per-bucket methods (auto.hook_choice: neither is predicted
PLAIN_EDGE faster than the other): each runs a window of steps, and the
faster by measured step time keeps the job.

DDP takes one comm hook per model, so one is registered (``trial_hook``)
and it hands each bucket to the side in use: the compression hook
(xagg.compress.ddp) whose selector is the Auto that made the start-up
choice, or the plain hook (its lanes, its overlap with backward). Both sum
on the run's one job, one after the other: a side's transport (an
XaggState) is opened at the first bucket of its first step and the other's
closed, as every rank does at the same bucket.

A step's time is what passes between the last buckets of two steps, so it
holds backward, the optimizer and any wait for sums; a step that follows
the other side's is not counted (it holds the change). The per-bucket
side runs steps 0..2*window, each bucket on its fastest compressing
method (dense and int16 are what the plain hook's lanes are) and not
revisited before the trial ends; the plain hook the next window + 1. The
medians of each side's last ``window`` steps, the slowest rank's, choose:
every rank enters the same agreement at the same bucket and picks the
same side.

Nothing sent is lost in a change: a bucket going to the plain hook puts
what its method had not sent yet (the selector's residual) into its first
plain sum. Only int16's rounding residual, which the client keeps per
transport, stays behind (under one 16-bit step an element).
"""
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from xagg.compress.ddp import HookState, ddp_hook
from xagg.torch.fallback import agree_max
from xagg.torch.hook import xagg_hook
from xagg.torch.state import XaggState

WINDOW = 3          # steps each side is judged on
PLAIN, BUCKETS = "plain", "per-bucket"


def trial_steps(window: int = WINDOW) -> int:
    """Steps a trial of ``window`` takes before its side is chosen."""
    return 3 * window + 2


@dataclass
class HookTrial:
    """The registered hook's state: the two sides, the step, what each side's
    steps took, and once chosen, the side that keeps the job."""
    buckets: HookState                          # the compression hook's state (its compressor an Auto)
    transport: Optional[XaggState]              # its collectives' job, open at the start
    open_buckets: Callable[[], tuple]           # -> (XaggState, its Collectives), opened anew
    open_plain: Callable[[], XaggState]         # -> the plain hook's XaggState, in its lanes
    lanes: int
    group: object = None                        # the DDP model's process group
    window: int = WINDOW
    said: Callable[[str], None] = print         # told the outcome's line once (every rank)
    clock: Callable[[], float] = time.perf_counter
    plain: Optional[XaggState] = None
    step: int = 0
    chosen: Optional[str] = None
    line: str = ""                              # the outcome, once chosen
    times: dict = field(default_factory=lambda: {PLAIN: [], BUCKETS: []})
    _last: Optional[float] = None               # when the previous step's last bucket came
    _last_side: Optional[str] = None
    _fed: set = field(default_factory=set)      # buckets whose residual went into a plain sum

    def __post_init__(self):
        # the per-bucket side is judged on the methods the plain hook's lanes are not
        self.buckets.compressor.compressing_first(2 * self.window + 1)

    @property
    def decide_at(self) -> int:
        return trial_steps(self.window)

    def side(self) -> str:
        """The side this step's buckets go to."""
        if self.chosen is not None:
            return self.chosen
        return BUCKETS if self.step <= 2 * self.window else PLAIN

    @property
    def compressor(self):
        """The selector once it holds the job (the run's summary says what
        each bucket ended on), else None."""
        return self.buckets.compressor if self.chosen == BUCKETS else None

    def close(self) -> None:
        for st in (self.plain, self.transport):
            if st is not None:
                st.close()

    def use(self, side: str) -> None:
        """Open ``side``'s transport if it is closed, closing the other's."""
        if side == PLAIN and self.plain is None:
            if self.transport is not None:
                self.transport.close()
                self.transport = None
            self.plain = self.open_plain()
        elif side == BUCKETS and self.transport is None:
            if self.plain is not None:
                self.plain.close()
                self.plain = None
            self.transport, self.buckets.collectives = self.open_buckets()

    # -- what the steps took -------------------------------------------------------------
    def step_done(self, side: str) -> None:
        now = self.clock()
        if self._last is not None and self._last_side == side:
            self.times[side].append(now - self._last)
        self._last, self._last_side = now, side
        self.step += 1

    def decide(self) -> str:
        """Both sides' medians agreed over ranks (each the slowest rank's, in
        microseconds), and the faster side; ties keep the plain hook."""
        mine = [round(1e6 * statistics.median(self.times[s][-self.window:])) if self.times[s] else 0
                for s in (PLAIN, BUCKETS)]
        plain_us, buckets_us = agree_max(mine, self.group)
        self.chosen = BUCKETS if 0 < buckets_us < plain_us else PLAIN
        what = (f"plain hook, {self.lanes}-bit lanes" if self.chosen == PLAIN
                else "per-bucket methods in the compression hook")
        self.line = (f"compress auto: {what}, measured: plain hook {plain_us / 1e3:.0f} ms a step, per-bucket "
                     f"methods {buckets_us / 1e3:.0f} ms (the slowest rank's median of {self.window} steps each)")
        self.said(self.line)
        return self.chosen

    # -- residuals ---------------------------------------------------------------------
    def feed_residual(self, bucket: dist.GradBucket) -> None:
        """Put what the per-bucket method left for ``bucket`` into its buffer."""
        name = f"bucket{bucket.index()}"
        if name in self._fed:
            return
        self._fed.add(name)
        buf = bucket.buffer()
        layers = [p.numel() for p in bucket.parameters()]
        flat, r = self.buckets.compressor.take_residual(name, buf.detach().to("cpu", torch.float32), layers)
        if r is not None:
            buf.copy_(flat.view(buf.shape).to(buf.device, buf.dtype))


# no ``from __future__ import annotations`` here: DDP checks the hook's bucket annotation is dist.GradBucket
def trial_hook(t: HookTrial, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if t.chosen is None and t.step == t.decide_at:     # the step's first bucket, on every rank
        t.decide()
    side = t.side()
    t.use(side)
    if side == PLAIN:
        t.feed_residual(bucket)
        fut = xagg_hook(t.plain, bucket)
    else:
        fut = ddp_hook(t.buckets, bucket)
    if bucket.is_last():
        t.step_done(side)
    return fut

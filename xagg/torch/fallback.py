"""Where sums go when the aggregators fail, and when xagg is tried again.

One policy, two drivers: the DDP hook (engine.py, counted in training
steps) and the compression transport (compressed.py, counted in sums).
Both run it on every rank with decisions every rank shares, so the mode is
the same everywhere at every unit:

* a failure agreed by the ranks moves every rank to the fallback
  (torch.distributed on the same ranks) for ``backoff`` units; the next
  back-off doubles, up to ``max_backoff_steps``;
* when the back-off has run out (``due``), ``retry`` has rank 0 register
  the job again (the daemon may have restarted without it) and the ranks
  agree whether it could; a failed retry backs off again and is not
  counted as a new fallback;
* the first unit that succeeds everywhere after a retry is a recovery
  (``succeeded``): the back-off starts from ``backoff_steps`` again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("xagg.torch")


@dataclass(frozen=True)
class Wording:
    """How a driver's log lines name what happens."""
    falls_back: str      # "falling back to gloo all_reduce"
    unit: str            # what a back-off counts: "steps", "sums"
    back: str            # said on recovery: "the aggregators answer again; back on xagg"


HOOK = Wording("falling back to gloo all_reduce", "steps", "the aggregators answer again; back on xagg")


MODES = ("xagg", "gloo")        # a Fallback's modes: on the aggregators, or backing off


@dataclass
class Fallback:
    backoff_steps: int
    max_backoff_steps: int
    mode: str = "xagg"          # or "gloo" while backing off
    reason: str = ""            # why the last fallback happened
    backoff: int = 0            # the length of the next back-off (0: backoff_steps)
    left: int = 0               # units still to go on the fallback
    retrying: bool = False      # back on xagg after a back-off, not yet succeeded
    fallbacks: int = 0
    retries: int = 0
    recoveries: int = 0

    def __post_init__(self):
        self.backoff = self.backoff or self.backoff_steps

    def counters(self) -> dict:
        return {"fallbacks": self.fallbacks, "retries": self.retries, "recoveries": self.recoveries}

    def fail(self, rank: int, reason: str, wording: Wording = HOOK, first: bool | None = None) -> None:
        """Go to the fallback for ``backoff`` units (the same on every rank) and
        double the next back-off. A new fallback is counted and logged as a
        warning; a failed retry (``first`` False; by default: while retrying)
        only at info level."""
        first = not self.retrying if first is None else first
        self.mode, self.reason, self.left, self.retrying = "gloo", reason, self.backoff, False
        if first:
            self.fallbacks += 1
            log.warning("xagg: rank %d: %s: %s; xagg is tried again in %d %s",
                        rank, wording.falls_back, reason, self.backoff, wording.unit)
        else:
            log.info("xagg: rank %d: retry failed (%s); next retry in %d %s", rank, reason, self.backoff,
                     wording.unit)
        self.backoff = min(2 * self.backoff, self.max_backoff_steps)

    def due(self) -> bool:
        """One unit went by on the fallback: whether it is time to retry."""
        self.left -= 1
        return self.left <= 0

    def retry(self, rank: int, register, agree, wording: Wording = HOOK) -> bool:
        """Try xagg again: rank 0 calls ``register()`` -> (ok, reason); every rank
        calls ``agree(failed_here)`` -> whether any rank failed (a collective).
        Back on xagg when none did, else a longer back-off."""
        self.retries += 1
        self.retrying = True
        ok, reason = register() if rank == 0 else (True, "")
        if agree(not ok):
            self.fail(rank, reason or "rank 0 could not register the job", wording)
            return False
        self.mode = "xagg"
        return True

    def succeeded(self, rank: int, wording: Wording = HOOK) -> None:
        """A unit succeeded on every rank: after a retry, that is a recovery."""
        if self.retrying:
            self.recoveries += 1
            self.backoff, self.retrying = self.backoff_steps, False
            log.warning("xagg: rank %d: %s", rank, wording.back)

    def restored(self) -> None:
        """After a checkpoint restore: start on xagg again."""
        self.mode, self.left, self.retrying = "xagg", 0, False


def agree_max(values: list, group) -> list:
    """The elementwise maximum of ``values`` (integers) over the ranks of
    ``group``: a collective every rank enters. How the ranks agree whether
    any failed, and on the highest round any used."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t]

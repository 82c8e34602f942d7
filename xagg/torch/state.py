"""XaggState: what the xagg DDP hook knows between buckets.

The settings (config.py), the counters, the fallback controller
(fallback.py) and the round counter live here and pickle with a
checkpoint; the live part (socket, I/O thread, the private gloo group)
lives in an ``Engine`` that ``__getstate__`` drops and the first hook call
after ``__setstate__`` rebuilds, as torch's own PowerSGDState does with its
process group.
"""
from __future__ import annotations

import logging

import sys
from dataclasses import dataclass

from xagg.client import XaggError, handshake
from xagg.torch.config import HookConfig, HookConfigError
from xagg.torch.fallback import HOOK, Fallback

log = logging.getLogger("xagg.torch")

# Tries at xagg that waited out the timeout since the start, none of them
# answered, after which a run stops trying: the same misconfiguration would
# cost a timeout at every retry for the rest of the run.
GIVE_UP_AFTER = 3

# Counters every rank keeps; `xagg-client status` and the progress line read
# them (with the fallback's: fallbacks, retries, recoveries).
COUNTERS = ("steps", "buckets_xagg", "buckets_gloo", "bytes_xagg", "seconds_xagg", "seconds_gloo",
            "seconds_comm", "last_step_comm", "packets_sent", "retransmits", "results", "redone",
            "max_in_flight",        # the most buckets this rank had in flight at once
            "staged_f32")           # buckets copied to float32 to be summed (float64 ones)


class XaggStateError(ValueError):
    """A bad XaggState argument; the message names it."""


class XaggRequired(XaggError):
    """The aggregators did not sum a step and the run asked for no fallback (require_xagg)."""


@dataclass
class RunFallback(Fallback):
    """The hook's fallback policy (fallback.py) with what a run adds to it:
    ``require`` turns any fallback into an error, and a run on which no try
    has ever been answered stops trying after ``GIVE_UP_AFTER`` of them.

    Every input of these decisions is agreed by the ranks (fail, retry and
    succeeded are called at the same agreed points everywhere), so every
    rank gives up at the same step. ``explain(reason)`` adds what a rank
    knows of the cause to the reason it logs."""
    require: bool = False
    on_xagg_once: bool = False      # a step succeeded on every rank since the start
    unanswered: int = 0             # tries since the start that reached the aggregators and failed
    gave_up: bool = False
    registering: bool = False       # the failure at hand is rank 0's registration, no timeout paid
    explain: object = None          # (reason, registering) -> reason with a hint (not pickled)

    def fail(self, rank: int, reason: str, wording=HOOK, first: bool | None = None) -> None:
        if self.explain is not None and not self.on_xagg_once:
            reason = self.explain(reason, self.registering)
        if self.require:
            self.mode, self.reason = "gloo", reason
            self.fallbacks += 1
            raise XaggRequired(f"require_xagg: the aggregators did not sum a step: {reason}")
        if not self.registering and not self.on_xagg_once:
            self.unanswered += 1
        super().fail(rank, reason, wording, first)
        if not self.on_xagg_once and self.unanswered >= GIVE_UP_AFTER and not self.gave_up:
            self.gave_up, self.left = True, sys.maxsize
            if rank == 0:
                log.error("xagg: giving up on the aggregators for this run: none of %d tries since the "
                          "start was answered, each waited out the timeout; training goes on over gloo. "
                          "Last: %s", self.unanswered, reason)

    def retry(self, rank: int, register, agree, wording=HOOK) -> bool:
        # a retry refused at registration paid no timeout: only a try that sent counts
        self.registering = True
        try:
            return super().retry(rank, register, agree, wording)
        finally:
            self.registering = False

    def succeeded(self, rank: int, wording=HOOK) -> None:
        self.on_xagg_once = True
        super().succeeded(rank, wording)

    def restored(self) -> None:
        super().restored()      # a restored run starts over: its tries too
        self.on_xagg_once, self.unanswered, self.gave_up = False, 0, False

    def __getstate__(self):
        return {**self.__dict__, "explain": None}


class XaggState:
    """State of the xagg DDP communication hook, one per DDP model and rank.

    Construct it on every rank at the same point (it is a collective, like
    DDP itself; it creates a private gloo group, which every rank of the
    default group must enter): rank 0 picks or takes the job id and
    cookie, registers the job with the aggregators' daemons when ``control``
    is given, and tells the other ranks. Call ``close()`` before
    ``destroy_process_group()`` (``xagg-client run`` does): the hook may still
    be settling the last step, over the store and its own gloo group.

    aggregators     "HOST[:PORT]" list (or a comma-separated string)
    process_group   ranks that train together (default: the world); rank = worker id
    max_elements    largest bucket, in elements; registration sizes the job with it
    settings        any field of xagg.torch.config.HookConfig: control, token, job_id,
                    cookie, weights, fanout, timeout, rto, window, vals, require_xagg,
                    backoff_steps, max_backoff_steps, status_dir, progress_every, lanes
    """

    def __init__(self, aggregators, *, process_group=None, max_elements: int | None = None,
                 start: bool = True, **settings):
        try:
            self.config = cfg = HookConfig(aggregators, **settings)
        except HookConfigError as e:
            raise XaggStateError(f"XaggState({e.field}=...): {e.explain()}") from None
        if not (max_elements is None or (isinstance(max_elements, int) and max_elements > 0)):
            raise XaggStateError(f"XaggState(max_elements=...): must be a positive integer, got {max_elements!r}")
        if cfg.registers and max_elements is None:
            raise XaggStateError("XaggState(max_elements=...): registration sizes the job by its largest "
                                 "bucket: give max_elements (or use xagg.torch.attach(ddp, ...), which "
                                 "counts the model's parameters)")
        self.process_group, self.max_elements = process_group, max_elements
        # the job as it turns out: rank 0 may pick the id and cookie, the daemons say vals
        self.job_id, self.cookie, self.vals = cfg.job_id, cfg.cookie, cfg.vals
        # what every rank agrees on, step after step (agreement.py)
        self.rounds = [0] * cfg.lanes   # next aggregator round per lane (lanes.py), 64-bit (the
                                        # wire carries 32); each engine starts them at a fresh
                                        # random base
        self.fallback = RunFallback(cfg.backoff_steps, cfg.max_backoff_steps, require=cfg.require_xagg,
                                    explain=self.explain)
        self.stats = {k: 0 for k in COUNTERS}
        self._engine = None
        self.kept: list = []            # per lane, what a closed engine's lanes learned (buckets.Kept)
        if start:
            self.start()

    @property
    def round(self) -> int:
        """Lane 0's next round (the job's own; the only lane unless HookConfig.lanes > 1)."""
        return self.rounds[0]

    @round.setter
    def round(self, value: int) -> None:
        self.rounds[0] = value

    @property
    def mode(self) -> str:
        """The mode every rank is in: "xagg", or "gloo" while backing off after a failure."""
        return self.fallback.mode

    @property
    def reason(self) -> str:
        """Why the last fallback happened."""
        return self.fallback.reason

    # -- the live part --------------------------------------------------------
    def start(self) -> "XaggState":
        """Connect (collective over the process group); the hook calls it if needed."""
        if self._engine is None:
            from xagg.torch.engine import Engine
            self._engine = Engine(self)
        return self

    def submit(self, bucket):
        """Hand a DDP GradBucket to the I/O thread (connecting first if needed):
        a Future of its average over the ranks."""
        return self.start()._engine.submit(bucket)

    @property
    def client(self):
        """The live xagg.client.Client (for transports built on this job, e.g.
        xagg.torch.compressed.XaggCollectives); None before start()."""
        return self._engine.client if self._engine else None

    @property
    def started(self) -> bool:
        return self._engine is not None

    def close(self, keep: bool = False) -> None:
        """Stop the I/O thread and close the socket (the job stays registered).
        ``keep``: hold what its clients learned (predicted exponents, 16-bit
        residuals, packet layouts, sum buffers: about four times the model's
        gradient) for the next ``start()``, which goes on from it; else it
        is let go (a closed state that was kept lets it go now)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if not keep:
            self.kept = []

    def snapshot(self) -> dict:
        """Counters and mode, as `xagg-client status` shows them."""
        eng = self._engine
        s = {**self.stats, **self.fallback.counters()}
        s.update(transport="xagg", job_id=self.job_id, mode=self.mode, reason=self.reason,
                 aggregators=self.config.aggregators, rank=eng.rank if eng else None,
                 planned_out=[k for k in range(len(self.config.aggregators)) if eng and eng.aggs.out >> k & 1],
                 world=eng.world if eng else None)
        # per lane: how its packets go (udp, afxdp) and where AF_XDP runs or why not
        clients = [lane.client for lane in eng.lanes if lane.client] if eng else []
        s.update(path=[c.stats.path for c in clients], path_reason=[c.stats.path_reason for c in clients])
        secs = s["seconds_xagg"]
        s["bandwidth_gbps"] = s["bytes_xagg"] * 8 / secs / 1e9 if secs else 0.0
        return s

    def explain(self, reason: str, registering: bool = False) -> str:
        """``reason`` with the settings to check when no aggregator has ever
        answered this rank: then the cause is this run's settings far more
        often than a failure of the aggregators."""
        if registering:
            return f"{reason} - check --control (the daemons' control endpoints, XAGG_CONTROL) and the token"
        if self.stats["results"]:
            return reason
        if not self.config.registers:
            mine = f"{self.vals} values per packet"
            why = handshake.problem(handshake.ask(self.config.aggregators, self.job_id, self.cookie),
                                    self.job_id, self.vals)
            if why:         # what the aggregators themselves say is wrong
                return f"{reason} - {why}"
        else:
            mine = f"{self.vals} values per packet, as its daemons answered at registration"
        return (f"{reason} - no aggregator has answered this run: check -a/--aggregators (the daemons' data "
                f"address and port), --job-id/--cookie and --vals ({mine})")

    def reregister(self) -> tuple[bool, str]:
        """Register the job with the daemons again (rank 0, after a back-off: a
        daemon may have restarted without it): (ok, why not)."""
        if self._engine is None or not self.config.registers:
            return True, ""
        return self._engine.aggs.register()

    # -- checkpoints: drop the connection, keep the configuration and counters ----
    def __getstate__(self):
        d = dict(self.__dict__)
        d["_engine"] = None
        d["kept"] = []                  # a restored run learns again
        d["process_group"] = None       # not picklable; the default group on restore
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.__dict__.setdefault("kept", [])
        self.fallback.explain = self.explain
        # a restored run starts on xagg again (after a fresh registration when it registers)
        self.fallback.restored()
        if self.process_group is None:
            log.info("xagg: restored hook state for job %s; it reconnects on the first bucket, "
                     "on the default process group", self.job_id)

    def __repr__(self):
        return (f"XaggState(job_id={self.job_id}, aggregators={self.config.aggregators}, mode={self.mode!r}, "
                f"steps={self.stats['steps']}, fallbacks={self.fallback.fallbacks})")

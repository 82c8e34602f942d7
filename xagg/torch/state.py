"""XaggState: what the xagg DDP hook knows between buckets.

The configuration (aggregators, job, timeouts, back-off), the counters and
the round counter live here and pickle with a checkpoint; the live part
(socket, I/O thread, the private gloo group) lives in an ``Engine`` that
``__getstate__`` drops and the first hook call after ``__setstate__``
rebuilds, as torch's own PowerSGDState does with its process group.
"""
from __future__ import annotations

import logging
import numbers

from xagg.client import XaggError, parse_addr
from xagg.proto import JUMBO_MTU, MAX_VALS_FOR_MTU

log = logging.getLogger("xagg.torch")

FANOUTS = ("unicast", "bcast")

# Counters every rank keeps; `xagg-client status` and the progress line read them.
COUNTERS = ("steps", "buckets_xagg", "buckets_gloo", "fallbacks", "retries", "recoveries",
            "bytes_xagg", "seconds_xagg", "seconds_gloo", "seconds_comm", "last_step_comm",
            "packets_sent", "retransmits", "results", "redone")


class XaggStateError(ValueError):
    """A bad XaggState argument; the message names it."""


def _need(cond: bool, arg: str, why: str) -> None:
    if not cond:
        raise XaggStateError(f"XaggState({arg}=...): {why}")


def _split(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    return list(value)


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
    job_id, cookie  a job registered by the operator; default: rank 0 picks random ones
    weights         share of every bucket per aggregator (default: equal)
    control         xaggd control endpoints, one per aggregator ("HOST:PORT" or a Unix
                    socket path); with them rank 0 registers (and resets) the job
    token           the daemons' control token (TCP control)
    max_elements    largest bucket, in elements; registration sizes the job with it
    fanout          "unicast" (always works) or "bcast" (one rank per host only)
    timeout         seconds without progress before a bucket counts as failed
    rto, window     the client's retransmit timeout and packets in flight
    vals            int32 values per packet, as the aggregators run them (xaggd --vals);
                    default: what the daemons answer at registration, else 256
    backoff_steps   training steps on gloo after a failure before trying xagg again;
                    doubles on every failed retry up to max_backoff_steps
    status_dir      write this rank's counters to STATUS_DIR/rank<R>.json (xagg-client status)
    progress_every  seconds between progress lines on rank 0 (0: none)
    """

    def __init__(self, aggregators, *, process_group=None, job_id: int | None = None,
                 cookie: int | None = None, weights=None, control=None, token: str | None = None,
                 max_elements: int | None = None, fanout: str = "unicast", timeout: float = 5.0,
                 rto: float = 0.05, window: int = 512, vals: int | None = None, backoff_steps: int = 10,
                 max_backoff_steps: int = 1000, status_dir: str | None = None,
                 progress_every: float = 0.0, start: bool = True):
        self.aggregators = _split(aggregators)
        _need(bool(self.aggregators), "aggregators", "at least one HOST[:PORT] is needed")
        for a in self.aggregators:
            _need(isinstance(a, str), "aggregators", f"entries must be 'HOST[:PORT]' strings, got {a!r}")
            try:
                parse_addr(a)
            except XaggError as e:
                raise XaggStateError(f"XaggState(aggregators=...): {e}") from None
        self.weights = None if weights is None else [float(w) for w in _split(weights)]
        if self.weights is not None:
            _need(len(self.weights) == len(self.aggregators), "weights",
                  f"{len(self.weights)} weights for {len(self.aggregators)} aggregators")
            _need(all(w >= 0 for w in self.weights) and sum(self.weights) > 0, "weights",
                  f"must be >= 0 and not all zero, got {self.weights}")
        for name, v in (("job_id", job_id), ("cookie", cookie)):
            _need(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32),
                  name, f"must be an unsigned 32-bit integer, got {v!r}")
        self.control = _split(control)
        _need(not self.control or len(self.control) == len(self.aggregators), "control",
              f"one control endpoint per aggregator: {len(self.control)} for {len(self.aggregators)}")
        _need(self.control or (job_id is not None and cookie is not None), "control",
              "without control endpoints nobody registers the job: give control=[...] (xaggd), "
              "or job_id and cookie of a job registered by the operator")
        _need(token is None or isinstance(token, str), "token", f"must be a string, got {type(token).__name__}")
        _need(max_elements is None or (isinstance(max_elements, int) and max_elements > 0), "max_elements",
              f"must be a positive integer, got {max_elements!r}")
        _need(not self.control or max_elements is not None, "max_elements",
              "registration sizes the job by its largest bucket: give max_elements "
              "(or use xagg.torch.attach(ddp, ...), which counts the model's parameters)")
        _need(fanout in FANOUTS, "fanout", f"must be one of {FANOUTS}, got {fanout!r}")
        for name, v in (("timeout", timeout), ("rto", rto)):
            _need(isinstance(v, numbers.Real) and v > 0, name, f"must be > 0 seconds, got {v!r}")
        _need(rto < timeout, "rto", f"({rto}s) must be shorter than timeout ({timeout}s)")
        _need(isinstance(window, int) and window > 0, "window", f"must be a positive integer, got {window!r}")
        _need(vals is None or (isinstance(vals, int) and not isinstance(vals, bool)
                               and 1 <= vals <= MAX_VALS_FOR_MTU(JUMBO_MTU)), "vals",
              f"must be 1..{MAX_VALS_FOR_MTU(JUMBO_MTU)} values per packet, got {vals!r}")
        for name, v in (("backoff_steps", backoff_steps), ("max_backoff_steps", max_backoff_steps)):
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
                  f"must be a positive number of steps, got {v!r}")
        _need(max_backoff_steps >= backoff_steps, "max_backoff_steps",
              f"({max_backoff_steps}) must be >= backoff_steps ({backoff_steps})")
        _need(isinstance(progress_every, numbers.Real) and progress_every >= 0, "progress_every",
              f"must be >= 0 seconds, got {progress_every!r}")

        self.process_group = process_group
        self.job_id, self.cookie, self.token = job_id, cookie, token
        self.max_elements, self.fanout = max_elements, fanout
        self.timeout, self.rto, self.window, self.vals = float(timeout), float(rto), window, vals
        self.backoff_steps, self.max_backoff_steps = backoff_steps, max_backoff_steps
        self.status_dir, self.progress_every = status_dir, float(progress_every)
        # what every rank agrees on, step after step (see engine.py)
        self.round = 0                  # next aggregator round, 64-bit (the wire carries 32)
        self.mode = "xagg"              # or "gloo" while backing off
        self.backoff = backoff_steps    # length of the next back-off
        self.backoff_left = 0
        self.reason = ""                # why the last fallback happened
        self.stats = {k: 0 for k in COUNTERS}
        self._engine = None
        if start:
            self.start()

    @property
    def register(self) -> bool:
        return bool(self.control)

    # -- the live part --------------------------------------------------------
    def start(self) -> "XaggState":
        """Connect (collective over the process group); the hook calls it if needed."""
        if self._engine is None:
            from xagg.torch.engine import Engine
            self._engine = Engine(self)
        return self

    @property
    def client(self):
        """The live xagg.client.Client (for transports built on this job, e.g.
        xagg.compress.XaggCollectives); None before start()."""
        return self._engine.client if self._engine else None

    @property
    def started(self) -> bool:
        return self._engine is not None

    def close(self) -> None:
        """Stop the I/O thread and close the socket (the job stays registered)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def snapshot(self) -> dict:
        """Counters and mode, as `xagg-client status` shows them."""
        eng = self._engine
        s = dict(self.stats)
        s.update(transport="xagg", job_id=self.job_id, mode=self.mode, reason=self.reason,
                 aggregators=self.aggregators, rank=eng.rank if eng else None,
                 world=eng.world if eng else None)
        secs = s["seconds_xagg"]
        s["bandwidth_gbps"] = s["bytes_xagg"] * 8 / secs / 1e9 if secs else 0.0
        return s

    def fall_back(self, rank: int, reason: str, first: bool,
                  what: str = "falling back to gloo all_reduce", unit: str = "steps") -> None:
        """Go to the fallback for ``backoff`` units (the same on every rank), log
        why (a new fallback is counted; a failed retry is not), and double the
        next back-off."""
        self.mode, self.reason, self.backoff_left = "gloo", reason, self.backoff
        if first:
            self.stats["fallbacks"] += 1
            log.warning("xagg: rank %d: %s: %s; xagg is tried again in %d %s",
                        rank, what, reason, self.backoff, unit)
        else:
            log.info("xagg: rank %d: retry failed (%s); next retry in %d %s", rank, reason, self.backoff, unit)
        self.backoff = min(2 * self.backoff, self.max_backoff_steps)

    # -- checkpoints: drop the connection, keep the configuration and counters ----
    def __getstate__(self):
        d = dict(self.__dict__)
        d["_engine"] = None
        d["process_group"] = None       # not picklable; the default group on restore
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        # a restored run starts on xagg again (after a fresh registration when it registers)
        self.mode, self.backoff_left = "xagg", 0
        if self.process_group is None:
            log.info("xagg: restored hook state for job %s; it reconnects on the first bucket, "
                     "on the default process group", self.job_id)

    def __repr__(self):
        return (f"XaggState(job_id={self.job_id}, aggregators={self.aggregators}, mode={self.mode!r}, "
                f"steps={self.stats['steps']}, fallbacks={self.stats['fallbacks']})")

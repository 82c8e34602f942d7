"""The xagg hook's settings: one dataclass for its defaults and its checks.

Three doors lead here, and all of them take the same defaults and report a
bad value naming what the user wrote:

* ``XaggState(aggregators, **settings)``: keyword arguments,
  ``XaggState(timeout=...): must be > 0 seconds``;
* ``xagg-client run``: flags, ``--weights: 2 weights for 3 aggregators``;
* the ranks ``xagg-client run`` starts: ``XAGG_*`` variables (``to_env`` /
  ``from_env``), ``XAGG_TIMEOUT='x': expected a number``.

The client's own defaults (fan-out, timeout, retransmit timeout, window)
come from xagg.client.config; the back-off is the hook's.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field

from xagg.client.config import DEFAULT_RTO, DEFAULT_TIMEOUT
from xagg.torch.lanes import MAX_LANES
from xagg.wire import chunks
from xagg.wire.jobspec import DEFAULT_FANOUT, FANOUTS
from xagg.wire.proto import MAX_VALS, parse_addr

DEFAULT_BACKOFF_STEPS = 10          # steps on gloo after a failure before xagg is tried again
DEFAULT_MAX_BACKOFF_STEPS = 1000    # the back-off doubles on every failed retry, up to this

# field -> the XAGG_* variable that carries it to the ranks
ENV = {"aggregators": "XAGG_AGGREGATORS", "control": "XAGG_CONTROL", "token": "XAGG_TOKEN",
       "job_id": "XAGG_JOB_ID", "cookie": "XAGG_COOKIE", "weights": "XAGG_WEIGHTS", "fanout": "XAGG_FANOUT",
       "timeout": "XAGG_TIMEOUT", "rto": "XAGG_RTO", "window": "XAGG_WINDOW", "vals": "XAGG_VALS",
       "backoff_steps": "XAGG_BACKOFF", "max_backoff_steps": "XAGG_MAX_BACKOFF",
       "status_dir": "XAGG_STATUS_DIR", "progress_every": "XAGG_PROGRESS", "plan": "XAGG_PLAN",
       "routes": "XAGG_ROUTES", "metrics": "XAGG_METRICS", "lanes": "XAGG_LANES"}
_ENV_TYPES = {**dict.fromkeys(("job_id", "cookie", "window", "vals", "backoff_steps", "max_backoff_steps",
                                "lanes"),
                               (lambda s: int(s, 0), "an integer")),
              **dict.fromkeys(("timeout", "rto", "progress_every"), (float, "a number")),
              "routes": (json.loads, "JSON: a list per worker of one aggregator index per aggregator")}
PLANS = ("off", "auto")
# what xagg-client run tells the ranks to attach, beside the hook's settings
TRANSPORT_ENV, COMPRESS_ENV, VERBOSE_ENV = "XAGG_TRANSPORT", "XAGG_COMPRESS", "XAGG_VERBOSE"


_UNSHOWN = object()
_OTHER = re.compile(r"<(\w+)>")


class HookConfigError(ValueError):
    """A setting that cannot be used: ``field`` names it, ``explain()`` says
    what it must be. A reason that refers to other settings writes them as
    ``<name>``, so each door names them its own way (flags, variables)."""

    def __init__(self, name: str, why: str, value=_UNSHOWN):
        self.field, self.template, self.value = name, why, value
        super().__init__(f"{name}: {self.explain()}" if value is _UNSHOWN
                         else f"{name}={value!r}: {self.explain()}")

    def explain(self, names: dict | None = None) -> str:
        """The reason, other settings named as in ``names`` (default: field names)."""
        names = names or {}
        return _OTHER.sub(lambda m: names.get(m.group(1), m.group(1)), self.template)


def _split(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    return list(value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class HookConfig:
    """aggregators      "HOST[:PORT]" list (or one comma-separated string)
    control          xaggd control endpoints, one per aggregator ("HOST:PORT" or a Unix
                     socket path); with them rank 0 registers (and resets) the job
    token            the daemons' control token (TCP control)
    job_id, cookie   a job registered by the operator; default: rank 0 picks random ones
    weights          share of every tensor per aggregator (default: equal)
    fanout           "unicast" (always works) or "bcast" (one rank per host, a flat LAN)
    timeout          seconds without progress before a bucket counts as failed
    rto              the floor of the client's retransmit timeout
    window           packets in flight per aggregator (default: the client's byte window)
    vals             int32 values per packet, as the aggregators run them (xaggd --vals);
                     default: what the daemons answer at registration, else the wire default
    backoff_steps    training steps on gloo after a failure before trying xagg again;
                     doubles on every failed retry up to max_backoff_steps
    status_dir       write each rank's counters to STATUS_DIR/rank<R>.json (xagg-client status)
    progress_every   seconds between progress lines on rank 0 (0: none)
    plan             "auto": the weights (and routes) came from the planner (xagg.wire.planner),
                     which `xagg-client run --plan auto` runs at start; "off" (default): as given
    routes           the plan's routes[w][p] = c (worker w sends aggregator p's chunks through
                     aggregator c, a child that sends one partial to p): the engine registers
                     the tree and gives each rank its row
    metrics          "HOST:PORT": each rank serves Prometheus text at http://HOST:PORT+L/metrics,
                     L its local rank (torchrun's LOCAL_RANK, else its rank): fallbacks,
                     retransmits, bytes, step comm time, mode
    lanes            buckets in flight at once (xagg/torch/lanes.py): lane L is a job of its
                     own, ids <job_id>, <job_id>+1, ... and broadcast result ports 9001, 9002, ...
                     (rank 0 registers them all given <control>; an operator who registers
                     jobs by hand registers each lane's); 1: one bucket at a time
    """
    aggregators: list
    control: list = field(default_factory=list)
    token: str | None = None
    job_id: int | None = None
    cookie: int | None = None
    weights: list | None = None
    fanout: str = DEFAULT_FANOUT
    timeout: float = DEFAULT_TIMEOUT
    rto: float = DEFAULT_RTO
    window: int | None = None
    vals: int | None = None
    backoff_steps: int = DEFAULT_BACKOFF_STEPS
    max_backoff_steps: int | None = None       # None: DEFAULT_MAX_BACKOFF_STEPS, or backoff_steps if larger
    status_dir: str | None = None
    progress_every: float = 0.0
    plan: str = "off"
    routes: list | None = None
    metrics: str | None = None
    lanes: int = 1

    def __post_init__(self):
        self.aggregators, self.control = _split(self.aggregators), _split(self.control)
        if self.weights is not None:
            self.weights = _split(self.weights)
        if self.max_backoff_steps is None and _is_int(self.backoff_steps):
            self.max_backoff_steps = max(DEFAULT_MAX_BACKOFF_STEPS, self.backoff_steps)
        self.validate()

    def validate(self) -> "HookConfig":
        def need(ok, name, why):
            if not ok:
                raise HookConfigError(name, why)
        need(bool(self.aggregators), "aggregators", "at least one HOST[:PORT] is needed")
        for a in self.aggregators:
            need(isinstance(a, str), "aggregators", f"entries must be 'HOST[:PORT]' strings, got {a!r}")
            try:
                parse_addr(a)
            except ValueError as e:
                need(False, "aggregators", str(e))
        if self.weights is not None:
            try:
                self.weights = chunks.check_weights(self.weights, len(self.aggregators))
            except ValueError as e:
                need(False, "weights", str(e))
        for name in ("job_id", "cookie"):
            v = getattr(self, name)
            need(v is None or (_is_int(v) and 0 <= v < 2**32), name,
                 f"must be an unsigned 32-bit integer, got {v!r}")
        need(not self.control or len(self.control) == len(self.aggregators), "control",
             f"one control endpoint per aggregator: {len(self.control)} for {len(self.aggregators)}")
        need(self.control or (self.job_id is not None and self.cookie is not None), "control",
             "nobody registers the job: give <control> (the xaggd endpoints; rank 0 registers it) "
             "or <job_id> and <cookie> of a job the operator registered")
        need(self.token is None or isinstance(self.token, str), "token",
             f"must be a string, got {type(self.token).__name__}")
        need(self.fanout in FANOUTS, "fanout", f"must be one of {', '.join(sorted(FANOUTS))}, got {self.fanout!r}")
        for name in ("timeout", "rto"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf, name,
                 f"must be > 0 seconds, got {v!r}")
        need(self.rto < self.timeout, "rto", f"({self.rto}s) must be shorter than <timeout> ({self.timeout}s)")
        need(self.window is None or (_is_int(self.window) and self.window > 0), "window",
             f"must be a positive integer, got {self.window!r}")
        need(self.vals is None or (_is_int(self.vals) and 1 <= self.vals <= MAX_VALS), "vals",
             f"must be 1..{MAX_VALS} values per packet, got {self.vals!r}")
        for name in ("backoff_steps", "max_backoff_steps"):
            v = getattr(self, name)
            need(_is_int(v) and v >= 1, name, f"must be a positive number of steps, got {v!r}")
        need(self.max_backoff_steps >= self.backoff_steps, "max_backoff_steps",
             f"({self.max_backoff_steps}) must be >= <backoff_steps> ({self.backoff_steps})")
        need(isinstance(self.progress_every, (int, float)) and self.progress_every >= 0, "progress_every",
             f"must be >= 0 seconds, got {self.progress_every!r}")
        need(_is_int(self.lanes) and 1 <= self.lanes <= MAX_LANES, "lanes",
             f"must be 1..{MAX_LANES} buckets in flight, got {self.lanes!r}")
        need(self.plan in PLANS, "plan", f"must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.routes is not None:
            n = len(self.aggregators)
            need(isinstance(self.routes, list) and all(
                isinstance(row, list) and len(row) == n and all(_is_int(c) and 0 <= c < n for c in row)
                for row in self.routes), "routes",
                f"must be a list per worker of {n} aggregator indices 0..{n - 1}, got {self.routes!r}")
        if self.metrics is not None:
            try:
                parse_addr(self.metrics)
                ok = ":" in self.metrics
            except (ValueError, TypeError):
                ok = False
            need(ok, "metrics", f"must be HOST:PORT (rank L serves PORT+L), got {self.metrics!r}")
        return self

    @property
    def registers(self) -> bool:
        """Rank 0 registers the job with the daemons (control endpoints given)."""
        return bool(self.control)

    # -- to the ranks and back: XAGG_* variables --------------------------------------
    def to_env(self) -> dict[str, str]:
        """The settings as XAGG_* variables (defaults left out)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v == [] or v == f.default:
                continue
            if f.name == "routes":
                out[ENV[f.name]] = json.dumps(v, separators=(",", ":"))
                continue
            out[ENV[f.name]] = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        return out

    @classmethod
    def from_env(cls, env) -> "HookConfig":
        """The settings the XAGG_* variables in ``env`` hold. HookConfigError
        names the variable: ``XAGG_TIMEOUT='x': expected a number``."""
        kw = {}
        for name, var in ENV.items():
            raw = env.get(var)
            if raw in (None, ""):
                continue
            parse, what = _ENV_TYPES.get(name, (str, ""))
            try:
                kw[name] = parse(raw)
            except ValueError:
                raise HookConfigError(var, f"expected {what}", raw) from None
        if "aggregators" not in kw:
            raise HookConfigError(ENV["aggregators"], "not set (HOST[:PORT],...): run the script with "
                                                      "xagg-client run")
        try:
            return cls(**kw)
        except HookConfigError as e:
            var = ENV[e.field]
            raise HookConfigError(var, e.explain(ENV), *([env[var]] if env.get(var) else [])) from None

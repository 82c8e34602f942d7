"""The xagg hook's settings, each declared once: its default, its XAGG_*
variable, its ``xagg-client run`` flag, its help and its check.

``HookConfig``'s fields are the table: each is a ``setting(...)``, and
``SETTINGS`` lists their rows in field order. Three doors lead here, and all
of them take the same defaults and report a bad value naming what the user
wrote:

* ``XaggState(aggregators, **settings)``: keyword arguments,
  ``XaggState(timeout=...): must be > 0 seconds``;
* ``xagg-client run``: the flags cli.py makes from the table,
  ``--weights: 2 weights for 3 aggregators``;
* the ranks ``xagg-client run`` starts: ``XAGG_*`` variables (``to_env`` /
  ``from_env``), ``XAGG_TIMEOUT='x': expected a number``.

Every check runs once, at the door (``validate``, in field order, so a check
may use the settings above it); the checks the client shares live in
xagg.client.config, and a checked HookConfig builds its ClientConfigs
without checking them again (``client_config``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field

from xagg.client.config import (
    DEFAULT_PATH,
    DEFAULT_RTO,
    DEFAULT_TIMEOUT,
    PATHS,
    ClientConfig,
    check_aggregators,
    check_fanout,
    check_path,
    check_result_group,
    check_route,
    check_rto,
    check_seconds,
    check_vals,
    check_weights,
    check_wire_bits,
    is_int,
    name_others,
)
from xagg.torch.lanes import MAX_LANES
from xagg.wire.addresses import parse_addr
from xagg.wire.control import parse_address
from xagg.wire.fanout import AUTO, CHOICES, DEFAULT_GROUP, Fanout, ResultPath
from xagg.wire.jobspec import DEFAULT_RESULT_PORT
from xagg.wire.proto import C

DEFAULT_BACKOFF_STEPS = 10          # steps on gloo after a failure before xagg is tried again
DEFAULT_MAX_BACKOFF_STEPS = 1000    # the back-off doubles on every failed retry, up to this
PLANS = ("off", "auto")
LOCAL_REDUCE = ("auto", "on", "off")     # local_reduce.py
# what xagg-client run tells the ranks to attach, beside the hook's settings
TRANSPORT_ENV, COMPRESS_ENV, VERBOSE_ENV = "XAGG_TRANSPORT", "XAGG_COMPRESS", "XAGG_VERBOSE"

_UNSHOWN = object()


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
        return name_others(self.template, names)


# -- the table's columns ---------------------------------------------------------------
@dataclass(frozen=True)
class Text:
    """How a setting is written as text (a flag, an XAGG_* variable) and read back."""
    name: str                                   # a flag's metavar
    parse: Callable[[str], object]
    what: str                                   # what a text that does not parse should have been
    show: Callable[[object], str] = str


TEXT = Text("TEXT", str, "text")
LIST = Text("LIST", str, "a comma-separated list", lambda v: ",".join(map(str, v)))     # split by the check
INT = Text("INTEGER", lambda s: int(s, 0), "an integer")
NUMBER = Text("NUMBER", float, "a number")
BOOL = Text("BOOL", lambda s: {"1": True, "true": True, "yes": True, "0": False, "false": False,
                               "no": False}[s.strip().lower()], "1/true/yes or 0/false/no",
            lambda v: "1" if v else "0")
ROWS = Text("JSON", json.loads, "JSON: a list per worker of one aggregator index per aggregator",
            lambda v: json.dumps(v, separators=(",", ":")))


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()      # the default of a setting that has none


@dataclass(frozen=True)
class Setting:
    """One row: a HookConfig field (and XaggState keyword) as every door sees it."""
    env: str                                    # the XAGG_* variable that carries it to the ranks
    flag: str | None                            # xagg-client run's, "-a/--aggregators"; None: no flag
    help: str                                   # other settings written <name>
    check: Callable                             # (value, config) -> the value as used; ValueError says why
    text: Text = TEXT
    choices: tuple = ()                         # the values a flag offers
    metavar: str | None = None
    flag_default: object = None                 # the flag's own default, where it differs
    flag_file: bool = False                     # the flag names a file holding the value (a secret)
    name: str = ""                              # filled in from the field
    default: object = REQUIRED                  # filled in from the field

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(self.flag.split("/")) if self.flag else ()


_ROW = "xagg.setting"


def setting(default=REQUIRED, **row) -> dataclasses.Field:
    """A HookConfig field whose metadata holds the rest of its row."""
    kw = {"default_factory": list} if isinstance(default, list) else {"default": default}
    return field(**({} if default is REQUIRED else kw), metadata={_ROW: Setting(**row)})


# -- the checks no other layer shares (the rest are xagg.client.config's) ---------------
def _split(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    return list(value)


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


def _aggregators(value, cfg) -> list[str]:
    addrs = _split(value)
    for a in addrs:
        _need(isinstance(a, str), f"entries must be 'HOST[:PORT]' strings, got {a!r}")
    check_aggregators(addrs)
    return addrs


def _control(value, cfg) -> list[str]:
    eps, n = _split(value), len(cfg.aggregators)
    for ep in eps:
        parse_address(ep)           # a port out of range says so here, not at registration
    _need(not eps or len(eps) == n, f"one control endpoint per aggregator: {len(eps)} for {n}")
    _need(eps or (cfg.job_id is not None and cfg.cookie is not None),
          "nobody registers the job: give <control> (the xaggd endpoints; rank 0 registers it) "
          "or <job_id> and <cookie> of a job the operator registered")
    return eps


def _u32_or_none(value, cfg):
    _need(value is None or (is_int(value) and 0 <= value < 2**32), f"must be an unsigned 32-bit integer, got {value!r}")
    return value


def _token(value, cfg):
    _need(value is None or isinstance(value, str), f"must be a string, got {type(value).__name__}")
    return value


def _steps(value, cfg) -> int:
    _need(is_int(value) and value >= 1, f"must be a positive number of steps, got {value!r}")
    return value


def _max_backoff(value, cfg) -> int:
    if value is None:
        return max(DEFAULT_MAX_BACKOFF_STEPS, cfg.backoff_steps)    # never below the back-off
    _steps(value, cfg)
    _need(value >= cfg.backoff_steps, f"({value}) must be >= <backoff_steps> ({cfg.backoff_steps})")
    return value


def _positive_or_none(value):
    _need(value is None or (is_int(value) and value > 0), f"must be a positive integer, got {value!r}")
    return value


def _status_dir(value, cfg):
    _need(value is None or (isinstance(value, str) and not os.path.isfile(value)),
          f"must be a directory, got {value!r}")
    return value


def _bool(value) -> bool:
    _need(isinstance(value, bool), f"must be True or False, got {value!r}")
    return value


def _progress(value, cfg):
    _need(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
          f"must be >= 0 seconds, got {value!r}")
    return value


def _routes(value, cfg):
    if value is None:
        return None
    n = len(cfg.aggregators)
    _need(isinstance(value, list), f"must be a list per worker of {n} aggregator indices 0..{n - 1}, got {value!r}")
    rows = []
    for w, row in enumerate(value):
        try:
            rows.append(check_route(row, n))
        except ValueError as e:
            raise ValueError(f"worker {w}'s row {e}") from None
    return rows


def _metrics(value, cfg):
    if value is not None:
        try:
            parse_addr(value)
            ok = ":" in value
        except (ValueError, TypeError):
            ok = False
        _need(ok, f"must be HOST:PORT (rank L serves PORT+L), got {value!r}")
    return value


def _lanes(value, cfg) -> int:
    _need(is_int(value) and 1 <= value <= MAX_LANES, f"must be 1..{MAX_LANES} buckets in flight, got {value!r}")
    return value


def _local_reduce(value, cfg) -> str:
    _need(value in LOCAL_REDUCE, f"must be one of {', '.join(LOCAL_REDUCE)}, got {value!r}")
    return value


def _fanout(value, cfg) -> str:
    try:
        return value if value == AUTO else check_fanout(value)
    except ValueError:
        raise ValueError(f"must be one of {', '.join(CHOICES)}, got {value!r}") from None


def _plan(value, cfg) -> str:
    _need(value in PLANS, f"must be one of {', '.join(PLANS)}, got {value!r}")
    return value


@dataclass
class HookConfig:
    """The xagg hook's settings (keyword arguments of XaggState and
    xagg.torch.attach; flags of xagg-client run; XAGG_* variables):
    """
    aggregators: list = setting(
        env="XAGG_AGGREGATORS", flag="-a/--aggregators", text=LIST, metavar="HOST[:PORT],...",
        check=_aggregators,
        help=f"the aggregators' data addresses (default port {C.XAGG_PORT}), a list or one comma-separated string")
    control: list = setting(
        [], env="XAGG_CONTROL", flag="--control", text=LIST, metavar="ADDR,...", check=_control,
        help="xaggd control endpoints, one per aggregator (HOST:PORT or a Unix socket path): "
             "rank 0 registers (and resets) the job there")
    token: str | None = setting(
        None, env="XAGG_TOKEN", flag="--token-file", flag_file=True, check=_token,
        help="the daemons' control token (the client or the admin token) for TCP <control>; xagg-client run "
             "takes it from a file or the XAGG_TOKEN variable, never from its command line, where `ps` "
             "shows it to every user")
    job_id: int | None = setting(
        None, env="XAGG_JOB_ID", flag="--job-id", text=INT, check=_u32_or_none,
        help="a job registered by the operator (instead of <control>); default: rank 0 picks one")
    cookie: int | None = setting(
        None, env="XAGG_COOKIE", flag="--cookie", text=INT, check=_u32_or_none,
        help="that job's cookie (default: rank 0 picks one); `ps` shows a command line to every "
             "local user, so prefer the XAGG_COOKIE variable to the flag")
    weights: list | None = setting(
        None, env="XAGG_WEIGHTS", flag="--weights", text=LIST, metavar="W,...",
        check=lambda v, cfg: check_weights(None if v is None else _split(v), len(cfg.aggregators)),
        help="share of every gradient per aggregator (default: equal)")
    fanout: str = setting(
        AUTO, env="XAGG_FANOUT", flag="--fanout", choices=CHOICES,
        check=_fanout,
        help="how results come back: auto (a multicast group, one frame per chunk, where every worker "
             "is on each aggregator's own segment, one rank per host; else unicast; a group that "
             "does not deliver in the first round moves the job to unicast, and the log says so), "
             "unicast (one copy per worker: always works) or bcast (one rank per host, a flat LAN)")
    result_group: str = setting(
        "", env="XAGG_RESULT_GROUP", flag="--result-group", metavar="ADDR",
        check=lambda v, cfg: check_result_group(v, "bcast" if cfg.fanout == AUTO else cfg.fanout),
        help="with --fanout bcast: an IPv4 multicast group the results go to (the workers join it), so a "
             "snooping switch delivers them to the workers alone instead of every port; \"\": the subnet "
             f"broadcast. With --fanout auto: the group auto picks (default {DEFAULT_GROUP})")
    timeout: float = setting(
        DEFAULT_TIMEOUT, env="XAGG_TIMEOUT", flag="--timeout", text=NUMBER,
        check=lambda v, cfg: check_seconds(v),
        help="seconds without an answer before a bucket falls back to gloo")
    rto: float = setting(
        DEFAULT_RTO, env="XAGG_RTO", flag=None, text=NUMBER, check=lambda v, cfg: check_rto(v, cfg.timeout),
        help="the floor of the client's retransmit timeout, in seconds")
    window: int | None = setting(
        None, env="XAGG_WINDOW", flag=None, text=INT,
        check=lambda v, cfg: _positive_or_none(v),
        help="packets in flight per aggregator (default: an equal share of the client's byte window)")
    path: str = setting(
        DEFAULT_PATH, env="XAGG_PATH", flag="--path", choices=PATHS, check=lambda v, cfg: check_path(v),
        help="how packets leave and results arrive: udp (the kernel's stack), afxdp (an AF_XDP socket on "
             "the worker's interface; needs root, libxdp and clang, else udp runs and the status says why) "
             "or auto (AF_XDP where it runs)")
    vals: int | None = setting(
        None, env="XAGG_VALS", flag="--vals", text=INT, check=lambda v, cfg: v if v is None else check_vals(v),
        help="int32 values per packet, as the aggregators run them (xaggd --vals); default: what the "
             f"daemons answer at registration, else {C.XAGG_VALS}")
    wire_bits: int = setting(
        32, env="XAGG_WIRE_BITS", flag="--wire-bits", text=INT,
        check=lambda v, cfg: check_wire_bits(v),
        help="bits per gradient value on the wire: 32, or 16 (what --compress int16 sets: two values an "
             "int32 word, half the packets each way, at least 6 bits kept per value of a chunk's largest "
             "magnitude, the rounding error carried into the next step by error feedback)")
    require_xagg: bool = setting(
        False, env="XAGG_REQUIRE", flag="--require-xagg", text=BOOL, check=lambda v, cfg: _bool(v),
        help="fail (the script stops with an error) instead of falling back to gloo when the "
             "aggregators do not sum a step: a run that must not train slower than asked")
    backoff_steps: int = setting(
        DEFAULT_BACKOFF_STEPS, env="XAGG_BACKOFF", flag="--backoff", text=INT, check=_steps,
        help="training steps on gloo after a failure before trying xagg again; doubles on every "
             "failed retry up to <max_backoff_steps>")
    max_backoff_steps: int | None = setting(
        None, env="XAGG_MAX_BACKOFF", flag="--max-backoff", text=INT, check=_max_backoff,
        help=f"most steps between retries while xagg keeps failing (default: {DEFAULT_MAX_BACKOFF_STEPS}, "
             "or <backoff_steps> if larger); lower it where an aggregator's restart takes minutes, so "
             "the first retry after its return comes soon")
    status_dir: str | None = setting(
        None, env="XAGG_STATUS_DIR", flag="--status-dir", metavar="DIR", check=_status_dir,
        help="where each rank writes its counters, STATUS_DIR/rankR.json for rank R (`xagg-client "
             "status` reads them; xagg-client run makes a new directory per run)")
    # a library user asked for no progress lines; xagg-client run's user watches them
    progress_every: float = setting(
        0.0, env="XAGG_PROGRESS", flag="--progress", text=NUMBER, flag_default=10.0, check=_progress,
        help="seconds between progress lines from rank 0 (0: none)")
    plan: str = setting(
        "off", env="XAGG_PLAN", flag="--plan", choices=PLANS, check=_plan,
        help="auto: the weights (and routes) come from the planner (xagg.wire.planner), which "
             "xagg-client run runs at start on the cluster's figures (--plan-inputs), running on gloo "
             "if its ring is predicted faster (`xagg plan` explains); off: as given")
    routes: list | None = setting(
        None, env="XAGG_ROUTES", flag=None, text=ROWS, check=_routes,
        help="the plan's routes[w][p] = c: worker w sends aggregator p's chunks through aggregator c, "
             "a child that sends one partial to p; the engine registers the tree and gives each rank its row")
    metrics: str | None = setting(
        None, env="XAGG_METRICS", flag="--metrics", metavar="HOST:PORT", check=_metrics,
        help="each rank serves Prometheus text at http://HOST:PORT+L/metrics, L its local rank "
             "(torchrun's LOCAL_RANK, else its rank): fallbacks, retransmits, bytes, step comm time, mode")
    lanes: int = setting(
        1, env="XAGG_LANES", flag="--lanes", text=INT, check=_lanes,
        help=f"DDP buckets in flight at once, 1..{MAX_LANES}: lane L is a job of its own, id <job_id>+L, "
             f"broadcast results on port {DEFAULT_RESULT_PORT}+L (rank 0 registers them all given "
             "<control>; an operator who registers jobs by hand registers each lane's)")

    local_reduce: str = setting(
        "auto", env="XAGG_LOCAL_REDUCE", flag="--local-reduce", choices=LOCAL_REDUCE,
        check=_local_reduce,
        help="sum the ranks of a host in shared memory first, so the host is one worker of the job and "
             "each of its L ranks sends 1/L of the host's sum (local rank i's share of lane k is job "
             "<job_id>+i*<lanes>+k): auto does where torchrun starts several ranks per host "
             "(LOCAL_WORLD_SIZE > 1) and rank 0 registers the job (<control>); on insists (a job the "
             "operator registers then needs <lanes> x L jobs of one worker per host); off: every rank a worker")

    def __post_init__(self):
        self.validate()

    def validate(self) -> "HookConfig":
        """Every setting checked once, in table order, and kept as it is used."""
        for s in SETTINGS:
            try:
                setattr(self, s.name, s.check(getattr(self, s.name), self))
            except ValueError as e:
                raise HookConfigError(s.name, str(e)) from None
        return self

    @property
    def registers(self) -> bool:
        """Rank 0 registers the job with the daemons (control endpoints given)."""
        return bool(self.control)

    def client_config(self, *, job_id: int, cookie: int, worker_id: int, n_workers: int, result_port: int,
                      weights: list, vals: int, route: list | None,
                      results: ResultPath | None = None) -> ClientConfig:
        """One lane's ClientConfig for this rank: these settings, checked at the
        door, and what the ranks agreed at start (the job, the daemons' values
        per packet, the weights with planned-out aggregators at 0, this rank's
        row of the routes, the result path <fanout> auto resolved to, else the
        one set); nothing is checked again."""
        if results is None:
            if self.fanout == AUTO:
                raise ValueError("fanout 'auto' is resolved at registration: pass the result path it chose")
            results = ResultPath(Fanout.parse(self.fanout), self.result_group)
        return ClientConfig.from_checked(
            job_id=job_id, cookie=cookie, worker_id=worker_id, n_workers=n_workers, result_port=result_port,
            aggregators=self.aggregators, weights=weights, fanout=results.fanout.label, result_group=results.group,
            vals=vals, rto=self.rto,
            timeout=self.timeout, window=self.window or 0, route=route, path=self.path,
            wire_bits=self.wire_bits)

    # -- to the ranks and back: XAGG_* variables --------------------------------------
    def to_env(self) -> dict[str, str]:
        """The settings as XAGG_* variables (defaults left out)."""
        out = {}
        for s in SETTINGS:
            v = getattr(self, s.name)
            if not (v is None or v == [] or v == s.default):
                out[s.env] = s.text.show(v)
        return out

    @classmethod
    def from_env(cls, env) -> "HookConfig":
        """The settings the XAGG_* variables in ``env`` hold. HookConfigError
        names the variable: ``XAGG_TIMEOUT='x': expected a number``."""
        kw = {}
        for s in SETTINGS:
            raw = env.get(s.env)
            if raw in (None, ""):
                continue
            try:
                kw[s.name] = s.text.parse(raw)
            except (ValueError, KeyError):
                raise HookConfigError(s.env, f"expected {s.text.what}", raw) from None
        if "aggregators" not in kw:
            raise HookConfigError(ENV["aggregators"], "not set (HOST[:PORT],...): run the script with "
                                                      "xagg-client run")
        try:
            return cls(**kw)
        except HookConfigError as e:
            var = ENV[e.field]
            raise HookConfigError(var, e.explain(ENV), *([env[var]] if env.get(var) else [])) from None


def _rows() -> tuple[Setting, ...]:
    rows = []
    for f in dataclasses.fields(HookConfig):
        default = (f.default_factory() if f.default_factory is not MISSING
                   else REQUIRED if f.default is MISSING else f.default)
        rows.append(dataclasses.replace(f.metadata[_ROW], name=f.name, default=default))
    return tuple(rows)


SETTINGS = _rows()
ENV = {s.name: s.env for s in SETTINGS}             # field -> the XAGG_* variable that carries it
HookConfig.__doc__ = HookConfig.__doc__.rstrip() + "\n\n" + "\n".join(
    textwrap.fill(name_others(s.help), 100, initial_indent=f"    {s.name:<19}", subsequent_indent=" " * 23,
                  break_on_hyphens=False) for s in SETTINGS)

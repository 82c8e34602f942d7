"""A worker's client settings, the defaults every layer above takes, the
checks they share, and the errors the client raises.

The torch hook (xagg.torch.config), ``xagg-client`` and the lab's traffic
generator take their defaults from here, so a default is written once; the
hook checks the settings it shares with the client with the functions
below, so each check is written once too. A ClientConfig built by hand is
checked when it is made; the hook, whose settings are checked at its own
door, builds its clients with ``ClientConfig.from_checked``.
"""
from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import MISSING, dataclass, fields

from xagg.client.fixedpoint import WIRE_BITS
from xagg.wire import chunks
from xagg.wire.addresses import parse_addr
from xagg.wire.fanout import DEFAULT_FANOUT, Fanout
from xagg.wire.jobspec import DEFAULT_RESULT_PORT
from xagg.wire.proto import MAX_VALS, C, packet_dtype

DEFAULT_TIMEOUT = 5.0              # seconds without progress before a call fails
DEFAULT_RTO = 0.05                 # floor of the retransmit timeout (seconds)
# In flight per worker, split over its aggregators: every aggregator's results
# converge on the worker's link and its host's receive path, so it is the sum
# that must fit their queues under incast (per aggregator, 4 of them put more
# frames in flight than a CPU's backlog holds, and the excess was dropped).
DEFAULT_WINDOW_BYTES = 256 << 10
MIN_WINDOW = 16                    # packets in flight per aggregator, at the least
# How a worker's packets leave and its results arrive: the kernel's UDP
# stack, an AF_XDP socket (exchange_afxdp.py), or AF_XDP where it runs.
# AF_XDP falls back to UDP wherever it cannot run, saying why (ClientStats).
PATHS = ("udp", "afxdp", "auto")
DEFAULT_PATH = "udp"


class XaggError(RuntimeError):
    """The aggregators could not produce this sum (or the client cannot be set up)."""


class XaggTimeout(XaggError):
    """No progress from the aggregators within the configured timeout."""


# -- the checks the client and the torch hook share ----------------------------------
# Each returns the value as it is used, or raises ValueError saying what it must
# be; a reason that refers to another setting writes it <name>, and each door
# (ClientConfig, HookConfig's keyword arguments, flags, XAGG_* variables) names
# it its own way.

_OTHER = re.compile(r"<(\w+)>")


def name_others(why: str, names: dict | None = None) -> str:
    """``why`` with each <setting> it refers to named as in ``names`` (default: its own name)."""
    names = names or {}
    return _OTHER.sub(lambda m: names.get(m.group(1), m.group(1)), why)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_aggregators(addrs) -> list[tuple[str, int]]:
    """Each aggregator's data address as (IPv4, port): "HOST[:PORT]" or a pair."""
    if not addrs:
        raise ValueError("at least one HOST[:PORT] is needed")
    return [a if isinstance(a, tuple) else parse_addr(a) for a in addrs]


def check_weights(weights, n_aggregators: int) -> list[float] | None:
    """One share per aggregator (None: equal shares)."""
    return None if weights is None else chunks.check_weights(weights, n_aggregators)


def check_fanout(fanout) -> str:
    """The fan-out's label ("bcast", "unicast"), as the job registers it."""
    return Fanout.parse(fanout).label


def check_vals(vals) -> int:
    """int32 values per packet: what the largest (jumbo) frame holds, at most."""
    if not (is_int(vals) and 1 <= vals <= MAX_VALS):
        raise ValueError(f"must be 1..{MAX_VALS} values per packet, got {vals!r}")
    return vals


def check_wire_bits(bits) -> int:
    """Bits per value in the data packets: 32, or 16 (two values an int32
    word: half the packets each way, fewer bits kept; fixedpoint.py)."""
    if not (is_int(bits) and bits in WIRE_BITS):
        raise ValueError(f"must be {' or '.join(map(str, WIRE_BITS))} bits per value, got {bits!r}")
    return bits


def check_seconds(seconds) -> float:
    """A positive, finite time in seconds (a timeout)."""
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds < math.inf):
        raise ValueError(f"must be > 0 seconds, got {seconds!r}")
    return seconds


def check_rto(rto, timeout: float) -> float:
    """The retransmit timeout's floor: a time, and shorter than the timeout."""
    check_seconds(rto)
    if not rto < timeout:
        raise ValueError(f"({rto}s) must be shorter than <timeout> ({timeout}s)")
    return rto


def check_path(path) -> str:
    """How packets leave and results arrive: one of PATHS."""
    if path not in PATHS:
        raise ValueError(f"must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def check_route(route, n_aggregators: int) -> list[int] | None:
    """One worker's row of a plan's routes: per aggregator, the index of the
    aggregator its chunks are sent through (None: straight to each)."""
    if route is None:
        return None
    m = n_aggregators
    if not (isinstance(route, (list, tuple)) and len(route) == m and all(is_int(c) and 0 <= c < m for c in route)):
        raise ValueError(f"must give, per aggregator, the index (0..{m - 1}) of the aggregator its "
                         f"chunks are sent through, got {route!r}")
    return list(route)


def check_result_group(group: str, fanout: str) -> str:
    """A multicast group for a broadcast fan-out, or "" (the subnet broadcast)."""
    if not group:
        return group
    if Fanout.parse(fanout) is not Fanout.BCAST:
        raise ValueError("needs fanout 'bcast' (results to one address)")
    try:
        ok = ipaddress.IPv4Address(group).is_multicast
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"must be an IPv4 multicast address (224.0.0.0/4), got {group!r}")
    return group


@dataclass
class ClientConfig:
    job_id: int
    cookie: int
    worker_id: int
    n_workers: int
    aggregators: list                  # "host[:port]" strings or (ip, port)
    weights: list | None = None        # share of chunks per aggregator (default: equal)
    fanout: str = DEFAULT_FANOUT.label  # as the job was registered
    result_port: int = DEFAULT_RESULT_PORT
    # bcast fan-out to an IPv4 multicast group (the job's bcast_ip): the group,
    # joined on the result socket. A snooping switch then delivers results to
    # the workers alone, not to every port as broadcast does. "": broadcast.
    result_group: str = ""
    vals: int = C.XAGG_VALS            # int32 values per packet, as the aggregators run them
    rto: float = DEFAULT_RTO           # the retransmit timeout adapts to measured result
                                       # times (RFC 6298), never below this
    timeout: float = DEFAULT_TIMEOUT   # seconds without progress -> XaggTimeout
    window: int = 0                    # packets in flight per aggregator (0: its share of window_bytes)
    window_bytes: int = DEFAULT_WINDOW_BYTES    # in flight to all the aggregators together
    bind_ip: str = "0.0.0.0"
    fast: bool = True                  # the compiled round loop (native.py) where it builds
    path: str = DEFAULT_PATH           # PATHS: udp, afxdp (needs the compiled loop), auto
    # This worker's row of a plan's routes (xagg.wire.planner.Plan.routes[w]):
    # route[p] = c sends aggregator p's chunks to aggregator c, a child that
    # sums them with other workers' and sends one partial to p (c == p:
    # straight to p). The header still names p; results come back from c.
    # None: every aggregator's chunks go to it directly.
    route: list | None = None
    wire_bits: int = 32                # bits per value in data packets (check_wire_bits)

    def __post_init__(self):
        def checked(name, check, *args):
            try:
                return check(*args)
            except ValueError as e:
                raise XaggError(f"config.{name}: {name_others(str(e))}") from None
        n = len(self.aggregators or ())
        self.aggregators = checked("aggregators", check_aggregators, self.aggregators)
        self.weights = checked("weights", check_weights, self.weights or None, n)
        if not (is_int(self.n_workers) and 1 <= self.n_workers <= C.XAGG_MAX_WORKERS):
            raise XaggError(f"config.n_workers: must be 1..{C.XAGG_MAX_WORKERS} (the workers one "
                            f"aggregator's contributor set holds), got {self.n_workers!r}")
        if not 0 <= self.worker_id < self.n_workers:
            raise XaggError(f"config.worker_id: {self.worker_id} not in 0..{self.n_workers - 1}")
        self.fanout = checked("fanout", check_fanout, self.fanout)
        checked("result_group", check_result_group, self.result_group, self.fanout)
        checked("vals", check_vals, self.vals)
        checked("wire_bits", check_wire_bits, self.wire_bits)
        checked("path", check_path, self.path)
        checked("timeout", check_seconds, self.timeout)
        checked("rto", check_rto, self.rto, self.timeout)
        self.route = checked("route", check_route, self.route, n)
        self._derive()

    @classmethod
    def from_checked(cls, **settings) -> "ClientConfig":
        """A ClientConfig of settings its caller has checked with the functions
        above (the torch hook: HookConfig, at its door): not checked again,
        only completed (addresses resolved, defaults filled in)."""
        cfg = cls.__new__(cls)
        for f in fields(cls):
            if f.name not in settings and f.default is MISSING:
                raise TypeError(f"ClientConfig.from_checked: {f.name} is required")
            setattr(cfg, f.name, settings.pop(f.name, f.default))
        if settings:
            raise TypeError(f"ClientConfig.from_checked: no settings {sorted(settings)}")
        cfg._derive()
        return cfg

    def _derive(self) -> None:
        """What the client takes from its settings: addresses as (ip, port),
        equal weights by default, the window from its bytes (an equal share
        per aggregator)."""
        self.aggregators = [a if isinstance(a, tuple) else parse_addr(a) for a in self.aggregators]
        self.weights = [float(w) for w in self.weights] if self.weights else [1.0] * len(self.aggregators)
        self.route = None if self.route is None else list(self.route)
        if self.window <= 0:
            share = self.window_bytes // len(self.aggregators)
            self.window = max(MIN_WINDOW, share // packet_dtype(self.vals).itemsize)

    @property
    def send_to(self) -> list:
        """Per aggregator p, the (ip, port) its chunks are sent to: p's own, or
        the child aggregator this worker's route names."""
        if self.route is None:
            return list(self.aggregators)
        return [self.aggregators[c] for c in self.route]

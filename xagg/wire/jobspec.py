"""A job as one aggregator sees it: who may contribute, how much memory it
needs, where results go. Validated once here, so the XDP maps, the
userspace aggregator and the control API all refuse the same bad input with
the same message naming the field."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from xagg.wire.fanout import DEFAULT_FANOUT, Fanout
from xagg.wire.proto import C

DEFAULT_RESULT_PORT = C.XAGG_PORT + 1     # where broadcast results go
DEFAULT_BCAST_IP = "255.255.255.255"


def mac_ok(mac) -> bool:
    """Whether ``mac`` is "aa:bb:cc:dd:ee:ff" (not all zeros)."""
    try:
        b = bytes.fromhex(mac.replace(":", "")) if isinstance(mac, str) and mac.count(":") == 5 else b""
    except ValueError:
        return False
    return len(b) == 6 and any(b)


BLOCK = 64          # workers per word of a contributor set, and per partial sum's header
WIDE_BLOCK = C.XAGG_SET_WORDS   # the block a wide child's partial names (struct xagg_hdr)


def first_block(mask: int) -> int:
    """The 64-worker block of a worker set's lowest worker."""
    return ((mask & -mask).bit_length() - 1) // BLOCK if mask else 0


def is_wide(mask: int) -> bool:
    """Whether a worker set spans more than one 64-worker block: a child
    aggregator summing it sends partials that name it by registration."""
    return mask >> BLOCK * first_block(mask) >= 1 << BLOCK


def block_bits(mask: int) -> tuple[int, int]:
    """(block, bits) of a worker set lying in one 64-worker block: how a
    partial sum's header names it. ValueError if it spans blocks."""
    if is_wide(mask):
        raise ValueError(f"workers {worker_ids(mask)} span more than one 64-worker block")
    block = first_block(mask)
    return block, mask >> BLOCK * block


def set_words(mask: int, words: int = C.XAGG_SET_WORDS) -> list[int]:
    """A worker set as the data plane's 64-bit words (struct xagg_slot's set)."""
    return [mask >> BLOCK * i & (1 << BLOCK) - 1 for i in range(words)]


def worker_ids(mask: int) -> str:
    """A worker set for a message: "0-63, 70"."""
    ids = [i for i in range(mask.bit_length()) if mask >> i & 1]
    runs, start = [], None
    for i, w in enumerate(ids):
        if start is None:
            start = w
        if i + 1 == len(ids) or ids[i + 1] != w + 1:
            runs.append(f"{start}" if start == w else f"{start}-{w}")
            start = None
    return ", ".join(runs)


class JobError(ValueError):
    """A job definition that cannot be served; the message names the field."""


@dataclass
class JobSpec:
    job_id: int
    cookie: int
    n_workers: int
    n_chunks: int                         # chunks this aggregator holds
    fanout: Fanout = DEFAULT_FANOUT       # a label ("bcast") is parsed by validate
    bcast_ip: str = DEFAULT_BCAST_IP      # broadcast fan-out destination: the subnet's or a group
    result_port: int = DEFAULT_RESULT_PORT  # broadcast fan-out UDP port
    worker_ips: list = field(default_factory=list)  # per worker id; "" = any source
    # Which of the job's aggregators this is, of how many: packets naming
    # another (agg_id, n_aggs) are dropped. n_aggs 0: not checked.
    agg_id: int = 0
    n_aggs: int = 0
    # Child aggregators allowed to send partial sums (XAGG_F_PARTIAL):
    # (IPv4, mask of the workers they aggregate). None registered: every
    # partial sum is refused.
    children: list = field(default_factory=list)
    # A child entry: this host sums ``mask`` (some of the job's workers) for
    # aggregator agg_id's chunk range and sends their sum as one PARTIAL to
    # that aggregator, parent_ip:parent_port, through the next hop parent_mac
    # ("aa:bb:cc:dd:ee:ff"); the parent's results come back here and go on
    # to those workers. parent_ip "": a main entry (this host's own range).
    mask: int = 0                         # the workers this entry sums; 0 = all
    parent_ip: str = ""
    parent_port: int = C.XAGG_PORT
    parent_mac: str = ""

    def __post_init__(self):
        self.validate()

    def validate(self, max_workers: int = C.XAGG_MAX_WORKERS) -> "JobSpec":
        def need(cond, fld, why):
            if not cond:
                raise JobError(f"{fld}: {why}")

        def u32(v):
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32

        def ipv4(v):
            try:
                return isinstance(v, str) and bool(ipaddress.IPv4Address(v))
            except ValueError:
                return False
        for name in ("job_id", "cookie"):
            v = getattr(self, name)
            need(u32(v), name, f"must be an unsigned 32-bit integer, got {v!r}")
        need(isinstance(self.n_workers, int) and 1 <= self.n_workers <= max_workers,
             "n_workers", f"must be 1..{max_workers}, got {self.n_workers!r}")
        need(isinstance(self.n_chunks, int) and self.n_chunks >= 1, "n_chunks",
             f"must be a positive integer, got {self.n_chunks!r}")
        try:
            self.fanout = Fanout.parse(self.fanout)
        except ValueError as e:
            need(False, "fanout", str(e))
        need(u32(self.result_port) and 0 < self.result_port < 65536, "result_port",
             f"must be a UDP port 1..65535, got {self.result_port!r}")
        need(ipv4(self.bcast_ip), "bcast_ip", f"not an IPv4 address: {self.bcast_ip!r}")
        need(self.fanout is not Fanout.UNICAST or self.mask or self.n_workers <= BLOCK, "fanout",
             f"unicast sends every result once per worker, for at most {BLOCK} workers; "
             f"a job of {self.n_workers} needs bcast (or a multicast group)")
        need(len(self.worker_ips) in (0, self.n_workers), "worker_ips",
             f"needs one address per worker ({self.n_workers}), got {len(self.worker_ips)}")
        for i, ip in enumerate(self.worker_ips):
            need(not ip or ipv4(ip), f"workers[{i}]", f"not an IPv4 address: {ip!r}")
        need(isinstance(self.n_aggs, int) and 0 <= self.n_aggs < 65536, "n_aggs",
             f"must be 0 (not checked) or an aggregator count up to 65535, got {self.n_aggs!r}")
        need(isinstance(self.agg_id, int) and 0 <= self.agg_id < max(self.n_aggs, 1), "agg_id",
             f"must be an index into the job's {self.n_aggs or 1} aggregators, got {self.agg_id!r}")
        need(len(self.children) <= C.XAGG_MAX_CHILDREN, "children",
             f"at most {C.XAGG_MAX_CHILDREN}, got {len(self.children)}")
        for i, child in enumerate(self.children):
            ok = isinstance(child, (tuple, list)) and len(child) == 2
            need(ok and ipv4(child[0]) and child[0] != "0.0.0.0", f"children[{i}]",
                 f"must be (IPv4 address, worker mask), got {child!r}")
            m = child[1]
            need(isinstance(m, int) and m > 0 and not m & ~self.full_mask, f"children[{i}]",
                 f"worker mask must name some of workers 0..{self.n_workers - 1}, got {m!r}")
        all_workers = (1 << self.n_workers) - 1
        need(isinstance(self.mask, int) and not isinstance(self.mask, bool)
             and 0 <= self.mask and not self.mask & ~all_workers, "mask",
             f"must name some of workers 0..{self.n_workers - 1} (0: all), got {self.mask!r}")
        if self.parent_ip:
            need(ipv4(self.parent_ip) and self.parent_ip != "0.0.0.0", "parent_ip",
                 f"not an IPv4 address: {self.parent_ip!r}")
            need(self.n_aggs > 0, "n_aggs", "a child entry names its parent's agg_id, so n_aggs "
                 "must be the job's aggregator count (not 0)")
            need(self.mask != 0, "mask", "a child entry must name the workers it sums")
            need(self.fanout is not Fanout.UNICAST or not is_wide(self.mask), "fanout",
                 f"unicast sends every result once per worker, for the workers of one 64-worker "
                 f"block; this child entry's (workers {worker_ids(self.mask)}) need bcast")
            need(not self.children, "children", "a child entry has no children (two levels)")
            need(isinstance(self.parent_port, int) and 0 < self.parent_port < 65536, "parent_port",
                 f"must be a UDP port 1..65535, got {self.parent_port!r}")
            need(self.parent_mac == "" or mac_ok(self.parent_mac), "parent_mac",
                 f"must be the next hop's MAC \"aa:bb:cc:dd:ee:ff\" (\"\": the data plane "
                 f"needs none), got {self.parent_mac!r}")
        return self

    @property
    def is_child(self) -> bool:
        return bool(self.parent_ip)

    @property
    def full_mask(self) -> int:
        """The workers whose contributions complete a chunk here."""
        return self.mask or (1 << self.n_workers) - 1

    @property
    def n_slots(self) -> int:
        return 2 * self.n_chunks          # round parity: two copies per chunk

    def worker_ip(self, wid: int) -> str:
        return self.worker_ips[wid] if self.worker_ips else ""

"""Reduce inside the host first: the ranks of one host sum their buckets in
shared memory, and the host, not each rank, is a worker of the xagg job.

torchrun starts L ranks per host (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
Without this, each is a worker in its own right and the host's one NIC
carries L gradients each way. With it (``HookConfig.local_reduce``), per
bucket and lane:

1. every local rank copies its bucket into the lane's shared segment;
2. reduce-scatter: local rank i sums slice i of the L copies (``share``),
   so each sums 1/L of the bucket;
3. local rank i sends only its slice of the host's sum to the aggregators,
   on a job of its own with one worker per host (``job_index``: lane k,
   share i is job index i * lanes + k, registered with every other), so
   all L processes share the sending and the host's link carries one
   gradient each way;
4. all-gather: each rank copies the whole host sum back out, once every
   share has come back, together with whether each did.

A share that failed (or was skipped: an earlier bucket of the step failed
on that rank) fails the bucket on every rank of the host, so the ranks of
a host post the same failures and the step's agreement (agreement.py)
redoes it over the process group like any failed bucket.

Each share job keeps its own sequence of rounds (one entry of
``XaggState.rounds`` per job): a share that takes a redo round does so on
every host, since its prediction check reads only the share's agreed
exponents. A share with no elements (a bucket smaller than L) sends
nothing and takes no round.

The segment is a file under /dev/shm named from the job, the engine's
nonce, the host and the lane, unlinked as soon as every rank has it open.
Its barrier is a sequence number per local rank, polled with short sleeps;
a peer that exited while it was awaited is named. Stores become visible in
program order to the polling ranks on x86-64 (total store order); other
architectures would need fences here.

CUDA buckets arrive already staged in pinned host memory (buckets.py); the
sums run on the host (untested on a GPU).
"""
from __future__ import annotations

import mmap
import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from xagg.client import XaggError

SHM_DIR = "/dev/shm"
LINE = 64                       # bytes: each rank's counters on a cache line of their own
ALIGN = 16                      # elements: shares start on a 64-byte boundary
POLL_MAX_S = 0.001              # the longest sleep between looks at the peers' counters
PEER_CHECK_S = 1.0              # how often a wait looks whether its peers are alive
WAIT_S = 1800.0                 # a peer that never arrives: as long as torch's default process-group timeout


class LocalReduceError(RuntimeError):
    """The ranks of a host lost step with each other (a peer exited): not a
    failure of the aggregators, so no fallback; it stops the run."""


@dataclass(frozen=True)
class Hosts:
    """Where a rank sits: host ``host`` of ``hosts`` (the job's worker id
    and worker count), local rank ``local_rank`` of ``local_size``."""
    host: int
    hosts: int
    local_rank: int
    local_size: int
    first_ranks: tuple          # per host, its lowest rank: whose address the job registers

    @property
    def reducing(self) -> bool:
        return self.local_size > 1


def flat(rank: int, world: int) -> Hosts:
    """Every rank a host of its own (the hook without local reduce)."""
    return Hosts(rank, world, 0, 1, tuple(range(world)))


def host_key() -> str:
    """What ranks sharing a host (a /dev/shm, a network) have in common: the
    host's name and this process's network and mount namespaces (two lab
    hosts on one machine differ in the first)."""
    ns = [os.stat(f"/proc/self/ns/{n}").st_ino for n in ("net", "mnt")]
    return f"{socket.gethostname()}/{ns[0]}/{ns[1]}"


def find_hosts(cfg, group, rank: int, world: int, env=os.environ) -> Hosts:
    """Which ranks share a host, from torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE
    (a collective on ``group``). ``cfg.local_reduce``: auto reduces where a
    host has several ranks and rank 0 registers the job (a job the operator
    registered has one worker per rank), on insists, off never."""
    setting = cfg.local_reduce
    lr, ls = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    mine = (host_key(), int(lr) if lr is not None else -1, int(ls) if ls is not None else 0, setting)
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    if setting == "off" or (setting == "auto" and (not cfg.registers or max(r[2] for r in every) <= 1)):
        return flat(rank, world)
    if any(r[1] < 0 for r in every):
        raise XaggError("local_reduce=on needs torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE on every rank "
                        "(start the script with xagg-client run or torchrun)")
    by_key: dict = {}
    for r, (key, local, size, _) in enumerate(every):
        by_key.setdefault(key, []).append((r, local, size))
    hosts = sorted(by_key.values(), key=lambda rs: rs[0][0])
    sizes = {len(rs) for rs in hosts}
    for rs in hosts:
        if sorted(local for _, local, _ in rs) != list(range(len(rs))) or {s for _, _, s in rs} != {len(rs)}:
            raise XaggError(f"local_reduce: ranks {[r for r, _, _ in rs]} share a host, but their LOCAL_RANK "
                            f"{[lo for _, lo, _ in rs]} and LOCAL_WORLD_SIZE {[s for _, _, s in rs]} do not "
                            "number them 0..L-1")
    if len(sizes) != 1:
        raise XaggError(f"local_reduce needs the same number of ranks on every host, got {sorted(sizes)} "
                        "(set local_reduce=off, or start as many ranks on each host)")
    host = next(h for h, rs in enumerate(hosts) if any(r == rank for r, _, _ in rs))
    if sizes == {1}:
        return flat(rank, world)
    return Hosts(host, len(hosts), int(lr), sizes.pop(), tuple(rs[0][0] for rs in hosts))


def job_index(lane: int, share: int, lanes: int) -> int:
    """The job (an index for xagg.torch.lanes.lane_job_id) that lane ``lane``
    of local rank ``share`` sums on: lane k of share 0 is lane k's job, so
    without local reduce the jobs are the lanes'."""
    return share * lanes + lane


def share_bounds(n: int, share: int, shares: int) -> tuple[int, int]:
    """Elements [lo, hi) of an n-element bucket that local rank ``share`` sums and sends."""
    q = -(-(-(-n // shares)) // ALIGN) * ALIGN
    return min(n, share * q), min(n, (share + 1) * q)


def share_elements(max_elements: int | None, shares: int) -> int | None:
    """The largest share of a bucket of ``max_elements``: what a share job is sized for."""
    return None if max_elements is None else share_bounds(max_elements, 0, shares)[1]


class HostSegment:
    """One lane's shared segment on a host: per local rank a cache line of
    counters (its barrier sequence, its share's outcome, its pid), then the
    host's sum, then one input copy per local rank. The sum comes first, so
    growing the segment for a larger bucket never moves it onto a copy that
    a slower peer may still be reading (inputs are free once every share is
    summed; the sum once every rank has arrived at the next bucket)."""

    def __init__(self, path: str, hosts: Hosts):
        self.path, self.me, self.size = path, hosts.local_rank, hosts.local_size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.header = self.size * LINE
        self.cap = 0                    # elements per region, the same on every rank (grown alike)
        self.map = None
        self.seq = 0
        self._remap(0)
        self.counters[self.me, 2] = os.getpid()

    def _remap(self, cap: int) -> None:
        size = self.header + 4 * cap * (1 + self.size)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)         # every rank grows it alike; the first one wins
        self.map = mmap.mmap(self.fd, size)
        self.counters = np.frombuffer(self.map, np.int64, self.size * LINE // 8).reshape(self.size, LINE // 8)
        data = np.frombuffer(self.map, np.float32, cap * (1 + self.size), self.header).reshape(1 + self.size, cap)
        self.sum, self.inputs, self.cap = data[0], data[1:], cap

    def fit(self, n: int) -> None:
        if n > self.cap:
            self._remap(-(-n // ALIGN) * ALIGN)

    def barrier(self) -> None:
        """Every local rank at the same point of the same bucket."""
        self.seq += 1
        self.counters[self.me, 0] = self.seq
        seqs, sleep = self.counters[:, 0], 0.0
        start = checked = time.monotonic()
        while (seqs < self.seq).any():
            time.sleep(sleep)
            sleep = min(POLL_MAX_S, sleep * 2 or 1e-5)
            now = time.monotonic()
            if now - checked > PEER_CHECK_S:
                checked = now
                self._check_peers(now - start)

    def _check_peers(self, waited: float) -> None:
        late = [j for j in range(self.size) if self.counters[j, 0] < self.seq]
        for j in late:
            pid = int(self.counters[j, 2])      # 0: not here yet
            if pid and not _alive(pid):
                raise LocalReduceError(f"local rank {j} (pid {pid}) exited while its host's ranks "
                                       "summed a bucket together")
        if waited > WAIT_S:
            raise LocalReduceError(f"local ranks {late} did not reach bucket {self.seq // 2} "
                                   f"within {WAIT_S:.0f}s")

    def close(self) -> None:
        self.sum = self.inputs = self.counters = None
        try:
            self.map.close()
        except BufferError:
            pass            # a view still out there: the mapping goes with it
        os.close(self.fd)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class HostReduce:
    """One lane's host sum (see the module's docstring)."""

    def __init__(self, segment: HostSegment):
        self.seg = segment
        self.mine = np.empty(0, np.float32)     # this rank's slice of the host's sum, before the hosts'

    def allreduce(self, x: np.ndarray, dest: np.ndarray, share, divide: int = 1) -> np.ndarray:
        """The sum over every rank of the job of the float32 array ``x``,
        divided by ``divide``, into ``dest``. ``share(h, out)`` sums ``h``, this rank's slice of the host's
        sum, over the hosts into ``out``, its place in the segment (raising
        XaggError when it cannot); it is not called for an empty slice.
        XaggError when some share of the host failed, on every rank of the
        host alike."""
        seg, n = self.seg, x.size
        seg.fit(n)
        seg.inputs[seg.me, :n] = x
        seg.barrier()
        lo, hi = share_bounds(n, seg.me, seg.size)
        why = ""
        if hi > lo:
            if self.mine.size < hi - lo:
                self.mine = np.empty(hi - lo, np.float32)
            # summed apart from its place: the client then writes each result
            # there as it arrives (its codec in the round loop), not once at the end
            h = self.mine[:hi - lo]
            np.add(seg.inputs[0, lo:hi], seg.inputs[1, lo:hi], out=h)
            for j in range(2, seg.size):
                np.add(h, seg.inputs[j, lo:hi], out=h)
            try:
                share(h, seg.sum[lo:hi])
            except (XaggError, OSError) as e:        # the peers wait for this share's outcome
                why = str(e) or type(e).__name__
        seg.counters[seg.me, 1] = 1 if why else 0
        seg.barrier()
        failed = [j for j in range(seg.size) if seg.counters[j, 1]]
        if failed:
            raise XaggError(why or f"the share of local rank {failed[0]} of this host got no answer "
                                   "from the aggregators")
        np.divide(seg.sum[:n], np.float32(divide), out=dest[:n])
        return dest

    def close(self) -> None:
        self.seg.close()


def open_segments(hosts: Hosts, job_id: int, nonce: int, lanes: int, group) -> list:
    """Each lane's HostReduce (a collective on ``group``), or Nones without
    local reduce. The files are unlinked once every rank has them open, so
    a crash leaves nothing in /dev/shm."""
    if not hosts.reducing:          # the same on every rank: no collective then
        return [None] * lanes
    paths = [os.path.join(SHM_DIR, f"xagg-{job_id}-{nonce & 0xFFFFFFFF:08x}-h{hosts.host}-l{k}")
             for k in range(lanes)]
    segs = [HostReduce(HostSegment(p, hosts)) for p in paths]
    dist.barrier(group=group)
    if hosts.local_rank == 0:
        for p in paths:
            os.unlink(p)
    return segs

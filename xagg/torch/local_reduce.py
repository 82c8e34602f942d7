"""Reduce inside the host first: the ranks of one host sum their buckets in
shared memory, and the host, not each rank, is a worker of the xagg job.

torchrun starts L ranks per host (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
Without this, each is a worker in its own right and the host's one NIC
carries L gradients each way. With it (``HookConfig.local_reduce``), per
bucket and lane:

1. every local rank copies its bucket into the lane's shared segment, all
   but its own slice (which only it reads), in the bucket's dtype (float32,
   or bf16/fp16 as they are: no float32 copy of a 16-bit bucket is made);
2. reduce-scatter: local rank i sums slice i of the L copies in float32,
   divided by the job's rank count (csrc/host_sum.c: one pass, block by
   block, 16-bit values widened as read), so each sums 1/L of the bucket
   and the aggregators sum averages;
3. local rank i sends only its slice of the host's sum to the aggregators,
   on a job of its own with one worker per host (``job_index``: lane k,
   share i is job index i * lanes + k, registered with every other), so
   all L processes share the sending and the host's link carries one
   gradient each way; the hosts' sum of it lands in the segment as the
   results arrive;
4. all-gather, without a copy: once every share has come back (and with
   whether each did), every rank's result is the segment's sum region
   itself (in the bucket's dtype, each value rounded once from the hosts'
   float32 sum), which DDP copies into the gradients.

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
Its barrier is a sequence number per local rank and a futex the last
arrival wakes the others on (host_sum.py): a waiting rank sleeps, as a
host's ranks may share fewer cores than there are ranks; a peer that
exited while it was awaited is named. The barrier's atomics order the
regions' plain stores before it against the loads after it.

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
from xagg.client.host_sum import HostSum

SHM_DIR = "/dev/shm"
LINE = 64                       # bytes: each rank's counters on a cache line of their own
ALIGN = 16                      # elements: shares start on a 64-byte boundary
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
    """One lane's shared segment on a host, a file every local rank maps:
    a header of counters (per local rank a cache line: its barrier
    sequence, its share's outcome, its pid; then the barrier's futex word),
    then regions appended as they are first needed, at the same offsets on
    every rank as every rank asks for the same ones in the same order: the
    input copies (one per local rank, grown for a larger bucket into a new
    region, so a slower peer still reading the old one is not moved under)
    and per bucket two result regions used in turn (result())."""

    def __init__(self, path: str, hosts: Hosts, fast: bool = True):
        self.path, self.me, self.size = path, hosts.local_rank, hosts.local_size
        self.ops = HostSum(fast)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.end = 0                    # bytes of the file given out so far
        head = self._map((self.size + 1) * LINE)
        self.counters = np.frombuffer(head, np.int64, self.size * LINE // 8).reshape(self.size, LINE // 8)
        self.gen = np.frombuffer(head, np.uint32, 1, self.size * LINE)
        self.inputs = np.empty((self.size, 0), np.float32)
        self.results: dict = {}         # bucket key -> (its two regions, the one used last)
        self.seq = 0
        self.counters[self.me, 2] = os.getpid()

    def _map(self, nbytes: int) -> mmap.mmap:
        """The next ``nbytes`` of the file, mapped. posix_fallocate only ever
        grows the file: a rank behind its peers never cuts their regions off."""
        off, size = self.end, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        os.posix_fallocate(self.fd, off, size)
        self.end += size
        return mmap.mmap(self.fd, size, offset=off)

    def _array(self, n: int, dtype=np.float32) -> np.ndarray:
        dtype = np.dtype(dtype)
        return np.frombuffer(self._map(dtype.itemsize * n), dtype, n)

    def fit(self, n: int, dtype=np.float32) -> np.ndarray:
        """Input copies of at least ``n`` elements of ``dtype`` (float32 or a
        16-bit ELEMS type: the float32 regions' bytes, viewed as it), one row
        per local rank."""
        if n * np.dtype(dtype).itemsize > 4 * self.inputs.shape[1]:
            cap = -(-n // ALIGN) * ALIGN
            self.inputs = self._array(self.size * cap).reshape(self.size, cap)
        return self.inputs.view(dtype)

    def result(self, key, n: int, dtype=np.float32) -> np.ndarray:
        """Where bucket ``key``'s host sum of ``n`` elements of ``dtype`` goes
        this call: its two regions in turn, as the hook keeps two sums per
        bucket (a step's sum may still be read while the next step's is summed)."""
        regions, last = self.results.get(key, ((None, None), 1))
        if regions[0] is None or regions[0].size != n or regions[0].dtype != dtype:
            regions = (self._array(n, dtype), self._array(n, dtype))
        self.results[key] = (regions, 1 - last)
        return regions[1 - last]

    def barrier(self) -> None:
        """Every local rank at the same point of the same bucket; a futex
        sleep meanwhile, a look every PEER_CHECK_S whether the peers live."""
        self.seq += 1
        start = time.monotonic()
        while not self.ops.wait(self.counters, self.gen, self.me, self.seq, PEER_CHECK_S):
            self._check_peers(time.monotonic() - start)

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
        # the mappings go with the last view of them (a result DDP still holds)
        self.inputs = self.counters = self.gen = None
        self.results.clear()
        os.close(self.fd)


def _bits(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their size, to be copied as
    memory (numpy copies a BFLOAT16 record array field by field, at half the speed)."""
    return a.view(f"u{a.dtype.itemsize}")


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
        # where the calls' time went, summed over them (the bench reads it)
        self.seconds = dict.fromkeys(("copy", "wait_in", "sum", "share", "wait_out"), 0.0)
        self.calls = 0

    def allreduce(self, x: np.ndarray, share, key=None, divide: int = 1) -> np.ndarray:
        """The sum over every rank of the job of the contiguous 1-D array
        ``x`` (float32, or a 16-bit type of fixedpoint.ELEMS), divided by
        ``divide``, in x's dtype: a view of the segment, the same memory on
        every rank of the host, valid until the call after next with the
        same ``key`` (the bucket). ``share(h, out)`` sums ``h``, this rank's
        float32 slice of the host's sum, already divided, over the hosts
        into ``out``, its place in the result (raising XaggError when it
        cannot); it is not called for an empty slice. XaggError when some
        share of the host failed, on every rank of the host alike."""
        seg, n, t = self.seg, x.size, self.seconds
        t0 = time.perf_counter()
        inputs = seg.fit(n, x.dtype)
        lo, hi = share_bounds(n, seg.me, seg.size)
        # the peers read every slice but this rank's own, which it sums from x itself
        mine, into = _bits(x), _bits(inputs[seg.me])
        into[:lo] = mine[:lo]
        into[hi:n] = mine[hi:n]
        out = seg.result(key, n, x.dtype)
        t1 = time.perf_counter()
        seg.barrier()
        t2 = time.perf_counter()
        why, ts = "", t2
        if hi > lo:
            if self.mine.size < hi - lo:
                self.mine = np.empty(hi - lo, np.float32)
            # summed apart from its place: the client then writes each result
            # there as it arrives (its codec in the round loop), not once at the end
            h = self.mine[:hi - lo]
            seg.ops.sum([x[lo:hi] if j == seg.me else inputs[j, lo:hi] for j in range(seg.size)],
                        divide, h)
            ts = time.perf_counter()
            try:
                share(h, out[lo:hi])
            except (XaggError, OSError) as e:        # the peers wait for this share's outcome
                why = str(e) or type(e).__name__
        seg.counters[seg.me, 1] = 1 if why else 0
        t3 = time.perf_counter()
        seg.barrier()
        t4 = time.perf_counter()
        self.calls += 1
        for k, v in (("copy", t1 - t0), ("wait_in", t2 - t1), ("sum", ts - t2), ("share", t3 - ts),
                     ("wait_out", t4 - t3)):
            t[k] += v
        failed = [j for j in range(seg.size) if seg.counters[j, 1]]
        if failed:
            raise XaggError(why or f"the share of local rank {failed[0]} of this host got no answer "
                                   "from the aggregators")
        return out

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

"""A DDP bucket on its way, and the lane thread that sums it through xagg.

The engine (engine.py) stages each bucket on the host and hands it to lane
i mod L (lanes.py), whose thread sums it through its own job and client,
one bucket after another. Where the ranks of a host sum locally first
(local_reduce.py), a lane sends only its rank's share of the host's sum.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from xagg.client import XaggError
from xagg.client.fixedpoint import BFLOAT16

# the dtypes the codec reads and writes in place (fixedpoint.ELEMS)
IN_PLACE = (torch.float32, torch.float16, torch.bfloat16)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor of an IN_PLACE dtype as numpy, sharing its memory
    (numpy has no bfloat16: its bits, as fixedpoint.BFLOAT16)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """as_numpy's inverse: a tensor sharing the memory of ``a``."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class Step:
    """The buckets of the step in progress on xagg, and whether one failed here."""
    __slots__ = ("items", "failed", "reason")

    def __init__(self):
        self.items: list[Bucket] = []
        self.failed, self.reason = False, ""        # reason: why a bucket failed here


class Bucket:
    """One bucket on its way: the original tensor, its host copy, the future."""
    __slots__ = ("index", "last", "buf", "host", "event", "fut", "t0", "step", "result", "failed", "done", "error")
    # result: the averaged sum on the host, in the bucket's dtype (None until summed)
    # done: set by its lane once summed or failed; error: what broke the lane's thread

    def __init__(self, index, last, buf, host, event, fut):
        self.index, self.last, self.buf, self.host, self.event, self.fut = index, last, buf, host, event, fut
        self.t0 = time.perf_counter()
        self.step: Step | None = None
        self.result, self.failed, self.error = None, False, None
        self.done = threading.Event()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.buf.device, non_blocking=True) if self.buf.is_cuda else host


def stage(bucket, pinned: dict) -> Bucket:
    """A DDP GradBucket as a Bucket: a CUDA bucket is copied to pinned host
    memory (one buffer per bucket, kept in ``pinned``) behind an event its
    sum waits on."""
    buf = bucket.buffer()
    if buf.is_cuda:
        key = (bucket.index(), buf.numel(), buf.dtype)
        host = pinned.get(key)
        if host is None:
            host = pinned[key] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        host.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buf.device))
        fut = torch.futures.Future(devices=[buf.device])
    else:
        host, event, fut = buf, None, torch.futures.Future()
    return Bucket(bucket.index(), bucket.is_last(), buf, host, event, fut)


class InFlight:
    """The buckets in flight on every lane of a rank; its lock also guards
    the state's counters, which every lane adds to."""

    def __init__(self, stats: dict):
        self.lock, self.stats, self.n = threading.Lock(), stats, 0

    def __enter__(self):
        with self.lock:
            self.n += 1
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.n)

    def __exit__(self, *exc):
        with self.lock:
            self.n -= 1


@dataclass(frozen=True)
class Kept:
    """A closed lane's, for the lane of its index when its job's transport
    opens again (XaggState.start): what its client learned (Client.learned:
    no redo round for every bucket's first sum) and its sum buffers (none to
    page in anew)."""
    learned: object = None
    sums: dict = field(default_factory=dict)


class Lane:
    """A thread that sums the buckets handed to it, one after another, on its
    own job and client (lanes.py)."""

    def __init__(self, index: int, state, rank: int, world: int, in_flight: InFlight, local=None,
                 kept: Kept | None = None):
        kept = kept or Kept()
        self.index, self.state, self.world, self.in_flight = index, state, world, in_flight
        self.local = local                  # a local_reduce.HostReduce, or None: this rank is a worker
        self.job = index                    # its job's entry of state.rounds (AggregatorSet.connect)
        self.client = None
        self.learned = kept.learned         # for its first client (AggregatorSet.connect)
        self.seen = {}                      # the client's counters as last added to the state's
        self.sums: dict = kept.sums         # (bucket, size, dtype) -> two sum buffers, used in turn
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"xagg-lane{index}-r{rank}", daemon=True)
        self.thread.start()

    def use(self, client, rnd: int) -> None:
        """Sum on ``client`` from round ``rnd`` on."""
        self.client = client
        client.round = rnd & 0xFFFFFFFF
        self.seen = dict(packets_sent=0, retransmits=0, results=0, redone=0)

    def put(self, item: Bucket) -> None:
        self.q.put(item)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                self._sum(item)
            except BaseException as e:  # noqa: BLE001 - raised on the I/O thread
                item.error = e
            finally:
                item.done.set()

    def _sum(self, item: Bucket) -> None:
        """Sum ``item`` through this lane's job, or mark it failed."""
        st, step = self.state, item.step
        if step.failed and self.local is None:
            st.rounds[self.job] += 1        # at least one round per bucket on every rank, tried or not
            item.failed = True              # the others will time out on it (agreement.py)
            return
        with self.in_flight:                # a host's ranks still sum together: its peers wait for this one
            try:
                item.result = self._xagg(item, skip=step.failed)
            except (XaggError, OSError) as e:
                item.failed, step.failed, step.reason = True, True, str(e)

    def _xagg(self, item: Bucket, skip: bool) -> torch.Tensor:
        st = self.state
        n = item.host.numel()
        if st.max_elements is not None and n > st.max_elements:
            raise XaggError(f"bucket {item.index} holds {n} elements, more than max_elements="
                            f"{st.max_elements} the job was sized for")
        if item.event is not None:
            item.event.synchronize()
        x = item.host.detach()
        staged = x.dtype not in IN_PLACE
        if staged:
            # a float32 copy, summed in place: the codec reads no float64
            x = x.to(torch.float32)
            with self.in_flight.lock:
                st.stats["staged_f32"] += 1
        t0 = time.perf_counter()
        if self.local is None:
            dest = x if staged else self._sum_buffer(item.index, x, pinned=item.buf.is_cuda)
            self._round(as_numpy(x.reshape(-1)), item.index, as_numpy(dest), divide=self.world)
            out = dest
        else:
            def share(h, into):
                if skip:                    # an earlier bucket of the step failed on this rank
                    st.rounds[self.job] += 1
                    raise XaggError(item.step.reason)
                self._round(h, item.index, into)
            # the host's sum, averaged, in the bucket's dtype, read straight
            # from the shared segment: no copy
            out = from_numpy(self.local.allreduce(as_numpy(x.reshape(-1)), share, key=item.index,
                                                  divide=self.world))
        with self.in_flight.lock:
            st.stats["seconds_xagg"] += time.perf_counter() - t0
            st.stats["bytes_xagg"] += n * item.host.element_size()
        # averaged before it is rounded to a 16-bit dtype (an fp16 sum may overflow)
        return out.to(item.buf.dtype).view(item.buf.shape)

    def _sum_buffer(self, index: int, x: torch.Tensor, pinned: bool) -> torch.Tensor:
        """Where bucket ``index``'s average goes, in x's dtype: the codec
        reads the bucket as it is and writes the average into a sum buffer.
        Not summed in place into the bucket: this rank may broadcast the sum
        when its step's agreement is read, which can be after the next
        backward refilled the bucket. Two buffers per bucket, in turn: step
        s's is written again at step s + 2, after step s + 1 settled step
        s's agreement and long after DDP copied the result out. Reused, not
        fresh: a new 16 MB array page-faults on every call. Pinned for a
        CUDA bucket: the copy back to the device is then async."""
        key = (index, x.numel(), x.dtype)
        pair = self.sums.get(key)
        if pair is None:
            pair = self.sums[key] = [torch.empty(x.numel(), dtype=x.dtype, pin_memory=pinned)
                                     for _ in range(2)]
        pair.reverse()
        return pair[0]

    def _round(self, x: np.ndarray, key: int, out: np.ndarray, divide: int = 1) -> np.ndarray:
        """One xagg call on this lane's job, at its next round."""
        st, client = self.state, self.client
        client.round = st.rounds[self.job] & 0xFFFFFFFF
        st.rounds[self.job] += 1            # at least one round per bucket on every rank, tried or not
        try:
            # 16-bit lanes carry each bucket's rounding error into its next step
            out = client.allreduce(x, key=key, out=out, feedback=client.cfg.wire_bits == 16, divide=divide)
            # a redo round: the same on every rank that got here
            st.rounds[self.job] += client.last_rounds - 1
        finally:
            with self.in_flight.lock:
                cs = client.stats
                for k in self.seen:
                    st.stats[k] += getattr(cs, k) - self.seen[k]
                    self.seen[k] = getattr(cs, k)
        return out

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
        if self.client is not None:
            self.client.close()
        if self.local is not None:
            self.local.close()

    def kept(self) -> Kept:
        """What the next lane of this index can go on from, once this one is
        closed (nothing where its thread outlived close(): it may still write)."""
        if self.client is None or self.thread.is_alive():
            return Kept()
        return Kept(self.client.learned(), self.sums)

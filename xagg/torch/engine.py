"""The I/O side of the xagg hook: one thread per process, buckets in order,
and one thread per lane that sums them.

DDP calls the hook for buckets 0..B-1 in index order on every rank, so one
thread consuming a FIFO sees the same sequence everywhere. It hands bucket
i to lane i mod L (``HookConfig.lanes``, lanes.py; the lane threads are
buckets.py's): each lane is a job of its own with its own client, and runs
one xagg round per bucket, its buckets one after another, so up to L
buckets are in flight at once (and all of them while backward goes on).

At the last bucket of a step the I/O thread waits for every lane, posts the
step's flags on the board and executes what the ranks agreed
(agreement.py: the rule, as data). A rank whose buckets all succeeded reads
the agreement on the board's thread while training goes on; this thread
acts on it as soon as it arrives (so a rank waiting for a broadcast never
waits for another rank's *training* thread, which may itself be blocked in
a collective of the script's), and always before it issues its next
collective, so every rank issues the private group's collectives in the
same order. Between steps, after that, the aggregator set
(aggregator_set.py) and the re-planner (replan.py) may change the set every
rank sums on, at the same step everywhere.

All collectives of this module run on this thread, on a private gloo group,
so they never interleave with DDP's own collectives on its process group.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import torch
import torch.distributed as dist

from xagg.client import Client, XaggError
from xagg.torch import agreement
from xagg.torch.aggregator_set import AggregatorSet
from xagg.torch.agreement import How
from xagg.torch.board import Board, Pending, default_store
from xagg.torch.buckets import Bucket, InFlight, Kept, Lane, Step, stage
from xagg.torch.fallback import agree_max
from xagg.torch.local_reduce import find_hosts, open_segments
from xagg.torch.progress import Reporter
from xagg.torch.replan import Replanner

_AGREED = object()          # queued by the board when an agreement is read: act on it
_IDLE = object()            # no bucket for a keepalive interval

log = logging.getLogger("xagg.torch")


class _Unsettled:
    """A step whose agreement is still being read on the board's thread."""
    __slots__ = ("no", "step", "read")

    def __init__(self, no: int, step: Step, read: Pending):
        self.no, self.step, self.read = no, step, read


class Engine:
    def __init__(self, state):
        if not dist.is_available() or not dist.is_initialized():
            raise XaggError("xagg hook: torch.distributed is not initialised "
                            "(call init_process_group first, e.g. under torchrun)")
        self.state = st = state
        pg = st.process_group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        # a private gloo group: agreement flags and fallback reductions happen
        # on this thread only, so they can never interleave with DDP's own
        # collectives (NCCL or gloo) issued from the autograd/main threads
        self.group = dist.new_group(dist.get_process_group_ranks(pg), backend="gloo")
        # the ranks of a host sum there first where it has several (local_reduce.py)
        self.hosts = find_hosts(st.config, self.group, self.rank, self.world)
        self.aggs = AggregatorSet(st, self.group, self.rank, self.world, self.hosts)
        nonce = self.aggs.agree_job()
        self.replanner = Replanner.from_env(st)   # re-plans between steps when rates drift
        in_flight = InFlight(st.stats)
        local = open_segments(self.hosts, st.job_id, nonce, st.config.lanes, self.group)
        kept = st.kept if len(st.kept) == st.config.lanes else [Kept() for _ in range(st.config.lanes)]
        st.kept = []                            # the lanes hold it now
        self.lanes = [Lane(k, st, self.rank, self.world, in_flight, local[k], kept[k]) for k in range(st.config.lanes)]
        self.aggs.connect(self.lanes)
        self.report = Reporter(st, self.rank)
        self.step = Step()                    # the step in progress on xagg
        self.step_no = 0                      # steps finished, the same count on every rank
        self.unsettled: _Unsettled | None = None       # the last step's, while its agreement is read
        self.switch: agreement.Switch | None = None    # an agreed move to gloo
        self.t_first = None
        self.next_index = 0
        self.fatal: BaseException | None = None
        self._pinned: dict = {}
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        # a nonce names this engine's posts on the store (a restored job restarts at step 0)
        self.board = Board(default_store(), f"xagg/{st.job_id}/{nonce}/", self.rank, self.world,
                           on_read=lambda: self.q.put(_AGREED))
        self.thread = threading.Thread(target=self._run, name=f"xagg-io-r{self.rank}", daemon=True)
        self.thread.start()

    @property
    def client(self) -> Client:
        """Lane 0's client: the job's own (the compressed transport sums on it)."""
        return self.lanes[0].client

    # -- called on the autograd thread ------------------------------------------
    def submit(self, bucket) -> torch.futures.Future:
        item = stage(bucket, self._pinned)
        if self.fatal is not None:
            item.fut.set_exception(self.fatal)
        else:
            self.q.put(item)
        return item.fut

    # -- the I/O thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:        # idle (no bucket for a while: evaluation, a checkpoint): the leases still run
                item = self.q.get(timeout=self.aggs.keepalive_every)
            except queue.Empty:
                item = _IDLE
            self.aggs.keep_alive(time.monotonic())
            if item is _IDLE:
                continue
            if item is None or item is _AGREED:
                if self.fatal is None:
                    try:        # at close, the last step's agreement must still finish
                        self._decide(block=item is None)
                    except BaseException as e:  # noqa: BLE001 - surfaced by the next bucket
                        log.error("xagg: rank %d: I/O thread failed: %s", self.rank, e)
                        self.fatal = e
                if item is None:
                    return
                continue
            if self.fatal is not None:
                item.fut.set_exception(self.fatal)
                continue
            try:
                self._process(item)
            except BaseException as e:  # noqa: BLE001 - surfaced through the futures
                # a gloo failure (a peer died): nothing sane to return; make
                # backward raise instead of hanging or training on garbage
                log.error("xagg: rank %d: I/O thread failed: %s", self.rank, e)
                self.fatal = e
                for it in self.step.items + [item]:
                    if not it.fut.done():
                        it.fut.set_exception(e)
                self.step = Step()

    def _process(self, item: Bucket) -> None:
        st = self.state
        if item.index != self.next_index:
            # DDP reduces buckets strictly in index order; anything else means two
            # models share this state, and the per-step agreement would mix them
            raise XaggError(f"bucket {item.index} arrived where bucket {self.next_index} was due: "
                            "give every DDP model its own XaggState")
        self.next_index = 0 if item.last else item.index + 1
        if self.t_first is None:
            self.t_first = item.t0
        if st.mode == "xagg":
            item.step = self.step
            self.step.items.append(item)
            self.lanes[item.index % len(self.lanes)].put(item)
            if item.last:
                for it in self.step.items:  # every lane done with the step
                    it.done.wait()
                    if it.error is not None:
                        raise it.error
                self._finish_step()
        else:
            res = self._gloo(item)
            if item.last:
                self.switch = None          # already on gloo
                if st.fallback.due():
                    self._retry()
                self._end_step()
            item.fut.set_result(item.to_device(res))

    def _gloo(self, item: Bucket) -> torch.Tensor:
        """DDP's default: divide, then sum over the group (here: the private gloo group)."""
        st = self.state
        self._decide()                      # collectives in the same order on every rank
        if item.event is not None:
            item.event.synchronize()
        t0 = time.perf_counter()
        t = item.host
        t.div_(self.world)
        dist.all_reduce(t, group=self.group)
        st.stats["seconds_gloo"] += time.perf_counter() - t0
        st.stats["buckets_gloo"] += 1
        return t

    # -- the step's end: post, then execute what the ranks agree ---------------------
    def _finish_step(self) -> None:
        step, no = self.step, self.step_no  # listed until settled: a failure fails them
        self._decide()                      # the previous step's, if still undecided
        self.aggs.between_steps(no)
        if self.replanner is not None:      # every rank, here: all switch at the same step
            self.replanner.between_steps(self.aggs, no, step.failed)
        posted = agreement.post(self.rank, [it.failed for it in step.items], self.state.rounds)
        if not step.failed:
            # every bucket came back summed: complete now, agree in the background
            self.state.stats["buckets_xagg"] += len(step.items)
            self._end_step()
            for it in step.items:
                it.fut.set_result(it.to_device(it.result))
            self.board.post(no, posted)
            self.unsettled = _Unsettled(no, step, self.board.read_later(no))
        else:
            self.board.post(no, posted)
            results = self._settle(no, step, self.board.read(no))
            self._end_step()
            for it, res in zip(step.items, results):    # last: DDP may read the counters right after
                it.fut.set_result(it.to_device(res))
        self.step = Step()
        if self.switch and self.switch.after <= no:
            sw, self.switch = self.switch, None
            self.state.fallback.fail(self.rank, sw.reason, first=sw.first)

    def _decide(self, block: bool = True) -> None:
        """Act on the agreement in flight, once it is complete (waiting for it if ``block``)."""
        u = self.unsettled
        if u is None or not (block or u.read.done.is_set()):
            return
        self.unsettled = None
        self._settle(u.no, u.step, u.read.wait())

    def _settle(self, no: int, step: Step, agreed: list) -> list:
        """Execute step ``no``'s agreement: returns each bucket's final host result."""
        st = self.state
        d = agreement.decide(agreement.read(agreed, len(step.items)), no, [it.failed for it in step.items],
                             st.rounds, step.reason, st.fallback.retrying)
        if d.rounds is not None:        # before this rank's next step: its lanes are idle
            st.rounds = list(d.rounds)
        results = []
        for it, fate in zip(step.items, d.fates):
            if fate.how is How.KEEP:
                if not it.fut.done():       # (buckets completed early were counted then)
                    st.stats["buckets_xagg"] += 1
                results.append(it.result)
            elif fate.how is How.FROM_RANK:
                results.append(self._from_rank(it, fate.rank))
            else:
                results.append(self._gloo(it))
            it.result = None
        self.switch = agreement.sooner(self.switch, d.switch)
        if d.succeeded:
            st.fallback.succeeded(self.rank)
        return results

    def _from_rank(self, item: Bucket, src: int) -> torch.Tensor:
        """The sum a rank that got it broadcasts to those that did not."""
        st = self.state
        t0 = time.perf_counter()
        # a fresh buffer unless this rank sends: DDP may be reading the result it already has
        t = item.result if src == self.rank else torch.empty(item.host.shape, dtype=item.buf.dtype)
        # as bytes: gloo broadcasts any dtype that way, bf16 included
        dist.broadcast(t.view(torch.uint8), src=dist.get_global_rank(self.group, src), group=self.group)
        if not item.failed:
            return item.result          # the same bytes
        st.stats["seconds_gloo"] += time.perf_counter() - t0
        st.stats["buckets_gloo"] += 1
        return t

    def _retry(self) -> None:
        """After a back-off: back to xagg if every rank can (fallback.py, agreement.py)."""
        st = self.state
        self._decide()

        def agree(failed_here: bool) -> bool:
            d = agreement.decide_retry(agree_max(
                agreement.post_retry(self.rank, failed_here, st.rounds, self.aggs.proposed_out), self.group))
            if d.back:
                st.rounds = list(d.rounds)
                self.aggs.adopt(d.out)
            return not d.back
        st.fallback.retry(self.rank, st.reregister, agree)

    # -- bookkeeping ------------------------------------------------------------------
    def _end_step(self) -> None:
        st = self.state
        self.step_no += 1
        now = time.perf_counter()
        st.stats["steps"] += 1
        st.stats["last_step_comm"] = now - self.t_first
        st.stats["seconds_comm"] += now - self.t_first
        self.t_first = None
        self.report.step_ended(now)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
        self.report.close()
        for lane in self.lanes:
            lane.close()
        self.board.close()
        self.state.kept = [lane.kept() for lane in self.lanes]

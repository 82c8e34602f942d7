"""The I/O side of the xagg hook: one thread per process, buckets in order,
and one thread per lane that sums them.

DDP calls the hook for buckets 0..B-1 in index order on every rank, so one
thread consuming a FIFO sees the same sequence everywhere. It hands bucket
i to lane i mod L (``HookConfig.lanes``, lanes.py): each lane is a job of
its own with its own client, and runs one xagg round per bucket, its
buckets one after another, so up to L buckets are in flight at once (and
all of them while backward goes on). At the last bucket of a step the I/O
thread waits for every lane, posts the step's flags and executes what the
ranks agreed (agreement.py: the rule, as data). The agreement is read on
the board's thread while training goes on; its outcome is acted on by this
I/O thread as soon as it arrives (so a rank waiting for a broadcast never
waits for another rank's *training* thread, which may itself be blocked in
a collective of the script's), and always before this thread issues its
next collective, so every rank issues the private group's collectives in
the same order.

**Re-planning around a dead aggregator.** When rank 0 cannot register the
job with one aggregator's daemon (at start, or on a retry after a back-off),
it plans that aggregator out (weight 0: no chunk of any tensor goes there)
and registers the job with the rest, as long as one is left; the ranks
adopt the new set at the agreement that follows, so the job goes back to
xagg on the others after one back-off instead of staying on gloo. Every
``REPLAN_EVERY`` steps on a reduced set, rank 0 tries to register the whole
set again and every rank takes the outcome at the same step (between steps,
after the last step's agreement is settled, so no round is in flight).

All collectives of this module run on this thread, on a private gloo group,
so they never interleave with DDP's own collectives on its process group.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from xagg.client import Client, ClientConfig, XaggError
from xagg.torch import agreement
from xagg.torch.agreement import How
from xagg.torch.board import Board, default_store
from xagg.torch.fallback import agree_max
from xagg.torch.lanes import lane_jobs
from xagg.torch.metrics import serve as serve_metrics
from xagg.torch.replan import Replanner
from xagg.wire.proto import C
from xagg.wire.registration import RegistrationError, job_request, register_job, run_job_token, worker_source_ips

_AGREED = object()          # queued by the board when an agreement is read: act on it

log = logging.getLogger("xagg.torch")

REPLAN_EVERY = 50           # steps between tries to bring planned-out aggregators back


class _Bucket:
    """One bucket on its way: the original tensor, its host copy, the future."""
    __slots__ = ("index", "last", "buf", "host", "event", "fut", "t0", "result", "failed", "done", "error")
    # result: the averaged sum on the host, in the bucket's dtype (None until summed)
    # done: set by its lane once summed or failed; error: what broke the lane's thread

    def __init__(self, index, last, buf, host, event, fut):
        self.index, self.last, self.buf, self.host, self.event, self.fut = index, last, buf, host, event, fut
        self.t0 = time.perf_counter()
        self.result, self.failed, self.error = None, False, None
        self.done = threading.Event()


class _Lane:
    """A thread that sums the buckets handed to it, one after another, on its
    own job and client (lanes.py)."""

    def __init__(self, engine, index: int):
        self.engine, self.index = engine, index
        self.client: Client | None = None
        self.seen = {}                      # the client's counters as last added to the state's
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"xagg-lane{index}-r{engine.rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            try:
                self.engine._sum_in_lane(self, item)
            except BaseException as e:  # noqa: BLE001 - raised on the I/O thread
                item.error = e
            finally:
                item.done.set()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
        if self.client is not None:
            self.client.close()


class _Agreement:
    """One step's agreement: the step's buckets and the flags agreed on them."""
    __slots__ = ("step", "pending", "flags", "items")

    def __init__(self, step, items, *, flags=None, pending=None):
        # pending: the board's read still in flight (flags come from it)
        self.step, self.items, self.flags, self.pending = step, items, flags, pending


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
        self.root = dist.get_global_rank(self.group, 0)
        self.request = None
        self.workers_by_agg = None            # per aggregator, one address per rank (registering)
        self.out = 0                          # aggregators planned out (bit k: aggregator k), agreed
        self.proposed_out = 0                 # rank 0: the set its last registration left out
        self._lock = threading.Lock()        # the counters, which lanes add to
        self._in_flight = 0
        self._agree_job()
        self.replanner = Replanner.from_env(st)   # re-plans between steps when rates drift
        self.lanes = [_Lane(self, k) for k in range(st.config.lanes)]
        for lane in self.lanes:
            lane.client = self._make_client(lane)
        self.metrics = None
        if st.config.metrics:
            try:
                self.metrics = serve_metrics(st, st.config.metrics, self.rank)
            except OSError as e:        # training goes on; the operator is told once
                log.warning("xagg: rank %d: metrics: cannot serve at %s (+ local rank): %s",
                            self.rank, st.config.metrics, e)
        self.pending: list[_Bucket] = []
        self.step_failed = False
        self.step_no = 0                      # steps finished, the same count on every rank
        self.unsettled: _Agreement | None = None   # the last step's, while undecided
        self.switch: agreement.Switch | None = None     # an agreed move to gloo
        self.local_reason = ""
        self.t_first = None
        self.next_index = 0
        self.fatal: BaseException | None = None
        self._pinned: dict = {}
        self._sums: dict = {}                 # (bucket, size) -> two float32 sum buffers, used in turn
        self._last_status = self._last_progress = 0.0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.board = Board(default_store(), f"xagg/{st.job_id}/{self.nonce}/", self.rank, self.world,
                           on_read=lambda: self.q.put(_AGREED))
        self.thread = threading.Thread(target=self._run, name=f"xagg-io-r{self.rank}", daemon=True)
        self.thread.start()

    def _make_client(self, lane: _Lane) -> Client:
        """This rank's client of ``lane``'s job for the agreed set of
        aggregators: the plan's weights and, for a tree on the whole set, this
        rank's row of its routes (a re-plan around a dead aggregator runs flat
        on the rest)."""
        st, cfg = self.state, self.state.config
        job_id, port = lane_jobs(st.job_id, lane.index + 1)[lane.index]
        client = Client(ClientConfig(
            job_id=job_id, cookie=st.cookie, worker_id=self.rank, n_workers=self.world, result_port=port,
            aggregators=cfg.aggregators, weights=self.weights(self.out), fanout=cfg.fanout, rto=cfg.rto,
            timeout=cfg.timeout, window=cfg.window or 0, vals=st.vals, route=self.routes()[self.rank]
            if self.routes() else None))
        # the compressed transport counts rounds on lane 0's client
        client.round = st.rounds[lane.index] & 0xFFFFFFFF
        lane.seen = dict(packets_sent=0, retransmits=0, results=0, redone=0)
        return client

    @property
    def client(self) -> Client:
        """Lane 0's client: the job's own (the compressed transport sums on it)."""
        return self.lanes[0].client

    def routes(self, out: int | None = None) -> list | None:
        """The plan's routes (a tree), while every aggregator is in the set."""
        return self.state.config.routes if not (self.out if out is None else out) else None

    # -- start-up: one job id for all ranks, registered by rank 0 -------------------
    def _agree_job(self) -> None:
        st = self.state
        ok, reason = 1, ""
        registers = st.config.registers
        if registers:
            # each rank's address towards each aggregator: a multi-rail host reaches
            # them through different NICs, and each daemon pins what it will see
            ips = [None] * self.world
            dist.all_gather_object(ips, worker_source_ips(st.config.aggregators), group=self.group)
            self.workers_by_agg = [[ips[r][k] for r in range(self.world)]
                                   for k in range(len(st.config.aggregators))]
        if self.rank == 0:
            st.job_id = st.job_id if st.job_id is not None else 1 + secrets.randbelow(2**32 - 1)
            st.cookie = st.cookie if st.cookie is not None else secrets.randbelow(2**32)
            if registers:
                self.request = job_request(job_id=st.job_id, cookie=st.cookie, workers=self.workers_by_agg[0],
                                           max_elements=st.max_elements, aggregators=st.config.aggregators,
                                           weights=st.config.weights, fanout=st.config.fanout, vals=st.vals,
                                           # over TCP: the same job token for every run of this job,
                                           # so a rerun or a restore can re-register it
                                           job_token=run_job_token(st.config.token, st.job_id, st.cookie)
                                           if st.config.token else None)
                ok, reason = self.register()
        # every rank packs chunks like the aggregators: vals from rank 0's registration;
        # a nonce naming this engine's posts on the store (a restored job restarts at step 0);
        # and this incarnation's first round (see below)
        t = torch.tensor([st.job_id or 0, st.cookie or 0, ok, st.vals or C.XAGG_VALS, secrets.randbits(62),
                          secrets.randbits(31), self.proposed_out], dtype=torch.int64)
        dist.broadcast(t, src=self.root, group=self.group)
        st.job_id, st.cookie, ok, st.vals, self.nonce, base, self.out = (int(v) for v in t)
        # A run of a job id the aggregators already served (a fixed --job-id/--cookie run
        # again, a restored checkpoint) must not meet the old run's slots: rounds start at a
        # random base, almost surely more than XAGG_ROUND_WINDOW from where the old run left
        # them, and the aggregators take a round that far behind for a new incarnation
        # (bpf/xagg_xdp.c slot_update). The odds of landing inside an old run's window are
        # (W + 1) / 2**31, about 2**-15. The base is below 2**31 so that a run's 32-bit
        # rounds (the compressed transport agrees on the client's, compressed.py) do not
        # wrap within 2**31 rounds.
        st.rounds = [base] * st.config.lanes
        if not ok:
            st.fallback.fail(self.rank, reason or "rank 0 could not register the job with the aggregators",
                             first=True)

    def weights(self, out: int) -> list[float]:
        """The configured weights with the aggregators in ``out`` (a bit mask) at 0."""
        cfg = self.state.config
        ws = cfg.weights or [1.0] * len(cfg.aggregators)
        return [0.0 if out >> k & 1 else float(w) for k, w in enumerate(ws)]

    def register(self, out: int | None = None) -> tuple[int, str]:
        """Register the job with the aggregators' daemons (rank 0): (ok, why not).
        Starts from the aggregators in ``out`` (default: the agreed set) planned
        out; one whose daemon cannot be reached is planned out as well and the
        rest registered, while an aggregator with a weight is left. The set it
        ended with is ``proposed_out``, which the ranks adopt when they agree."""
        st = self.state
        out = self.out if out is None else out
        while True:
            ws = self.weights(out)
            self.request = {**self.request, "aggregators": [{**a, "weight": w} for a, w in
                                                            zip(self.request["aggregators"], ws)]}
            try:
                for job_id, port in lane_jobs(st.job_id, st.config.lanes):
                    req = {**self.request, "job_id": job_id, "result_port": port}
                    if st.config.token:
                        req["job_token"] = run_job_token(st.config.token, job_id, st.cookie)
                    vals = register_job(st.config.control, st.config.token, req,
                                        workers_by_agg=self.workers_by_agg, routes=self.routes(out))
                break
            except RegistrationError as e:
                k = e.aggregator
                left = [w for i, w in enumerate(ws) if i != k and w]
                if k is None or not left:
                    return 0, str(e)
                log.warning("xagg: rank %d: %s; planning aggregator %d out, the job goes on with "
                            "the others", self.rank, e, k)
                out |= 1 << k
        if st.vals is not None and vals != st.vals:     # a daemon restarted with other --vals
            return 0, f"the aggregators now run {vals} values per packet, this job {st.vals}"
        st.vals = vals
        self.proposed_out = out
        return 1, ""

    def remake_clients(self) -> None:
        """Every lane's client made again for the set and routes now agreed
        (another socket address book), each at the round it had reached."""
        for lane in self.lanes:
            rnd = lane.client.round
            lane.client.close()
            lane.client = self._make_client(lane)
            lane.client.round = rnd

    def adopt(self, out: int) -> None:
        """Every rank, at the same point: chunks go to the aggregators not in ``out``."""
        if out != self.out:
            tree = bool(self.routes())
            self.out = out
            if tree or self.routes():       # routes in or out: another socket address book
                self.remake_clients()
            else:
                for lane in self.lanes:
                    lane.client.cfg.weights = self.weights(out)
            gone = [k for k in range(len(self.state.config.aggregators)) if out >> k & 1]
            log.warning("xagg: rank %d: aggregating on %s", self.rank,
                        f"all but aggregator(s) {gone}" if gone else "every aggregator again")

    # -- called on the autograd thread ------------------------------------------
    def submit(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        if buf.is_cuda:
            # stage through pinned host memory; the I/O thread waits on the event
            key = (bucket.index(), buf.numel(), buf.dtype)
            host = self._pinned.get(key)
            if host is None:
                host = self._pinned[key] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buf.device))
            fut = torch.futures.Future(devices=[buf.device])
        else:
            host, event, fut = buf, None, torch.futures.Future()
        item = _Bucket(bucket.index(), bucket.is_last(), buf, host, event, fut)
        if self.fatal is not None:
            fut.set_exception(self.fatal)
        else:
            self.q.put(item)
        return fut

    # -- the I/O thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self.q.get()
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
                for it in self.pending + [item]:
                    if not it.fut.done():
                        it.fut.set_exception(e)
                self.pending = []

    def _process(self, item: _Bucket) -> None:
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
            self.pending.append(item)
            self.lanes[item.index % len(self.lanes)].q.put(item)
            if item.last:
                for it in self.pending:     # every lane done with the step
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
            item.fut.set_result(self._to_device(item, res))

    def _sum_in_lane(self, lane: _Lane, item: _Bucket) -> None:
        """On ``lane``'s thread: sum ``item`` through its job, or mark it failed."""
        st, k = self.state, lane.index
        rnd = st.rounds[k]                  # at least one round per bucket on every rank, tried or not
        st.rounds[k] += 1
        if self.step_failed:
            item.failed = True              # the others will time out; see module docstring
            return
        with self._lock:
            self._in_flight += 1
            st.stats["max_in_flight"] = max(st.stats["max_in_flight"], self._in_flight)
        try:
            item.result = self._xagg(item, rnd, lane)
        except (XaggError, OSError) as e:
            item.failed, self.step_failed, self.local_reason = True, True, str(e)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _xagg(self, item: _Bucket, rnd: int, lane: _Lane) -> torch.Tensor:
        st, client = self.state, lane.client
        n = item.host.numel()
        if st.max_elements is not None and n > st.max_elements:
            raise XaggError(f"bucket {item.index} holds {n} elements, more than max_elements="
                            f"{st.max_elements} the job was sized for")
        if item.event is not None:
            item.event.synchronize()
        x = item.host.detach()
        if x.dtype == torch.float32:
            # Not summed in place into the bucket: this rank may broadcast the
            # sum when its step's agreement is read (_from_rank), which can be
            # after the next backward refilled the bucket. Two buffers per
            # bucket, in turn: step s's is written again at step s + 2, after
            # step s + 1 settled step s's agreement (_finish_step) and long
            # after DDP copied the result out. Reused, not fresh: a new 16 MB
            # array page-faults on every call.
            x = x.numpy()
            pair = self._sums.get((item.index, n))
            if pair is None:
                pair = self._sums[(item.index, n)] = [np.empty(n, np.float32), np.empty(n, np.float32)]
            pair.reverse()
            dest = pair[0]
        else:
            x = dest = x.to(torch.float32).numpy()      # our own copy: summed in place
        client.round = rnd & 0xFFFFFFFF
        t0 = time.perf_counter()
        try:
            out = client.allreduce(x, key=item.index, out=dest)
            # a redo round: the same on every rank that got here
            st.rounds[lane.index] += client.last_rounds - 1
        finally:
            with self._lock:
                cs = client.stats
                for k in lane.seen:
                    st.stats[k] += getattr(cs, k) - lane.seen[k]
                    lane.seen[k] = getattr(cs, k)
        with self._lock:
            st.stats["seconds_xagg"] += time.perf_counter() - t0
            st.stats["bytes_xagg"] += n * item.host.element_size()
        # sum in float32, then average, then the bucket's dtype (no fp16 overflow)
        return torch.from_numpy(out).div_(self.world).to(item.buf.dtype).view(item.buf.shape)

    def _gloo(self, item: _Bucket) -> torch.Tensor:
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

    @staticmethod
    def _to_device(item: _Bucket, host: torch.Tensor) -> torch.Tensor:
        return host.to(item.buf.device, non_blocking=True) if item.buf.is_cuda else host

    # -- agreement ----------------------------------------------------------------
    def _finish_step(self) -> None:
        pending, step = self.pending, self.step_no  # listed until settled: a failure fails them
        self._decide()                      # the previous step's, if still undecided
        if self.out and step % REPLAN_EVERY == REPLAN_EVERY - 1:
            self._try_whole_set()
        if self.replanner is not None:      # every rank, here: all switch at the same step
            self.replanner.between_steps(self, step, self.step_failed)
            for lane in self.lanes[1:]:     # it re-plans lane 0's client; the others follow
                lane.client.cfg.weights = self.client.cfg.weights
        if not self.step_failed:
            # every bucket came back summed: complete now, agree in the background
            self.state.stats["buckets_xagg"] += len(pending)
            self._end_step()
            for it in pending:
                it.fut.set_result(self._to_device(it, it.result))
            self.board.post(step, self._flags(pending))
            self.unsettled = _Agreement(step, pending, pending=self.board.read_later(step))
        else:
            self.board.post(step, self._flags(pending))
            results = self._settle(_Agreement(step, pending, flags=self.board.read(step)))
            self.step_failed, self.local_reason = False, ""
            self._end_step()
            for it, res in zip(pending, results):   # last: DDP may read the counters right after
                it.fut.set_result(self._to_device(it, res))
        self.pending = []
        if self.switch and self.switch.after <= step:
            sw, self.switch = self.switch, None
            self.state.fallback.fail(self.rank, sw.reason, first=sw.first)

    def _flags(self, pending: list) -> list:
        return agreement.post(self.rank, [it.failed for it in pending], self.state.rounds)

    def _decide(self, block: bool = True) -> None:
        """Act on the agreement in flight, once it is complete (waiting for it if ``block``)."""
        a = self.unsettled
        if a is None or not (block or a.pending.done.is_set()):
            return
        self.unsettled = None
        a.flags = a.pending.wait()
        self._settle(a)

    def _settle(self, a: _Agreement) -> list:
        """Execute an agreement: returns each bucket's final host result."""
        st = self.state
        failed_here = [it.failed for it in a.items]
        d = agreement.decide(agreement.read(a.flags, len(a.items)), a.step, failed_here, st.rounds,
                             self.local_reason, st.fallback.retrying)
        if d.rounds is not None:        # this runs before this rank's next step, its lanes idle
            st.rounds = list(d.rounds)
        results = []
        for it, fate in zip(a.items, d.fates):
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

    def _from_rank(self, item: _Bucket, src: int) -> torch.Tensor:
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

    def _try_whole_set(self) -> None:
        """On a reduced set, every REPLAN_EVERY steps: rank 0 registers the whole
        set again (an aggregator planned out may be back) and every rank takes
        the set it got from the next step on. Runs where every rank has settled
        the steps before (a collective, on this thread, in the same order)."""
        if not self.state.config.registers:
            return
        ok = self.register(out=0)[0] if self.rank == 0 else 0
        t = torch.tensor([ok, self.proposed_out], dtype=torch.int64)
        dist.broadcast(t, src=self.root, group=self.group)
        if t[0]:
            self.adopt(int(t[1]))

    def _retry(self) -> None:
        """After a back-off: back to xagg if every rank can (fallback.py). Rounds
        go on past every round any rank used, so the slots an abandoned round
        left are superseded."""
        st = self.state
        self._decide()

        def agree(failed_here: bool) -> bool:
            d = agreement.decide_retry(agree_max(
                agreement.post_retry(self.rank, failed_here, st.rounds, self.proposed_out), self.group))
            if d.back:
                st.rounds = list(d.rounds)
                self.adopt(d.out)
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
        if st.config.status_dir and now - self._last_status >= 1.0:
            self._last_status = now
            self.write_status()
        every = st.config.progress_every
        if every and self.rank == 0 and now - self._last_progress >= every:
            self._last_progress = now
            print(progress_line(st.snapshot()), file=sys.stderr, flush=True)

    def write_status(self) -> None:
        st = self.state
        try:
            os.makedirs(st.config.status_dir, exist_ok=True)
            path = os.path.join(st.config.status_dir, f"rank{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({**st.snapshot(), "time": time.time()}, f)
            os.replace(path + ".tmp", path)
        except OSError as e:
            log.debug("xagg: status file: %s", e)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)
        if self.metrics is not None:
            self.metrics.close()
        if self.state.config.status_dir:
            self.write_status()
        for lane in self.lanes:
            lane.close()
        self.board.close()


def progress_line(s: dict) -> str:
    steps = s["steps"] or 1
    return (f"xagg: step {s['steps']} [{s['mode']}] | buckets xagg {s['buckets_xagg']} "
            f"gloo {s['buckets_gloo']} | fallbacks {s['fallbacks']} | "
            f"{s['bytes_xagg'] / 1e6:.1f} MB at {s['bandwidth_gbps']:.2f} Gbit/s | "
            f"comm {1e3 * s['seconds_comm'] / steps:.1f} ms/step | retransmits {s['retransmits']}")

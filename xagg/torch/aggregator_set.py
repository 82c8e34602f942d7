"""The aggregators a job sums on, and every lane's client of them.

At start rank 0 picks or takes the job id and cookie, registers the job with
the aggregators' daemons (when it registers) and tells the other ranks, with
the values per packet the daemons run, a nonce for the engine's posts and
the first round (``agree_job``).

**Planning a dead aggregator out.** When rank 0 cannot register the job with
one aggregator's daemon (at start, or on a retry after a back-off), it plans
that aggregator out (weight 0: no chunk of any tensor goes there) and
registers the job with the rest, as long as one is left; the ranks adopt the
new set at the agreement that follows (agreement.py ``decide_retry``), so
the job goes back to xagg on the others after one back-off instead of
staying on gloo. Every ``WHOLE_SET_EVERY`` steps on a reduced set, rank 0
tries to register the whole set again and every rank takes the outcome at
the same step (between steps, after the last step's agreement is settled,
so no round is in flight).

A tree (the plan's routes) runs only on the whole set: on a reduced set the
job runs flat on the rest, so a change in or out of the whole set gives
every lane another client (another socket address book).
"""
from __future__ import annotations

import logging
import secrets

import torch
import torch.distributed as dist

from xagg.client import Client, ClientConfig, handshake
from xagg.client.config import MIN_WINDOW, XaggError
from xagg.torch import result_path
from xagg.torch.lanes import lane_jobs
from xagg.torch.local_reduce import Hosts, flat, job_index, share_elements
from xagg.wire.control import ControlClient, ControlError
from xagg.wire.proto import C
from xagg.wire.registration import RegistrationError, job_request, register_job, run_job_token, worker_source_ips

log = logging.getLogger("xagg.torch")

WHOLE_SET_EVERY = 50        # steps between tries to bring planned-out aggregators back
# Seconds between rank 0's keepalives of its registered jobs. Packets renew a
# job's lease by themselves; a keepalive matters while none flow (steps on
# gloo, an evaluation, a checkpoint). A tenth of xaggd's default lease (10
# min), so a few lost or late ones do not cost the job; a daemon's shorter
# lease (its answer's lease_s) brings it down to a third of that.
KEEPALIVE_S = 60.0
KEEPALIVE_TIMEOUT_S = 2.0   # a daemon that does not answer must not hold the I/O thread long


class AggregatorSet:
    """The agreed set of aggregators (``out``: those planned out, bit k for
    aggregator k) and the lanes' clients of it; every method that is a
    collective runs on the engine's I/O thread, on its private ``group``."""

    def __init__(self, state, group, rank: int, world: int, hosts: Hosts | None = None):
        self.state, self.group, self.rank, self.world = state, group, rank, world
        # the job's workers: the hosts where their ranks sum locally first (local_reduce.py),
        # each rank's lane k then on job job_index(k, local rank): lanes x ranks per host jobs
        self.hosts = hosts or flat(rank, world)
        self.n_jobs = state.config.lanes * self.hosts.local_size
        self.request = None                   # rank 0: the job as it registers it
        self.workers_by_agg = None            # per aggregator, one address per rank (registering)
        self.out = 0                          # aggregators planned out, agreed
        self.proposed_out = 0                 # rank 0: the set its last registration left out
        self.lanes: list = []                 # the engine's lanes, whose clients this makes
        self.keepalive_every = KEEPALIVE_S
        self.kept_alive = None                # rank 0: when the jobs' leases were last renewed
        self.choice = None                    # how results come back, and why (result_path.py)
        self.results = None                   # the result path the clients use: the choice's, or unicast

    @property
    def root(self) -> int:
        """Rank 0 of the group, as the default group numbers it (what broadcasts name)."""
        return dist.get_global_rank(self.group, 0)

    # -- start-up: one job id for all ranks, registered by rank 0 -------------------
    def agree_job(self) -> int:
        """Agree on the job (a collective): returns the nonce that names this
        engine's posts on the store (a restored job restarts at step 0)."""
        st = self.state
        ok, reason = 1, ""
        self._same_lanes()
        if st.config.registers:
            self.workers_by_agg = self._source_addresses()
        self.choice = result_path.agree(st.config, self.group, self.world, list(self.hosts.first_ranks))
        self.results = self.choice.path
        if self.rank == 0:
            st.job_id = st.job_id if st.job_id is not None else 1 + secrets.randbelow(2**32 - 1)
            st.cookie = st.cookie if st.cookie is not None else secrets.randbelow(2**32)
            if st.config.registers:
                self.request = self._job_request()
                ok, reason = self.register()
            else:
                ok, reason = self._ask_aggregators()
        # every rank packs chunks like the aggregators: vals from rank 0's registration
        t = torch.tensor([st.job_id or 0, st.cookie or 0, ok, st.vals or C.XAGG_VALS, secrets.randbits(62),
                          secrets.randbits(31), self.proposed_out], dtype=torch.int64)
        dist.broadcast(t, src=self.root, group=self.group)
        st.job_id, st.cookie, ok, st.vals, nonce, base, self.out = (int(v) for v in t)
        # A run of a job id the aggregators already served (a fixed --job-id/--cookie run
        # again, a restored checkpoint) must not meet the old run's slots: rounds start at a
        # random base, almost surely more than XAGG_ROUND_WINDOW from where the old run left
        # them, and the aggregators take a round that far behind for a new incarnation
        # (bpf/xagg_slot.h slot_step). The odds of landing inside an old run's window are
        # (W + 1) / 2**31, about 2**-15. The base is below 2**31 so that a run's 32-bit
        # rounds (the compressed transport agrees on the client's, compressed.py) do not
        # wrap within 2**31 rounds.
        st.rounds = [base] * self.n_jobs        # one sequence per job (local_reduce.py)
        if not ok:
            st.fallback.registering = True       # refused at registration: no timeout paid
            try:
                st.fallback.fail(self.rank, reason or "rank 0 could not register the job with the aggregators",
                                 first=True)
            finally:
                st.fallback.registering = False
        return nonce

    def _same_lanes(self) -> None:
        """Every rank's lane width, compared (a collective) before anything is
        registered: the aggregators refuse a chunk whose contributions mix
        widths (mixed_lanes), so a rank set apart would time out every step."""
        bits = self.state.config.wire_bits
        t = torch.tensor([bits, -bits], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) != -int(t[1]):
            raise XaggError(f"rank {self.rank}: the job's ranks sum in {-int(t[1])}-bit and {int(t[0])}-bit lanes "
                            f"(this one {bits}): every rank must give the same --wire-bits (XAGG_WIRE_BITS; "
                            "--compress int16 is 16-bit lanes)")

    def _ask_aggregators(self) -> tuple[int, str]:
        """A job the operator registered: one probe packet to each aggregator
        (xagg/client/handshake.py) gives its values per packet, and names a
        wrong address, job id, cookie or --vals before the first sum: (ok, why not)."""
        st = self.state
        answers = handshake.ask(st.config.aggregators, st.job_id, st.cookie)
        why = handshake.problem(answers, st.job_id, st.vals)
        if why:
            return 0, why
        vals = next(iter(answers.values())).vals
        if st.vals is None:
            log.info("xagg: job %d: %d values per packet, as its aggregators answered", st.job_id, vals)
        st.vals = vals
        return 1, ""

    def _source_addresses(self) -> list:
        """Each worker's address towards each aggregator (a collective): a
        multi-rail host reaches them through different NICs, and each daemon
        pins what it will see. A host's first rank speaks for it."""
        ips = [None] * self.world
        dist.all_gather_object(ips, worker_source_ips(self.state.config.aggregators), group=self.group)
        return [[ips[r][k] for r in self.hosts.first_ranks] for k in range(len(self.state.config.aggregators))]

    def _job_request(self) -> dict:
        st = self.state
        return job_request(job_id=st.job_id, cookie=st.cookie, workers=self.workers_by_agg[0],
                           max_elements=share_elements(st.max_elements, self.hosts.local_size),
                           aggregators=st.config.aggregators,
                           weights=st.config.weights, fanout=self.results.fanout, vals=st.vals,
                           result_group=self.results.group,
                           # over TCP: the same job token for every run of this job,
                           # so a rerun or a restore can re-register it
                           job_token=run_job_token(st.config.token, st.job_id, st.cookie)
                           if st.config.token else None)

    # -- the set --------------------------------------------------------------------
    def weights(self, out: int) -> list[float]:
        """The configured weights with the aggregators in ``out`` (a bit mask) at 0."""
        cfg = self.state.config
        ws = cfg.weights or [1.0] * len(cfg.aggregators)
        return [0.0 if out >> k & 1 else float(w) for k, w in enumerate(ws)]

    def routes(self, out: int | None = None) -> list | None:
        """The plan's routes (a tree), while every aggregator is in the set."""
        return self.state.config.routes if not (self.out if out is None else out) else None

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
                for job_id, port in lane_jobs(st.job_id, self.n_jobs):
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
        self.kept_alive = None          # renew at once: the answer says the daemons' lease
        return 1, ""

    def keep_alive(self, now: float) -> None:
        """Rank 0: renew the leases of the jobs it registered, at most every
        ``keepalive_every`` seconds (not a collective: the engine calls it
        between buckets and when idle). A daemon that does not answer is the
        fallback's business; this only logs it."""
        st = self.state
        if self.rank != 0 or not st.config.registers or self.request is None:
            return
        if self.kept_alive is not None and now - self.kept_alive < self.keepalive_every:
            return
        self.kept_alive = now
        ws = self.weights(self.out)
        for k, address in enumerate(st.config.control):
            if not ws[k]:
                continue
            try:
                with ControlClient(address, token=st.config.token, timeout=KEEPALIVE_TIMEOUT_S) as cc:
                    for job_id, _ in lane_jobs(st.job_id, self.n_jobs):
                        token = (run_job_token(st.config.token, job_id, st.cookie) if st.config.token
                                 else self.request["job_token"])
                        lease = cc.keepalive(job_id, job_token=token).get("lease_s") or 0
                        if lease:
                            self.keepalive_every = min(KEEPALIVE_S, lease / 3)
            except (ControlError, OSError, ValueError) as e:
                log.info("xagg: rank 0: keepalive of job %d at aggregator %d (%s): %s", st.job_id, k, address, e)

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

    def between_steps(self, step: int) -> None:
        """On a reduced set, every WHOLE_SET_EVERY steps: rank 0 registers the
        whole set again (an aggregator planned out may be back) and every rank
        takes the set it got from the next step on. Runs where every rank has
        settled the steps before (a collective, on the I/O thread, in the same
        order)."""
        if not self.out or step % WHOLE_SET_EVERY != WHOLE_SET_EVERY - 1 or not self.state.config.registers:
            return
        ok = self.register(out=0)[0] if self.rank == 0 else 0
        t = torch.tensor([ok, self.proposed_out], dtype=torch.int64)
        dist.broadcast(t, src=self.root, group=self.group)
        if t[0]:
            self.adopt(int(t[1]))

    # -- the lanes' clients -----------------------------------------------------------
    def job_of(self, lane: int) -> int:
        """The job index this rank's lane ``lane`` sums on (local_reduce.job_index)."""
        return job_index(lane, self.hosts.local_rank, self.state.config.lanes)

    def client_config(self, lane: int) -> ClientConfig:
        """This rank's client settings for lane ``lane``'s job on the agreed set:
        the plan's weights and, for a tree on the whole set, this worker's row of
        its routes (a re-plan around a dead aggregator runs flat on the rest)."""
        st, cfg, h = self.state, self.state.config, self.hosts
        job = self.job_of(lane)
        job_id, port = lane_jobs(st.job_id, job + 1)[job]
        routes = self.routes()
        c = cfg.client_config(
            job_id=job_id, cookie=st.cookie, worker_id=h.host, n_workers=h.hosts, result_port=port,
            weights=self.weights(self.out), vals=st.vals, route=routes[h.host] if routes else None,
            results=self.results)
        if not cfg.window:      # the host is the worker: its ranks' shares split its byte window
            c.window = max(MIN_WINDOW, c.window // h.local_size)
        return c

    def connect(self, lanes: list) -> None:
        """Give every lane its client, at its job's agreed round."""
        self.lanes = lanes
        for lane in lanes:
            lane.job = self.job_of(lane.index)
            lane.use(Client(self.client_config(lane.index), lane.learned), self.state.rounds[lane.job])
            lane.learned = None
        if self.choice.check and self.state.mode == "xagg":      # "auto" chose a group: does it deliver?
            result_path.check_delivery(self, share_elements(self.state.max_elements, self.hosts.local_size))

    def remake_clients(self) -> None:
        """Every lane's client made again for the set and routes now agreed
        (another socket address book), each at the round it had reached and
        going on from what the last one learned."""
        for lane in self.lanes:
            rnd = lane.client.round
            lane.client.close()
            lane.use(Client(self.client_config(lane.index), lane.client.learned()), rnd)

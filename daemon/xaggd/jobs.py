"""The jobs one daemon serves: register, resize, reset and remove requests
turned into placed, installed jobs (placement.py), and the list kept across
restarts (persist.py), and their leases (lease.py): the requests here
that come from a job's registrant renew its lease, ``expire`` removes the
jobs whose lease ran out.

Every method that reads or changes the table takes one lock: the control
API calls them from several connection threads.
"""
from __future__ import annotations

import logging
import threading
import time

from xagg.wire import chunks
from xagg.wire.addresses import parse_addr
from xagg.wire.fanout import DEFAULT_FANOUT, Fanout
from xagg.wire.jobspec import DEFAULT_BCAST_IP, DEFAULT_RESULT_PORT, JobError
from xaggd import job_request
from xaggd.auth import holds, job_token_hash
from xaggd.backends import Backend
from xaggd.job import Job
from xaggd.job_request import RequestError, job_token
from xaggd.lease import IDLE_AFTER_S, Activity, expired
from xaggd.placement import Placement
from xaggd.settings import format_size

log = logging.getLogger("xaggd.jobs")


class JobTable:
    """The jobs installed in one backend, and the memory they hold."""

    def __init__(self, backend: Backend, *, max_slots: int, max_jobs: int, max_workers: int, vals: int,
                 slot_bytes: int, on_change=None, clock=time.monotonic):
        self.backend = backend
        self.clock = clock              # what leases are measured with (tests give their own)
        self.on_change = on_change or (lambda records: None)   # the job list changed (persist.py)
        self.max_workers = max_workers
        self.vals = vals
        self.slot_bytes = slot_bytes
        self.placement = Placement(backend, max_slots=max_slots, max_jobs=max_jobs, slot_bytes=slot_bytes)
        self.jobs: dict[int, Job] = {}
        self.lock = threading.RLock()

    # -- reporting ----------------------------------------------------------
    def memory(self) -> dict:
        slots = self.placement.slots
        return {"max_slots": slots.total, "used_slots": slots.total - slots.free_total,
                "free_slots": slots.free_total, "largest_free_slots": slots.largest_free,
                "slot_bytes": self.slot_bytes, "memory_bytes": slots.total * self.slot_bytes,
                "free_bytes": slots.free_total * self.slot_bytes,
                "max_jobs": self.placement.max_jobs, "jobs": len(self.jobs)}

    def get(self, job_id: int) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            known = ", ".join(str(j) for j in sorted(self.jobs)) or "none"
            raise RequestError(f"job_id: no job {job_id} on this aggregator (registered: {known})")
        return job

    def list(self, cookies: bool = True) -> list[dict]:
        """Every job, with how long it has been idle (``idle_s``); ``cookies``
        False leaves their cookies out (for non-admins)."""
        with self.lock:
            idle = self.idle()
            out = [{**self.jobs[j].describe(self.slot_bytes), "idle_s": round(idle[j], 1)}
                   for j in sorted(self.jobs)]
        if not cookies:
            for d in out:
                d.pop("cookie")
        return out

    def idle_report(self, idle: dict[int, float]) -> dict:
        """The jobs of ``idle`` ({job_id: idle seconds}) idle for IDLE_AFTER_S
        or longer, and the slots they hold."""
        with self.lock:
            jobs = sorted(j for j, s in idle.items() if s >= IDLE_AFTER_S and j in self.jobs)
            return {"after_s": IDLE_AFTER_S, "jobs": jobs,
                    "slots": sum(self.jobs[j].n_slots for j in jobs)}

    def stats(self, job_id: int | None = None) -> dict:
        with self.lock:
            ids = [self.get(job_id).job_id] if job_id is not None else sorted(self.jobs)
            out = {}
            for j in ids:
                job = self.jobs[j]
                st = self.backend.job_stats(job.job_id, job.job_index)
                st["bytes_aggregated"] = st.get("aggregated", 0) * self.vals * 4
                if job.subs:        # per child entry: this host summing for another root
                    st["child_entries"] = {
                        str(s["agg_index"]): self.backend.job_stats(job.job_id, s["job_index"], s["agg_index"])
                        for s in job.subs}
                out[str(j)] = st
            return out

    def _authorise(self, job: Job, admin: bool, token: str | None) -> None:
        """Admins may touch any job; others only with its job token."""
        if not admin and not holds(job.token_hash, token):
            raise RequestError(f"job_token: job {job.job_id} belongs to another registrant: send the "
                               "job_token its register answer gave, or use the admin token")

    def _get_authorised(self, job_id: int, admin: bool, token: str | None) -> Job:
        job = self.get(job_id)
        self._authorise(job, admin, token)
        return job

    # -- leases (lease.py) -----------------------------------------------------
    def _packets(self, job: Job) -> int:
        """The total of the job's packet counters, its child entries' too."""
        total = sum(self.backend.job_stats(job.job_id, job.job_index).values())
        for s in job.subs:
            total += sum(self.backend.job_stats(job.job_id, s["job_index"], s["agg_index"]).values())
        return total

    def idle(self, now: float | None = None) -> dict[int, float]:
        """{job_id: seconds without a sign of life} at ``now`` (default: the
        clock), after reading every job's packet counters."""
        now = self.clock() if now is None else now
        with self.lock:
            for job in self.jobs.values():
                job.activity = job.activity.observe(self._packets(job), now)
            return {j: job.activity.idle_s(now) for j, job in self.jobs.items()}

    def expire(self, lease_s: float, now: float | None = None) -> list[Job]:
        """Remove the jobs idle for ``lease_s`` or longer at ``now``; 0: none."""
        if lease_s <= 0:
            return []
        with self.lock:
            idle = self.idle(now)
            gone = [self.jobs[j] for j in expired(idle, lease_s)]
            for job in gone:
                self._remove(job)
            if gone:
                self._changed()
        for job in gone:
            log.warning("removed job %d: neither packets nor requests from its registrant for %.0fs "
                        "(job_lease %gs); freed %d slots (%s) and index %d", job.job_id, idle[job.job_id],
                        lease_s, job.n_slots, format_size(job.n_slots * self.slot_bytes), job.job_index)
        return gone

    def keepalive(self, job_id: int, *, admin: bool = True, token: str | None = None) -> Job:
        """The registrant is still there: renew the job's lease."""
        with self.lock:
            job = self._get_authorised(job_id, admin, token)
            job.activity = job.activity.seen(self.clock())
        return job

    # -- building a job from a request ----------------------------------------
    def _chunks(self, job_id: int, max_elements: int, aggregators: list, agg_index: int) -> int:
        if not 0 <= agg_index < len(aggregators):
            raise RequestError(f"agg_index: {agg_index} is not an index into aggregators "
                               f"(0..{len(aggregators) - 1})")
        n = chunks.capacity(max_elements, self.vals, [a["weight"] for a in aggregators])[agg_index]
        if n < 1:
            raise RequestError(f"aggregators[{agg_index}].weight: this aggregator's share of job "
                               f"{job_id} is empty (weight {aggregators[agg_index]['weight']})")
        return n

    def _check_not_local(self, workers: list) -> None:
        """A worker on this host sends through the program itself
        (client/local.py), which needs the slot lock; over loopback its
        packets would never pass XDP."""
        problem = self.backend.local_worker_problem()
        if not problem:
            return
        own = self.backend.own_addresses()
        for i, ip in enumerate(workers):
            if ip and ip in own:
                raise RequestError(f"workers[{i}]: {ip} is this aggregator's own address, and {problem}")

    def _parse_register(self, req: dict) -> Job:
        job_id = job_request.u32(req, "job_id")
        cookie = job_request.u32(req, "cookie")
        workers = job_request.parse_workers(req, self.max_workers)
        self._check_not_local(workers)
        max_elements = job_request.pos_int(req, "max_elements")
        vals = req.get("vals")
        if vals is not None and vals != self.vals:
            raise RequestError(f"vals: this aggregator runs {self.vals} values per packet, "
                               f"the job asks for {vals!r}")
        aggregators = job_request.parse_aggregators(req)
        agg_index = job_request.agg_index(req)
        job_request.replace_flag(req)
        n_chunks = self._chunks(job_id, max_elements, aggregators, agg_index)
        children = job_request.parse_children(req, len(workers))
        child_for = job_request.parse_child_for(req, len(workers), aggregators, agg_index)
        # fanout, bcast_ip and result_port are checked by JobSpec, like every job's
        job = Job(job_id=job_id, cookie=cookie, workers=workers, max_elements=max_elements,
                  fanout=req.get("fanout", DEFAULT_FANOUT), bcast_ip=req.get("bcast_ip", DEFAULT_BCAST_IP),
                  result_port=req.get("result_port", DEFAULT_RESULT_PORT),
                  aggregators=aggregators, agg_index=agg_index, n_chunks=n_chunks,
                  children=children, child_for=child_for)
        for c in child_for:
            p = c["agg_index"]
            job.subs.append({"agg_index": p, "n_chunks": self._chunks(job_id, max_elements, aggregators, p),
                             "slot_base": 0, "job_index": 0, "parent_mac": ""})
        try:
            job.fanout = job.spec().validate(self.max_workers).fanout
            for sub in job.subs:
                job.sub_spec(sub).validate(self.max_workers)
        except JobError as e:
            raise RequestError(str(e)) from None
        problem = job.fanout is Fanout.UNICAST and self.backend.unicast_problem()
        if problem:
            raise RequestError(f"fanout: unicast fan-out cannot work here: {problem}")
        return job

    def _resolve_parents(self, job: Job) -> None:
        """The next hop's MAC towards each parent, where the data plane sends
        partial sums as frames of its own (XDP)."""
        for i, (sub, cf) in enumerate(zip(job.subs, job.child_for)):
            ip = parse_addr(cf["parent"])[0]
            mac = self.backend.next_hop_mac(ip)
            if mac is None:
                raise RequestError(f"child_for[{i}].agg_index: cannot resolve the MAC of the next hop "
                                   f"to aggregator {cf['agg_index']} ({ip}) from this host: is it "
                                   "reachable (`ip route get`, `ip neigh`)?")
            sub["parent_mac"] = mac

    # -- operations -----------------------------------------------------------
    def register(self, req: dict, *, admin: bool = True, fresh_token: str | None = None,
                 save: bool = True) -> tuple[Job, bool]:
        """Install a job; returns (job, created). Re-registering the same
        parameters is a no-op; different ones need ``replace: true``.

        A new job's credential is the request's ``job_token``, else
        ``fresh_token``. An existing job may be registered again (or
        replaced) only by an admin or with its job token; a replace keeps
        the old credential unless the request brings one."""
        token = job_token(req)
        job = self._parse_register(req)
        self._resolve_parents(job)
        with self.lock:
            old = self.jobs.get(job.job_id)
            if old is not None:
                self._authorise(old, admin, token)
                job.token_hash = job_token_hash(token) if token is not None else old.token_hash
                if old.params() == job.params() and job.token_hash == old.token_hash:
                    old.activity = old.activity.seen(self.clock())
                    return old, False
                if not job_request.replace_flag(req):
                    raise RequestError(f"job_id: job {job.job_id} is already registered with other "
                                       "parameters; remove it first, or send replace: true")
                self._remove(old)
            elif job.token_hash is None:
                given = token if token is not None else fresh_token
                job.token_hash = job_token_hash(given) if given is not None else None
            try:
                self.placement.install(job)
            except Exception:
                if old is not None:           # put the old one back as it was
                    self.placement.install(old, at=old.slot_base, index=old.job_index)
                    self.jobs[old.job_id] = old
                raise
            job.activity = Activity(at=self.clock())     # installed: its counters start at 0
            self.jobs[job.job_id] = job
            if save:
                self._changed()
        log.info("registered job %d: %d workers, %d elements -> %d chunks here (aggregator %d of %d), "
                 "slots %d..%d (%s), index %d, %s fan-out", job.job_id, len(job.workers),
                 job.max_elements, job.n_chunks, job.agg_index, len(job.aggregators), job.slot_base,
                 job.slot_base + job.n_slots - 1, format_size(job.n_slots * self.slot_bytes),
                 job.job_index, job.fanout)
        return job, True

    def _remove(self, job: Job) -> None:
        self.placement.uninstall(job)
        self.jobs.pop(job.job_id, None)

    def remove(self, job_id: int, *, admin: bool = True, token: str | None = None) -> Job:
        with self.lock:
            job = self._get_authorised(job_id, admin, token)
            self._remove(job)
            self._changed()
        log.info("removed job %d: freed %d slots (%s) and index %d", job_id, job.n_slots,
                 format_size(job.n_slots * self.slot_bytes), job.job_index)
        return job

    def reset(self, job_id: int, *, admin: bool = True, token: str | None = None) -> Job:
        """Forget every partial sum and the job's counters (new generation)."""
        with self.lock:
            job = self._get_authorised(job_id, admin, token)
            self.placement.reinstall(job)
            job.resets += 1
            job.activity = job.activity.seen(self.clock())
        log.info("reset job %d", job_id)
        return job

    def resize(self, req: dict, *, admin: bool = True) -> Job:
        """New gradient size (and optionally aggregator weights/index): the
        job keeps its index and, where it fits, its first slot; all its
        slots reset."""
        job_id = job_request.u32(req, "job_id")
        token = job_token(req)
        with self.lock:
            job = self._get_authorised(job_id, admin, token)
            if job.child_for:
                raise RequestError(f"job_id: job {job_id} is a child aggregator for other aggregators' "
                                   "chunks here; register it again with replace: true instead of a resize")
            max_elements = job_request.pos_int(req, "max_elements", required=False, default=job.max_elements)
            aggregators = job_request.parse_aggregators(req, current=job.aggregators)
            agg_index = job_request.agg_index(req, default=job.agg_index)
            n_chunks = self._chunks(job_id, max_elements, aggregators, agg_index)
            new = Job(**{**job.__dict__, "max_elements": max_elements, "aggregators": aggregators,
                         "agg_index": agg_index, "n_chunks": n_chunks})
            self.placement.move(job, new)
            new.activity = new.activity.seen(self.clock())
            self.jobs[job_id] = new
            self._changed()
        log.info("resized job %d: %d -> %d elements, %d -> %d chunks, slots %d..%d", job_id,
                 job.max_elements, new.max_elements, job.n_chunks, new.n_chunks, new.slot_base,
                 new.slot_base + new.n_slots - 1)
        return new

    # -- persistence (persist.py) --------------------------------------------------
    def records(self) -> list[dict]:
        """Every job as the register request that makes it again, with its
        job token's hash (the caller holds the lock)."""
        return [{"job_id": j.job_id, **j.params(),
                 "token_hash": j.token_hash.hex() if j.token_hash is not None else None}
                for j in (self.jobs[i] for i in sorted(self.jobs))]

    def _changed(self) -> None:
        try:
            self.on_change(self.records())
        except OSError as e:      # the job is served; only a restart would forget it
            log.error("saving the job list: %s; a restart would forget this change", e)

    def restore(self, records: list[dict]) -> None:
        """Install saved jobs; one that no longer fits or checks is logged and left out."""
        for rec in records:
            try:
                rec = dict(rec)
                token_hash = rec.pop("token_hash", None)
                job, _ = self.register(rec, admin=True, save=False)
                job.token_hash = bytes.fromhex(token_hash) if token_hash else None
            except (RequestError, ValueError, TypeError, AttributeError) as e:
                log.error("saved job %s not restored: %s", rec.get("job_id") if isinstance(rec, dict) else rec, e)
        with self.lock:
            self._changed()
        log.info("restored %d of %d saved jobs", len(self.jobs), len(records))

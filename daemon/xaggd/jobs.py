"""Jobs as the daemon manages them: request checking, slot and index
allocation, and the table of what is installed in the backend.

A job holds ``2 x n_chunks`` consecutive slots (round parity) in
``[0, max_slots)``, placed first-fit, and one job index (its row in the
per-job maps) in ``[0, max_jobs)``. Removing a job frees both. All methods
of ``JobTable`` are serialised by one lock: the control API calls them from
several connection threads.
"""
from __future__ import annotations

import ipaddress
import logging
import threading
import time
from dataclasses import dataclass, field

from xagg.wire import chunks
from xagg.wire.addresses import parse_addr
from xagg.wire.fanout import DEFAULT_FANOUT, Fanout
from xagg.wire.jobspec import DEFAULT_BCAST_IP, DEFAULT_RESULT_PORT, JobError, JobSpec
from xagg.wire.proto import C
from xaggd.auth import JOB_TOKEN_CHARS, holds, job_token_hash
from xaggd.config import format_size

log = logging.getLogger("xaggd.jobs")


class RequestError(ValueError):
    """A control request that cannot be served; the message names the field."""


class NoRoom(RequestError):
    """The job does not fit in the free slots or job indexes."""


# -- field checks (error messages name the request field) ------------------
def _u32(req: dict, name: str, default=None, required=True) -> int:
    if name not in req or req[name] is None:
        if required and default is None:
            raise RequestError(f"{name}: missing (an unsigned 32-bit integer)")
        return default
    v = req[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
        raise RequestError(f"{name}: must be an unsigned 32-bit integer, got {v!r}")
    return v


def _pos_int(req: dict, name: str, required=True, default=None) -> int:
    if name not in req or req[name] is None:
        if required:
            raise RequestError(f"{name}: missing (a positive integer)")
        return default
    v = req[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"{name}: must be a positive integer, got {v!r}")
    return v


def _ipv4(v, name: str, allow_empty=False) -> str:
    if allow_empty and v in ("", None):
        return ""
    if not isinstance(v, str):
        raise RequestError(f"{name}: must be an IPv4 address string, got {v!r}")
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        raise RequestError(f"{name}: not an IPv4 address: {v!r}") from None
    return v


def job_token(req: dict) -> str | None:
    """A request's ``job_token`` (None: not given), checked."""
    value = req.get("job_token")
    if value is None:
        return None
    lo, hi = JOB_TOKEN_CHARS
    if not isinstance(value, str) or not lo <= len(value) <= hi or not value.isprintable() \
            or any(c.isspace() for c in value):
        raise RequestError(f"job_token: must be a string of {lo} to {hi} printable characters "
                           "without spaces (the one the register answer gave)")
    return value


def parse_workers(req: dict, max_workers: int) -> list[str]:
    """``workers``: one entry per worker id, its IPv4 source address or ""
    / null for any source; or ``n_workers`` alone (any source)."""
    workers, n = req.get("workers"), req.get("n_workers")
    if workers is None and n is None:
        raise RequestError("workers: missing (a list of worker IPv4 addresses, one per worker id; "
                           "\"\" accepts any source), or give n_workers")
    if n is not None:
        n = _pos_int(req, "n_workers")
        if n > max_workers:
            raise RequestError(f"n_workers: {n} workers, this aggregator takes at most {max_workers}")
    if workers is None:
        return [""] * n
    if not isinstance(workers, list) or not workers:
        raise RequestError(f"workers: must be a non-empty list of IPv4 addresses, got {workers!r}")
    if len(workers) > max_workers:
        raise RequestError(f"workers: {len(workers)} workers, this aggregator takes at most {max_workers}")
    if n is not None and n != len(workers):
        raise RequestError(f"n_workers: {n} does not match the {len(workers)} entries of workers")
    out = []
    for i, w in enumerate(workers):
        if isinstance(w, str) and w.count(":") == 1:
            w = w.split(":")[0]            # "ip:port": the port is learned from packets
        out.append(_ipv4(w, f"workers[{i}]", allow_empty=True))
    return out


def parse_aggregators(req: dict, current: list | None = None) -> list[dict]:
    aggs = req.get("aggregators")
    if aggs is None:
        return current if current is not None else [{"addr": "", "weight": 1.0}]
    if not isinstance(aggs, list) or not aggs:
        raise RequestError("aggregators: must be a non-empty list of {\"addr\": \"HOST:PORT\", \"weight\": W}")
    out = []
    for i, a in enumerate(aggs):
        if isinstance(a, str):
            a = {"addr": a}
        if not isinstance(a, dict):
            raise RequestError(f"aggregators[{i}]: must be an object {{\"addr\": ..., \"weight\": ...}}, got {a!r}")
        extra = set(a) - {"addr", "weight"}
        if extra:
            raise RequestError(f"aggregators[{i}].{sorted(extra)[0]}: unknown field (known: addr, weight)")
        addr = a.get("addr", "")
        if not isinstance(addr, str):
            raise RequestError(f"aggregators[{i}].addr: must be a \"HOST:PORT\" string, got {addr!r}")
        w = a.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf"):
            raise RequestError(f"aggregators[{i}].weight: must be a finite number >= 0, got {w!r}")
        out.append({"addr": addr, "weight": float(w)})
    if sum(a["weight"] for a in out) <= 0:
        raise RequestError("aggregators: the weights are all zero")
    return out


def _worker_mask(v, name: str, n_workers: int) -> int:
    """A worker set: a bit mask, or a list of worker ids."""
    if isinstance(v, list) and all(isinstance(w, int) and not isinstance(w, bool) for w in v):
        if not all(0 <= w < n_workers for w in v) or not v:
            raise RequestError(f"{name}: worker ids must be 0..{n_workers - 1}, got {v!r}")
        return sum(1 << w for w in set(v))
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << n_workers:
        raise RequestError(f"{name}: must be a list of worker ids or a mask of workers "
                           f"0..{n_workers - 1}, got {v!r}")
    return v


def parse_children(req: dict, n_workers: int) -> list[dict]:
    """``children``: the child aggregators that send this one partial sums for
    its chunks, [{"addr": IPv4, "workers": ids or mask}]."""
    kids = req.get("children") or []
    if not isinstance(kids, list) or len(kids) > C.XAGG_MAX_CHILDREN:
        raise RequestError(f"children: must be a list of at most {C.XAGG_MAX_CHILDREN} "
                           "{\"addr\": IPv4, \"workers\": [ids]}")
    out = []
    for i, c in enumerate(kids):
        if not isinstance(c, dict) or set(c) - {"addr", "workers"}:
            raise RequestError(f"children[{i}]: must be {{\"addr\": IPv4, \"workers\": [ids] or mask}}, got {c!r}")
        out.append({"addr": _ipv4(c.get("addr"), f"children[{i}].addr"),
                    "workers": _worker_mask(c.get("workers"), f"children[{i}].workers", n_workers)})
    return out


def parse_child_for(req: dict, n_workers: int, aggregators: list, agg_index: int) -> list[dict]:
    """``child_for``: the other aggregators' chunk ranges this one sums some
    workers' contributions for, [{"agg_index": p, "workers": ids or mask}];
    aggregators[p]["addr"] is where the partial sums go."""
    subs = req.get("child_for") or []
    if not isinstance(subs, list):
        raise RequestError("child_for: must be a list of {\"agg_index\": p, \"workers\": [ids]}")
    out, seen = [], set()
    for i, c in enumerate(subs):
        if not isinstance(c, dict) or set(c) - {"agg_index", "workers"}:
            raise RequestError(f"child_for[{i}]: must be {{\"agg_index\": p, \"workers\": [ids] or mask}}, "
                               f"got {c!r}")
        p = c.get("agg_index")
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(aggregators) \
                or p == agg_index or p in seen:
            raise RequestError(f"child_for[{i}].agg_index: must name another of the job's aggregators "
                               f"(0..{len(aggregators) - 1}, not {agg_index}, each once), got {p!r}")
        seen.add(p)
        try:
            ip, port = parse_addr(aggregators[p]["addr"])
        except ValueError as e:
            raise RequestError(f"aggregators[{p}].addr: {e} (a child sends its partial sums there)") from None
        out.append({"agg_index": p, "workers": _worker_mask(c.get("workers"), f"child_for[{i}].workers",
                                                              n_workers),
                    "parent": f"{ip}:{port}"})
    return out


# -- allocation -------------------------------------------------------------
class SlotAllocator:
    """First-fit ranges over [0, total)."""

    def __init__(self, total: int):
        self.total = total
        self.used: dict[int, int] = {}          # base -> size

    def _gaps(self):
        pos = 0
        for base in sorted(self.used):
            if base > pos:
                yield pos, base - pos
            pos = base + self.used[base]
        if pos < self.total:
            yield pos, self.total - pos

    def alloc(self, size: int, at: int | None = None) -> int | None:
        for base, length in self._gaps():
            if at is not None:
                if base <= at and at + size <= base + length:
                    self.used[at] = size
                    return at
            elif length >= size:
                self.used[base] = size
                return base
        return None

    def free(self, base: int) -> None:
        self.used.pop(base, None)

    @property
    def free_total(self) -> int:
        return self.total - sum(self.used.values())

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._gaps()), default=0)


@dataclass
class Job:
    job_id: int
    cookie: int
    workers: list                       # IPv4 per worker id, "" = any source
    max_elements: int
    fanout: Fanout                      # the request's label, parsed by JobSpec
    bcast_ip: str
    result_port: int
    aggregators: list                   # [{"addr", "weight"}]
    agg_index: int
    n_chunks: int                       # chunks this aggregator holds
    slot_base: int = 0
    job_index: int = 0
    registered_at: float = field(default_factory=time.time)
    resets: int = 0
    token_hash: bytes | None = field(default=None, repr=False)     # its job token's SHA-256
    children: list = field(default_factory=list)    # [{"addr", "workers"}]: partial sums for our chunks
    child_for: list = field(default_factory=list)   # [{"agg_index", "workers", "parent"}]
    # one placed child entry per child_for: {"agg_index", "n_chunks", "slot_base", "job_index", "parent_mac"}
    subs: list = field(default_factory=list)

    @property
    def n_slots(self) -> int:
        return 2 * self.n_chunks

    def spec(self) -> JobSpec:
        return JobSpec(job_id=self.job_id, cookie=self.cookie, n_workers=len(self.workers),
                       n_chunks=self.n_chunks, fanout=self.fanout, bcast_ip=self.bcast_ip,
                       result_port=self.result_port,
                       worker_ips=self.workers if any(self.workers) else [],
                       # packets naming another of the job's aggregators are dropped (wrong_agg)
                       agg_id=self.agg_index, n_aggs=len(self.aggregators),
                       children=[(c["addr"], c["workers"]) for c in self.children])

    def sub_spec(self, sub: dict) -> JobSpec:
        """The child entry for aggregator sub["agg_index"]'s chunks."""
        cf = next(c for c in self.child_for if c["agg_index"] == sub["agg_index"])
        ip, port = parse_addr(cf["parent"])
        return JobSpec(job_id=self.job_id, cookie=self.cookie, n_workers=len(self.workers),
                       n_chunks=sub["n_chunks"], fanout=self.fanout, bcast_ip=self.bcast_ip,
                       result_port=self.result_port, worker_ips=self.workers if any(self.workers) else [],
                       agg_id=cf["agg_index"], n_aggs=len(self.aggregators), mask=cf["workers"],
                       parent_ip=ip, parent_port=port, parent_mac=sub.get("parent_mac") or "")

    def params(self) -> dict:
        """What the client asked for (compared on re-registration)."""
        return {"cookie": self.cookie, "workers": self.workers, "max_elements": self.max_elements,
                "fanout": self.fanout.label, "bcast_ip": self.bcast_ip, "result_port": self.result_port,
                "aggregators": self.aggregators, "agg_index": self.agg_index,
                "children": self.children,
                "child_for": [{"agg_index": c["agg_index"], "workers": c["workers"]} for c in self.child_for]}

    def describe(self, slot_bytes: int) -> dict:
        return {"job_id": self.job_id, "job_index": self.job_index, **self.params(),
                "n_workers": len(self.workers), "n_chunks": self.n_chunks,
                "slot_base": self.slot_base, "n_slots": self.n_slots,
                "memory_bytes": self.n_slots * slot_bytes,
                "registered_at": self.registered_at, "resets": self.resets,
                "child_entries": [{k: s[k] for k in ("agg_index", "n_chunks", "slot_base", "job_index",
                                                     "parent_mac")} for s in self.subs]}


class JobTable:
    """The jobs installed in one backend, and the memory they hold."""

    def __init__(self, backend, *, max_slots: int, max_jobs: int, max_workers: int, vals: int,
                 slot_bytes: int, on_change=None):
        self.backend = backend
        self.on_change = on_change or (lambda records: None)   # the job list changed (persist.py)
        self.max_jobs = max_jobs
        self.max_workers = max_workers
        self.vals = vals
        self.slot_bytes = slot_bytes
        self.slots = SlotAllocator(max_slots)
        self.jobs: dict[int, Job] = {}
        self.lock = threading.RLock()

    # -- reporting ----------------------------------------------------------
    def memory(self) -> dict:
        return {"max_slots": self.slots.total, "used_slots": self.slots.total - self.slots.free_total,
                "free_slots": self.slots.free_total, "largest_free_slots": self.slots.largest_free,
                "slot_bytes": self.slot_bytes, "memory_bytes": self.slots.total * self.slot_bytes,
                "free_bytes": self.slots.free_total * self.slot_bytes,
                "max_jobs": self.max_jobs, "jobs": len(self.jobs)}

    def get(self, job_id: int) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            known = ", ".join(str(j) for j in sorted(self.jobs)) or "none"
            raise RequestError(f"job_id: no job {job_id} on this aggregator (registered: {known})")
        return job

    def list(self, cookies: bool = True) -> list[dict]:
        """Every job; ``cookies`` False leaves their cookies out (for non-admins)."""
        with self.lock:
            out = [self.jobs[j].describe(self.slot_bytes) for j in sorted(self.jobs)]
        if not cookies:
            for d in out:
                d.pop("cookie")
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
        own = getattr(self.backend, "own_addresses", set)()
        problem = getattr(self.backend, "local_worker_problem", lambda: None)()
        for i, ip in enumerate(workers):
            if ip and ip in own and problem:
                raise RequestError(f"workers[{i}]: {ip} is this aggregator's own address, and {problem}")

    def _parse_register(self, req: dict) -> Job:
        job_id = _u32(req, "job_id")
        cookie = _u32(req, "cookie")
        workers = parse_workers(req, self.max_workers)
        self._check_not_local(workers)
        max_elements = _pos_int(req, "max_elements")
        vals = req.get("vals")
        if vals is not None and vals != self.vals:
            raise RequestError(f"vals: this aggregator runs {self.vals} values per packet, "
                               f"the job asks for {vals!r}")
        aggregators = parse_aggregators(req)
        agg_index = req.get("agg_index", 0)
        if isinstance(agg_index, bool) or not isinstance(agg_index, int):
            raise RequestError(f"agg_index: must be an integer, got {agg_index!r}")
        if not isinstance(req.get("replace", False), bool):
            raise RequestError(f"replace: must be true or false, got {req.get('replace')!r}")
        n_chunks = self._chunks(job_id, max_elements, aggregators, agg_index)
        children = parse_children(req, len(workers))
        child_for = parse_child_for(req, len(workers), aggregators, agg_index)
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
        problem = job.fanout is Fanout.UNICAST and getattr(self.backend, "unicast_problem", lambda: None)()
        if problem:
            raise RequestError(f"fanout: unicast fan-out cannot work here: {problem}")
        return job

    def _resolve_parents(self, job: Job) -> None:
        """The next hop's MAC towards each parent, for a data plane that sends
        partial sums itself (XDP); the userspace one needs none."""
        resolve = getattr(self.backend, "next_hop_mac", None)
        for i, (sub, cf) in enumerate(zip(job.subs, job.child_for)):
            if resolve is None:
                continue
            ip = parse_addr(cf["parent"])[0]
            mac = resolve(ip)
            if not mac:
                raise RequestError(f"child_for[{i}].agg_index: cannot resolve the MAC of the next hop "
                                   f"to aggregator {cf['agg_index']} ({ip}) from this host: is it "
                                   "reachable (`ip route get`, `ip neigh`)?")
            sub["parent_mac"] = mac

    def _no_room(self, job: Job, n_slots: int) -> NoRoom:
        free, largest = self.slots.free_total, self.slots.largest_free
        msg = (f"job {job.job_id} does not fit: it needs {n_slots} slots "
               f"({format_size(n_slots * self.slot_bytes)}: {n_slots // 2} chunks x 2 for round parity, "
               f"{job.max_elements} elements) but {free} slots ({format_size(free * self.slot_bytes)}) "
               f"are free of {self.slots.total}")
        if free >= n_slots:
            msg += f", the largest contiguous block being {largest} slots"
        return NoRoom(msg + "; remove a job, or restart xaggd with more --memory")

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
                    return old, False
                if not req.get("replace", False):
                    raise RequestError(f"job_id: job {job.job_id} is already registered with other "
                                       "parameters; remove it first, or send replace: true")
                self._remove(old)
            elif job.token_hash is None:
                given = token if token is not None else fresh_token
                job.token_hash = job_token_hash(given) if given is not None else None
            try:
                self._place(job)
            except Exception:
                if old is not None:           # put the old one back as it was
                    self._place(old, at=old.slot_base, index=old.job_index)
                    self.jobs[old.job_id] = old
                raise
            self.jobs[job.job_id] = job
            if save:
                self._changed()
        log.info("registered job %d: %d workers, %d elements -> %d chunks here (aggregator %d of %d), "
                 "slots %d..%d (%s), index %d, %s fan-out", job.job_id, len(job.workers),
                 job.max_elements, job.n_chunks, job.agg_index, len(job.aggregators), job.slot_base,
                 job.slot_base + job.n_slots - 1, format_size(job.n_slots * self.slot_bytes),
                 job.job_index, job.fanout)
        return job, True

    def _used_indexes(self, but: Job) -> set:
        return {i for j in self.jobs.values() if j is not but
                for i in [j.job_index] + [s["job_index"] for s in j.subs]}

    def _place(self, job: Job, at: int | None = None, index: int | None = None) -> None:
        self._place_main(job, at, index)
        placed = []
        try:
            for sub in job.subs:
                self._place_sub(job, sub)
                placed.append(sub)
        except Exception:
            for sub in placed:
                self._remove_sub(job, sub)
            self.backend.remove_job(job.job_id)
            self.slots.free(job.slot_base)
            raise

    def _place_sub(self, job: Job, sub: dict) -> None:
        """A child entry: its own job index and slots."""
        used = self._used_indexes(job) | {job.job_index} | {s["job_index"] for s in job.subs if s is not sub
                                                            and s.get("placed")}
        index = next((i for i in range(self.max_jobs) if i not in used), None)
        if index is None:
            raise NoRoom(f"job {job.job_id} does not fit: its child entry for aggregator {sub['agg_index']} "
                         f"needs a job place, and all {self.max_jobs} are in use (max_jobs)")
        base = self.slots.alloc(2 * sub["n_chunks"])
        if base is None:
            raise self._no_room(job, 2 * sub["n_chunks"])
        sub["slot_base"], sub["job_index"] = base, index
        try:
            self.backend.set_job(job.sub_spec(sub), slot_base=base, job_index=index)
        except Exception:
            self.slots.free(base)
            raise
        sub["placed"] = True

    def _remove_sub(self, job: Job, sub: dict) -> None:
        self.backend.remove_job(job.job_id, sub["agg_index"])
        self.slots.free(sub["slot_base"])
        sub["placed"] = False

    def _place_main(self, job: Job, at: int | None = None, index: int | None = None) -> None:
        used = self._used_indexes(job)
        if index is None:
            index = next((i for i in range(self.max_jobs) if i not in used), None)
            if index is None:
                raise NoRoom(f"job {job.job_id} does not fit: all {self.max_jobs} job places are in "
                             "use (max_jobs); remove a job, or restart xaggd with more --max-jobs")
        base = self.slots.alloc(job.n_slots, at=at)
        if base is None and at is not None:
            base = self.slots.alloc(job.n_slots)
        if base is None:
            raise self._no_room(job, job.n_slots)
        job.slot_base, job.job_index = base, index
        try:
            self.backend.set_job(job.spec(), slot_base=base, job_index=index)
        except Exception:
            self.slots.free(base)
            raise

    def _remove(self, job: Job) -> None:
        for sub in job.subs:
            if sub.get("placed"):
                self._remove_sub(job, sub)
        self.backend.remove_job(job.job_id)
        self.slots.free(job.slot_base)
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
            self.backend.set_job(job.spec(), slot_base=job.slot_base, job_index=job.job_index)
            for sub in job.subs:
                self.backend.set_job(job.sub_spec(sub), slot_base=sub["slot_base"], job_index=sub["job_index"])
            job.resets += 1
        log.info("reset job %d", job_id)
        return job

    def resize(self, req: dict, *, admin: bool = True) -> Job:
        """New gradient size (and optionally aggregator weights/index): the
        job keeps its index and, where it fits, its first slot; all its
        slots reset."""
        job_id = _u32(req, "job_id")
        token = job_token(req)
        with self.lock:
            job = self._get_authorised(job_id, admin, token)
            if job.child_for:
                raise RequestError(f"job_id: job {job_id} is a child aggregator for other aggregators' "
                                   "chunks here; register it again with replace: true instead of a resize")
            max_elements = _pos_int(req, "max_elements", required=False, default=job.max_elements)
            aggregators = parse_aggregators(req, current=job.aggregators)
            agg_index = req.get("agg_index", job.agg_index)
            if isinstance(agg_index, bool) or not isinstance(agg_index, int):
                raise RequestError(f"agg_index: must be an integer, got {agg_index!r}")
            n_chunks = self._chunks(job_id, max_elements, aggregators, agg_index)
            new = Job(**{**job.__dict__, "max_elements": max_elements, "aggregators": aggregators,
                         "agg_index": agg_index, "n_chunks": n_chunks})
            self.slots.free(job.slot_base)
            base = self.slots.alloc(new.n_slots, at=job.slot_base)
            if base is None:
                base = self.slots.alloc(new.n_slots)
            if base is None:
                self.slots.alloc(job.n_slots, at=job.slot_base)
                raise self._no_room(new, new.n_slots)
            new.slot_base = base
            try:
                self.backend.set_job(new.spec(), slot_base=base, job_index=job.job_index)
            except Exception:
                self.slots.free(base)
                self.slots.alloc(job.n_slots, at=job.slot_base)
                raise
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

    def clear(self) -> None:
        with self.lock:
            for job in list(self.jobs.values()):
                try:
                    self._remove(job)
                except Exception as e:  # shutting down: keep going
                    log.warning("removing job %d: %s", job.job_id, e)

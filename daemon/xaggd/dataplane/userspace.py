"""The userspace aggregator: the xagg protocol aggregated in Python/numpy.

It has two jobs. ``UserspaceAggregator.handle`` is a pure state machine with
the same verdicts as bpf/xagg_xdp.c, so it is the reference the kernel
program is tested against (tests/test_differential_fuzz.py, ``xaggd
check``); ``UserspaceServer`` puts it behind a UDP socket for ``xaggd start
--userspace``, where XDP cannot run (no root, no kernel headers). Keep it
and the C program in step: the differential test feeds both the same
packet sequences and compares every byte.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field

import numpy as np

from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import BLOCK, WIDE_BLOCK, JobSpec, block_bits, is_wide, set_words
from xagg.wire.proto import HDR_DTYPE, HDR_SIZE, VERDICTS, C, packet_dtype

log = logging.getLogger("xaggd.dataplane")
WIDE = BLOCK * WIDE_BLOCK       # bit of wide child 0 in a contributor set, as the kernel's last word


@dataclass
class _Slot:
    gen: int = 0
    round: int = 0
    done: int = 0                 # 1 complete (a child's: partial sent), 2 a child's: result stored
    mask: int = 0                 # contributors: workers' bits, then wide children's (WIDE)
    count: int = 0                # workers summed
    encoding: int = 0             # lane width (XAGG_ENC_*) of the round's first contribution
    vals: np.ndarray = None


@dataclass
class _Worker:
    """A contributor: a worker, or a child aggregator sending partial sums."""
    ip: str = ""                  # registered source address, "" = any
    mask: int = 0                 # the workers whose sums it may send
    addr: tuple | None = None     # (ip, port) from its summed packets; a pinned ip is kept
    wide: int = 0                 # a wide child: its contributor bit (WIDE), its sums hold all of mask
    behind: bool = False          # a worker a wide child sums: its own packets are refused

    def learn(self, src: tuple) -> None:
        self.addr = (self.ip or src[0], src[1])

    @property
    def known(self) -> bool:
        """Somewhere to send results (the kernel's row has a port)."""
        return self.addr is not None and self.addr[1] != 0


@dataclass
class _Job:
    spec: JobSpec
    gen: int
    slots: dict = field(default_factory=dict)
    workers: list = field(default_factory=list)
    children: list = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {"aggregated": 0, "completed": 0,
                                                 "retransmits": 0, "dropped": 0})


@dataclass
class Reply:
    """A datagram the aggregator sends: payload bytes to (ip, port)."""
    payload: bytes
    dest: tuple


class UserspaceAggregator:
    """Same protocol and verdicts as the XDP program, one packet at a time."""

    def __init__(self, vals: int = C.XAGG_VALS, max_workers: int = C.XAGG_MAX_WORKERS):
        self.vals = vals
        self.max_workers = max_workers
        self.pkt_dtype = packet_dtype(vals)
        self.jobs: dict[int, _Job] = {}                     # main entries, by job_id
        self.subjobs: dict[tuple[int, int], _Job] = {}      # child entries, by (job_id, agg_id)
        self.counters = {name: 0 for name in VERDICTS}
        self._gen = 0
        self._lock = threading.Lock()

    def set_job(self, spec: JobSpec) -> None:
        """Install or replace a job's main entry, or (``spec.parent_ip`` set)
        its child entry for aggregator ``spec.agg_id``'s chunks."""
        spec.validate(self.max_workers)
        self._gen += 1
        behind = sum(m for _, m in spec.children if is_wide(m))
        job = _Job(spec, self._gen,
                   workers=[_Worker(spec.worker_ip(w), 1 << w, behind=bool(behind >> w & 1))
                            for w in range(spec.n_workers)],
                   children=[_Worker(ip, mask, wide=(1 << WIDE + i) if is_wide(mask) else 0)
                             for i, (ip, mask) in enumerate(spec.children)])
        with self._lock:
            if spec.is_child:
                self.subjobs[(spec.job_id, spec.agg_id)] = job
            else:
                self.jobs[spec.job_id] = job

    def remove_job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> None:
        with self._lock:
            if agg == C.XAGG_AGG_MAIN:
                self.jobs.pop(job_id, None)
            else:
                self.subjobs.pop((job_id, agg), None)

    def entry(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> _Job:
        return self.jobs[job_id] if agg == C.XAGG_AGG_MAIN else self.subjobs[(job_id, agg)]

    def job_stats(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> dict:
        return dict(self.entry(job_id, agg).stats)

    def _lookup(self, job_id: int, agg_id: int) -> _Job | None:
        """The job's main entry, or its child entry for agg_id's chunks
        (the kernel's two lookups, in its order)."""
        job = self.jobs.get(job_id)
        if job is None or (job.spec.n_aggs and agg_id != job.spec.agg_id):
            job = self.subjobs.get((job_id, agg_id), job)
        return job

    def _count(self, verdict: str) -> str:
        self.counters[verdict] += 1
        return verdict

    def handle(self, payload: bytes, src: tuple, local_ip: str = "0.0.0.0"):
        """Process one UDP payload from ``src`` = (ip, port).

        Returns (verdict, [Reply, ...]). Thread-safe.
        """
        with self._lock:
            return self._handle(payload, src)

    def _handle(self, payload: bytes, src: tuple):
        """The kernel program's stages in its order: the header, the job
        entry, the sender, the slot, the answer."""
        probe = self._probe(payload, src)
        if probe is not None:
            return probe
        h = self._header(payload)
        if h is None:
            return self._count("malformed"), []
        flags = int(h["flags"])
        result = bool(flags & C.XAGG_F_RESULT)
        job, refused = self._entry(h, src, result)
        if refused:
            return self._count(refused), []
        spec = job.spec
        wid = int(h["worker_id"])
        if not result and wid // BLOCK > WIDE_BLOCK:
            return self._count("bad_worker"), []
        # the header's mask is the bits of worker_id's 64-worker block
        mask = spec.full_mask if result else int(h["worker_mask"]) << BLOCK * (wid // BLOCK)
        sender, refused = self._sender(job, h, mask, src, result)
        if refused:
            return self._count(refused), []
        n = bin(mask).count("1")
        if sender is not None and sender.wide:      # named by registration: its bit, its workers
            mask, n = sender.wide, bin(sender.mask).count("1")
        chunk, rnd = int(h["chunk"]), int(h["round"])
        if chunk >= spec.n_chunks:
            return self._count("bad_chunk"), []
        pv = np.frombuffer(payload, dtype="<i4", offset=HDR_SIZE, count=self.vals)
        outcome, superseded, slot, done_was = self._slot_update(
            job, chunk * 2 + (rnd & 1), rnd, mask, n, pv, int(h["op"]), result, int(h["encoding"]))
        if superseded:
            self._count("superseded")
        if outcome == "completed" and result:
            outcome = "final"       # the parent's result, stored
        elif outcome == "resend" and done_was == 1 and spec.is_child:
            outcome = "partial_resend"      # the parent has not answered
        if outcome in ("added", "completed"):
            sender.learn(src)       # only a summed packet says where results go
        if outcome == "resend" and not sender.known:
            outcome = "dup"         # summed through someone else: nowhere to answer
        return self._answer(job, outcome, sender, slot, payload, flags)

    def _probe(self, payload: bytes, src: tuple):
        """A client's probe answered as bpf/xagg_probe.h answers it, or None
        for any other packet."""
        if (len(payload) < HDR_SIZE or int.from_bytes(payload[:4], "little") != C.XAGG_MAGIC
                or not payload[HDR_DTYPE.fields["flags"][1]] & C.XAGG_F_PROBE):
            return None
        h = np.frombuffer(payload, dtype=HDR_DTYPE, count=1).copy()[0]
        if len(payload) != HDR_SIZE or int(h["flags"]) & C.XAGG_F_RESULT:
            return self._count("malformed"), []
        if int(h["version"]) != C.XAGG_VERSION:
            verdict = C.XAGG_V_MALFORMED
        else:
            job = self.jobs.get(int(h["job_id"]))
            verdict = (C.XAGG_V_UNKNOWN_JOB if job is None else
                       C.XAGG_V_BAD_COOKIE if int(h["cookie"]) != job.spec.cookie else C.XAGG_V_PROBED)
        h["version"], h["count"], h["chunk"] = C.XAGG_VERSION, self.vals, verdict
        h["flags"] = C.XAGG_F_PROBE | C.XAGG_F_RESULT
        return self._count("probed"), [Reply(h.tobytes(), src)]

    def _header(self, payload: bytes):
        """The xagg header of a well-formed packet of ours, or None (malformed)."""
        if len(payload) < HDR_SIZE:
            return None
        h = np.frombuffer(payload, dtype=HDR_DTYPE, count=1)[0]
        if int(h["magic"]) != C.XAGG_MAGIC or int(h["version"]) != C.XAGG_VERSION:
            return None
        if (len(payload) != self.pkt_dtype.itemsize or int(h["count"]) != self.vals
                or int(h["op"]) >= C.XAGG_NR_OPS or int(h["encoding"]) >= C.XAGG_NR_ENCODINGS):
            return None
        return h

    def _entry(self, h, src: tuple, result: bool) -> tuple[_Job | None, str | None]:
        """(the job entry the header names, None), or (None, the verdict that drops it)."""
        job = self._lookup(int(h["job_id"]), int(h["agg_id"]))
        if result:
            # results go to workers, never on an aggregator host, except a
            # child entry's parent's: from its address only
            if job is None or not job.spec.is_child:
                return None, "passed"
            if src[0] != job.spec.parent_ip:
                return None, "bad_worker"
        if job is None:
            return None, "unknown_job"
        spec = job.spec
        if int(h["cookie"]) != spec.cookie:
            return None, "bad_cookie"
        if spec.n_aggs and (int(h["agg_id"]), int(h["n_aggs"])) != (spec.agg_id, spec.n_aggs):
            return None, "wrong_agg"
        return job, None

    def _sender(self, job: _Job, h, mask: int, src: tuple, result: bool) -> tuple[_Worker | None, str | None]:
        """(who sent the packet: a worker, or a child aggregator's partial sum;
        None for the parent's result, None), or (None, "bad_worker")."""
        if result:
            return None, None       # nothing learned from or resent to the parent
        if int(h["flags"]) & C.XAGG_F_PARTIAL:
            child = next((c for c in job.children if c.ip == src[0]), None)
            if child is None or not mask:
                return None, "bad_worker"
            if child.wide:      # its block past the workers', and their count
                n = bin(child.mask).count("1")
                return (child, None) if mask == n << WIDE else (None, "bad_worker")
            return (None, "bad_worker") if mask & ~child.mask else (child, None)
        if not mask or mask & ~job.spec.full_mask:
            return None, "bad_worker"
        wid = int(h["worker_id"])
        if wid >= self.max_workers or mask != (1 << wid):
            return None, "bad_worker"
        worker = job.workers[wid]
        if worker.ip and worker.ip != src[0] or worker.behind:
            return None, "bad_worker"
        return worker, None

    def _answer(self, job: _Job, outcome: str, sender: _Worker | None, slot: _Slot, payload: bytes,
                flags: int):
        """(verdict, replies) for a packet that reached its slot with ``outcome``."""
        spec, st = job.spec, job.stats
        if outcome == "added":
            st["aggregated"] += 1
            return self._count("aggregated"), []
        if outcome in ("dup", "stale", "overlap", "mixed"):
            st["dropped"] += 1
            return self._count({"dup": "duplicate", "stale": "stale", "overlap": "partial_overlap",
                                "mixed": "mixed_lanes"}[outcome]), []
        if outcome in ("completed", "partial_resend") and spec.is_child:
            # a child entry's workers are all in: one partial up (again)
            if outcome == "completed":
                st["aggregated"] += 1
                st["completed"] += 1
                verdict = self._count("partial_sent")
            else:
                st["retransmits"] += 1
                verdict = self._count("partial_resent")
            return verdict, [Reply(self._partial(payload, slot, spec, flags), (spec.parent_ip, spec.parent_port))]
        out = self._result(payload, slot, spec, flags)
        if outcome == "resend":     # to where its summed packets came from
            st["retransmits"] += 1
            rh = np.frombuffer(out, dtype=HDR_DTYPE, count=1).copy()
            rh["flags"] = C.XAGG_F_RESULT | C.XAGG_F_RETX
            return self._count("retransmit"), [Reply(rh.tobytes() + out[HDR_SIZE:], sender.addr)]
        if outcome == "final":
            verdict = self._count("parent_result")
        else:
            st["aggregated"] += 1
            st["completed"] += 1
            verdict = self._count("completed")
        # the tc fan-out's order: children first, then the workers
        replies = [Reply(out, c.addr) for c in job.children if c.known]
        if spec.fanout is Fanout.BCAST:
            return verdict, replies + [Reply(out, (spec.bcast_ip, spec.result_port))]
        return verdict, replies + [Reply(out, w.addr) for w in job.workers if w.known]

    def _slot_update(self, job: _Job, idx: int, rnd: int, mask: int, n: int, pv: np.ndarray, op: int,
                     final: bool = False, encoding: int = C.XAGG_ENC_I32):
        """(outcome, superseded, slot, done before this packet). ``final``: the
        parent's result, stored over whatever the slot holds."""
        s = job.slots.get(idx)
        if s is None or s.gen != job.gen:
            s = job.slots[idx] = _Slot(gen=job.gen, round=rnd, vals=np.zeros(self.vals, "<i4"))
        d = ((rnd - s.round + 2**31) % 2**32) - 2**31      # signed 32-bit difference
        superseded = False
        if -C.XAGG_ROUND_WINDOW <= d < 0:
            return "stale", False, s, s.done
        if d != 0:              # a newer round, or a new incarnation's (far behind)
            superseded = not s.done and s.count != 0
            s.round, s.mask, s.count, s.done = rnd, 0, 0, 0
        if final:
            s.mask, s.count = 0, 0
        done_was = s.done
        if s.count and encoding != s.encoding:     # lanes of another width: neither sum, nor its answer
            return "mixed", superseded, s, done_was
        if s.done and not final:    # every contributor of a finished chunk is in it
            return "resend", superseded, s, done_was
        if s.mask & mask:
            if mask & ~s.mask:      # a partial sum overlapping in part: dropped whole
                return "overlap", superseded, s, done_was
            return "dup", superseded, s, done_was
        if s.count == 0:
            s.vals[:] = pv
        elif op == C.XAGG_OP_SUM:
            s.vals += pv        # int32 wrap-around, like the kernel's adds
        elif op == C.XAGG_OP_SUM64:     # as the kernel: pairs of lanes as 64-bit words
            w = len(pv) & ~1
            sw = s.vals[:w].view(np.uint64)
            np.add(sw, np.ascontiguousarray(pv[:w]).view(np.uint64), out=sw)
            s.vals[w:] += pv[w:]
        else:
            np.maximum(s.vals, pv, out=s.vals)
        s.encoding = encoding
        s.mask |= mask
        s.count += n
        if s.count == bin(job.spec.full_mask).count("1"):
            s.done = 2 if final else 1
            return "completed", superseded, s, done_was
        return "added", superseded, s, done_was

    def _partial(self, payload: bytes, slot: _Slot, spec: JobSpec, flags: int) -> bytes:
        h = np.frombuffer(payload, dtype=HDR_DTYPE, count=1).copy()
        h["flags"] = C.XAGG_F_PARTIAL | (flags & C.XAGG_F_RESENT)    # as the kernel: see XAGG_F_RESENT
        if is_wide(spec.full_mask):     # named by the parent's registration, and counted
            h["worker_id"], h["worker_mask"] = WIDE, bin(spec.full_mask).count("1")
        else:
            block, h["worker_mask"] = block_bits(spec.full_mask)
            h["worker_id"] = block * BLOCK
        return h.tobytes() + slot.vals.tobytes()

    def _result(self, payload: bytes, slot: _Slot, spec: JobSpec, flags: int) -> bytes:
        h = np.frombuffer(payload, dtype=HDR_DTYPE, count=1).copy()
        h["flags"] = C.XAGG_F_RESULT | (flags & C.XAGG_F_RESENT)
        # as the kernel: the job's workers in the block of worker_id
        h["worker_mask"] = set_words(spec.full_mask)[int(h["worker_id"][0]) // BLOCK % C.XAGG_SET_WORDS]
        return h.tobytes() + slot.vals.tobytes()


class UserspaceServer:
    """UserspaceAggregator behind a UDP socket: ``xaggd start --userspace``."""

    def __init__(self, agg: UserspaceAggregator, host: str = "0.0.0.0", port: int = C.XAGG_PORT):
        self.agg = agg
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = None

    def serve_forever(self) -> None:
        self.sock.settimeout(0.2)
        bufsize = 65536
        while not self._stop.is_set():
            try:
                payload, src = self.sock.recvfrom(bufsize)
            except socket.timeout:
                continue
            except OSError:
                break
            _, replies = self.agg.handle(payload, src)
            for r in replies:
                try:
                    self.sock.sendto(r.payload, r.dest)
                except OSError as e:
                    log.debug("send to %s failed: %s", r.dest, e)

    def start(self) -> "UserspaceServer":
        self._thread = threading.Thread(target=self.serve_forever, name="xagg-userspace", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """The receive thread is alive (started and not stopped or crashed)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        self.sock.close()

    def __enter__(self) -> "UserspaceServer":      # with UserspaceServer(...).start() as server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

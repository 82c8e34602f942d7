"""Jobs wider than one 64-bit word, through the real program (BPF_PROG_TEST_RUN):
256 and 1,024 workers at one aggregator, each sum exact, duplicates and
resends answered as for a small job, partial sums from a child aggregator
naming their 64-worker block, or (a child whose workers span blocks) named
by the parent's registration. Each packet also goes through the userspace
aggregator, which must give the same verdict."""
from __future__ import annotations

import numpy as np
import pytest

from xagg.wire.jobspec import JobError, JobSpec
from xagg.wire.proto import HDR_DTYPE, HDR_SIZE, C, make_packets
from xagg.wire.syscalls import XDP_DROP, XDP_TX, prog_test_run
from xaggd.dataplane.frames import split_frame, udp_frame
from xaggd.dataplane.userspace import UserspaceAggregator

CHILD_IP = "10.78.200.1"
ROUND = 40          # a round whose parity copy is slot 0 of each chunk


def worker_ip(w: int) -> str:
    return f"10.78.{w // 250}.{w % 250 + 1}"


def values(w: int, rnd: int) -> np.ndarray:
    """Worker w's contribution: different in every lane, worker and round."""
    lanes = np.arange(C.XAGG_VALS, dtype=np.int64)
    return ((w + 1) * 7919 + lanes * (w % 13 + 1) + rnd * 31).astype(np.int32)


def total(workers, rnd: int) -> np.ndarray:
    return sum(values(w, rnd).astype(np.int64) for w in workers).astype(np.int32)


class Wide:
    """One job of n workers on the shared program, and its userspace twin."""

    def __init__(self, prog, n: int, children=(), job_index=6, slot_base=3000, job_id=None):
        self.prog, self.n, self.slot_base = prog, n, slot_base
        self.spec = JobSpec(job_id=job_id or 4000 + n, cookie=0xD1CE, n_workers=n, n_chunks=2, fanout="bcast",
                            worker_ips=[worker_ip(w) for w in range(n)], children=list(children))
        prog.set_job(self.spec, slot_base=slot_base, job_index=job_index)
        self.twin = UserspaceAggregator()
        self.twin.set_job(self.spec)

    def payload(self, w, rnd, chunk=0, vals=None, **kw):
        v = values(w, rnd) if vals is None else vals
        return make_packets(job_id=self.spec.job_id, cookie=self.spec.cookie, worker_id=w, round_=rnd,
                            chunks=np.array([chunk]), values=v[None], **kw).tobytes()

    def send(self, payload, src_ip, sport=41000):
        """(XDP action, reply frame, verdict): the program's, checked against the twin's."""
        before = self.prog.counters()
        run = prog_test_run(self.prog.xdp_fn.fd, udp_frame(payload, src_ip=src_ip, sport=sport))
        after = self.prog.counters()
        verdict = [k for k in after if after[k] != before[k] and k not in ("passed", "superseded")]
        twin_verdict, _ = self.twin.handle(payload, (src_ip, sport))
        assert verdict == [twin_verdict], (verdict, twin_verdict)
        return run.action, run.data, twin_verdict

    def worker(self, w, rnd, chunk=0, **kw):
        return self.send(self.payload(w, rnd, chunk, **kw), worker_ip(w), 40000 + w % 20000)

    def slot(self, chunk=0, rnd=ROUND):
        return self.prog.slot(self.slot_base + chunk * 2 + (rnd & 1))


def result_of(frame: bytes):
    """(header, values) of a frame the program sent."""
    payload = split_frame(frame)["payload"]
    return np.frombuffer(payload[:HDR_SIZE], HDR_DTYPE)[0], np.frombuffer(payload[HDR_SIZE:], "<i4")


@pytest.mark.parametrize("n", [256, 1024])
def test_every_worker_of_a_wide_job_is_summed_once(xdp_program, n):
    job = Wide(xdp_program, n)
    order = [int(w) for w in np.random.default_rng(n).permutation(n)]
    first, rest, last = order[:n // 2], order[n // 2:-1], order[-1]
    for w in first:
        assert job.worker(w, ROUND)[2] == "aggregated"
    for w in first[::37]:               # resent before the chunk is done: nothing summed twice
        assert job.worker(w, ROUND, flags=C.XAGG_F_RESENT)[:3:2] == (XDP_DROP, "duplicate")
    for w in rest:
        assert job.worker(w, ROUND)[2] == "aggregated"
    s = job.slot()
    assert s["count"] == n - 1 and s["mask"] == (1 << n) - 1 - (1 << last) and not s["done"]
    action, frame, verdict = job.worker(last, ROUND)
    assert (action, verdict) == (XDP_TX, "completed")
    hdr, got = result_of(frame)
    want = total(range(n), ROUND)
    assert (got == want).all()
    # the result names the workers of its worker_id's block: all 64 of them
    assert hdr["flags"] & C.XAGG_F_RESULT and hdr["worker_mask"] == (1 << 64) - 1
    s = job.slot()
    assert s["done"] == 1 and s["count"] == n and s["mask"] == (1 << n) - 1
    assert (np.array(s["vals"], np.int32) == want).all()
    # a worker that missed it, in the last block: the stored sum, to it alone
    w = n - 3
    action, frame, verdict = job.worker(w, ROUND, flags=C.XAGG_F_RESENT)
    assert (action, verdict) == (XDP_TX, "retransmit")
    f = split_frame(frame)
    assert f["dst_ip"] == worker_ip(w) and (result_of(frame)[1] == want).all()
    assert xdp_program.job_stats(6)["completed"] == 1


@pytest.mark.parametrize("n", [256, 1024])
def test_a_wide_job_refuses_bits_it_does_not_hold(xdp_program, n):
    job = Wide(xdp_program, n)
    w = n - 1
    # another bit of the sender's block, a second bit, none
    assert job.worker(w, ROUND, worker_mask=1 << (w - 1) % 64)[2] == "bad_worker"
    assert job.worker(w, ROUND, worker_mask=3 << 62)[2] == "bad_worker"
    assert job.worker(w, ROUND, worker_mask=0)[2] == "bad_worker"
    # a worker id past the job's, and past any job's
    assert job.send(job.payload(n, ROUND), worker_ip(0))[2] == "bad_worker"
    assert job.send(job.payload(C.XAGG_MAX_WORKERS + 5, ROUND, worker_mask=1 << 5), worker_ip(0))[2] \
        == "bad_worker"
    # worker w's id from another worker's pinned address
    assert job.send(job.payload(w, ROUND), worker_ip(w - 64))[2] == "bad_worker"
    assert job.slot()["count"] == 0 or job.slot()["gen"] != xdp_program.job(job.spec.job_id)["gen"]


def test_rounds_reset_every_word_of_a_slot(xdp_program):
    """A slot's second use (round r + 2, same parity) starts from an empty set in
    every word, and an unfinished round it replaces counts as superseded."""
    n = 1024
    job = Wide(xdp_program, n)
    for w in range(n):
        job.worker(w, ROUND)
    # the next round on this parity: some workers in, then abandoned for the one after
    part = [5, 300, 1023]
    for w in part:
        assert job.worker(w, ROUND + 2)[2] == "aggregated"
    s = job.slot(rnd=ROUND + 2)
    assert s["count"] == 3 and s["mask"] == sum(1 << w for w in part)
    before = xdp_program.counters()["superseded"]
    assert job.worker(700, ROUND + 4)[2] == "aggregated"
    assert xdp_program.counters()["superseded"] == before + 1
    s = job.slot(rnd=ROUND + 4)
    assert s["count"] == 1 and s["mask"] == 1 << 700
    for w in range(n):
        if w != 700:
            action, frame, verdict = job.worker(w, ROUND + 4)
    assert verdict == "completed" and (result_of(frame)[1] == total(range(n), ROUND + 4)).all()
    # and a stale packet of the round before is dropped as such
    assert job.worker(9, ROUND + 2)[2] == "stale"


@pytest.mark.parametrize("n, block", [(256, 3), (1024, 9)])
def test_a_childs_partial_sum_names_its_block(xdp_program, n, block):
    """A child aggregator sums one 64-worker block; its partial (worker_id in that
    block, worker_mask its bits) completes the chunk with the workers sent
    directly. Duplicates, overlaps and resends as for a small job."""
    lo = 64 * block
    kids = range(lo, lo + 64)
    job = Wide(xdp_program, n, children=[(CHILD_IP, ((1 << 64) - 1) << lo)])
    partial = total(kids, ROUND)

    def part(mask=(1 << 64) - 1, wid=lo, flags=0):
        return job.send(job.payload(wid, ROUND, vals=partial, flags=C.XAGG_F_PARTIAL | flags, worker_mask=mask),
                        CHILD_IP)
    # one of the child's workers came straight here: the partial overlaps it in part
    assert job.worker(lo + 5, ROUND)[2] == "aggregated"
    assert part()[2] == "partial_overlap"
    job = Wide(xdp_program, n, children=[(CHILD_IP, ((1 << 64) - 1) << lo)], job_id=job.spec.job_id + 1)
    # the child's bits named in another block, or beyond its workers: refused
    assert part(wid=lo - 64)[2] == "bad_worker"
    assert job.send(job.payload(lo, ROUND, vals=partial, flags=C.XAGG_F_PARTIAL), "10.78.201.1")[2] \
        == "bad_worker"
    assert part()[2] == "aggregated"
    assert part()[2] == "duplicate"
    assert part(mask=0b1010)[2] == "duplicate"           # a part of what it already gave
    assert job.worker(lo + 7, ROUND)[2] == "duplicate"    # summed through the child already
    direct = [w for w in range(n) if w not in kids]
    for w in direct:
        action, frame, verdict = job.worker(w, ROUND)
    assert verdict == "completed"
    # a child is registered: the result goes to tc, which clones it to the child too
    assert (result_of(frame[16:])[1] == total(range(n), ROUND)).all()
    assert job.slot()["count"] == n
    # the child missed the result: its partial again gets it back, to the child
    action, frame, verdict = part(flags=C.XAGG_F_RESENT)
    assert (action, verdict) == (XDP_TX, "retransmit")
    assert split_frame(frame)["dst_ip"] == CHILD_IP


def test_a_child_entry_sends_its_block_up(xdp_program):
    """The child's side: a child entry for workers 640..703 of a 1,024-worker job
    sums them and sends one PARTIAL naming that block; the parent's result is
    stored and fanned out, and a worker's resend then gets it."""
    lo, parent = 640, "10.78.250.1"
    mask = ((1 << 64) - 1) << lo
    spec = JobSpec(job_id=4999, cookie=0xD1CE, n_workers=1024, n_chunks=2, fanout="bcast",
                   worker_ips=[worker_ip(w) for w in range(1024)], agg_id=1, n_aggs=2, mask=mask,
                   parent_ip=parent, parent_mac="02:00:00:00:02:50")
    xdp_program.set_job(spec, slot_base=3100, job_index=7)
    twin = UserspaceAggregator()
    twin.set_job(spec)

    def send(w, vals=None, src=None, **kw):
        pk = make_packets(job_id=spec.job_id, cookie=spec.cookie, worker_id=w, round_=ROUND,
                          chunks=np.array([0]), values=(values(w, ROUND) if vals is None else vals)[None],
                          agg_id=1, n_aggs=2, **kw).tobytes()
        src = src or worker_ip(w)
        run = prog_test_run(xdp_program.xdp_fn.fd, udp_frame(pk, src_ip=src, sport=40000))
        return run, twin.handle(pk, (src, 40000))
    assert send(5)[1][0] == "bad_worker"            # not one of this entry's workers
    for w in range(lo, lo + 63):
        assert send(w)[1][0] == "aggregated"
    run, (verdict, replies) = send(lo + 63)
    assert run.action == XDP_TX and verdict == "partial_sent"
    hdr, got = result_of(run.data)
    assert hdr["flags"] & C.XAGG_F_PARTIAL and hdr["worker_id"] == lo and hdr["worker_mask"] == (1 << 64) - 1
    assert (got == total(range(lo, lo + 64), ROUND)).all() and split_frame(run.data)["dst_ip"] == parent
    assert replies[0].payload == split_frame(run.data)["payload"]
    # the parent's result (any worker_id), stored over the child's sum and fanned out
    full = total(range(1024), ROUND)
    run, (verdict, _) = send(3, vals=full, src=parent, flags=C.XAGG_F_RESULT)
    assert run.action == XDP_TX and verdict == "parent_result"
    assert (result_of(run.data)[1] == full).all()
    run, (verdict, _) = send(lo + 10, flags=C.XAGG_F_RESENT)
    assert run.action == XDP_TX and verdict == "retransmit" and (result_of(run.data)[1] == full).all()


WIDE_PARTIAL = dict(worker_mask=200)   # with worker_id 1024: "the 200 workers you registered for me"


def test_a_wide_childs_partial_counts_as_its_registered_workers(xdp_program):
    """A child summing workers 100..299 of 1,024 (four blocks, none whole): its
    partial names block 16 and its 200 workers, and counts as the workers the
    parent registered for it. Its workers' own packets are refused here,
    so nothing it summed can be summed twice."""
    n, kids = 1024, range(100, 300)
    mask = sum(1 << w for w in kids)
    job = Wide(xdp_program, n, children=[("10.78.210.9", 0b1), (CHILD_IP, mask)])
    partial = total(kids, ROUND)

    def part(wid=16 * 64, flags=0, **kw):
        return job.send(job.payload(wid, ROUND, vals=partial, flags=C.XAGG_F_PARTIAL | flags,
                                    **{**WIDE_PARTIAL, **kw}), CHILD_IP)
    assert job.worker(150, ROUND)[2] == "bad_worker"            # behind the child
    assert part(wid=64, worker_mask=(1 << 64) - 1)[2] == "bad_worker"   # named as one block
    assert part(worker_mask=199)[2] == "bad_worker"              # not as many as registered
    assert part()[2] == "aggregated"
    assert part()[2] == "duplicate"
    s = job.slot()
    assert s["count"] == len(kids) and s["wide_children"] == 0b10 and s["mask"] == 0
    direct = [w for w in range(n) if w not in kids]
    for w in direct:
        action, frame, verdict = job.worker(w, ROUND)
    assert verdict == "completed" and (result_of(frame[16:])[1] == total(range(n), ROUND)).all()
    # the child missed the result: its partial again brings it back to the child
    action, frame, verdict = part(flags=C.XAGG_F_RESENT)
    assert (action, verdict) == (XDP_TX, "retransmit") and split_frame(frame)["dst_ip"] == CHILD_IP
    assert (result_of(frame)[1] == total(range(n), ROUND)).all()


def test_a_wide_child_entry_names_its_workers_by_registration(xdp_program):
    """The child's side of the same: it sums workers 100..299 and sends one
    PARTIAL with worker_id 1024 and their count; the parent's result is
    stored and a worker's resend gets it."""
    kids, parent = range(100, 300), "10.78.250.1"
    spec = JobSpec(job_id=4998, cookie=0xD1CE, n_workers=1024, n_chunks=2, fanout="bcast",
                   worker_ips=[worker_ip(w) for w in range(1024)], agg_id=1, n_aggs=2,
                   mask=sum(1 << w for w in kids), parent_ip=parent, parent_mac="02:00:00:00:02:50")
    xdp_program.set_job(spec, slot_base=3100, job_index=7)
    twin = UserspaceAggregator()
    twin.set_job(spec)

    def send(w, vals=None, src=None, **kw):
        pk = make_packets(job_id=spec.job_id, cookie=spec.cookie, worker_id=w, round_=ROUND,
                          chunks=np.array([0]), values=(values(w, ROUND) if vals is None else vals)[None],
                          agg_id=1, n_aggs=2, **kw).tobytes()
        src = src or worker_ip(w)
        run = prog_test_run(xdp_program.xdp_fn.fd, udp_frame(pk, src_ip=src, sport=40000))
        return run, twin.handle(pk, (src, 40000))
    for w in kids[:-1]:
        assert send(w)[1][0] == "aggregated"
    assert send(kids[3])[1][0] == "duplicate"
    run, (verdict, replies) = send(kids[-1])
    assert run.action == XDP_TX and verdict == "partial_sent"
    hdr, got = result_of(run.data)
    assert hdr["flags"] & C.XAGG_F_PARTIAL and hdr["worker_id"] == 1024 and hdr["worker_mask"] == len(kids)
    assert (got == total(kids, ROUND)).all() and replies[0].payload == split_frame(run.data)["payload"]
    full = total(range(1024), ROUND)
    run, (verdict, _) = send(0, vals=full, src=parent, flags=C.XAGG_F_RESULT)
    assert run.action == XDP_TX and verdict == "parent_result" and (result_of(run.data)[1] == full).all()
    run, (verdict, _) = send(250, flags=C.XAGG_F_RESENT)
    assert run.action == XDP_TX and verdict == "retransmit" and (result_of(run.data)[1] == full).all()


def test_registration_refuses_what_the_data_plane_cannot_hold():
    with pytest.raises(JobError, match=r"fanout: unicast .* at most 64 workers; a job of 65 needs bcast"):
        JobSpec(job_id=1, cookie=1, n_workers=65, n_chunks=1, fanout="unicast")
    with pytest.raises(JobError, match=r"fanout: unicast .* this child entry's \(workers 60-67\) need bcast"):
        JobSpec(job_id=1, cookie=1, n_workers=256, n_chunks=1, fanout="unicast", mask=0xFF << 60,
                parent_ip="10.0.0.1", n_aggs=2, agg_id=1)
    with pytest.raises(JobError, match=r"n_workers: must be 1..1024"):
        JobSpec(job_id=1, cookie=1, n_workers=1025, n_chunks=1, fanout="bcast")

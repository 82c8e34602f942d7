"""Two-level aggregation in the data plane (issue 14, item 3).

A child aggregator sums some workers' packets for another aggregator's
(the root's) chunks and sends one PARTIAL up from XDP; the root completes
and sends results to the child, which stores them and fans them out. First
crafted frames through BPF_PROG_TEST_RUN, each compared with the userspace
twin; then real traffic: the real program attached to veths of a lab, real
clients routing the root's chunks through the child, lost partials and
lost results, and the two-racks shape in miniature.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from xagg.wire.jobspec import JobError, JobSpec
from xagg.wire.proto import HDR_DTYPE, C, make_packets, packet_dtype, struct_dtype
from xaggd.dataplane.frames import mac_bytes, split_frame, udp_frame
from xaggd.dataplane.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from xaggd.dataplane.userspace import UserspaceAggregator

JOB, COOKIE = 7100, 0xAB12
CHILD_IP, CHILD_MAC = "10.77.0.101", "02:00:00:00:01:01"     # udp_frame's default destination
PARENT_IP, PARENT_MAC = "10.77.0.102", "02:00:00:00:01:02"
N = 3                                   # workers 0 and 1 go through the child, 2 straight to the root


def wip(w):
    return f"10.77.0.{w + 1}"


def delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def child_spec(fanout="bcast", **kw):
    kw = {"parent_ip": PARENT_IP, "parent_mac": PARENT_MAC, **kw}
    return JobSpec(job_id=JOB, cookie=COOKIE, n_workers=N, n_chunks=4, fanout=fanout,
                   worker_ips=[wip(w) for w in range(N)], agg_id=1, n_aggs=2, mask=0b011, **kw)


class Pair:
    """A child entry in the program and in the twin, fed the same frames."""

    def __init__(self, prog, spec, job_index=6, slot_base=3500):
        self.prog, self.spec = prog, spec
        prog.set_job(spec, slot_base=slot_base, job_index=job_index)
        self.twin = UserspaceAggregator()
        self.twin.set_job(spec)

    def payload(self, w, rnd, chunk, values, **kw):
        kw.setdefault("agg_id", 1)
        kw.setdefault("n_aggs", 2)
        vals = np.broadcast_to(np.asarray(values, np.int32), (C.XAGG_VALS,))[None]
        return make_packets(job_id=JOB, cookie=COOKIE, worker_id=w, round_=rnd, chunks=np.array([chunk]),
                            values=vals, **kw).tobytes()

    def send(self, payload, src_ip, sport, src_mac="02:00:00:00:00:01"):
        """(XDP run, twin verdict, twin replies) for one frame."""
        run = prog_test_run(self.prog.xdp_fn.fd, udp_frame(payload, src_ip=src_ip, sport=sport,
                                                           src_mac=src_mac))
        verdict, replies = self.twin.handle(payload, (src_ip, sport))
        return run, verdict, replies

    def worker(self, w, rnd, chunk, values):
        return self.send(self.payload(w, rnd, chunk, values), wip(w), 40000 + w)

    def result(self, rnd, chunk, values, src_ip=PARENT_IP, src_mac=PARENT_MAC, flags=C.XAGG_F_RESULT):
        return self.send(self.payload(0, rnd, chunk, values, flags=flags, worker_mask=0b111),
                         src_ip, C.XAGG_PORT, src_mac)


def packet_of(data: bytes):
    return np.frombuffer(split_frame(data)["payload"], dtype=packet_dtype())[0]


def test_child_sends_one_partial_to_its_parent(xdp_program):
    p = Pair(xdp_program, child_spec())
    before = xdp_program.counters()
    a, b = np.arange(C.XAGG_VALS) - 100, 3 * np.arange(C.XAGG_VALS)
    run, verdict, replies = p.worker(0, 0, 2, a)
    assert run.action == XDP_DROP and verdict == "aggregated"
    run, verdict, replies = p.worker(1, 0, 2, b)
    assert run.action == XDP_TX and verdict == "partial_sent"
    f = split_frame(run.data)
    assert (f["dst_ip"], f["dport"], f["dst_mac"]) == (PARENT_IP, C.XAGG_PORT, mac_bytes(PARENT_MAC))
    assert (f["src_ip"], f["sport"], f["src_mac"]) == (CHILD_IP, C.XAGG_PORT, mac_bytes(CHILD_MAC))
    assert f["ip_csum_ok"]
    pk = packet_of(run.data)
    assert pk["hdr"]["flags"] == C.XAGG_F_PARTIAL and pk["hdr"]["worker_mask"] == 0b011
    assert (pk["hdr"]["agg_id"], pk["hdr"]["chunk"], pk["hdr"]["round"]) == (1, 2, 0)
    assert (pk["vals"] == a + b).all()
    assert replies[0].dest == (PARENT_IP, C.XAGG_PORT) and replies[0].payload == f["payload"]
    assert delta(before, xdp_program.counters()) == {"aggregated": 1, "partial_sent": 1}
    assert xdp_program.job_stats(6) == p.twin.job_stats(JOB, 1)


def test_resend_before_the_result_sends_the_partial_again(xdp_program):
    p = Pair(xdp_program, child_spec())
    p.worker(0, 4, 1, 5)
    first = p.worker(1, 4, 1, 6)[0]
    run, verdict, replies = p.worker(0, 4, 1, 5)          # worker 0 got no result: resends
    assert run.action == XDP_TX and verdict == "partial_resent"
    again, sent = packet_of(run.data), packet_of(first.data)
    assert (again["vals"] == 11).all() and (sent["vals"] == 11).all()
    assert again["hdr"]["worker_mask"] == sent["hdr"]["worker_mask"] == 0b011
    assert split_frame(run.data)["dst_ip"] == PARENT_IP
    assert replies[0].payload == split_frame(run.data)["payload"]


@pytest.mark.parametrize("fanout", ["bcast", "unicast"])
def test_parents_result_is_stored_and_fanned_out(xdp_program, fanout):
    p = Pair(xdp_program, child_spec(fanout=fanout))
    p.worker(0, 0, 3, 1)
    p.worker(1, 0, 3, 2)                     # partial (3) went up
    run, verdict, replies = p.result(0, 3, 10)
    assert verdict == "parent_result"
    if fanout == "bcast":
        assert run.action == XDP_TX
        f = split_frame(run.data)
        assert (f["dst_ip"], f["dport"], f["dst_mac"]) == ("255.255.255.255", p.spec.result_port, b"\xff" * 6)
        assert [r.dest for r in replies] == [("255.255.255.255", p.spec.result_port)]
    else:
        assert run.action == XDP_PASS            # tc clones it to the child's workers
        meta = np.frombuffer(run.data[:16], dtype=struct_dtype("xagg_meta"))[0]
        assert (meta["magic"], meta["job_id"], meta["agg_key"]) == (C.XAGG_META_MAGIC, JOB, 1)
        f = split_frame(run.data[16:])
        assert sorted(r.dest for r in replies) == [(wip(0), 40000), (wip(1), 40001)]
    pk = packet_of(run.data[0 if fanout == "bcast" else 16:])
    assert pk["hdr"]["flags"] == C.XAGG_F_RESULT and (pk["vals"] == 10).all()
    assert pk["hdr"]["worker_mask"] == 0b011 and all(r.payload == f["payload"] for r in replies)
    # a worker that missed it is answered here, from the stored result
    run, verdict, replies = p.worker(1, 0, 3, 2)
    assert run.action == XDP_TX and verdict == "retransmit"
    f = split_frame(run.data)
    assert (f["dst_ip"], f["dport"]) == (wip(1), 40001) and (packet_of(run.data)["vals"] == 10).all()
    assert replies[0].dest == (wip(1), 40001) and replies[0].payload == f["payload"]
    # the next hop towards the parent is refreshed from its results
    assert xdp_program.job(JOB, 1)["parent_mac"] == mac_bytes(PARENT_MAC)


def test_results_only_from_the_registered_parent(xdp_program):
    p = Pair(xdp_program, child_spec())
    p.worker(0, 0, 0, 1)
    p.worker(1, 0, 0, 2)
    before = xdp_program.counters()
    slot = xdp_program.slot(3500)
    run, verdict, _ = p.result(0, 0, 999, src_ip="10.77.0.66", src_mac="02:00:00:00:00:66")
    assert run.action == XDP_DROP and verdict == "bad_worker"
    run, verdict, _ = p.result(0, 0, 999, src_ip=wip(2))           # a worker of the job
    assert run.action == XDP_DROP and verdict == "bad_worker"
    assert xdp_program.slot(3500) == slot                          # nothing stored
    assert delta(before, xdp_program.counters()) == {"bad_worker": 2}
    # a result for the job's main entry (none here) still passes to the stack
    run, verdict, _ = p.send(p.payload(0, 0, 0, 1, flags=C.XAGG_F_RESULT, agg_id=0), PARENT_IP, 9977)
    assert run.action == XDP_PASS and verdict == "passed"


def test_partials_refused_at_a_child_entry(xdp_program):
    """A child entry has no children: a partial for its range is refused."""
    p = Pair(xdp_program, child_spec())
    run, verdict, _ = p.send(p.payload(0, 0, 0, 1, flags=C.XAGG_F_PARTIAL, worker_mask=0b011),
                             PARENT_IP, 9977)
    assert run.action == XDP_DROP and verdict == "bad_worker"


def test_root_and_child_entries_of_one_job_on_one_host(xdp_program):
    """Two racks: this host owns agg 0's chunks and is a child for agg 1's;
    each packet lands in its own entry's slots."""
    root = JobSpec(job_id=JOB, cookie=COOKIE, n_workers=N, n_chunks=4, fanout="bcast",
                   worker_ips=[wip(w) for w in range(N)], agg_id=0, n_aggs=2,
                   children=[(PARENT_IP, 0b100)])
    xdp_program.set_job(root, slot_base=3600, job_index=7)
    p = Pair(xdp_program, child_spec())
    twin = p.twin
    twin.set_job(root)
    p.worker(0, 0, 0, 1)
    assert xdp_program.slot(3500)["mask"] == 0b001 and xdp_program.slot(3600)["gen"] != \
        xdp_program.job(JOB)["gen"]
    run, verdict, _ = p.send(p.payload(0, 0, 0, 5, agg_id=0), wip(0), 40000)
    assert verdict == "aggregated" and xdp_program.slot(3600)["mask"] == 0b001
    # the root entry takes the other rack's partial (workers 2) from its child
    run, verdict, _ = p.send(p.payload(2, 0, 0, 4, agg_id=0, flags=C.XAGG_F_PARTIAL, worker_mask=0b100),
                             PARENT_IP, 9977)
    assert verdict == "aggregated"
    run, verdict, replies = p.send(p.payload(1, 0, 0, 6, agg_id=0), wip(1), 40001)
    assert verdict == "completed" and run.action == XDP_PASS         # tc: child copy + broadcast
    assert (packet_of(run.data[16:])["vals"] == 15).all()
    assert [r.dest for r in replies] == [(PARENT_IP, 9977), ("255.255.255.255", root.result_port)]
    xdp_program.remove_job(JOB, 1)
    assert xdp_program.job(JOB, 1) is None and xdp_program.job(JOB) is not None
    xdp_program.remove_job(JOB)


def test_child_entry_twin_agrees_on_random_traffic(xdp_program):
    """The differential test of a child entry: workers, resends, old rounds,
    results from the parent and from elsewhere, partials."""
    p = Pair(xdp_program, child_spec(fanout="bcast"))
    rng = np.random.default_rng(7)
    seen = set()
    for i in range(2500):
        rnd = 2 * (i // 250) + int(rng.integers(0, 3))
        chunk = int(rng.integers(0, 5))
        vals = rng.integers(-2**20, 2**20, C.XAGG_VALS, dtype=np.int32)
        r = rng.random()
        if r < 0.15:
            src = PARENT_IP if rng.random() < 0.8 else "10.77.0.66"
            run, verdict, replies = p.result(rnd, chunk, vals, src_ip=src)
        elif r < 0.2:
            run, verdict, replies = p.send(p.payload(0, rnd, chunk, vals, flags=C.XAGG_F_PARTIAL,
                                                     worker_mask=0b011), PARENT_IP, 9977)
        else:
            w = int(rng.integers(0, N))
            run, verdict, replies = p.worker(w, rnd, chunk, vals)
        seen.add(verdict)
        if run.action == XDP_TX:
            f = split_frame(run.data)
            assert len(replies) == 1 and replies[0].payload == f["payload"], verdict
            assert replies[0].dest == (f["dst_ip"], f["dport"]), verdict
        else:
            assert run.action == XDP_DROP and replies == [], verdict
    assert {"partial_sent", "partial_resent", "parent_result", "retransmit", "bad_worker",
            "stale"} <= seen
    assert xdp_program.job_stats(6) == p.twin.job_stats(JOB, 1)


def test_child_spec_is_checked():
    with pytest.raises(JobError, match="parent_mac"):
        child_spec(parent_mac="02:00")
    with pytest.raises(JobError, match="n_aggs"):
        JobSpec(job_id=1, cookie=1, n_workers=2, n_chunks=1, mask=1, parent_ip=PARENT_IP,
                parent_mac=PARENT_MAC)
    with pytest.raises(JobError, match="mask"):
        JobSpec(job_id=1, cookie=1, n_workers=2, n_chunks=1, mask=0b100)

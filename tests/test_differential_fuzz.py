"""The XDP program and the userspace aggregator are the same machine: identical
packet sequences give identical verdicts and identical result bytes. The
fuzzer then throws random and mutated packets at the program: none may
change aggregation state, and the counters must account for every one."""
from __future__ import annotations

import numpy as np

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import HDR_DTYPE, VERDICTS, C
from xaggd.dataplane.frames import split_frame, udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from xaggd.dataplane.userspace import UserspaceAggregator

N_WORKERS, N_CHUNKS = 3, 6


CHILD = "10.77.0.50"


def random_sequence(rng, spec, n):
    """Mostly-valid traffic with duplicates, old/new rounds, runs of the job
    whose rounds start far behind (new incarnations) and bad fields,
    partial sums from the child and from elsewhere, frames for another
    aggregator, and sources that are not the worker's."""
    from xagg.wire.proto import make_packets
    out = []
    for i in range(n):
        w = int(rng.integers(0, N_WORKERS))
        src, sport = f"10.77.0.{w + 1}", 40000 + w
        kw = dict(job_id=spec.job_id, cookie=spec.cookie, agg_id=spec.agg_id, n_aggs=spec.n_aggs)
        r = rng.random()
        if r < 0.03:
            kw["cookie"] = int(rng.integers(0, 2**32))
        elif r < 0.05:
            kw["job_id"] = int(rng.integers(0, 2**32))
        elif r < 0.07:
            kw["agg_id"], kw["n_aggs"] = int(rng.integers(0, 3)), int(rng.integers(1, 4))
        elif r < 0.17:                  # a partial sum: the child's, or anyone's
            kw["flags"] = C.XAGG_F_PARTIAL
            kw["worker_mask"] = int(rng.choice([1, 2, 3, 3, 3, 4, 7]))    # the child's: 0b011
            src, sport = (CHILD, 41000) if rng.random() < 0.8 else ("10.66.0.9", 5555)
        elif r < 0.22:                  # from another address or port than the worker's
            src, sport = ("10.66.0.9", 5555) if rng.random() < 0.5 else (src, 6000 + w)
        if rng.random() < 0.3:          # a resend: marked, and the mark carried into what it completes
            kw["flags"] = kw.get("flags", 0) | C.XAGG_F_RESENT
        # SUM64 with signed values: its lanes carry into their neighbours, which the twin must match
        op = int(rng.choice([C.XAGG_OP_SUM, C.XAGG_OP_SUM, C.XAGG_OP_SUM64, C.XAGG_OP_MAX]))
        vals = rng.integers(-2**20, 2**20, size=(1, C.XAGG_VALS), dtype=np.int32)
        rnd = 2 * (i // 300) + int(rng.integers(0, 4))   # rounds move on, some behind
        if (i // 1000) % 2:             # a new incarnation of the job, its rounds far behind
            rnd = (rnd - 3 * C.XAGG_ROUND_WINDOW) & 0xFFFFFFFF
        chunk = int(rng.integers(0, N_CHUNKS + 1))      # N_CHUNKS is out of range
        out.append((src, sport, make_packets(worker_id=w, round_=rnd, chunks=np.array([chunk]),
                                             values=vals, op=op, **kw).tobytes()))
    return out


def test_xdp_and_twin_agree_on_every_packet(harness):
    h = harness(n_workers=N_WORKERS, n_chunks=N_CHUNKS, job_index=3, slot_base=1000)
    # worker 1 unpinned (its address is learned), a child aggregator for
    # workers 0 and 1, and this is aggregator 1 of 2
    h.spec = JobSpec(job_id=h.spec.job_id, cookie=h.spec.cookie, n_workers=N_WORKERS, n_chunks=N_CHUNKS,
                     fanout="bcast", worker_ips=[h.ip(0), "", h.ip(2)], children=[(CHILD, 0b011)],
                     agg_id=1, n_aggs=2)
    h.prog.set_job(h.spec, slot_base=1000, job_index=3)
    reference = UserspaceAggregator()
    reference.set_job(h.spec)
    rng = np.random.default_rng(1234)
    tx = 0
    verdicts = set()
    for src, sport, payload in random_sequence(rng, h.spec, 3000):
        run = prog_test_run(h.prog.xdp_fn.fd, udp_frame(payload, src_ip=src, sport=sport))
        verdict, replies = reference.handle(payload, (src, sport))
        verdicts.add(verdict)
        if run.action == XDP_TX:
            tx += 1
            got = split_frame(run.data)
            assert len(replies) == 1, verdict
            assert got["payload"] == replies[0].payload
            assert (got["dst_ip"], got["dport"]) == replies[0].dest
        elif run.action == XDP_PASS and verdict == "completed":
            # a job with a child: tc clones the result to the child (once
            # it sent a partial) and sends the broadcast copy
            tx += 1
            got = split_frame(run.data[16:])
            assert replies and all(r.payload == got["payload"] for r in replies)
            assert replies[-1].dest == (h.spec.bcast_ip, h.spec.result_port)
        else:
            assert run.action == XDP_DROP and replies == [], verdict
    assert tx > 50                               # the sequence did complete chunks
    assert {"partial_overlap", "wrong_agg", "bad_worker", "retransmit", "completed"} <= verdicts
    assert h.prog.job_stats(3) == reference.job_stats(h.spec.job_id)


def mutate(rng, payload: bytes) -> bytes:
    b = bytearray(payload)
    kind = rng.integers(0, 4)
    if kind == 0:                                    # flip header bytes
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, HDR_DTYPE.itemsize))] ^= int(rng.integers(1, 256))
    elif kind == 1:                                  # truncate
        b = b[: int(rng.integers(0, len(b)))]
    elif kind == 2:                                  # extend
        b += bytes(int(rng.integers(1, 64)))
    else:                                            # random bytes
        b = bytearray(rng.integers(0, 256, size=int(rng.integers(0, len(b) + 64)), dtype=np.uint8).tobytes())
    return bytes(b)


def test_fuzz_invalid_packets_never_change_state(harness):
    h = harness(n_workers=N_WORKERS, n_chunks=N_CHUNKS, job_index=4, slot_base=2000)
    rng = np.random.default_rng(99)
    # half-fill chunk 0 so there is state to corrupt
    h.send(0, 0, 0, 5)
    valid = h.payload(1, 0, 0, 7)
    snapshot = [h.prog.slot(2000 + i) for i in range(2 * N_CHUNKS)]
    before = h.counters()
    n, passed = 4000, 0
    valid_twin = UserspaceAggregator()
    valid_twin.set_job(h.spec)
    for _ in range(n):
        m = mutate(rng, valid)
        if m == valid:
            continue
        # a mutation that still makes a valid contribution is not invalid
        if valid_twin.handle(m, (h.ip(1), 40001))[0] in ("aggregated", "completed", "duplicate",
                                                           "stale", "superseded", "retransmit"):
            valid_twin.set_job(h.spec)
            continue
        valid_twin.set_job(h.spec)
        run = prog_test_run(h.prog.xdp_fn.fd, udp_frame(m, src_ip=h.ip(1), sport=40001))
        assert run.action in (XDP_DROP, XDP_PASS)
        passed += 1
    after = h.counters()
    assert [h.prog.slot(2000 + i) for i in range(2 * N_CHUNKS)] == snapshot
    counted = sum(after[v] - before[v] for v in VERDICTS)
    assert counted == passed            # every packet got exactly one verdict
    assert after["aggregated"] == before["aggregated"] and after["completed"] == before["completed"]
    assert passed > 3000
    # and the half-filled chunk still completes correctly
    h.send(1, 0, 0, 7)
    run = h.send(2, 0, 0, 1)
    assert run.action == XDP_TX
    vals = np.frombuffer(split_frame(run.data)["payload"][HDR_DTYPE.itemsize:], "<i4")
    assert (vals == 13).all()

"""An off-path host that knows the job's cookie, against the real program
(BPF_PROG_TEST_RUN): 10^5 random and mutated packets from addresses that are
neither a registered worker's nor a registered child aggregator's. None may
change a slot, complete a chunk or make the program send anything (so no
packet goes to an address the attacker chooses), and every packet is
counted under exactly one verdict. (A host that can forge a pinned worker's
source address is on-path for this purpose: see the README's threat model.)
"""
from __future__ import annotations

import numpy as np

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import HDR_DTYPE, VERDICTS, C, make_packets
from xaggd.dataplane.frames import udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run

N_PACKETS = 100_000
N_WORKERS, N_CHUNKS = 4, 16
CHILD = "10.77.0.50"
SLOT_BASE, JOB_INDEX = 3000, 6


def attacker_ip(rng) -> str:
    """Anywhere but the workers (10.77.0.1..4) and the child."""
    while True:
        ip = f"10.{rng.integers(0, 256)}.{rng.integers(0, 256)}.{rng.integers(1, 255)}"
        if not (ip.startswith("10.77.0.") and int(ip.rsplit(".", 1)[1]) in (1, 2, 3, 4, 50)):
            return ip


def forged_headers(rng, spec, n) -> np.ndarray:
    """Well-formed packets with the right job and cookie and every header
    field an attacker could pick: any worker id and mask, chunk, round, op,
    flags (partial sums and results included)."""
    vals = rng.integers(-2**31, 2**31, size=(n, C.XAGG_VALS), dtype=np.int64).astype(np.int32)
    pk = make_packets(job_id=spec.job_id, cookie=spec.cookie, worker_id=0, round_=0,
                      chunks=np.zeros(n, np.uint32), values=vals)
    h = pk["hdr"]
    h["worker_id"] = rng.integers(0, N_WORKERS + 2, n)
    one_bit = np.left_shift(np.uint64(1), h["worker_id"].astype(np.uint64))
    h["worker_mask"] = np.where(rng.random(n) < 0.7, one_bit, rng.integers(0, 2**6, n).astype(np.uint64))
    h["chunk"] = rng.integers(0, N_CHUNKS + 2, n)
    h["round"] = rng.choice([0, 1, 2, 3, 2**31, 2**32 - 1], n)
    h["op"] = rng.integers(0, C.XAGG_NR_OPS + 1, n)
    h["flags"] = rng.choice([0, 0, C.XAGG_F_PARTIAL, C.XAGG_F_RESULT, C.XAGG_F_RETX, C.XAGG_F_RESENT, 0xff], n)
    return pk


def mutated(rng, pk: np.ndarray) -> bytes:
    b = bytearray(pk.tobytes())
    kind = rng.integers(0, 4)
    if kind == 0:
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, HDR_DTYPE.itemsize))] ^= int(rng.integers(1, 256))
    elif kind == 1:
        b = b[: int(rng.integers(0, len(b)))]
    elif kind == 2:
        b += bytes(int(rng.integers(1, 64)))
    else:
        b = bytearray(rng.integers(0, 256, size=int(rng.integers(0, len(b) + 64)), dtype=np.uint8).tobytes())
    return bytes(b)


def test_an_off_path_host_with_the_cookie_changes_nothing(harness):
    h = harness(n_workers=N_WORKERS, n_chunks=N_CHUNKS, job_index=JOB_INDEX, slot_base=SLOT_BASE)
    h.spec = JobSpec(job_id=h.spec.job_id, cookie=h.spec.cookie, n_workers=N_WORKERS, n_chunks=N_CHUNKS,
                     fanout="bcast", worker_ips=[h.ip(w) for w in range(N_WORKERS)],
                     children=[(CHILD, 0b0011)])
    h.prog.set_job(h.spec, slot_base=SLOT_BASE, job_index=JOB_INDEX)
    # state worth attacking: chunk 0 half full, chunk 1 done (resends answer it), round 0.
    # (A root with children hands its results to tc: XDP_PASS with metadata.)
    h.send(0, 0, 0, 3)
    h.send(1, 0, 0, 4)
    for w in range(N_WORKERS):
        last = h.send(w, 0, 1, w + 1)
    assert last.action == XDP_PASS and h.prog.slot(SLOT_BASE + 2)["done"]
    slots = [h.prog.slot(SLOT_BASE + i) for i in range(2 * N_CHUNKS)]
    stats = h.prog.job_stats(JOB_INDEX)
    before = h.counters()

    rng = np.random.default_rng(2026)
    forged = forged_headers(rng, h.spec, N_PACKETS)
    actions = {XDP_DROP: 0, XDP_PASS: 0, XDP_TX: 0}
    for i in range(N_PACKETS):
        payload = forged[i].tobytes() if i % 2 else mutated(rng, forged[i])
        run = prog_test_run(h.prog.xdp_fn.fd, udp_frame(payload, src_ip=attacker_ip(rng),
                                                        sport=int(rng.integers(1, 65536))))
        actions[run.action] += 1
    after = h.counters()

    assert actions[XDP_TX] == 0, actions               # nothing sent, to anyone
    assert [h.prog.slot(SLOT_BASE + i) for i in range(2 * N_CHUNKS)] == slots
    assert h.prog.job_stats(JOB_INDEX) == stats
    moved = {v: after[v] - before[v] for v in VERDICTS if after[v] != before[v]}
    assert sum(moved.values()) == N_PACKETS, moved      # one verdict each
    assert moved.get("passed", 0) == actions[XDP_PASS]  # passed: results and non-xagg frames
    assert not {"aggregated", "completed", "retransmit", "partial_sent"} & moved.keys(), moved
    assert moved.get("bad_worker", 0) > N_PACKETS // 10  # the address check did real work
    # the honest workers finish chunk 0 with the right sum
    h.send(2, 0, 0, 5)
    assert h.send(3, 0, 0, 6).action == XDP_PASS
    done = h.prog.slot(SLOT_BASE)
    assert done["done"] and done["mask"] == 0b1111 and set(done["vals"]) == {18}

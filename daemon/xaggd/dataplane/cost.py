"""Cost of the XDP program per packet, measured in the kernel (test-run).

Realistic traffic: N workers' contributions to successive chunks and
rounds, so the timing covers adds, completions (result written into the
packet, XDP_TX) and the lock, not a cheap duplicate path. Each packet runs
once; BPF_PROG_TEST_RUN's own clock gives its duration, so Python's
overhead between calls does not count.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from xagg.wire.fanout import Fanout
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C, make_packets
from xaggd.dataplane.frames import udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_TX, prog_test_run


def workload(job: JobSpec, n_chunks: int, rounds: int, vals: int):
    """Frames in arrival order: for each round and chunk, every worker once,
    with XAGG_OP_SUM64 and non-negative (biased) values, as the client's
    dense data."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2000, size=(1, vals), dtype=np.int32)
    frames = []
    for r in range(rounds):
        for c in range(n_chunks):
            for w in range(job.n_workers):
                p = make_packets(job_id=job.job_id, cookie=job.cookie, worker_id=w, round_=r,
                                 chunks=np.array([c]), values=values, op=C.XAGG_OP_SUM64).tobytes()
                frames.append(udp_frame(p, src_ip=f"10.77.0.{w + 1}", sport=40000 + w))
    return frames


def measure(prog, n_workers: int = 4, n_chunks: int = 256, rounds: int = 4,
            job_index: int = 0, slot_base: int = 0, cpu: int | None = None) -> dict:
    """Mean ns per packet (and Gbit/s of payload) over a realistic sequence;
    checks every verdict."""
    job = JobSpec(job_id=0xB0000 + job_index, cookie=1, n_workers=n_workers, n_chunks=n_chunks,
                  fanout=Fanout.BCAST, worker_ips=[f"10.77.0.{w + 1}" for w in range(n_workers)])
    prog.set_job(job, slot_base=slot_base, job_index=job_index)
    # pinning is the calling thread's and is inherited by whatever it starts
    # next: left pinned, `make bench` ran every later section's lab
    # processes on one core
    was = os.sched_getaffinity(0)
    try:
        frames = workload(job, n_chunks, rounds, prog.config.vals)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        fd = prog.xdp_fn.fd
        total_ns, tx = 0, 0
        for f in frames:
            r = prog_test_run(fd, f)
            total_ns += r.duration_ns
            tx += r.action == XDP_TX
            assert r.action in (XDP_TX, XDP_DROP)
    finally:
        if cpu is not None:
            os.sched_setaffinity(0, was)
        prog.remove_job(job.job_id)      # the measurement's job is gone, its slots free again
    assert tx == n_chunks * rounds, f"expected {n_chunks * rounds} completions, got {tx}"
    ns = total_ns / len(frames)
    return {"packets": len(frames), "ns_per_packet": ns, "mpps": 1e3 / ns if ns else float("inf"),
            "gbps_payload": prog.config.vals * 32 / ns if ns else float("inf"), "completions": tx}


def measure_parallel(prog, cpus=(0, 1), **kw) -> dict:
    """Both cores at once on separate jobs: aggregate Mpps of the host."""
    res = [None] * len(cpus)

    def run(i, cpu):
        res[i] = measure(prog, job_index=i, slot_base=i * 2 * kw.get("n_chunks", 256), cpu=cpu, **kw)
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(cpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"cores": len(cpus), "mpps_total": sum(r["mpps"] for r in res),
            "ns_per_packet": [r["ns_per_packet"] for r in res]}

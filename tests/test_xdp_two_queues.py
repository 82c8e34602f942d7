"""Why the slot lock is on wherever more than one CPU can run the program
(``--lock auto`` leaves it out only with one RX queue in driver mode): two
RX queues are two CPUs summing into the same slot at once. Here two
processes pinned to different CPUs play the two queues with
BPF_PROG_TEST_RUN, each feeding half of a chunk's workers, chunk by chunk
in step with each other so that both are on the same slot nearly all the
time. The lock-free build loses updates (a chunk never completes, or
completes with a wrong sum); the locked build, on the same run, never does.

A process never runs ahead of the other by more than one chunk, so
whenever both run at once they contend on one slot; each of the 256 chunk
rounds is a fresh chance to lose an update (a lock-free run lost one in
about one of six, also beside a busy loop on each core), which makes a
lock-free run that loses none practically impossible on two CPUs (one
CPU cannot race, hence the skip)."""
from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import HDR_DTYPE, C, make_packets
from xagg.wire.syscalls import XDP_DROP, XDP_TX, prog_test_run
from xaggd.dataplane.frames import split_frame, udp_frame
from xaggd.dataplane.program import ProgramConfig, XaggProgram

W, CHUNKS, ROUNDS = 64, 64, 4           # 32 workers per CPU on each chunk, 256 chunk rounds
JOB, COOKIE, SLOT_BASE, JOB_INDEX = 779, 9, 0, 6

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a race needs two CPUs")


@pytest.fixture(scope="module")
def lock_free():
    prog = XaggProgram(ProgramConfig(max_slots=2 * CHUNKS, max_jobs=8, lock=False))
    yield prog
    prog.close()


def _frames(workers):
    """Per chunk round (round-major, as sent): this CPU's workers' frames."""
    out = []
    for r in range(ROUNDS):
        for c in range(CHUNKS):
            out.append([udp_frame(make_packets(
                job_id=JOB, cookie=COOKIE, worker_id=w, round_=r, chunks=np.array([c]),
                values=np.full((1, C.XAGG_VALS), (w + 1) * (r + 1), np.int32)).tobytes(), src_ip="10.77.0.1")
                for w in workers])
    return out


def _queue(fd, me, cpu, frames, progress, q):
    """One RX queue: its workers' packets of each chunk round, never more
    than one chunk round ahead of the other queue."""
    os.sched_setaffinity(0, {cpu})
    other = 1 - me
    results, errors = [], []
    for g, batch in enumerate(frames):
        while progress[other] < g:         # the other queue is still on chunk round g - 1
            if progress[other] < 0:        # it failed: stop
                break
        for f in batch:
            out = prog_test_run(fd, f)
            if out.action == XDP_TX:
                results.append(out.data)
            elif out.action != XDP_DROP:
                errors.append(out.action)
        progress[me] = g + 1
    q.put((results, errors))


def run_two_queues(prog) -> dict:
    """The run on two CPUs: how many chunk rounds came back exactly once
    with the exact sum, and the program's `aggregated` count."""
    prog.set_job(JobSpec(job_id=JOB, cookie=COOKIE, n_workers=W, n_chunks=CHUNKS, fanout="bcast"),
                 slot_base=SLOT_BASE, job_index=JOB_INDEX)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ctx = mp.get_context("fork")            # the children share the program's fd
    progress, q = ctx.Array("q", [0, 0], lock=False), ctx.Queue()
    before = prog.job_stats(JOB_INDEX)
    procs = [ctx.Process(target=_queue, args=(prog.xdp_fn.fd, k, cpus[k], _frames(range(k, W, 2)), progress, q))
             for k in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not got[0][1] and not got[1][1], "verdicts other than XDP_TX/XDP_DROP"
    results: dict = {}
    for data in got[0][0] + got[1][0]:
        payload = split_frame(data)["payload"]
        h = np.frombuffer(payload[:HDR_DTYPE.itemsize], HDR_DTYPE)[0]
        results.setdefault((int(h["chunk"]), int(h["round"])), []).append(
            np.frombuffer(payload[HDR_DTYPE.itemsize:], "<i4"))
    total = W * (W + 1) // 2
    exact = sum(1 for (c, r), sums in results.items()
                if len(sums) == 1 and (sums[0] == total * (r + 1)).all())
    after = prog.job_stats(JOB_INDEX)
    return {"exact": exact, "lost": CHUNKS * ROUNDS - exact,
            **{k: after[k] - before[k] for k in ("aggregated", "completed")}}


def test_locked_build_loses_no_update_on_two_queues(xdp_program):
    assert xdp_program.config.lock
    r = run_two_queues(xdp_program)
    assert r["lost"] == 0, r
    assert r["aggregated"] == CHUNKS * ROUNDS * W           # every contribution added once
    assert r["completed"] == CHUNKS * ROUNDS


def test_lock_free_build_loses_updates_on_two_queues(lock_free):
    assert not lock_free.config.lock
    r = run_two_queues(lock_free)
    print(f"\nlock-free on two CPUs: {r['lost']} of {CHUNKS * ROUNDS} chunk rounds lost an update")
    assert r["lost"] > 0, r

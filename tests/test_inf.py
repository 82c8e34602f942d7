"""An Inf in a chunk makes that chunk NaN on every worker, never a wrong
finite sum, and leaves the other chunks summed (README; fixedpoint.py):

* through the XDP program alone: the packets a worker sends for a round
  with +Inf in one chunk and -Inf in another (meta chunk with XAGG_OP_MAX,
  data with XAGG_OP_SUM64, made with the client's own encoding), fed
  through BPF_PROG_TEST_RUN; the program's maximum of the exponent lanes
  carries the non-finite marker to every worker's result;
* end to end: four workers in a lab, each with the client (the compiled
  round loop, and numpy), against the program attached to the aggregator's
  veth, over three calls of one tensor (Inf, Inf again on the predicted
  round, then finite again).

Run as ``python tests/test_inf.py worker JSON``, this file is one lab
worker (the test starts them)."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

N = 4
CALLS = 3                   # Inf in the first two (the second on the predicted exponents), none in the third
INF_AT = {1: (2, 17, math.inf), 2: (5, 3, -math.inf)}   # worker: (chunk, offset, value)


def worker_input(w: int, call: int, vals: int, size: int) -> np.ndarray:
    x = (np.random.default_rng([w, call]).standard_normal(size) * (call + 1)).astype(np.float32)
    if call < CALLS - 1 and w in INF_AT:
        chunk, off, v = INF_AT[w]
        x[chunk * vals + off] = v
    return x


def nonfinite_chunks(call: int) -> list[int]:
    return sorted(c for c, _, _ in INF_AT.values()) if call < CALLS - 1 else []


def worker_main(args: dict) -> None:
    from xagg.client import Client, ClientConfig, native
    if args["fast"]:
        assert native.load() is not None, "the compiled round loop did not build"
    cfg = ClientConfig(job_id=args["job_id"], cookie=args["cookie"], worker_id=args["worker"], n_workers=N,
                       aggregators=[args["aggregator"]], fanout=args["fanout"], vals=args["vals"],
                       timeout=20, fast=args["fast"])
    with Client(cfg) as client:
        for call in range(CALLS):
            x = worker_input(args["worker"], call, args["vals"], args["size"])
            np.save(os.path.join(args["out"], f"w{args['worker']}_c{call}.npy"), client.allreduce(x, key="grad"))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker_main(json.loads(sys.argv[2]))
    sys.exit(0)

# -- the tests ------------------------------------------------------------------------------
import pytest  # noqa: E402

from xagg.client import fixedpoint  # noqa: E402
from xagg.client.fixedpoint import EXP_NONFINITE, tolerance  # noqa: E402
from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.wire.chunks import capacity  # noqa: E402
from xagg.wire.jobspec import JobSpec  # noqa: E402
from xagg.wire.proto import HDR_DTYPE, C  # noqa: E402
from xagg.wire.syscalls import XDP_DROP, XDP_TX  # noqa: E402
from xaggd.dataplane.frames import split_frame  # noqa: E402

VALS = C.XAGG_VALS          # the session program's (conftest.xdp_program)


def result_vals(run) -> np.ndarray:
    return np.frombuffer(split_frame(run.data)["payload"][HDR_DTYPE.itemsize:], "<i4")


def test_inf_chunks_come_back_as_the_nonfinite_marker_through_xdp(harness):
    """One round of 3 workers over 4 data chunks and their meta chunk,
    encoded as the client encodes them with a prediction that holds every
    finite chunk: the agreed exponent of the two chunks holding +Inf and
    -Inf is the marker, so they decode to NaN; the others decode to their
    sums. Every worker's copy (the broadcast, and the stored result a
    worker that asks again gets) is the same."""
    nw, data = 3, 4
    h = harness(n_workers=nw, n_chunks=data + 1, job_index=4, slot_base=1024)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((data, VALS)).astype(np.float32) for _ in range(nw)]
    xs[1][1, 5], xs[2][3, 7] = np.inf, -np.inf
    own = [fixedpoint.chunk_exponents(x) for x in xs]
    finite = [np.where(o == EXP_NONFINITE, np.iinfo(np.int32).min, o) for o in own]
    pred = np.maximum.reduce(finite).astype(np.int32)     # what a history of finite calls predicts
    assert (own[1] == EXP_NONFINITE).sum() == 1 and (own[2] == EXP_NONFINITE).sum() == 1
    sent = {}
    for w in range(nw):
        q = fixedpoint.quantise_predicted(xs[w], own[w], pred, nw, biased=True)
        meta = np.zeros(VALS, np.int32)
        lanes = fixedpoint.meta_lanes(own[w], pred).reshape(-1)
        meta[:lanes.size] = lanes
        sent[w] = [(c, q[c], C.XAGG_OP_SUM64) for c in range(data)] + [(data, meta, C.XAGG_OP_MAX)]
    results = {}
    for w in range(nw):
        for c, v, op in sent[w]:
            run = h.send(w, 0, c, v, op=op)
            assert run.action == (XDP_TX if w == nw - 1 else XDP_DROP), (w, c)
            if run.action == XDP_TX:
                results[c] = result_vals(run)
    # the raw maximum the program took: the marker where any worker had Inf
    agreed = results[data][:3 * data].reshape(3, data)
    assert list(agreed[0][[1, 3]]) == [EXP_NONFINITE, EXP_NONFINITE]
    exps, scale, redo = fixedpoint.check_predicted(agreed, nw)
    assert not redo.any()                   # nothing to sum again: the marker's result stands
    out = fixedpoint.dequantise(np.stack([results[c] for c in range(data)]), scale, nw, biased=True)
    assert np.isnan(out[[1, 3]]).all()
    want = np.sum(np.array(xs, np.float64), axis=0)
    for c in (0, 2):
        assert np.max(np.abs(out[c] - want[c])) <= tolerance(max(np.abs(x[c]).max() for x in xs), nw)
    for w in range(nw):                     # a worker that missed the broadcast asks again
        for c in (1, data):
            again = h.send(w, 0, c, sent[w][c][1], op=sent[w][c][2])
            assert again.action == XDP_TX and np.array_equal(result_vals(again), results[c]), (w, c)


# -- end to end --------------------------------------------------------------------------
SIZE = 8 * VALS + 5         # nine data chunks, the last one short
MODES = {"native": dict(fanout="unicast", fast=True, job_index=2, slot_base=0),
         "numpy": dict(fanout="bcast", fast=False, job_index=3, slot_base=64)}


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"in{os.getpid() % 100000}", workers=N, aggregators=1)) as lab:
        yield lab


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inf_on_two_workers_is_nan_on_every_worker_end_to_end(lab, xdp_program, mode, tmp_path):
    m = MODES[mode]
    assert xdp_program.config.vals == VALS
    a0 = lab.host("a0")
    job = JobSpec(job_id=460 + m["job_index"], cookie=0xF00D, n_workers=N, fanout=m["fanout"],
                  n_chunks=capacity(SIZE, VALS, [1])[0], bcast_ip=lab.broadcast,
                  worker_ips=[h.ip for h in lab.workers])
    xdp_program.set_job(job, slot_base=m["slot_base"], job_index=m["job_index"])
    before = xdp_program.job_stats(m["job_index"])
    with xdp_program.attached(a0.ifname, netns=a0.netns):
        procs = [lab.spawn(f"w{w}", [sys.executable, os.path.abspath(__file__), "worker", json.dumps(dict(
            job_id=job.job_id, cookie=job.cookie, worker=w, aggregator=a0.ip, fanout=m["fanout"], vals=VALS,
            size=SIZE, fast=m["fast"], out=str(tmp_path)))], stdout=-1, stderr=-1, text=True)
            for w in range(N)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err[-3000:]
    completed = xdp_program.job_stats(m["job_index"])["completed"] - before["completed"]
    data = -(-SIZE // VALS)
    assert completed >= CALLS * data            # every call's chunks were summed by the program
    for call in range(CALLS):
        xs = [worker_input(w, call, VALS, SIZE) for w in range(N)]
        got = [np.load(tmp_path / f"w{w}_c{call}.npy") for w in range(N)]
        bad = np.zeros(SIZE, bool)
        for c in nonfinite_chunks(call):
            bad[c * VALS:(c + 1) * VALS] = True
        want = np.sum(np.array(xs, np.float64), axis=0)
        top = max(float(np.abs(x[~bad]).max()) for x in xs)
        for w, g in enumerate(got):
            assert np.array_equal(np.isnan(g), bad), (call, w)          # NaN exactly on the Inf chunks
            assert np.max(np.abs(g[~bad] - want[~bad])) <= tolerance(top, N), (call, w)
            assert np.array_equal(g, got[0], equal_nan=True), (call, w)   # the same bits everywhere

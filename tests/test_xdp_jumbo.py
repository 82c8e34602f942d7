"""Jumbo frames: the multi-buffer build of bpf/xagg_xdp.c (XAGG_FRAGS=1,
loaded with BPF_F_XDP_HAS_FRAGS) on frames longer than a page, first
through BPF_PROG_TEST_RUN (the kernel puts a frame's tail in fragments),
then end to end on a lab at MTU 9000 through xaggd, which picks the values
per packet from the interface's MTU."""
from __future__ import annotations

import os

import numpy as np
import pytest

from xagg.client.fixedpoint import tolerance
from xagg.lab.cluster import Lab, LabSpec
from xagg.lab.experiment import Aggregators, collect, start_xagg
from xagg.lab.traffic import expected
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C, make_packets, max_vals, packet_dtype, struct_dtype
from xaggd.dataplane.frames import split_frame, udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run

MTU = 9000
VALS = max_vals(MTU)
PAGE = 4096


@pytest.fixture(scope="module")
def jumbo():
    from xaggd.dataplane.program import ProgramConfig, XaggProgram
    prog = XaggProgram(ProgramConfig(vals=VALS, mtu=MTU, max_slots=64, max_jobs=2))
    assert prog.config.multi_buffer
    yield prog
    prog.close()


def _job(prog, n_workers=3, fanout="bcast"):
    spec = JobSpec(job_id=900 + n_workers, cookie=0xBEEF, n_workers=n_workers, n_chunks=4, fanout=fanout,
                   worker_ips=[f"10.77.0.{w + 1}" for w in range(n_workers)])
    prog.set_job(spec, slot_base=0, job_index=0)
    return spec


def _frame(spec, w, rnd, chunk, values, op=C.XAGG_OP_SUM):
    p = make_packets(job_id=spec.job_id, cookie=spec.cookie, worker_id=w, round_=rnd,
                     chunks=np.array([chunk]), values=values[None], op=op).tobytes()
    return udp_frame(p, src_ip=f"10.77.0.{w + 1}", sport=40000 + w)


def _vals(data):
    return np.frombuffer(split_frame(data)["payload"], dtype=packet_dtype(VALS))[0]["vals"]


@pytest.mark.parametrize("op", [C.XAGG_OP_SUM, C.XAGG_OP_MAX, C.XAGG_OP_SUM64])
def test_payload_past_the_first_page_is_combined(jumbo, op):
    """Every lane, the odd last one too (VALS is odd here); SUM64's senders
    keep lanes from carrying (biased, non-negative values), so its words
    sum to the lanes' sums."""
    spec = _job(jumbo)
    rng = np.random.default_rng(op)
    lo = 0 if op == C.XAGG_OP_SUM64 else -2**28
    vals = [rng.integers(lo, 2**28, VALS, dtype=np.int32) for _ in range(3)]
    frames = [_frame(spec, w, 0, 1, vals[w], op) for w in range(3)]
    assert len(frames[0]) > PAGE         # so the kernel hands the tail over in fragments
    assert [prog_test_run(jumbo.xdp_fn.fd, f).action for f in frames[:2]] == [XDP_DROP, XDP_DROP]
    run = prog_test_run(jumbo.xdp_fn.fd, frames[2])
    assert run.action == XDP_TX and len(run.data) == len(frames[2])
    want = np.maximum.reduce(vals) if op == C.XAGG_OP_MAX else vals[0] + vals[1] + vals[2]
    np.testing.assert_array_equal(_vals(run.data), want)
    f = split_frame(run.data)
    assert f["dst_ip"] == "255.255.255.255" and f["ip_csum_ok"]
    # a worker that missed the result gets it again from the slot, to itself
    again = prog_test_run(jumbo.xdp_fn.fd, frames[0])
    assert again.action == XDP_TX and split_frame(again.data)["dst_ip"] == "10.77.0.1"
    np.testing.assert_array_equal(_vals(again.data), want)


def test_unicast_completion_passes_to_tc_with_the_sum(jumbo):
    spec = _job(jumbo, n_workers=2, fanout="unicast")
    ones = np.ones(VALS, np.int32)
    prog_test_run(jumbo.xdp_fn.fd, _frame(spec, 0, 0, 2, ones))
    run = prog_test_run(jumbo.xdp_fn.fd, _frame(spec, 1, 0, 2, 2 * ones))
    assert run.action == XDP_PASS
    meta = np.frombuffer(run.data[:16], dtype=struct_dtype("xagg_meta"))[0]     # for tc, ahead of the frame
    assert meta["magic"] == C.XAGG_META_MAGIC and meta["job_id"] == spec.job_id
    np.testing.assert_array_equal(_vals(run.data[16:]), 3 * ones)


def test_truncated_jumbo_frame_is_dropped_not_summed(jumbo):
    spec = _job(jumbo, n_workers=2)
    before = jumbo.counters()["malformed"]
    short = _frame(spec, 0, 0, 3, np.ones(VALS, np.int32))[:-400]
    assert prog_test_run(jumbo.xdp_fn.fd, short).action == XDP_DROP
    assert jumbo.counters()["malformed"] == before + 1
    slot = jumbo.slot(3 * 2)
    assert slot["mask"] == 0 or slot["gen"] != jumbo.job(spec.job_id)["gen"]


@pytest.fixture(scope="module")
def jumbo_lab():
    with Lab(LabSpec(name=f"jb{os.getpid() % 100000}", workers=3, aggregators=1, mtu=MTU)) as lab:
        yield lab


@pytest.mark.parametrize("fanout", ["bcast", "unicast"])
def test_lab_at_mtu_9000_sums_through_xaggd(jumbo_lab, fanout, tmp_path):
    sizes = [1, VALS + 1, 300_007]
    with Aggregators(jumbo_lab, "xdp", max_slots=1024) as aggs:
        assert aggs.vals == VALS              # xaggd took the MTU's values per packet
        collect(start_xagg(jumbo_lab, aggs, sizes, rounds=2, fanout=fanout, n_workers=3,
                           out_dir=str(tmp_path))[1], timeout=300)
        counters = aggs.counters()[0]
    for r in range(2):
        for s in sizes:
            want, amax = expected(0, 3, r, s)
            got = [np.load(tmp_path / f"w{w}_r{r}_s{s}.npy") for w in range(3)]
            for g in got:
                assert np.max(np.abs(g - want)) <= tolerance(amax, 3), (r, s)
                assert np.array_equal(g, got[0])
    assert counters["completed"] > 0 and counters["malformed"] == 0

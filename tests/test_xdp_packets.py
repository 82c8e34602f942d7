"""Packet-level tests of bpf/xagg_xdp.c through BPF_PROG_TEST_RUN: the real
program, compiled by bcc and verified by this kernel, fed crafted frames."""
from __future__ import annotations

import numpy as np
import pytest

from xagg.wire.proto import HDR_DTYPE, C, packet_dtype, struct_dtype
from xaggd.dataplane.frames import mac_bytes, split_frame, udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run


def result_of(run):
    f = split_frame(run.data)
    pk = np.frombuffer(f["payload"], dtype=packet_dtype())[0]
    return f, pk["hdr"], pk["vals"]


def delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_sum_completes_and_broadcasts(harness):
    h = harness(n_workers=3)
    before = h.counters()
    vals = [np.arange(C.XAGG_VALS) * (w + 1) - 7 for w in range(3)]
    assert h.send(0, 0, 2, vals[0]).action == XDP_DROP
    assert h.send(1, 0, 2, vals[1]).action == XDP_DROP
    run = h.send(2, 0, 2, vals[2])
    assert run.action == XDP_TX
    f, hdr, got = result_of(run)
    np.testing.assert_array_equal(got, vals[0] + vals[1] + vals[2])
    assert hdr["flags"] == C.XAGG_F_RESULT and hdr["chunk"] == 2 and hdr["round"] == 0
    assert hdr["worker_mask"] == 0b111
    assert f["dst_mac"] == b"\xff" * 6 and f["dst_ip"] == "255.255.255.255"
    assert f["dport"] == C.XAGG_PORT + 1 and f["sport"] == C.XAGG_PORT
    assert f["src_ip"] == "10.77.0.101" and f["src_mac"] == mac_bytes("02:00:00:00:01:01")
    assert f["ip_csum_ok"] and f["udp_csum"] == 0
    assert delta(before, h.counters()) == {"aggregated": 2, "completed": 1}
    st = h.prog.job_stats(0)
    assert st["aggregated"] == 3 and st["completed"] == 1


def test_results_to_a_multicast_group_go_to_the_groups_mac(harness):
    """A group as the fan-out address: the frame goes to the group's MAC
    (01:00:5e + the low 23 bits), which a snooping switch delivers to the
    members alone, instead of to every port as broadcast does."""
    h = harness(n_workers=2, bcast_ip="239.129.2.3")
    h.send(0, 0, 1, 5)
    run = h.send(1, 0, 1, 6)
    assert run.action == XDP_TX
    f, hdr, got = result_of(run)
    assert (got == 11).all() and f["dst_ip"] == "239.129.2.3" and f["ip_csum_ok"]
    assert f["dst_mac"] == mac_bytes("01:00:5e:01:02:03")


def test_negative_values_and_int32_wraparound_are_plain_adds(harness):
    h = harness(n_workers=2)
    h.send(0, 0, 0, np.full(C.XAGG_VALS, -5))
    _, _, got = result_of(h.send(1, 0, 0, np.full(C.XAGG_VALS, 2**31 - 1)))
    assert (got == np.int32(-5) + np.int32(2**31 - 1)).all()


def test_sum64_adds_lanes_in_pairs_as_words(harness):
    """XAGG_OP_SUM64: lanes that stay in [0, 2**32) (what the client sends)
    sum as lanes, the odd last lane too; a lane that does carry runs into the
    next one, which is why the client biases its values."""
    h = harness(n_workers=2)
    a = np.arange(C.XAGG_VALS, dtype=np.int64) * 1000 + 7
    b = np.full(C.XAGG_VALS, 2**30, np.int64)
    h.send(0, 0, 0, a.astype(np.uint32).view(np.int32), op=C.XAGG_OP_SUM64)
    _, _, got = result_of(h.send(1, 0, 0, b.astype(np.uint32).view(np.int32), op=C.XAGG_OP_SUM64))
    np.testing.assert_array_equal(got.view(np.uint32), (a + b).astype(np.uint32))
    h.send(0, 0, 2, np.full(C.XAGG_VALS, -1), op=C.XAGG_OP_SUM64)        # 0xffffffff in every lane
    _, _, got = result_of(h.send(1, 0, 2, np.full(C.XAGG_VALS, 1), op=C.XAGG_OP_SUM64))
    words = C.XAGG_VALS // 2 * 2
    assert (got[0:words:2] == 0).all() and (got[1:words:2] == 1).all()      # the carry, in the odd lanes


def test_max_op(harness):
    h = harness(n_workers=3)
    a = np.arange(C.XAGG_VALS) - 100
    b = 50 - np.arange(C.XAGG_VALS)
    c = np.full(C.XAGG_VALS, -2**31 + 1)
    h.send(0, 0, 1, a, op=C.XAGG_OP_MAX)
    h.send(1, 0, 1, b, op=C.XAGG_OP_MAX)
    _, _, got = result_of(h.send(2, 0, 1, c, op=C.XAGG_OP_MAX))
    np.testing.assert_array_equal(got, np.maximum(np.maximum(a, b), c))


def test_duplicate_is_not_added_twice(harness):
    h = harness(n_workers=2)
    before = h.counters()
    h.send(0, 0, 0, 10)
    assert h.send(0, 0, 0, 10).action == XDP_DROP
    assert delta(before, h.counters()) == {"aggregated": 1, "duplicate": 1}
    _, _, got = result_of(h.send(1, 0, 0, 1))
    assert (got == 11).all()


def test_retransmit_after_completion_goes_to_sender_alone(harness):
    h = harness(n_workers=2)
    h.send(0, 0, 3, 4)
    h.send(1, 0, 3, 5)
    before = h.counters()
    run = h.send(0, 0, 3, 4)
    assert run.action == XDP_TX
    f, hdr, got = result_of(run)
    assert (got == 9).all()
    assert hdr["flags"] == C.XAGG_F_RESULT | C.XAGG_F_RETX
    assert f["dst_ip"] == h.ip(0) and f["dport"] == 40000 and f["src_ip"] == "10.77.0.101"
    assert f["dst_mac"] == mac_bytes("02:00:00:00:00:01") and f["ip_csum_ok"]
    assert delta(before, h.counters()) == {"retransmit": 1}


def test_parity_reuse_keeps_previous_round_answerable(harness):
    """Round 1 runs on the other parity copy while round 0's result is
    still resent; round 2 then reuses round 0's copy from scratch."""
    h = harness(n_workers=2)
    h.send(0, 0, 0, 1)
    h.send(1, 0, 0, 2)                       # round 0 done: 3
    h.send(0, 1, 0, 10)                      # round 1 open on parity 1
    _, _, got = result_of(h.send(1, 0, 0, 2))
    assert (got == 3).all()                  # round 0 still answers
    _, _, got = result_of(h.send(1, 1, 0, 20))
    assert (got == 30).all()
    h.send(0, 2, 0, 100)                     # round 2 reuses parity 0
    _, hdr, got = result_of(h.send(1, 2, 0, 200))
    assert (got == 300).all() and hdr["round"] == 2
    assert h.prog.slot(0)["round"] == 2 and h.prog.slot(1)["round"] == 1


def test_stale_round_is_dropped(harness):
    h = harness(n_workers=2)
    for r in (0, 2):
        h.send(0, r, 0, 1)
        h.send(1, r, 0, 1)
    before = h.counters()
    assert h.send(0, 0, 0, 1).action == XDP_DROP      # round 0 < slot's round 2
    assert delta(before, h.counters()) == {"stale": 1}
    assert h.prog.slot(0)["round"] == 2 and h.prog.slot(0)["done"] == 1


def test_future_round_supersedes_abandoned_one(harness):
    """A worker can only be at round r+2 if round r was abandoned; its
    partial sum is discarded, never mixed into the new round."""
    h = harness(n_workers=2)
    h.send(0, 4, 0, 1000)                    # round 4 never completes
    before = h.counters()
    h.send(0, 6, 0, 1)
    assert delta(before, h.counters()) == {"superseded": 1, "aggregated": 1}
    _, hdr, got = result_of(h.send(1, 6, 0, 2))
    assert (got == 3).all() and hdr["round"] == 6


def test_wrong_cookie_changes_nothing(harness):
    h = harness(n_workers=2)
    h.send(0, 0, 0, 1)
    before = h.counters()
    assert h.send(1, 0, 0, 50, cookie=0xBAD).action == XDP_DROP
    assert delta(before, h.counters()) == {"bad_cookie": 1}
    assert h.mask(0) == 0b01
    _, _, got = result_of(h.send(1, 0, 0, 2))
    assert (got == 3).all()


def test_unknown_job(harness):
    h = harness()
    before = h.counters()
    assert h.send(0, 0, 0, 1, job_id=0xDEAD).action == XDP_DROP
    assert delta(before, h.counters()) == {"unknown_job": 1}


@pytest.mark.parametrize("cut", [1, 20, 41, 100, 4 * C.XAGG_VALS - 1])
def test_truncated_packet_is_malformed(harness, cut):
    h = harness()
    payload = h.payload(0, 0, 0, 1)[:-cut]
    before = h.counters()
    run = prog_test_run(h.prog.xdp_fn.fd, udp_frame(payload, src_ip=h.ip(0)))
    assert run.action == XDP_DROP
    assert delta(before, h.counters()) == {"malformed": 1}


def test_oversized_packets_are_malformed(harness):
    h = harness()
    before = h.counters()
    extra = h.payload(0, 0, 0, 1) + b"\0" * 4
    assert prog_test_run(h.prog.xdp_fn.fd, udp_frame(extra, src_ip=h.ip(0))).action == XDP_DROP
    # header claiming more values than the program was built for
    big = h.payload(0, 0, 0, 1)
    hdr = np.frombuffer(big[:HDR_DTYPE.itemsize], HDR_DTYPE).copy()
    hdr["count"] = C.XAGG_VALS + 1
    assert prog_test_run(h.prog.xdp_fn.fd, udp_frame(hdr.tobytes() + big[HDR_DTYPE.itemsize:],
                                                src_ip=h.ip(0))).action == XDP_DROP
    # UDP length disagreeing with the frame
    assert prog_test_run(h.prog.xdp_fn.fd, udp_frame(h.payload(0, 0, 0, 1), src_ip=h.ip(0),
                                                udp_len=9000)).action == XDP_DROP
    assert delta(before, h.counters()) == {"malformed": 3}
    assert h.mask(0) == 0


@pytest.mark.parametrize("kw", [dict(ihl=6), dict(frag_off=0x2000)])
def test_ip_options_and_first_fragments_on_xagg_port_are_malformed(harness, kw):
    """(A non-first fragment has no UDP header to read: it passes, see
    test_xdp_hardening.py.)"""
    h = harness()
    before = h.counters()
    assert prog_test_run(h.prog.xdp_fn.fd, h.frame(0, 0, 0, 1, frame_kw=kw)).action == XDP_DROP
    assert delta(before, h.counters()) == {"malformed": 1}


def test_bad_magic_version_op_encoding(harness):
    h = harness()
    before = h.counters()
    good = h.payload(0, 0, 0, 1)
    for field, value in (("magic", 0x12345678), ("version", 9), ("op", 7), ("encoding", 3)):
        hdr = np.frombuffer(good[:HDR_DTYPE.itemsize], HDR_DTYPE).copy()
        hdr[field] = value
        run = prog_test_run(h.prog.xdp_fn.fd, udp_frame(hdr.tobytes() + good[HDR_DTYPE.itemsize:], src_ip=h.ip(0)))
        assert run.action == XDP_DROP, field
    assert delta(before, h.counters()) == {"malformed": 4}


def test_worker_id_out_of_range_and_forged_masks(harness):
    h = harness(n_workers=3)
    before = h.counters()
    assert h.send(3, 0, 0, 1, src_ip=h.ip(2)).action == XDP_DROP        # id >= n_workers
    assert h.send(70, 0, 0, 1, src_ip=h.ip(2), worker_mask=1).action == XDP_DROP       # id >= 64
    assert h.send(0, 0, 0, 1, worker_mask=0b011).action == XDP_DROP     # claims two workers
    assert h.send(0, 0, 0, 1, worker_mask=0).action == XDP_DROP
    assert h.send(0, 0, 0, 1, src_ip="10.77.0.9").action == XDP_DROP    # unregistered source
    assert delta(before, h.counters()) == {"bad_worker": 5}
    assert h.mask(0) == 0


def test_chunk_beyond_allocation(harness):
    h = harness(n_chunks=4)
    before = h.counters()
    assert h.send(0, 0, 4, 1).action == XDP_DROP
    assert delta(before, h.counters()) == {"bad_chunk": 1}


def test_partial_sum_from_child_aggregator(harness):
    """Hierarchical aggregation: a packet may carry several workers' sum,
    from a child aggregator registered for them (test_xdp_hardening.py has
    the refusals)."""
    h = harness(n_workers=4, children=[("10.77.0.50", 0b0111)])
    h.send(0, 0, 0, 1, flags=C.XAGG_F_PARTIAL, worker_mask=0b0011, src_ip="10.77.0.50")
    before = h.counters()
    assert h.send(0, 0, 0, 1, flags=C.XAGG_F_PARTIAL, worker_mask=0b0010,
                  src_ip="10.77.0.50").action == XDP_DROP
    assert delta(before, h.counters()) == {"duplicate": 1}       # worker 1 is in already
    assert h.send(2, 0, 0, 5).action == XDP_DROP
    run = h.send(3, 0, 0, 7)
    # results go to the child too: tc clones them (and the broadcast copy)
    assert run.action == XDP_PASS
    run.data = run.data[16:]                      # the XDP -> tc metadata
    _, hdr, got = result_of(run)
    assert (got == 13).all() and hdr["worker_mask"] == 0b1111


def test_vlan_tagged_frames_are_aggregated(harness):
    h = harness(n_workers=2)
    h.send(0, 0, 0, 1, frame_kw=dict(vlan=42))
    run = h.send(1, 0, 0, 2, frame_kw=dict(vlan=42))
    assert run.action == XDP_TX
    f, _, got = result_of(run)
    assert f["vlan"] == 42 and (got == 3).all()


def test_non_xagg_traffic_passes_untouched(harness):
    h = harness()
    before = h.counters()
    frames = [
        udp_frame(b"hello", dport=53),
        udp_frame(h.payload(0, 0, 0, 1), dport=C.XAGG_PORT + 1),     # xagg bytes, other port
        udp_frame(b"x" * 40, proto=6),                                # TCP
        bytes(mac_bytes("ff:ff:ff:ff:ff:ff") * 2) + b"\x08\x06" + b"\0" * 28,  # ARP
        mac_bytes("02:00:00:00:00:09") * 2 + b"\x08\x00",              # IPv4 type, no header
    ]
    for fr in frames:
        run = prog_test_run(h.prog.xdp_fn.fd, fr)
        assert run.action == XDP_PASS and run.data == fr
    assert delta(before, h.counters()) == {"passed": len(frames)}


def test_a_result_a_resend_completed_says_so(harness):
    """XAGG_F_RESENT on the packet that completes a chunk is carried into
    the result (workers then know it was late for a loss, not reordering);
    a resend that is only added, or the answer to one after completion, is not."""
    h = harness(n_workers=2)
    h.send(0, 0, 2, 4)
    _, hdr, got = result_of(h.send(1, 0, 2, 5, flags=C.XAGG_F_RESENT))
    assert hdr["flags"] == C.XAGG_F_RESULT | C.XAGG_F_RESENT and (got == 9).all()
    h.send(0, 0, 4, 4, flags=C.XAGG_F_RESENT)
    _, hdr, got = result_of(h.send(1, 0, 4, 5))
    assert hdr["flags"] == C.XAGG_F_RESULT and (got == 9).all()
    _, hdr, got = result_of(h.send(0, 0, 2, 4, flags=C.XAGG_F_RESENT))
    assert hdr["flags"] == C.XAGG_F_RESULT | C.XAGG_F_RETX and (got == 9).all()


def test_results_pass_to_local_workers(harness):
    h = harness()
    fr = h.frame(0, 0, 0, 1, flags=C.XAGG_F_RESULT)
    run = prog_test_run(h.prog.xdp_fn.fd, fr)
    assert run.action == XDP_PASS and run.data == fr
    assert h.mask(0) == 0


def test_unicast_completion_hands_result_to_tc(harness):
    h = harness(n_workers=2, fanout="unicast")
    h.send(0, 0, 5, 1)
    run = h.send(1, 0, 5, 2)
    assert run.action == XDP_PASS       # tc clones it to each worker
    meta = np.frombuffer(run.data[:16], dtype=struct_dtype("xagg_meta"))[0]
    assert meta["magic"] == C.XAGG_META_MAGIC and meta["job_id"] == h.spec.job_id
    assert meta["l3_off"] == 14
    run.data = run.data[16:]
    f, hdr, got = result_of(run)
    assert (got == 3).all() and hdr["flags"] == C.XAGG_F_RESULT


def test_jobs_are_isolated(xdp_program, harness):
    a = harness(n_workers=2, job_index=1, slot_base=100)
    b = harness(n_workers=2, job_index=2, slot_base=200)
    a.send(0, 0, 0, 1)
    b.send(0, 0, 0, 100)
    _, _, ga = result_of(a.send(1, 0, 0, 2))
    _, _, gb = result_of(b.send(1, 0, 0, 200))
    assert (ga == 3).all() and (gb == 300).all()


def test_reregistering_a_job_resets_its_slots(harness, xdp_program):
    h = harness(n_workers=2)
    h.send(0, 5, 0, 1)
    xdp_program.set_job(h.spec, slot_base=0, job_index=0)    # reset: new generation
    h.send(0, 0, 0, 10)
    _, _, got = result_of(h.send(1, 0, 0, 20))
    assert (got == 30).all()

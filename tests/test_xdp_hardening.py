"""Issue 13 against the real program (BPF_PROG_TEST_RUN): forged partial sums,
address learning, fragments, frames for another aggregator, overlapping
partial sums. Each test failed on the program before its fix; each checks
the userspace aggregator gives the same verdicts."""
from __future__ import annotations

import socket

import numpy as np

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C
from xaggd.dataplane.frames import mac_bytes, split_frame, udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from xaggd.dataplane.userspace import UserspaceAggregator

ATTACKER_IP, ATTACKER_MAC = "10.66.0.9", "02:00:00:00:66:09"
CHILD_IP, CHILD_MAC = "10.77.0.50", "02:00:00:00:00:50"


def delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def row(h, wid):
    """The program's worker row: where results for ``wid`` go."""
    w = h.prog.workers[h.prog.workers.Key(wid)]            # job_index 0
    return {"addr": socket.inet_ntoa(w.addr.to_bytes(4, "little")), "port": socket.ntohs(w.port),
            "mac": bytes(w.mac)}


def send_raw(h, payload, src_ip, sport, src_mac="02:00:00:00:00:01"):
    return prog_test_run(h.prog.xdp_fn.fd, udp_frame(payload, src_ip=src_ip, sport=sport, src_mac=src_mac))


def with_twin(h):
    twin = UserspaceAggregator()
    twin.set_job(h.spec)
    return twin


# -- item 1: PARTIAL only from registered children ----------------------------

def test_partial_without_registered_children_is_refused(harness):
    """The confirmed attack: one PARTIAL with the full mask from anywhere
    completed the chunk with the attacker's values."""
    h = harness(n_workers=2)
    twin = with_twin(h)
    forged = h.payload(0, 0, 0, 1000, flags=C.XAGG_F_PARTIAL, worker_mask=0b11)
    before = h.counters()
    assert send_raw(h, forged, ATTACKER_IP, 5555, ATTACKER_MAC).action == XDP_DROP
    assert delta(before, h.counters()) == {"bad_worker": 1}
    assert twin.handle(forged, (ATTACKER_IP, 5555)) == ("bad_worker", [])
    assert h.mask(0) == 0
    # the honest contributions still make the honest sum
    h.send(0, 0, 0, 1)
    run = h.send(1, 0, 0, 2)
    assert run.action == XDP_TX
    assert (np.frombuffer(split_frame(run.data)["payload"][40:], "<i4") == 3).all()
    # even from a worker's own address: no children registered, no partial sums
    assert h.send(0, 1, 0, 1, flags=C.XAGG_F_PARTIAL, worker_mask=0b01).action == XDP_DROP


def test_partial_cannot_reflect_a_finished_chunk(harness):
    """A PARTIAL whose mask lies inside a finished chunk got the stored result
    sent to its (forged) source."""
    h = harness(n_workers=2)
    h.send(0, 0, 3, 1)
    assert h.send(1, 0, 3, 2).action == XDP_TX
    before = h.counters()
    forged = h.payload(0, 0, 3, 0, flags=C.XAGG_F_PARTIAL, worker_mask=0b01)
    run = send_raw(h, forged, ATTACKER_IP, 5555, ATTACKER_MAC)
    assert run.action == XDP_DROP
    assert delta(before, h.counters()) == {"bad_worker": 1}


def test_partial_from_a_registered_child(harness):
    h = harness(n_workers=4, children=[(CHILD_IP, 0b0011)])
    twin = with_twin(h)

    def both(payload, src_ip, sport, mac):
        run = send_raw(h, payload, src_ip, sport, mac)
        verdict, replies = twin.handle(payload, (src_ip, sport))
        return run, verdict, replies

    before = h.counters()
    part = h.payload(0, 0, 1, 10, flags=C.XAGG_F_PARTIAL, worker_mask=0b0011)
    run, verdict, _ = both(part, CHILD_IP, 41000, CHILD_MAC)
    assert run.action == XDP_DROP and verdict == "aggregated"
    # the child's address, but workers it does not aggregate for
    run, verdict, _ = both(h.payload(0, 0, 1, 10, flags=C.XAGG_F_PARTIAL, worker_mask=0b0100),
                           CHILD_IP, 41000, CHILD_MAC)
    assert run.action == XDP_DROP and verdict == "bad_worker"
    # the child's mask from another address
    run, verdict, _ = both(h.payload(0, 0, 1, 10, flags=C.XAGG_F_PARTIAL, worker_mask=0b1100),
                           ATTACKER_IP, 41000, ATTACKER_MAC)
    assert run.action == XDP_DROP and verdict == "bad_worker"
    assert delta(before, h.counters()) == {"aggregated": 1, "bad_worker": 2}
    for w in (2, 3):
        run = h.send(w, 0, 1, w)
        twin.handle(h.payload(w, 0, 1, w), (h.ip(w), 40000 + w))
    assert run.action == XDP_PASS       # to tc, which clones it to the child too
    assert (np.frombuffer(split_frame(run.data[16:])["payload"][40:], "<i4") == 15).all()
    # the child missed the result: it goes back to the child, where its sums came from
    run, verdict, replies = both(part, CHILD_IP, 41000, CHILD_MAC)
    assert run.action == XDP_TX and verdict == "retransmit"
    f = split_frame(run.data)
    assert (f["dst_ip"], f["dport"], f["dst_mac"]) == (CHILD_IP, 41000, mac_bytes(CHILD_MAC))
    assert replies[0].dest == (CHILD_IP, 41000) and replies[0].payload == f["payload"]


def test_partial_overlapping_in_part_is_dropped_under_its_own_verdict(harness):
    """A partial sum cannot be split into the workers it adds and those the
    slot already has: it is dropped whole and counted as partial_overlap,
    not as a duplicate (nothing in it was summed before as such)."""
    h = harness(n_workers=3, children=[(CHILD_IP, 0b110)])
    twin = with_twin(h)
    h.send(1, 0, 0, 5)
    twin.handle(h.payload(1, 0, 0, 5), (h.ip(1), 40001))
    before = h.counters()
    part = h.payload(0, 0, 0, 9, flags=C.XAGG_F_PARTIAL, worker_mask=0b110)
    assert send_raw(h, part, CHILD_IP, 41000, CHILD_MAC).action == XDP_DROP
    assert twin.handle(part, (CHILD_IP, 41000)) == ("partial_overlap", [])
    sub = h.payload(0, 0, 0, 9, flags=C.XAGG_F_PARTIAL, worker_mask=0b010)
    assert send_raw(h, sub, CHILD_IP, 41000, CHILD_MAC).action == XDP_DROP
    assert twin.handle(sub, (CHILD_IP, 41000)) == ("duplicate", [])
    assert delta(before, h.counters()) == {"partial_overlap": 1, "duplicate": 1}
    assert h.mask(0) == 0b010
    assert h.prog.job_stats(0)["dropped"] == 2


# -- resends go where the contributor's sums came from ------------------------

def test_resend_goes_to_the_learned_address_not_the_requester(harness):
    """An unpinned worker's finished chunk, asked for again from a forged
    source: the copy goes to the address the worker's summed packets came
    from (or nowhere), never to the forged one."""
    h = harness(n_workers=2)
    h.spec = JobSpec(job_id=h.spec.job_id, cookie=h.spec.cookie, n_workers=2, n_chunks=4, fanout="bcast")
    h.prog.set_job(h.spec, slot_base=0, job_index=0)
    twin = with_twin(h)
    for w in (0, 1):
        h.send(w, 0, 2, w + 1)
        twin.handle(h.payload(w, 0, 2, w + 1), (h.ip(w), 40000 + w))
    forged = h.payload(0, 0, 2, 0)
    run = send_raw(h, forged, ATTACKER_IP, 5555, ATTACKER_MAC)
    verdict, replies = twin.handle(forged, (ATTACKER_IP, 5555))
    assert run.action == XDP_TX and verdict == "retransmit"
    f = split_frame(run.data)
    assert (f["dst_ip"], f["dport"], f["dst_mac"]) == (h.ip(0), 40000, mac_bytes("02:00:00:00:00:01"))
    assert replies[0].dest == (h.ip(0), 40000)
    assert row(h, 0) == {"addr": h.ip(0), "port": 40000, "mac": mac_bytes("02:00:00:00:00:01")}


# -- item 2: learn only from summed packets, never a pinned worker's address ----

def test_address_is_learned_only_from_summed_packets(harness):
    """The confirmed attack: a packet from a pinned worker's IP with the right
    cookie and a bad chunk rewrote the worker's result port and MAC."""
    h = harness(n_workers=2, n_chunks=4)
    h.send(0, 0, 0, 1)
    learned = {"addr": h.ip(0), "port": 40000, "mac": mac_bytes("02:00:00:00:00:01")}
    assert row(h, 0) == learned
    bad = [h.payload(0, 0, 4, 1),                                   # bad chunk
           h.payload(0, 0, 0, 1),                                   # duplicate
           h.payload(0, 0, 0, 1, cookie=0xBAD),                     # bad cookie
           h.payload(0, 0, 1, 1, op=9),                             # malformed
           h.payload(0, 0, 1, 1, flags=C.XAGG_F_PARTIAL, worker_mask=1)]   # no children
    for p in bad:
        assert send_raw(h, p, h.ip(0), 6666, ATTACKER_MAC).action == XDP_DROP
    h.send(0, 2, 1, 1)
    h.send(1, 2, 1, 1)
    assert send_raw(h, h.payload(0, 0, 1, 1), h.ip(0), 6666, ATTACKER_MAC).action == XDP_DROP   # stale
    assert row(h, 0) == learned
    # a packet that is summed moves the port and MAC, never the pinned address
    assert send_raw(h, h.payload(0, 4, 2, 1), h.ip(0), 6666, ATTACKER_MAC).action == XDP_DROP
    assert row(h, 0) == {"addr": h.ip(0), "port": 6666, "mac": mac_bytes(ATTACKER_MAC)}


def test_unpinned_worker_learns_only_when_summed(harness):
    h = harness(n_workers=2)
    h.spec = JobSpec(job_id=h.spec.job_id, cookie=h.spec.cookie, n_workers=2, n_chunks=4, fanout="unicast")
    h.prog.set_job(h.spec, slot_base=0, job_index=0)
    assert send_raw(h, h.payload(0, 0, 7, 1), ATTACKER_IP, 6666, ATTACKER_MAC).action == XDP_DROP
    assert row(h, 0)["port"] == 0
    send_raw(h, h.payload(0, 0, 1, 1), "10.77.0.31", 7000)
    assert row(h, 0)["addr"] == "10.77.0.31" and row(h, 0)["port"] == 7000


# -- minor: fragments, frames for another aggregator --------------------------

def test_non_first_fragments_pass_whatever_their_bytes(harness):
    """A non-first fragment carries no UDP header: bytes that happen to read
    as our port are someone's payload. So are a non-UDP packet's."""
    h = harness()
    payload = h.payload(0, 0, 0, 1)
    frames = [udp_frame(payload, src_ip=h.ip(0), frag_off=5),
              udp_frame(payload, src_ip=h.ip(0), frag_off=0x2000 | 185),
              udp_frame(payload, src_ip=h.ip(0), frag_off=5, proto=6),
              udp_frame(payload, src_ip=h.ip(0), ihl=6, proto=6),
              udp_frame(payload, src_ip=h.ip(0), ihl=6, proto=17, frag_off=1)]
    before = h.counters()
    for fr in frames:
        run = prog_test_run(h.prog.xdp_fn.fd, fr)
        assert run.action == XDP_PASS and run.data == fr
    assert delta(before, h.counters()) == {"passed": len(frames)}
    assert h.mask(0) == 0


def test_frames_for_another_aggregator_are_dropped_and_counted(harness):
    h = harness(n_workers=2, agg_id=1, n_aggs=2)
    twin = with_twin(h)
    before = h.counters()
    for kw in (dict(agg_id=0, n_aggs=2), dict(agg_id=1, n_aggs=1), dict(agg_id=2, n_aggs=3)):
        p = h.payload(0, 0, 0, 1, **kw)
        assert send_raw(h, p, h.ip(0), 40000).action == XDP_DROP
        assert twin.handle(p, (h.ip(0), 40000)) == ("wrong_agg", [])
    assert delta(before, h.counters()) == {"wrong_agg": 3}
    assert h.mask(0) == 0
    h.send(0, 0, 0, 1, agg_id=1, n_aggs=2)
    assert h.send(1, 0, 0, 2, agg_id=1, n_aggs=2).action == XDP_TX


# -- item 3: a new incarnation of the job never meets the old one's slots ------

def test_a_round_far_behind_the_slot_is_a_new_incarnation_not_stale(harness):
    """A run of the job restarted with the same id and cookie starts its rounds
    at a fresh base (xagg/torch/engine.py). A round more than XAGG_ROUND_WINDOW
    behind the slot's is that new run: the slot restarts, the old run's sum is
    neither kept nor answered. Within the window, an older round is stale."""
    h = harness(n_workers=2)
    twin = with_twin(h)
    old = 2 * C.XAGG_ROUND_WINDOW + 10                    # where the first run left the slot
    for w in (0, 1):
        p = h.payload(w, old, 0, 1000)
        h.send(w, old, 0, 1000)
        twin.handle(p, (h.ip(w), 40000 + w))
    near = h.payload(0, old - 2, 0, 1)                      # a late packet of the same run
    before = h.counters()
    assert h.send(0, old - 2, 0, 1).action == XDP_DROP
    assert delta(before, h.counters()) == {"stale": 1}
    assert twin.handle(near, (h.ip(0), 40000))[0] == "stale"
    new = old - C.XAGG_ROUND_WINDOW - 2                     # the new run's first round, same parity
    for w, expect in ((0, "aggregated"), (1, "completed")):
        p = h.payload(w, new, 0, 1 + w)
        before = h.counters()
        run = h.send(w, new, 0, 1 + w)
        assert expect in delta(before, h.counters())
        assert twin.handle(p, (h.ip(w), 40000 + w))[0] == expect
    assert run.action == XDP_TX
    assert (np.frombuffer(split_frame(run.data)["payload"][40:], "<i4") == 3).all()
    assert h.prog.slot(0)["round"] == new & 0xFFFFFFFF

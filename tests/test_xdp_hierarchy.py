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
from xagg.wire.proto import C, make_packets, packet_dtype, struct_dtype
from xaggd.dataplane.frames import mac_bytes, split_frame, udp_frame
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
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


# -- real traffic: the program on a lab's veths, real clients ---------------------
from xagg.wire import chunks                                       # noqa: E402

VALS = C.XAGG_VALS
SIZE = 24_000                           # elements per all-reduce: 94 chunks, 47 per aggregator
ROUNDS = 3

# One rank: all-reduces deterministic int32 data through the aggregators,
# aggregator p's chunks sent through route[p]; saves each sum.
WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from xagg.client.allreduce import Client
    from xagg.client.config import ClientConfig
    a = json.loads(sys.argv[1])
    cfg = ClientConfig(job_id=a["job"], cookie=a["cookie"], worker_id=a["w"], n_workers=a["n"],
                       aggregators=a["aggs"], fanout=a["fanout"], route=a["route"], timeout=30)
    with Client(cfg) as c:
        for r in range(a["rounds"]):
            x = np.random.default_rng([a["seed"], a["w"], r]).integers(-2**24, 2**24, a["size"], dtype=np.int32)
            np.save(f"{a['out']}/w{a['w']}_r{r}.npy", c.allreduce_int(x))
        print(json.dumps({"retransmits": c.stats.retransmits, "results": c.stats.results}))
""")


def expected_sum(seed, n, r, size):
    return sum(np.random.default_rng([seed, w, r]).integers(-2**24, 2**24, size, dtype=np.int32)
               for w in range(n)).astype(np.int32)


def run_ranks(lab, job, routes, out, seed, fanout="unicast"):
    aggs = [h.ip for h in lab.aggregators]
    n = len(routes)
    procs = [lab.spawn(f"w{w}", [sys.executable, "-c", WORKER, json.dumps(
        {"job": job, "cookie": COOKIE, "w": w, "n": n, "aggs": aggs, "fanout": fanout, "route": routes[w],
         "rounds": ROUNDS, "seed": seed, "size": SIZE, "out": str(out)})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(n)]
    reports = []
    for p in procs:
        o, e = p.communicate(timeout=240)
        assert p.returncode == 0, f"rank failed: {o}\n{e}"
        reports.append(json.loads(o.strip().splitlines()[-1]))
    for r in range(ROUNDS):
        want = expected_sum(seed, n, r, SIZE)
        for w in range(n):
            got = np.load(out / f"w{w}_r{r}.npy")
            assert np.array_equal(got, want), (w, r)           # exact: every worker counted once
    return reports


def install(progs, lab, job, routes, fanout="unicast"):
    """Every aggregator's entries for ``routes`` (a plan's routes[w][p]):
    its main entry with its children, and a child entry for each other root
    some workers reach through it (what register_job asks the daemons for,
    given a plan's routes)."""
    from xagg.wire.registration import plan_entries
    aggs = lab.aggregators
    caps = chunks.capacity(SIZE, VALS, [1.0] * len(aggs))
    workers = [h.ip for h in lab.workers]
    for k, (prog, a) in enumerate(zip(progs, aggs)):
        main, subs = plan_entries(routes, k)
        kids = [(aggs[c].ip, m) for c, m in main]
        prog.set_job(JobSpec(job_id=job, cookie=COOKIE, n_workers=len(workers), n_chunks=caps[k],
                             fanout=fanout, bcast_ip=lab.broadcast, worker_ips=workers, agg_id=k,
                             n_aggs=len(aggs), children=kids), slot_base=0, job_index=0)
        for i, (p, m) in enumerate(subs):
            prog.set_job(JobSpec(job_id=job, cookie=COOKIE, n_workers=len(workers), n_chunks=caps[p],
                                 fanout=fanout, bcast_ip=lab.broadcast, worker_ips=workers, agg_id=p,
                                 n_aggs=len(aggs), mask=m, parent_ip=aggs[p].ip, parent_mac=aggs[p].mac),
                         slot_base=2 * caps[k] + 2 * sum(caps[q] for q, _ in subs[:i]), job_index=1 + i)


PAYLOAD = packet_dtype(VALS).itemsize      # one xagg packet's UDP payload
FRAME = 14 + 20 + 8 + PAYLOAD             # and its frame; a UDP GSO batch of k crosses a veth
                                          # as one frame of k payloads and one set of headers
OTHER = 1000                              # other traffic a run may add (ARP: 42 bytes a frame)


def crossed(nbytes: int, packets: int, resends: int) -> bool:
    """Whether ``nbytes`` on a link are ``packets`` xagg packets, at most
    ``resends`` more, and a little ARP: another worker's packets would show."""
    return packets * PAYLOAD <= nbytes <= (packets + resends) * FRAME + OTHER


def port_tx_bytes(lab, host) -> int:
    """Bytes the switch has sent into ``host``'s link: what crossed into it."""
    out = lab.exec("switch", ["cat", f"/sys/class/net/{lab.host(host).port}/statistics/tx_bytes"],
                   capture_output=True, text=True)
    return int(out.stdout)


@pytest.fixture(scope="module")
def progs():
    from xaggd.dataplane.program import ProgramConfig, XaggProgram
    ps = [XaggProgram(ProgramConfig(max_slots=1024, max_jobs=4)) for _ in range(2)]
    yield ps
    for p in ps:
        p.close()


@pytest.fixture
def lab_of():
    from xagg.lab.cluster import Lab, LabSpec, destroy
    labs = []

    def make(**kw):
        destroy(kw["name"])             # one an interrupted run of this test left
        lab = Lab(LabSpec(**kw))
        labs.append(lab)
        lab.up()
        return lab
    yield make
    for lab in labs:
        lab.down()


def attached(progs, lab):
    from contextlib import ExitStack
    stack = ExitStack()
    for prog, a in zip(progs, lab.aggregators):
        stack.enter_context(prog.attached(a.ifname, netns=a.netns))
    return stack


def forged_partial(lab, src, dst, job, mask):
    """A PARTIAL for the root's chunk 0, sent by a host that is no child of it."""
    pk = make_packets(job_id=job, cookie=COOKIE, worker_id=0, round_=1 << 20, chunks=np.array([0]),
                      values=np.full((1, VALS), 10**6, np.int32), flags=C.XAGG_F_PARTIAL,
                      worker_mask=mask, agg_id=1, n_aggs=2).tobytes()
    code = (f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.sendto(bytes.fromhex({pk.hex()!r}), ({lab.host(dst).ip!r}, {C.XAGG_PORT}))")
    lab.exec(src, [sys.executable, "-c", code], check=True)


def test_tree_through_a_child_aggregator(lab_of, progs, tmp_path):
    """w0 and w1 send a1's chunks through a0, which sends one partial per
    chunk to a1; w2 goes to a1 directly. Flat first, for the bytes."""
    lab = lab_of(name="xhi1", workers=3, aggregators=2)
    a1_chunks = len(range(*chunks.split(-(-SIZE // VALS), [1, 1])[1]))
    flat, tree = [[0, 1]] * 3, [[0, 0], [0, 0], [0, 1]]
    with attached(progs, lab):
        install(progs, lab, 71, flat)
        before = port_tx_bytes(lab, "a1")
        (tmp_path / "flat").mkdir()
        reports = run_ranks(lab, 71, flat, tmp_path / "flat", seed=1)
        flat_bytes = port_tx_bytes(lab, "a1") - before
        assert progs[1].job_stats(0)["aggregated"] == 3 * a1_chunks * ROUNDS
        # into the root: every worker's packet for each of its chunks
        assert crossed(flat_bytes, 3 * a1_chunks * ROUNDS, sum(r["retransmits"] for r in reports)), flat_bytes

        install(progs, lab, 72, tree)
        c0, c1 = progs[0].counters(), progs[1].counters()
        before = port_tx_bytes(lab, "a1")
        (tmp_path / "tree").mkdir()
        reports = run_ranks(lab, 72, tree, tmp_path / "tree", seed=2)
        tree_bytes = port_tx_bytes(lab, "a1") - before
        d0, d1 = delta(c0, progs[0].counters()), delta(c1, progs[1].counters())
        # into the root: one partial per chunk and w2's packets, not w0's and
        # w1's too (resends: a0's partials again, and w2's)
        assert crossed(tree_bytes, 2 * a1_chunks * ROUNDS,
                       d0.get("partial_resent", 0) + reports[2]["retransmits"]), (tree_bytes, flat_bytes)
        # the root took one partial per chunk from its child and one packet from w2
        assert progs[1].job_stats(0)["aggregated"] == 2 * a1_chunks * ROUNDS
        assert d0["partial_sent"] == a1_chunks * ROUNDS
        assert d0["parent_result"] >= a1_chunks * ROUNDS
        assert progs[0].job_stats(1)["completed"] == a1_chunks * ROUNDS
        assert d1.get("bad_worker", 0) == 0 and d0.get("bad_worker", 0) == 0

        # a partial from a host that is not a registered child: dropped, counted
        c1 = progs[1].counters()
        slot = progs[1].slot(0)
        forged_partial(lab, "w2", "a1", 72, 0b011)
        assert delta(c1, progs[1].counters()) == {"bad_worker": 1}
        assert progs[1].slot(0) == slot

        # lost partials (a0 -> a1) and lost results (a1 -> a0): resends recover both
        lab.set_loss(15, hosts=["a0", "a1"], udp_port=C.XAGG_PORT, direction="out")
        install(progs, lab, 73, tree)       # a new run: rounds start at 0 again
        c0, c1 = progs[0].counters(), progs[1].counters()
        (tmp_path / "loss").mkdir()
        run_ranks(lab, 73, tree, tmp_path / "loss", seed=3)
        d0, d1 = delta(c0, progs[0].counters()), delta(c1, progs[1].counters())
        print(f"with 15% loss on partials and results: {d0}, root {d1}")
        assert d0.get("partial_resent", 0) > 0          # a worker's resend sent the partial again
        assert d1.get("retransmit", 0) > 0              # the root answered a repeated partial
        lab.set_loss(0, hosts=["a0", "a1"], direction="out")


def test_two_racks_each_aggregator_root_and_child(lab_of, progs, tmp_path):
    """Rack 0: w0, w1, a0; rack 1: w2, w3, a1. Each aggregator owns half the
    chunks and is the other's child for the rest: one partial per chunk
    crosses the uplink each way, not two workers' packets."""
    lab = lab_of(name="xhi2", workers=4, aggregators=2, racks=2)
    tree, flat = [[0, 0], [0, 0], [1, 1], [1, 1]], [[0, 1]] * 4
    n_chunks = -(-SIZE // VALS)
    with attached(progs, lab):
        moved, resent = {}, {}
        for name, routes, job in (("flat", flat, 81), ("tree", tree, 82)):
            install(progs, lab, job, routes)
            before, counters = lab.uplink_bytes(), [p.counters() for p in progs]
            (tmp_path / name).mkdir()
            reports = run_ranks(lab, job, routes, tmp_path / name, seed=4)
            after = lab.uplink_bytes()
            moved[name] = sum(a[0] - b[0] for a, b in zip(after, before))    # rack -> core
            d = [delta(c, p.counters()) for c, p in zip(counters, progs)]
            resent[name] = (sum(r["retransmits"] for r in reports)
                            + sum(x.get("partial_resent", 0) + x.get("retransmit", 0) for x in d))
        # flat: each chunk's packets from the other rack's two workers go up,
        # and its results to those two come up from its aggregator's rack
        assert crossed(moved["flat"], 4 * n_chunks * ROUNDS, resent["flat"]), moved
        # tree: one partial up and one result back per chunk, nothing else
        assert crossed(moved["tree"], 2 * n_chunks * ROUNDS, resent["tree"]), (moved, resent)
        for k in (0, 1):
            assert progs[k].job_stats(1)["completed"] == len(range(*chunks.split(n_chunks, [1, 1])[1 - k])) * ROUNDS


# -- the daemon's side: a Plan registered through the control API ------------------
def test_daemon_installs_a_plans_root_and_child_entries():
    """A tree plan's register requests, as two daemons' job tables take them: each
    root gets its children, each child its sub-job with the parent's address
    and next-hop MAC; remove frees both."""
    from types import SimpleNamespace
    from xagg.wire.registration import job_request, plan_request
    from xaggd import backends
    from xaggd.job_request import RequestError
    from xaggd.jobs import JobTable

    class Backend(backends.Backend):
        def __init__(self):
            self.entries = {}

        def set_job(self, spec, *, slot_base, job_index):
            self.entries[(spec.job_id, spec.agg_id if spec.is_child else C.XAGG_AGG_MAIN)] = (spec, slot_base)

        def remove_job(self, job_id, agg=C.XAGG_AGG_MAIN):
            self.entries.pop((job_id, agg), None)

        def next_hop_mac(self, ip):
            return "02:00:00:00:01:02" if ip == "10.77.0.102" else None

    aggs = ["10.77.0.101:9977", "10.77.0.102:9977"]
    plan_ = SimpleNamespace(kind="tree", weights=[1.0, 1.0], routes=[[0, 0], [0, 0], [0, 1]])
    req = job_request(job_id=9, cookie=5, workers=[wip(w) for w in range(3)], max_elements=SIZE,
                      aggregators=aggs, weights=plan_.weights, fanout="unicast")
    tables = [JobTable(Backend(), max_slots=1024, max_jobs=4, max_workers=64, vals=VALS, slot_bytes=1)
              for _ in aggs]
    for k, t in enumerate(tables):
        t.register(plan_request(req, plan_.routes, k, agg_ips=["10.77.0.101", "10.77.0.102"]))
    child, _ = tables[0].backend.entries[(9, 1)]
    assert (child.parent_ip, child.parent_port, child.parent_mac, child.full_mask) == \
        ("10.77.0.102", 9977, "02:00:00:00:01:02", 0b011)
    root, _ = tables[1].backend.entries[(9, C.XAGG_AGG_MAIN)]
    assert root.children == [("10.77.0.101", 0b011)] and (9, 0) not in tables[1].backend.entries
    assert tables[0].memory()["used_slots"] == 2 * (tables[0].jobs[9].n_chunks + child.n_chunks)
    tables[0].remove(9)
    assert tables[0].backend.entries == {} and tables[0].memory()["used_slots"] == 0
    # a parent whose next hop cannot be resolved: refused, naming the field
    bad = plan_request(req, [[1, 1], [1, 1], [1, 1]], 1, agg_ips=["10.77.0.101", "10.77.0.102"])
    bad["child_for"] = [{"agg_index": 0, "workers": [0, 1]}]
    with pytest.raises(RequestError, match=r"child_for\[0\].agg_index: cannot resolve"):
        JobTable(Backend(), max_slots=1024, max_jobs=4, max_workers=64, vals=VALS,
                 slot_bytes=1).register(bad)
    with pytest.raises(RequestError, match=r"child_for\[0\].agg_index"):
        tables[0].register({**req, "agg_index": 0, "child_for": [{"agg_index": 0, "workers": [0]}]})

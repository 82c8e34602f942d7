"""A 1,024-rank tree plan: `xagg plan` plans and predicts it, the plan's
register requests install it at both aggregators (each a real XDP program
behind a job table), and one chunk of all 1,024 workers goes through it:
the child sums its rack's 512 workers into one partial, the root sums that
with its own rack's 512 and the result is exact."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xagg.wire.jobspec import is_wide
from xagg.wire.proto import HDR_DTYPE, HDR_SIZE, C, make_packets
from xagg.wire.planner import registrable
from xagg.wire.registration import job_request, plan_request
from xagg.wire.syscalls import XDP_DROP, XDP_PASS, XDP_TX, prog_test_run
from xaggd import backends
from xaggd.dataplane.frames import split_frame, udp_frame
from xaggd.jobs import JobTable

XAGG = str(Path(sys.executable).parent / "xagg")
RACK = 512
N = 2 * RACK
AGG_IPS = ["10.79.0.101", "10.79.1.101"]
JOB = 77


def worker_ip(w: int) -> str:
    return f"10.79.{w // 250}.{w % 250 + 1}"


def inputs() -> dict:
    """Two racks of 512 ranks, an aggregator in each, uplinks 40 Gbit/s
    (128:1 oversubscribed): summing each rack first is what beats gloo."""
    return {"workers": [{"name": f"w{i}", "up": "10gbit", "down": "25gbit", "rack": i // RACK}
                        for i in range(N)],
            "aggregators": [{"name": f"a{r}", "rack": r, "pps": 1e12} for r in range(2)],
            "uplinks": {"0": "40gbit", "1": "40gbit"}, "mb": 64, "vals": 2233,
            "cpu": {"xagg_s_per_gb": 0, "gloo_s_per_gb": 0}}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    f = tmp_path_factory.mktemp("plan") / "inputs.json"
    f.write_text(json.dumps(inputs()))
    out = subprocess.run([XAGG, "plan", "--inputs", str(f), "--json"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    human = subprocess.run([XAGG, "plan", "--inputs", str(f)], capture_output=True, text=True, timeout=900)
    assert human.returncode == 0, human.stderr
    return json.loads(out.stdout)["plan"], human.stdout


def test_xagg_plan_predicts_a_1024_rank_tree(plan):
    p, human = plan
    assert p["kind"] == "tree" and len(p["routes"]) == N
    assert 0 < p["predicted_s"] < p["gloo_predicted_s"]
    # some rack's workers reach a root through their own rack's aggregator, as one child
    edges = {(c, q) for row in p["routes"] for q, c in enumerate(row) if c != q}
    assert edges and all(c != q for c, q in edges)
    # the tree's line names its workers by count, not one by one
    tree = [line for line in human.splitlines() if line.strip().startswith("tree:")]
    assert tree and all(len(line) < 200 for line in tree) and "512 workers" in tree[0]


class ProgramBackend(backends.Backend):
    """A job table's entries installed in a real XDP program."""

    def __init__(self, prog):
        self.prog = prog

    def set_job(self, spec, *, slot_base, job_index):
        self.prog.set_job(spec, slot_base=slot_base, job_index=job_index)

    def remove_job(self, job_id, agg=C.XAGG_AGG_MAIN):
        self.prog.remove_job(job_id, agg)

    def next_hop_mac(self, ip):
        return "02:00:00:00:79:01"


def test_the_1024_rank_tree_registers_and_sums_exactly(plan, xdp_program):
    from xaggd.dataplane.program import ProgramConfig, XaggProgram
    p, _ = plan
    routes = p["routes"]
    progs = [xdp_program, XaggProgram(ProgramConfig(max_slots=512, max_jobs=2))]
    try:
        req = job_request(job_id=JOB, cookie=5, workers=[worker_ip(w) for w in range(N)],
                          max_elements=64 * C.XAGG_VALS, aggregators=[f"{ip}:9977" for ip in AGG_IPS],
                          # the plan's shares, each at least a chunk of this (smaller) size
                          weights=registrable(p["weights"], 64), fanout="bcast")
        tables = [JobTable(ProgramBackend(prog), max_slots=512, max_jobs=2, max_workers=C.XAGG_MAX_WORKERS,
                           vals=C.XAGG_VALS, slot_bytes=prog.config.slot_bytes) for prog in progs]
        for k, t in enumerate(tables):
            t.register(plan_request(req, routes, k, agg_ips=AGG_IPS))
        # the root whose chunks go through a child, and that child
        root, child = next((q, c) for row in routes for q, c in enumerate(row) if c != q)
        kids = [w for w in range(N) if routes[w][root] == child]
        direct = [w for w in range(N) if routes[w][root] == root]
        assert len(kids) == RACK and is_wide(sum(1 << w for w in kids))
        job = tables[root].jobs[JOB]
        assert job.children == [{"addr": AGG_IPS[child], "workers": sum(1 << w for w in kids)}]
        assert [s["agg_index"] for s in tables[child].jobs[JOB].subs] == [root]

        vals = np.random.default_rng(3).integers(-3000, 3000, size=(N, C.XAGG_VALS), dtype=np.int32)

        def send(prog, w, src, **kw):
            pk = make_packets(job_id=JOB, cookie=5, worker_id=w, round_=0, chunks=np.array([0]),
                              values=vals[w:w + 1], agg_id=root, n_aggs=2, **kw).tobytes()
            return prog_test_run(prog.xdp_fn.fd, udp_frame(pk, src_ip=src, sport=40000))
        for w in kids[:-1]:
            assert send(progs[child], w, worker_ip(w)).action == XDP_DROP
        up = send(progs[child], kids[-1], worker_ip(kids[-1]))
        assert up.action == XDP_TX
        f = split_frame(up.data)
        hdr = np.frombuffer(f["payload"][:HDR_SIZE], HDR_DTYPE)[0]
        assert f["dst_ip"] == AGG_IPS[root] and hdr["flags"] & C.XAGG_F_PARTIAL
        assert (hdr["worker_id"], hdr["worker_mask"]) == (64 * C.XAGG_SET_WORDS, RACK)
        # the root: its own rack's workers, and the child's one partial
        run = prog_test_run(progs[root].xdp_fn.fd, udp_frame(f["payload"], src_ip=AGG_IPS[child], sport=9977))
        assert run.action == XDP_DROP
        for w in direct:
            run = send(progs[root], w, worker_ip(w))
        assert run.action == XDP_PASS               # to tc: the child gets the result too
        got = np.frombuffer(split_frame(run.data[16:])["payload"][HDR_SIZE:], "<i4")
        assert (got == vals.sum(axis=0, dtype=np.int64).astype(np.int32)).all()
        for t in tables:
            t.remove(JOB)
    finally:
        progs[1].close()

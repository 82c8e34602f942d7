"""Workers of one job summing in different lane widths (16-bit and 32-bit),
on the real XDP program (xaggd attached to a lab aggregator's veth): the
program drops every contribution whose width differs from the one its
chunk's round holds, counted as mixed_lanes, so no chunk completes and no
worker gets a wrong sum; the same widths sum as before. The torch hook
compares every rank's width before its first sum and says, on every rank,
in one line, which setting differs. The userspace aggregator gives the
same verdicts (the reference the kernel program is fuzzed against).

Run as ``python tests/test_mixed_lanes_xdp.py MODE JSON``, this file is one
worker: MODE ``client`` (one raw all-reduce) or ``rank`` (a DDP rank).
"""
from __future__ import annotations

import json
import os
import sys

WORLD = 4
N = 50_000


def client_main(a: dict) -> None:
    import numpy as np

    from xagg.client import Client, ClientConfig
    from xagg.client.config import XaggTimeout

    cfg = ClientConfig(job_id=a["job"], cookie=a["cookie"], worker_id=a["rank"], n_workers=WORLD,
                       aggregators=[a["aggregator"]], fanout="unicast", timeout=a["timeout"], vals=a["vals"],
                       wire_bits=a["bits"])
    x = np.full(N, a["rank"] + 1, np.float32)
    with Client(cfg) as c:
        try:
            got = c.allreduce(x)
        except XaggTimeout as e:
            print(json.dumps({"timeout": str(e)}))
            return
    print(json.dumps({"sum": [float(got.min()), float(got.max())]}))


def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xagg.client.config import XaggError
    from xagg.torch import attach

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    model = DDP(nn.Linear(64, 8))
    try:        # attach connects: every rank agrees on the job there
        attach(model, [a["aggregator"]], job_id=a["job"], cookie=a["cookie"], fanout="unicast", timeout=10.0,
               wire_bits=a["bits"])
        model(torch.randn(4, 64)).sum().backward()
        said = ""
    except XaggError as e:
        said = str(e)
    print(json.dumps({"said": said}))


if __name__ == "__main__" and sys.argv[1:2] in (["client"], ["rank"]):
    (client_main if sys.argv[1] == "client" else rank_main)(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side -------------------------------------------------------------------------
import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.lab.experiment import Aggregators  # noqa: E402
from xagg.wire.jobspec import JobSpec  # noqa: E402
from xagg.wire.proto import C, make_packets  # noqa: E402
from xaggd.dataplane.userspace import UserspaceAggregator  # noqa: E402


@pytest.fixture(scope="module")
def lab():
    with Lab(LabSpec(name=f"aum{os.getpid() % 1000}", workers=WORLD, aggregators=1)) as lab, \
            Aggregators(lab, "xdp", max_slots=4096) as aggs:
        yield lab, aggs


def run_workers(lab, aggs, mode: str, widths: list[int], **extra) -> list[dict]:
    job, cookie = random.randrange(1, 2**31), random.randrange(2**32)
    aggs.register(job, cookie, WORLD, N, "unicast")
    master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
    procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), mode, json.dumps(dict(
        rank=k, job=job, cookie=cookie, bits=widths[k], aggregator=lab.aggregators[0].ip, vals=aggs.vals,
        master=master, **extra))], stdout=-1, stderr=-1, text=True) for k, w in enumerate(lab.workers)]
    out = []
    for p in procs:
        so, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        out.append(json.loads(so.strip().splitlines()[-1]))
    aggs.remove(job)
    return out


def test_mixed_widths_are_dropped_and_counted_never_summed(lab):
    lab, aggs = lab
    before = aggs.counters()[0]
    got = run_workers(lab, aggs, "client", [16, 32, 32, 32], timeout=3.0)
    mid = aggs.counters()[0]
    # no worker got a sum: every chunk held a contribution of the other width, refused
    assert all("timeout" in g for g in got), got
    assert mid["mixed_lanes"] > before["mixed_lanes"], mid
    assert mid["completed"] == before["completed"] and mid["malformed"] == before["malformed"], mid
    # one width on every worker (either): summed, exactly 1 + 2 + 3 + 4, nothing refused
    for bits in (16, 32):
        got = run_workers(lab, aggs, "client", [bits] * WORLD, timeout=20.0)
        assert all(g.get("sum") == [10.0, 10.0] for g in got), (bits, got)
    after = aggs.counters()[0]
    assert after["mixed_lanes"] == mid["mixed_lanes"] and after["completed"] > mid["completed"], after


def test_the_hook_names_the_setting_on_every_rank_before_the_first_sum(lab):
    lab, aggs = lab
    before = aggs.counters()[0]
    said = [g["said"] for g in run_workers(lab, aggs, "rank", [32, 32, 16, 32])]
    for k, line in enumerate(said):
        assert f"rank {k}: the job's ranks sum in 16-bit and 32-bit lanes" in line, said
        assert "--wire-bits" in line and "--compress int16" in line and "\n" not in line, line
    assert "this one 16" in said[2] and "this one 32" in said[0]
    after = aggs.counters()[0]
    assert after["aggregated"] == before["aggregated"] and after["mixed_lanes"] == before["mixed_lanes"]


def test_the_userspace_aggregator_refuses_the_same():
    agg = UserspaceAggregator(vals=8)
    agg.set_job(JobSpec(job_id=5, cookie=9, n_workers=2, n_chunks=2))

    def send(worker, bits, chunk=0, rnd=1):
        pk = make_packets(job_id=5, cookie=9, worker_id=worker, round_=rnd, chunks=np.array([chunk]),
                          values=np.ones((1, 8), np.int32), op=C.XAGG_OP_SUM64, bits=bits)
        return agg.handle(pk.tobytes(), (f"10.0.0.{worker + 1}", 5000))[0]

    assert [send(0, 16), send(1, 32), send(1, 16)] == ["aggregated", "mixed_lanes", "completed"]
    # a finished chunk answers a resend of its own width only
    assert [send(0, 32), send(0, 16)] == ["mixed_lanes", "retransmit"]
    # the next round on the slot takes whichever width comes first
    assert [send(0, 32, rnd=3), send(1, 32, rnd=3)] == ["aggregated", "completed"]
    assert agg.job_stats(5)["dropped"] == 2

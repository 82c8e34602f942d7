"""``--compress auto`` on the real data plane: four torch.distributed ranks,
one per worker namespace of a lab whose links run at 100 Mbit/s, each with
its DDP model on the compression hook (xagg.compress.ddp) whose sums go
through xaggd's XDP program (XaggCollectives), as ``xagg-client run
--compress auto`` sets it up. The hook is wrapped only to record, per
bucket, what the rank put in (its gradient, plus the residual it held,
less the residual it keeps) and what came back.

Checks: every rank made the same choice for every bucket at every step;
every rank holds the same bits; each sum is the sum of what the ranks put
in (nothing lost or counted twice, on whichever option and across
changes; int16, whose error feedback the client keeps, within its lanes'
bound); on a 100 Mbit/s link some bucket left dense; the aggregator
summed.

Run as ``python tests/test_compress_auto_xdp.py rank JSON``, this file is one rank.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import astuple
from pathlib import Path

WORLD = 4
STEPS = 8
SPEC = "auto:methods=int16+rgc+iwp,every=2,min_size=0"


def rank_main(a: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xagg.client import Client, ClientConfig
    from xagg.compress import make_ddp_hook
    from xagg.torch.compressed import XaggCollectives
    from xagg.torch.hook import bucket_elements

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a['master']}", rank=a["rank"], world_size=WORLD)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
                bucket_cap_mb=1)
    cfg = ClientConfig(job_id=a["job"], cookie=a["cookie"], worker_id=a["rank"], n_workers=WORLD,
                       aggregators=[a["aggregator"]], fanout="bcast", timeout=20, vals=a["vals"])
    out = {"steps": []}
    with Client(cfg) as client:
        state, hook = make_ddp_hook(SPEC, XaggCollectives(client), model)
        # as xagg-client run does before the first step: the job's hook, from auto's start-up figures
        out["hook"] = list(astuple(state.compressor.hook_for(state.collectives, bucket_elements(model))))
        seen = []

        def recording(st, bucket):
            name = f"bucket{bucket.index()}"
            params = bucket.parameters()
            # the hook's own first move (idempotent): residuals follow a rebuilt layout; the
            # compression thread's buckets before this one done first, so the residuals hold still
            st.drain()
            st.relayout(name, st.param_keys(params), [p.numel() for p in params])
            mem = st.compressor.memory
            before = mem[name].clone() if name in mem else None
            grad = bucket.buffer().clone()
            fut = hook(st, bucket)

            def done(f):            # the hook may complete a step's futures at its last bucket
                after = mem.get(name)       # what the bucket's sum left
                put = grad + (before if before is not None else 0) - (after if after is not None else 0)
                seen.append((name, put, f.value().clone()))
                return f.value()
            return fut.then(done)

        model.register_comm_hook(state, recording)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + a["rank"])
            x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
            seen.clear()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            rec = {"choices": state.compressor.choices(), "sums": []}
            for name, put, avg in sorted(seen, key=lambda e: e[0]):
                every = [torch.empty_like(put) for _ in range(WORLD)]
                dist.all_gather(every, put)
                want = torch.stack(every).sum(0)
                got = avg * WORLD
                sums = [torch.empty_like(got) for _ in range(WORLD)]
                dist.all_gather(sums, got)
                rec["sums"].append({"name": name, "n": put.numel(), "in_max": float(torch.stack(every).abs().max()),
                                    "err": float((got - want).abs().max()), "scale": float(want.abs().max()),
                                    "same": all(torch.equal(s, got) for s in sums)})
            out["steps"].append(rec)
        out["calls"] = client.stats.calls
        out["summary"] = state.compressor.summary()
        (Path(a["out"]) / f"r{a['rank']}.json").write_text(json.dumps(out))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(json.loads(sys.argv[2]))
    from xagg.torch.leave import leave
    leave(0)     # not the teardown, where a finished rank can abort

# -- the test side: the lab, xaggd and the ranks ---------------------------------------------
import random  # noqa: E402

from xagg.client.fixedpoint import tolerance  # noqa: E402
from xagg.lab.cluster import Lab, LabSpec  # noqa: E402
from xagg.lab.experiment import Aggregators  # noqa: E402


def test_auto_chooses_alike_on_every_rank_and_sums_right_through_xdp(tmp_path):
    with Lab(LabSpec(name=f"wca{os.getpid() % 1000}", workers=WORLD, aggregators=1, rate="100mbit")) as lab, \
            Aggregators(lab, "xdp") as aggs:
        job, cookie = random.randrange(1, 2**31), random.randrange(2**32)
        aggs.register(job, cookie, WORLD, 500_000, "bcast")
        master = f"{lab.workers[0].ip}:{random.randrange(20000, 30000)}"
        procs = [lab.spawn(w, [sys.executable, os.path.abspath(__file__), "rank", json.dumps(dict(
            rank=k, master=master, aggregator=lab.aggregators[0].ip, job=job, cookie=cookie, vals=aggs.vals,
            out=str(tmp_path)))], stdout=-1, stderr=-1, text=True) for k, w in enumerate(lab.workers)]
        for p in procs:
            _, err = p.communicate(timeout=900)
            assert p.returncode == 0, err[-3000:]
        counters = aggs.counters()[0]
    ranks = [json.loads((tmp_path / f"r{k}.json").read_text()) for k in range(WORLD)]
    r0 = ranks[0]
    print("\n" + r0["summary"])
    # every rank chose the same hook for the job, from the same agreed figures
    assert all(r["hook"] == r0["hook"] for r in ranks), [r["hook"] for r in ranks]
    assert r0["hook"][0] in (None, 16, 32) and r0["hook"][2] <= r0["hook"][1]
    for step in range(STEPS):
        assert all(r["steps"][step]["choices"] == r0["steps"][step]["choices"] for r in ranks), step
        for s in r0["steps"][step]["sums"]:
            assert s["same"], (step, s)          # every rank holds the sum's bits
            # the sum of what the ranks put in, to the aggregator's fixed point and float32 rounding;
            # int16's error feedback is the client's (not the compressor's memory): its lanes' bound, twice
            # (this step's rounding and the last one's carried in)
            if r0["steps"][step]["choices"][s["name"]] == "int16":
                bound = 2 * tolerance(s["in_max"], WORLD, bits=16)
            else:
                bound = tolerance(s["scale"], WORLD) + WORLD * s["scale"] * 2.0 ** -20
            assert s["err"] <= bound, (step, s, bound)
    chosen = {m for st in r0["steps"] for m in st["choices"].values()}
    assert chosen - {"dense"}, f"no bucket left dense on a 100 Mbit/s link: {r0['summary']}"
    assert all(r["calls"] > 0 for r in ranks)
    assert counters["completed"] > 0 and counters["malformed"] == 0, counters

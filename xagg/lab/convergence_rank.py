"""One rank of the compression convergence run on a lab host, with the
summable collectives going through xagg aggregators. Started by
tests/test_compress_lab.py (one per worker namespace); rank 0 writes the
per-method results as JSON."""
from __future__ import annotations

import argparse
import json
import os

from xagg.wire.fanout import DEFAULT_FANOUT, LABELS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--aggregators", required=True)
    ap.add_argument("--job-id", type=int, required=True)
    ap.add_argument("--cookie", type=int, required=True)
    ap.add_argument("--fanout", default=DEFAULT_FANOUT.label, choices=LABELS, help="as the job was registered")
    ap.add_argument("--vals", type=int, required=True, help="values per packet (the aggregators')")
    ap.add_argument("--specs", required=True, help="';'-separated: ddp, or compressor specs")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    import torch
    import torch.distributed as dist

    from xagg.client import Client, ClientConfig
    from xagg.lab.convergence import train
    from xagg.torch.compressed import XaggCollectives
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
    cfg = ClientConfig(job_id=a.job_id, cookie=a.cookie, worker_id=a.rank, n_workers=a.world,
                       aggregators=a.aggregators.split(","), fanout=a.fanout, timeout=20, vals=a.vals)
    results = {}
    with Client(cfg) as client:
        for spec in a.specs.split(";"):
            coll = XaggCollectives(client) if spec != "ddp" else None
            calls0 = client.stats.calls
            r = train(spec, collectives=coll, epochs=a.epochs)
            every = [None] * a.world
            dist.all_gather_object(every, r)
            results[spec] = {"acc": every[0]["acc"], "same_on_all_ranks": len({e["checksum"] for e in every}) == 1,
                             "ratio": 4 * r["params"] * r["steps"] / max(1, sum(e["sent"] for e in every) / a.world),
                             "xagg_calls": client.stats.calls - calls0,
                             "control_calls": coll.calls["control"] if coll is not None else 0}
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    # every rank done with its collectives before any tears its gloo pairs down
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from xagg.torch.leave import leave
    leave(main())

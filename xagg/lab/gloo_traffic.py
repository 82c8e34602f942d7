"""The peer we measure against: torch.distributed gloo all_reduce, one
process per lab worker, same inputs as xagg.lab.traffic. Prints one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="HOST:PORT of rank 0")
    ap.add_argument("--iface", default="eth0")
    ap.add_argument("--sizes", default="1000")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", a.iface)
    import torch
    import torch.distributed as dist

    from xagg.lab.traffic import inputs
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=120))
    sizes = [int(s) for s in a.sizes.split(",")]
    from xagg.lab.cpustat import machine_cpu_seconds
    # inputs made before the clock starts, as xagg.lab.traffic's are
    data = {(r, s): torch.from_numpy(inputs(a.seed, a.rank, r, s)) for r in range(a.rounds) for s in sizes}
    times = []
    dist.barrier()
    cpu0, own0 = machine_cpu_seconds(), os.times()
    for r in range(a.rounds):
        if r == 1:          # CPU of the steady rounds, as xagg.lab.traffic's
            cpu0, own0 = machine_cpu_seconds(), os.times()
        for s in sizes:
            t = data[(r, s)]
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append({"round": r, "size": s, "seconds": time.perf_counter() - t0})
    cpu1, own1 = machine_cpu_seconds(), os.times()
    dist.destroy_process_group()
    print(json.dumps({"worker": a.rank, "times": times, "machine_cpu": [cpu0, cpu1],
                      "process_cpu": [own1.user - own0.user, own1.system - own0.system],
                      "cpu_from_round": min(1, a.rounds - 1)}), flush=True)
    return 0


if __name__ == "__main__":
    from xagg.torch.leave import leave
    leave(main())

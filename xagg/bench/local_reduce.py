"""Reduce inside the host first, measured on a lab: H hosts of L ranks
(torchrun --nproc-per-node L in each worker namespace), one aggregator
running xaggd with its XDP program, one gradient of MB megabytes (a DDP
model of one float32 parameter, one bucket).

Three transports in the same run, in turn, block after block: the hook with
the host's ranks summed in shared memory first (local_reduce auto: the job's
workers are the hosts), the hook with every rank a worker (local_reduce
off), plain DDP over gloo (its ring over all H x L ranks), and a step with
no all-reduce (none). Each host's
first rank reads its link's byte counters (eth0 in its namespace) around
each block, so the bytes each host's link carries per step and direction
are counted, not estimated.

    python -m xagg.bench.local_reduce [--hosts 2] [--per-host 4] [--mb 16] \\
        [--worker-rate 1gbit] [--agg-rate 4gbit] [--mtu 1500] [--steps 5] [--blocks 3] \\
        [--modes local,flat,gloo,none] [--window 0] [--path udp]

Each mode's row: its step, the ratio to gloo's, the CPU each rank spent per
step (every thread, user and system), the bytes on the busiest host link,
and the ratio on the time beyond mode none's step (the all-reduce's own).
The last line says where a local-reduce call's time went (copy in, waiting
for the host's ranks, the one-pass sum, the share over the network, waiting
for the other shares). Needs root (the lab) and XDP; MTU, fan-out, worker
path and load (before and after) are named.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

# hook with local reduce, hook with every rank a worker, DDP's gloo, and no all-reduce at all
# (a hook that hands the bucket back: what a step costs these ranks without communication)
MODES = ("local", "flat", "gloo", "none")


def _link_bytes() -> tuple[int, int]:
    """(tx, rx) bytes of eth0 in this network namespace."""
    d = "/sys/class/net/eth0/statistics"
    return tuple(int(open(f"{d}/{k}_bytes").read()) for k in ("tx", "rx"))


def _cpu_seconds() -> float:
    """This process's CPU time, every thread, user and system (softirq work the kernel
    does on its packets while it runs included)."""
    t = os.times()
    return t.user + t.system


# -- one rank -------------------------------------------------------------------------------
def _unsummed(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def rank_main(a: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xagg.torch import attach
    from xagg.torch.local_reduce import HostReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first_on_host = int(os.environ["LOCAL_RANK"]) == 0
    n = a["mb"] << 18

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return (self.w * x).sum()

    models, states = {}, {}
    modes = a["modes"]
    for mode in modes:
        models[mode] = DDP(Flat(), bucket_cap_mb=a["mb"] + 1)
        if mode == "none":
            models[mode].register_comm_hook(None, _unsummed)
        elif mode != "gloo":
            states[mode] = attach(models[mode], [a["aggregator"]], control=[a["control"]], fanout=a["fanout"],
                                  local_reduce="auto" if mode == "local" else "off", timeout=30.0,
                                  path=a["path"], **({"window": a["window"]} if a["window"] else {}))
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))

    def step(m) -> float:
        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        m(x).backward()         # returns once the bucket's all-reduce is in the gradient
        return time.perf_counter() - t0

    for mode in modes:          # warm up: first calls page in buffers, predict exponents
        for _ in range(2):
            step(models[mode])
    out = {m: {"ms": [], "tx": [], "rx": [], "cpu": []} for m in modes}
    for _ in range(a["blocks"]):
        for mode in modes:
            dist.barrier()
            b0 = _link_bytes() if first_on_host else (0, 0)
            c0 = _cpu_seconds()
            times = [step(models[mode]) for _ in range(a["steps"])]
            c1 = _cpu_seconds()
            dist.barrier()
            b1 = _link_bytes() if first_on_host else (0, 0)
            out[mode]["cpu"].append(1e3 * (c1 - c0) / a["steps"])
            out[mode]["ms"] += [1e3 * t for t in times]
            out[mode]["tx"].append((b1[0] - b0[0]) / a["steps"])
            out[mode]["rx"].append((b1[1] - b0[1]) / a["steps"])
    # where the local-reduce calls' time went, per lane (the hook's only ones in this process)
    phases = [dict(o.seconds, calls=o.calls) for o in gc.get_objects() if isinstance(o, HostReduce)]
    every = [None] * world
    dist.all_gather_object(every, dict(out=out, host_first=first_on_host, phases=phases,
                                       stats={m: s.snapshot() for m, s in states.items()}))
    if rank == 0:
        with open(a["result"], "w") as f:
            json.dump(every, f)
    for s in states.values():
        s.close()
    dist.barrier()
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------
def run(hosts: int, per_host: int, mb: int, worker_rate: str, agg_rate: str, steps: int, blocks: int,
        fanout: str, name: str, mtu: int = 1500, modes=MODES, window: int = 0, path: str = "udp") -> dict:
    from xagg.lab.cluster import Lab, LabSpec
    from xagg.lab.experiment import Aggregators

    rates = {**{f"w{k}": worker_rate for k in range(hosts)}, "a0": agg_rate}
    load = os.getloadavg()[0]
    with Lab(LabSpec(name=name, workers=hosts, aggregators=1, rate_of=rates, mtu=mtu)) as lab, \
            Aggregators(lab) as aggs, tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        arg = json.dumps(dict(aggregator=lab.host("a0").ip, control=aggs.controls[0].address, mb=mb,
                              steps=steps, blocks=blocks, fanout=fanout, result=result,
                              modes=list(modes), window=window, path=path))
        port = random.randrange(20000, 30000)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        procs = [lab.spawn(w, [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts),
                               "--node-rank", str(k), "--nproc-per-node", str(per_host), "--master-addr",
                               lab.workers[0].ip, "--master-port", str(port), "-m", "xagg.bench.local_reduce",
                               "rank", arg], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k, w in enumerate(lab.workers)]
        for k, p in enumerate(procs):
            _, err = p.communicate(timeout=1800)
            if p.returncode:
                raise RuntimeError(f"host w{k}'s ranks failed ({p.returncode}): {err[-3000:]}")
        with open(result) as f:
            every = json.load(f)
        return dict(every=every, mtu=lab.spec.mtu, vals=aggs.vals, load=load, window=window)


def report(r: dict, hosts: int, per_host: int, mb: int, worker_rate: str, agg_rate: str, fanout: str) -> str:
    grad = mb << 20
    firsts = [e["out"] for e in r["every"] if e["host_first"]]
    rows = []
    modes = list(r["every"][0]["out"])
    ms = {m: statistics.median(t for e in r["every"] for t in e["out"][m]["ms"]) for m in modes}
    for m in modes:
        tx = max(statistics.median(f[m]["tx"]) for f in firsts)
        rx = max(statistics.median(f[m]["rx"]) for f in firsts)
        # beyond what the step costs without an all-reduce (mode none): the all-reduce's own time
        comm = (f"   {(ms['gloo'] - ms['none']) / (ms[m] - ms['none']):5.2f}x gloo beyond none"
                if "none" in ms and m not in ("none", "gloo") else "")
        cpu = statistics.median(c for e in r["every"] for c in e["out"][m]["cpu"])
        rows.append(f"  {m:<6} {ms[m]:8.1f} ms/step   {ms['gloo'] / ms[m]:5.2f}x gloo   cpu {cpu:5.1f} ms/rank   "
                    f"busiest host link per step: out {tx / grad:5.2f}, in {rx / grad:5.2f} gradients{comm}")
    paths = sorted({p for e in r["every"] for st in e["stats"].values() for p in st["path"]})
    why = sorted({w for e in r["every"] for st in e["stats"].values() for w in st["path_reason"] if w})
    if why:         # a path other than the one asked for, and why
        paths = f"{paths} ({'; '.join(why)})"
    head = (f"local reduce: {hosts} hosts x {per_host} ranks, {mb} MB gradient, workers' links {worker_rate}, "
            f"aggregator {agg_rate}, MTU {r['mtu']}, {r['vals']} values per packet, fan-out {fanout}, "
            f"worker path {paths}, window {r['window'] or 'split'}; median of every rank's steps; "
            f"load {r['load']:.1f} before, {os.getloadavg()[0]:.1f} after")
    if "local" not in modes:
        return "\n".join([head, *rows])
    s = r["every"][0]["stats"]["local"]
    tail = [f"  local: {s['buckets_xagg']} buckets on xagg, {s['buckets_gloo']} on gloo, "
            f"{s['retransmits']} resends on rank 0"]
    # where a local-reduce call's time goes, per call, averaged over every rank and lane
    ph = [p for e in r["every"] for p in e["phases"]]
    calls = sum(p["calls"] for p in ph)
    if calls:
        tail.append("  local per call: " + ", ".join(f"{k} {1e3 * sum(p[k] for p in ph) / calls:.1f} ms"
                                                     for k in ph[0] if k != "calls"))
    return "\n".join([head, *rows, *tail])


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["rank"]:
        rank_main(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=4, help="ranks per host (torchrun --nproc-per-node)")
    ap.add_argument("--mb", type=int, default=16, help="gradient size in MiB")
    ap.add_argument("--worker-rate", default="1gbit")
    ap.add_argument("--agg-rate", default="4gbit")
    ap.add_argument("--mtu", type=int, default=1500, help="every lab link's MTU (xaggd packs what it takes)")
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per transport, in turn")
    ap.add_argument("--fanout", default="unicast", choices=("unicast", "bcast"))
    ap.add_argument("--path", default="udp", choices=("udp", "afxdp", "auto"),
                    help="the hook's worker path (its --path)")
    ap.add_argument("--window", type=int, default=0,
                    help="packets in flight per rank and aggregator (default 0: the host's byte window, "
                         "split between its ranks)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"which of {','.join(MODES)} to run, in turn (gloo is always the reference)")
    ap.add_argument("--name", default=f"wfb{os.getpid() % 10000}", help="lab name")
    a = ap.parse_args(argv)
    modes = [m for m in MODES if m in a.modes.split(",") or m == "gloo"]
    r = run(a.hosts, a.per_host, a.mb, a.worker_rate, a.agg_rate, a.steps, a.blocks, a.fanout, a.name, a.mtu,
            modes, a.window, a.path)
    print(report(r, a.hosts, a.per_host, a.mb, a.worker_rate, a.agg_rate, a.fanout), flush=True)
    return 0


if __name__ == "__main__":
    from xagg.torch.leave import leave
    leave(main())

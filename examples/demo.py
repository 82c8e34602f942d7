"""`make demo`: the whole path on one machine.

Builds a lab of 4 worker hosts and 1 aggregator host (network namespaces on
a bridge), starts xaggd on the aggregator's interface, all-reduces real
tensors from every worker, checks each result against the float64 numpy
sum, trains a small CNN with DDP under `xagg-client run` (examples/
train_digits.py; loss/accuracy per epoch), prints all-reduce throughput and
step times next to torch.distributed gloo on the same lab, and tears
everything down. Without root it runs the same all-reduce over loopback
with the userspace aggregator, and says so.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from xagg.client import Client, ClientConfig
from xagg.client.fixedpoint import tolerance
from xagg.lab.traffic import expected, inputs
from xagg.wire import chunks
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import max_vals
from xaggd.dataplane.userspace import UserspaceAggregator, UserspaceServer

# how each all-reduce's results came back (Result.results: a planner model name)
RESULTS_BY = {"mcast": "a multicast group", "bcast": "the subnet broadcast", "unicast": "unicast",
              "": "gloo's ring (TCP)"}


def _check(out_dir: Path, n: int, size: int, rounds: int) -> float:
    worst = 0.0
    for r in range(rounds):
        want, amax = expected(0, n, r, size)
        for w in range(n):
            got = np.load(out_dir / f"w{w}_r{r}_s{size}.npy")
            err = float(np.max(np.abs(got - want)))
            if err > tolerance(amax, n):
                raise SystemExit(f"WRONG SUM: worker {w} round {r}: max error {err:.3g} "
                                 f"> tolerance {tolerance(amax, n):.3g}")
            worst = max(worst, err / amax)
    return worst


def demo_lab(workers: int, size: int, rounds: int, rate: str | None, vals: int = 0,
             mtu: int = 9000, epochs: int = 8) -> int:
    from xagg.lab import Lab, LabSpec  # (needs root: pyroute2 namespaces)
    from xagg.lab.experiment import Aggregators, run_gloo, run_xagg
    from xagg.lab.training import lab_train, n_params
    name = f"demo{os.getpid() % 10000}"
    print(f"[demo] building lab {name}: {workers} workers, 1 aggregator, MTU {mtu}"
          + (f", links shaped to {rate}" if rate else ", unshaped links"), flush=True)
    with Lab(LabSpec(name=name, workers=workers, aggregators=1, rate=rate, mtu=mtu)) as lab:
        for h in lab.hosts:
            print(f"[demo]   {h.name:3} {h.kind:10} {h.netns:14} {h.ip}")
        print("[demo] starting xaggd on a0 (it compiles the XDP program and attaches it to eth0)", flush=True)
        # slots (x2, round parity) for the all-reduce job and the training job after it,
        # sized for the values per packet xaggd will pick (what the MTU takes) or was given
        per_pkt = vals or max_vals(mtu)
        slots = 2 * (chunks.capacity(size, per_pkt, [1])[0] + chunks.capacity(n_params("small"), per_pkt, [1])[0])
        with Aggregators(lab, "xdp", max_slots=slots, vals=vals) as aggs, \
                tempfile.TemporaryDirectory() as tmp:
            print(f"[demo] all-reduce of {size:,} float32 ({size * 4 / 1e6:.0f} MB) from every worker, "
                  f"{rounds} rounds", flush=True)
            # the default fan-out, as a user gets it: on the lab's one segment, a multicast group
            x = run_xagg(lab, aggs, size, rounds=rounds, out_dir=tmp)
            rel = _check(Path(tmp), workers, size, rounds)
            c = aggs.counters()[0]
            print(f"[demo] every worker got the right sum (max error {rel:.1e} of the largest value); "
                  f"aggregator: {c['aggregated']} packets summed, {c['completed']} chunks completed, "
                  f"{c['retransmit']} resent, {c['malformed']} malformed", flush=True)
            train = {}
            if epochs:
                print("[demo] training a CNN on scikit-learn's digits, one DDP rank per worker host, "
                      "unmodified script under `xagg-client run` through the XDP aggregator", flush=True)
                train["xagg"] = lab_train(lab, aggs, "xagg", epochs=epochs)
        print("[demo] same all-reduce with torch.distributed gloo on the same lab", flush=True)
        g = run_gloo(lab, size, rounds=rounds)
        if epochs:
            print("[demo] same training over gloo (DDP's default all-reduce)", flush=True)
            train["gloo"] = lab_train(lab, None, "gloo", epochs=epochs)
    print()
    print(f"{'all-reduce':12} {'time':>11} {'algbw':>12} {'vs gloo':>8}  results by (default fan-out)")
    for r in (x, g):
        print(f"{r.kind:12} {r.seconds * 1e3:8.1f} ms {r.gbps:7.2f} Gb/s {g.seconds / r.seconds:7.2f}x  "
              f"{RESULTS_BY.get(r.results, r.results)}")
    if train:
        print(f"\n{'training':12} {'step':>11} {'comm/step':>12} {'test acc':>9} {'fallbacks':>9}")
        for k, t in train.items():
            print(f"{k:12} {t['step_ms']:8.1f} ms {t['comm_ms']:9.1f} ms {100 * t['final_test_acc']:8.2f}% "
                  f"{t['fallbacks']:9}")
    print(f"[demo] lab {name} removed")
    return 0


def demo_loopback(workers: int, size: int, rounds: int) -> int:
    print("[demo] not root: no XDP and no network namespaces here. Running the same protocol over "
          "loopback with the userspace aggregator (`xaggd start --userspace`).", flush=True)
    agg = UserspaceAggregator()
    agg.set_job(JobSpec(job_id=1, cookie=2, n_workers=workers,
                        n_chunks=chunks.capacity(size, 256, [1])[0]))
    srv = UserspaceServer(agg, "127.0.0.1", 0).start()
    outs = {}

    def run(w):
        cfg = ClientConfig(job_id=1, cookie=2, worker_id=w, n_workers=workers,
                           aggregators=[f"127.0.0.1:{srv.port}"], timeout=30)
        with Client(cfg) as c:
            outs[w] = [c.allreduce(inputs(0, w, r, size)) for r in range(rounds)]
    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    srv.stop()
    for r in range(rounds):
        want, amax = expected(0, workers, r, size)
        for w in range(workers):
            assert np.max(np.abs(outs[w][r] - want)) <= tolerance(amax, workers)
    print(f"[demo] {workers} workers x {rounds} rounds of {size:,} elements: every sum correct "
          f"({agg.counters['completed']} chunks completed)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", type=int, default=4_000_000, help="elements per all-reduce")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default=None, help="shape every link, e.g. 1gbit")
    ap.add_argument("--vals", type=int, default=0,
                    help="int32 values per packet [default: what the MTU takes, 2233 at 9000]")
    ap.add_argument("--mtu", type=int, default=9000,
                    help="lab link MTU: jumbo frames go through XDP multi-buffer [default: 9000]")
    ap.add_argument("--epochs", type=int, default=8, help="training demo epochs (0: skip training)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        return demo_loopback(a.workers, min(a.size, 1_000_000), a.rounds)
    return demo_lab(a.workers, a.size, a.rounds, a.rate, a.vals, a.mtu, a.epochs)


if __name__ == "__main__":
    sys.exit(main())

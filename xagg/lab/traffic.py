"""One worker's all-reduce calls, as a process: the lab's traffic generator.

Tests, `make demo` and `make bench` start one per worker host (inside its
network namespace). Inputs are derived from (seed, worker, round, size), so
the parent can compute the exact float64 sum without shipping tensors.
Prints one JSON line: per-call seconds and client counters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from xagg.client import Client, ClientConfig, XaggError
from xagg.client.config import DEFAULT_PATH, DEFAULT_TIMEOUT, PATHS
from xagg.client.fixedpoint import WIRE_BITS, tolerance
from xagg.lab.cpustat import machine_cpu_seconds
from xagg.wire.fanout import DEFAULT_FANOUT, LABELS
from xagg.wire.jobspec import DEFAULT_RESULT_PORT
from xagg.wire.proto import C


def inputs(seed: int, worker: int, rnd: int, size: int) -> np.ndarray:
    rng = np.random.default_rng([seed, worker, rnd, size])
    return (rng.standard_normal(size) * (rnd + 1)).astype(np.float32)


def expected(seed: int, n_workers: int, rnd: int, size: int) -> tuple[np.ndarray, float]:
    xs = [inputs(seed, w, rnd, size) for w in range(n_workers)]
    return np.sum(np.array(xs, np.float64), axis=0), max(float(np.abs(x).max()) for x in xs)


class WrongSum(AssertionError):
    """A worker's saved output is not the sum of the inputs (within the
    fixed-point bound) or differs from another worker's."""


def check_sums(out_dir, n_workers: int, rounds: int, sizes, seed: int = 0, wire_bits: int = 32) -> None:
    """The outputs the workers saved with ``--out`` (``w{W}_r{R}_s{S}.npy``):
    every one within fixedpoint.tolerance of the float64 sum, and every
    worker's equal to worker 0's. Raises WrongSum naming the round and size."""
    for r in range(rounds):
        for s in sizes:
            want, top = expected(seed, n_workers, r, s)
            got = [np.load(Path(out_dir) / f"w{w}_r{r}_s{s}.npy") for w in range(n_workers)]
            for w, g in enumerate(got):
                err = float(np.max(np.abs(g - want))) if s else 0.0
                bound = tolerance(top, n_workers, bits=wire_bits)
                if not err <= bound:
                    raise WrongSum(f"round {r}, size {s}: worker {w}'s sum is off by {err} (bound {bound})")
                if not np.array_equal(g, got[0]):
                    raise WrongSum(f"round {r}, size {s}: worker {w}'s sum differs from worker 0's")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--job-id", type=int, required=True)
    ap.add_argument("--cookie", type=int, required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--aggregators", required=True, help="HOST[:PORT],... in chunk-map order")
    ap.add_argument("--weights", default="", help="comma-separated, default equal")
    ap.add_argument("--fanout", default=DEFAULT_FANOUT.label, choices=LABELS)
    ap.add_argument("--result-port", type=int, default=DEFAULT_RESULT_PORT)
    ap.add_argument("--result-group", default="", help="bcast results to this multicast group (joined)")
    ap.add_argument("--route", default="", help="a tree plan's row for this worker: per aggregator, "
                    "the aggregator its chunks go through (comma-separated)")
    ap.add_argument("--sizes", default="1000", help="comma-separated element counts")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=0, help="packets in flight per aggregator (0: auto)")
    ap.add_argument("--vals", type=int, default=C.XAGG_VALS, help="values per packet (the aggregator's)")
    ap.add_argument("--wire-bits", type=int, default=32, choices=WIRE_BITS, help="bits per value on the wire")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    ap.add_argument("--path", default=DEFAULT_PATH, choices=PATHS, help="udp, afxdp or auto (AF_XDP where it runs)")
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    ap.add_argument("--out", default="", help="directory for result .npy files")
    ap.add_argument("--start-at", type=float, default=0.0, help="wall-clock time to begin (sync)")
    a = ap.parse_args(argv)
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    cfg = ClientConfig(job_id=a.job_id, cookie=a.cookie, worker_id=a.worker, n_workers=a.workers,
                       aggregators=a.aggregators.split(","), fanout=a.fanout,
                       weights=[float(w) for w in a.weights.split(",")] if a.weights else None,
                       result_port=a.result_port, result_group=a.result_group,
                       route=[int(c) for c in a.route.split(",")] if a.route else None, window=a.window,
                       timeout=a.timeout, vals=a.vals, path=a.path, wire_bits=a.wire_bits)
    sizes = [int(s) for s in a.sizes.split(",")]
    data = {(r, s): inputs(a.seed, a.worker, r, s) for r in range(a.rounds) for s in sizes}
    # one output buffer per size, reused as the DDP hook reuses its sum buffers
    # (a fresh 16 MB array page-faults on every call)
    outs = {s: np.empty(s, np.float32) for s in sizes}
    times = []
    if a.start_at:
        time.sleep(max(0.0, a.start_at - time.time()))
    try:
        with Client(cfg) as c:
            cpu0, own0 = machine_cpu_seconds(), os.times()
            for r in range(a.rounds):
                if r == 1:      # CPU of the steady rounds: the first waits for every worker to start
                    cpu0, own0 = machine_cpu_seconds(), os.times()
                for s in sizes:
                    t0 = time.perf_counter()
                    out = c.allreduce(data[(r, s)], out=outs[s])
                    times.append({"round": r, "size": s, "seconds": time.perf_counter() - t0})
                    if a.out:
                        np.save(Path(a.out) / f"w{a.worker}_r{r}_s{s}.npy", out)
            cpu1, own1 = machine_cpu_seconds(), os.times()
            stats = vars(c.stats)
    except XaggError as e:
        print(json.dumps({"worker": a.worker, "error": str(e)}), flush=True)
        return 2
    print(json.dumps({"worker": a.worker, "times": times, "stats": stats, "machine_cpu": [cpu0, cpu1],
                      "process_cpu": [own1.user - own0.user, own1.system - own0.system],
                      "cpu_from_round": min(1, a.rounds - 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

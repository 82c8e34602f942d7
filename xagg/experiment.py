"""Run all-reduce experiments on a lab: xagg (XDP or userspace twin) and
gloo on the same hosts, same inputs. Used by `make demo`, `make bench` and
the lab integration tests.

The aggregators here are driven in-process (one XaggProgram per aggregator
host, attached inside its namespace, or a twin server process there), so an
experiment needs nothing but root; `xaggd` drives the same objects.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from . import plan
from .job import JobSpec
from .lab import Lab
from .proto import C


@dataclass
class Result:
    kind: str                       # "xagg-xdp", "xagg-twin", "gloo"
    size: int                       # elements
    seconds: float                  # median over rounds (the first is warm-up) of the slowest worker
    all_seconds: list = field(default_factory=list)
    cpu_seconds: float = 0.0        # whole machine (all namespaces), user+system+softirq,
                                    # from the first worker's first call to the last one's end
    reports: list = field(default_factory=list)

    @property
    def gbps(self) -> float:        # algorithm bandwidth: bytes of the tensor / time
        return self.size * 4 * 8 / self.seconds / 1e9


def machine_cpu_seconds() -> float:
    """user + nice + system + irq + softirq of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in parts[1:8])
    import os
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Aggregators:
    """XDP programs (or twin servers) on every aggregator host of a lab."""

    def __init__(self, lab: Lab, mode: str = "xdp", max_slots: int = 65536, vals: int = C.XAGG_VALS):
        self.lab, self.mode, self.vals = lab, mode, vals
        self.stack = ExitStack()
        self.progs = []
        self.twins = []
        self._next = [0, 0]          # (job_index, slot_base) for the next job, per program
        for h in lab.aggregators:
            if mode == "xdp":
                from .loader import ProgramConfig, XaggProgram
                prog = XaggProgram(ProgramConfig(max_slots=max_slots, vals=vals, mtu=lab.spec.mtu))
                self.stack.enter_context(prog.attached(h.ifname, netns=h.netns))
                self.progs.append(prog)
            else:
                p = lab.spawn(h, [sys.executable, "-m", "xagg.twin_server", "--port", str(C.XAGG_PORT),
                                      "--vals", str(vals)],
                              stdin=-1, stdout=-1, text=True)
                self.twins.append(p)
                assert p.stdout.readline().startswith("ready"), "twin server did not start"

    def register(self, job_id: int, cookie: int, n_workers: int, max_elements: int,
                 fanout: str, weights=None) -> list[JobSpec]:
        weights = weights or [1.0] * len(self.lab.aggregators)
        caps = plan.capacity(max_elements, self.vals, weights)
        specs = []
        index, base = self._next
        for k, _h in enumerate(self.lab.aggregators):
            spec = JobSpec(job_id=job_id, cookie=cookie, n_workers=n_workers, n_chunks=caps[k],
                           fanout=fanout, bcast_ip=self.lab.broadcast,
                           worker_ips=[w.ip for w in self.lab.workers[:n_workers]])
            if self.mode == "xdp":
                self.progs[k].set_job(spec, slot_base=base, job_index=index)
            else:
                self.twins[k].stdin.write(json.dumps(vars(spec)) + "\n")
                self.twins[k].stdin.flush()
                assert self.twins[k].stdout.readline().startswith("ok")
            specs.append(spec)
        self._next = [index + 1, base + 2 * max(caps)]
        return specs

    def reset(self) -> None:
        """Forget job placement: the next job reuses slots from 0."""
        self._next = [0, 0]

    def counters(self) -> list[dict]:
        return [p.counters() for p in self.progs]

    def close(self) -> None:
        self.stack.close()
        for p in self.twins:
            p.terminate()
            p.wait(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def collect(procs, timeout):
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {out[-500:]} {err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _summarise(kind, size, reports, rounds):
    cpu = max(r["machine_cpu"][1] for r in reports) - min(r["machine_cpu"][0] for r in reports)
    per_round = [max(t["seconds"] for r in reports for t in r["times"] if t["round"] == i and t["size"] == size)
                 for i in range(rounds)]
    steady = per_round[1:] or per_round
    return Result(kind, size, statistics.median(steady), per_round, cpu, reports)


def start_xagg(lab: Lab, aggs: Aggregators, size, rounds: int = 3, fanout: str = "bcast",
               n_workers: int | None = None, out_dir: str = "", seed: int = 0, timeout: float = 30,
               window: int = 0, result_port: int = C.XAGG_PORT + 1):
    """Register a job and start its worker probes; returns the processes.
    ``size`` is an element count or a list of them (one call each per round)."""
    n = n_workers or len(lab.workers)
    sizes = size if isinstance(size, (list, tuple)) else [size]
    job_id, cookie = random.randrange(1, 2**31), random.randrange(2**32)
    aggs.register(job_id, cookie, n, max(sizes), fanout)
    agg_addrs = ",".join(h.ip for h in lab.aggregators)
    start = time.time() + 1.0 + 0.1 * n
    procs = [lab.spawn(f"w{w}", [sys.executable, "-m", "xagg.probe", "--job-id", str(job_id), "--cookie",
                                 str(cookie), "--worker", str(w), "--workers", str(n), "--aggregators",
                                 agg_addrs, "--fanout", fanout, "--sizes", ",".join(map(str, sizes)), "--rounds",
                                 str(rounds), "--seed", str(seed), "--start-at", str(start),
                                 "--timeout", str(timeout), "--window", str(window),
                                 "--result-port", str(result_port), "--vals", str(aggs.vals)]
                       + (["--out", out_dir] if out_dir else []),
                       stdout=-1, stderr=-1, text=True)
             for w in range(n)]
    return procs


def run_xagg(lab: Lab, aggs: Aggregators, size: int, rounds: int = 3, timeout: float = 30,
             **kw) -> Result:
    procs = start_xagg(lab, aggs, size, rounds=rounds, timeout=timeout, **kw)
    reports = collect(procs, timeout=timeout * rounds * 4 + 120)
    return _summarise(f"xagg-{aggs.mode}", size, reports, rounds)


def run_gloo(lab: Lab, size: int, rounds: int = 3, n_workers: int | None = None, seed: int = 0) -> Result:
    n = n_workers or len(lab.workers)
    port = random.randrange(20000, 30000)
    master = f"{lab.workers[0].ip}:{port}"
    procs = [lab.spawn(f"w{w}", [sys.executable, "-m", "xagg.gloo_probe", "--rank", str(w), "--world", str(n),
                                 "--master", master, "--sizes", str(size), "--rounds", str(rounds),
                                 "--seed", str(seed)], stdout=-1, stderr=-1, text=True)
             for w in range(n)]
    reports = collect(procs, timeout=600)
    return _summarise("gloo", size, reports, rounds)

"""Run all-reduce experiments on a lab: xagg (the XDP or the userspace
aggregator, each served by `xaggd` on the aggregator hosts) and gloo on the
same hosts, same inputs. Used by `make demo`, `make bench` and the lab
integration tests.
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from xagg.client.config import DEFAULT_PATH
from xagg.lab.cluster import Lab
from xagg.wire.control import ControlClient
from xagg.wire.fanout import AUTO, DEFAULT_FANOUT, Fanout, Reach, ResultPath, choose
from xagg.wire.jobspec import DEFAULT_RESULT_PORT
from xagg.wire.proto import C
from xagg.wire.registration import plan_request


@dataclass
class Result:
    kind: str                       # "xagg-xdp", "xagg-userspace", "gloo"
    size: int                       # elements
    seconds: float                  # median over rounds (the first is warm-up) of the slowest worker
    all_seconds: list = field(default_factory=list)
    cpu_seconds: float = 0.0        # whole machine (all namespaces), user+system+softirq,
                                    # from the first worker's first call to the last one's end
    reports: list = field(default_factory=list)
    results: str = ""               # xagg: how results came back, a planner model name (fanout.ResultPath.model)

    @property
    def gbps(self) -> float:        # algorithm bandwidth: bytes of the tensor / time
        return self.size * 4 * 8 / self.seconds / 1e9


def lab_results(lab: Lab, hosts: list, n_workers: int, group: str = "") -> ResultPath:
    """What the hook's default fan-out ("auto", xagg.wire.fanout.choose) picks
    for the lab's first ``n_workers`` workers and the aggregator ``hosts``:
    every lab host sits on one L2 segment (racks too), so a group, unless a
    worker is itself one of the aggregators."""
    reach = [[Reach(w.ip, "local" if w.ip == h.ip else "link") for h in hosts] for w in lab.workers[:n_workers]]
    return choose(reach, [h.ip for h in hosts], group)[0]


def resolve(lab: Lab, hosts: list, n_workers: int, fanout: Fanout | str, result_group: str,
            routes=None) -> ResultPath:
    """The result path a fan-out setting stands for on the lab ("auto"
    resolved; a tree plan's ``routes`` keep unicast, as the hook's do)."""
    if fanout == AUTO:
        return ResultPath(Fanout.UNICAST) if routes else lab_results(lab, hosts, n_workers, result_group)
    return ResultPath(Fanout.parse(fanout), result_group)


class Aggregators:
    """`xaggd` on every aggregator host of a lab (``mode`` "xdp", or "userspace"
    for ``xaggd start --userspace``), driven through its control socket like
    any other client would. ``hosts``: the hosts that aggregate, in the
    job's aggregator order (default the lab's aggregators); a worker host
    among them runs its xaggd with the slot lock, as its own worker sums
    through the program beside the NIC (client/local.py)."""

    def __init__(self, lab: Lab, mode: str = "xdp", max_slots: int = 65536, vals: int = 0,
                 start_timeout: float = 60.0, hosts=None):
        if mode not in ("xdp", "userspace"):
            raise ValueError(f"Aggregators(mode={mode!r}): xdp or userspace")
        self.lab, self.mode, self.vals = lab, mode, vals
        self.hosts = [lab.host(h) for h in hosts] if hosts else list(lab.aggregators)
        self.daemons, self.controls = [], []
        try:
            for h in self.hosts:
                name = f"{lab.name}-{h.name}"
                argv = [sys.executable, "-m", "xaggd.cli", "start", "--name", name, "--vals", str(vals),
                        "--max-slots", str(max_slots), "--log-level", "warning"]
                argv += ["--userspace"] if mode == "userspace" else ["--iface", h.ifname]
                if h.kind == "worker" and mode == "xdp":
                    argv += ["--lock", "on"]
                    lab.take_xdp_tx(h)
                self.daemons.append(lab.spawn(h, argv))
                self.controls.append(ControlClient(f"/run/xaggd/{name}.sock"))
            # vals 0: each daemon picks what its link's MTU takes; they must agree
            found = {c.wait_ready(timeout=start_timeout)["vals"] for c in self.controls}
            if len(found) != 1:
                raise RuntimeError(f"the lab's aggregators run different values per packet: {sorted(found)}")
            self.vals = found.pop()
        except BaseException:
            self.close()
            raise

    def register(self, job_id: int, cookie: int, n_workers: int, max_elements: int,
                 fanout: Fanout | str = DEFAULT_FANOUT, weights=None, result_port: int = DEFAULT_RESULT_PORT,
                 result_group: str = "", routes=None) -> list[dict]:
        """Register the job at every aggregator; ``routes`` (a plan's tree,
        xagg.wire.planner.Plan.routes) adds each root's children and each
        child's entries for other roots' chunks. ``fanout``: the daemon's
        default, as an operator's registration that names none gets; "auto":
        what the hook's default picks on this lab (``resolve``), which the
        job's workers must then be told."""
        path = resolve(self.lab, self.hosts, n_workers, fanout, result_group)
        fanout, result_group = path.fanout, path.group
        weights = weights or [1.0] * len(self.hosts)
        aggs = [{"addr": f"{h.ip}:{C.XAGG_PORT}", "weight": w} for h, w in zip(self.hosts, weights)]
        req = {"job_id": job_id, "cookie": cookie, "max_elements": max_elements,
               "fanout": Fanout.parse(fanout).label,
               "workers": [w.ip for w in self.lab.workers[:n_workers]], "aggregators": aggs,
               "bcast_ip": result_group or self.lab.broadcast, "result_port": result_port, "vals": self.vals}
        ips = [h.ip for h in self.hosts]
        return [c.register(plan_request(req, routes, k, agg_ips=ips) if routes else {**req, "agg_index": k})
                for k, c in enumerate(self.controls)]

    def register_plan(self, job_id: int, cookie: int, n_workers: int, max_elements: int, plan, **kw):
        """register() with a plan's weights and, for a tree, its routes."""
        return self.register(job_id, cookie, n_workers, max_elements, weights=plan.weights,
                             routes=plan.routes if plan.kind == "tree" else None, **kw)

    def remove(self, job_id: int) -> None:
        for c in self.controls:
            c.remove(job_id)

    def counters(self) -> list[dict]:
        return [c.stats()["counters"] for c in self.controls]

    def close(self) -> None:
        for p in self.daemons:
            p.terminate()           # SIGTERM: xaggd detaches and exits
        for p in self.daemons:
            try:
                p.wait(15)
            except Exception:
                p.kill()
        self.daemons = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def collect(procs, timeout):
    return collect_with_stderr(procs, timeout)[0]


def collect_with_stderr(procs, timeout) -> tuple[list, list]:
    """Each worker probe's report (the last line of its stdout) and its stderr."""
    reports, errs = [], []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed ({p.returncode}): {out[-500:]} {err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
        errs.append(err)
    return reports, errs


def _summarise(kind, size, reports, rounds):
    cpu = max(r["machine_cpu"][1] for r in reports) - min(r["machine_cpu"][0] for r in reports)
    per_round = [max(t["seconds"] for r in reports for t in r["times"] if t["round"] == i and t["size"] == size)
                 for i in range(rounds)]
    steady = per_round[1:] or per_round
    return Result(kind, size, statistics.median(steady), per_round, cpu, reports)


def start_xagg(lab: Lab, aggs: Aggregators, size, rounds: int = 3, fanout: Fanout | str = AUTO,
               n_workers: int | None = None, out_dir: str = "", seed: int = 0, timeout: float = 30,
               window: int = 0, result_port: int = DEFAULT_RESULT_PORT, weights=None,
               result_group: str = "", routes=None, late=None, path: str = DEFAULT_PATH, wire_bits: int = 32):
    """Register a job and start its worker probes; returns (job_id, processes).
    ``size`` is an element count or a list of them (one call each per round);
    ``weights``: share of the chunks per aggregator (default equal);
    ``fanout`` "auto": what the hook's default picks here (``resolve``);
    ``result_group``: bcast fan-out to this multicast group, which the workers
    join (the lab's aggregator ports take no multicast), instead of broadcast;
    ``routes``: a tree plan's routes (each worker sends through its row);
    ``late``: {worker: seconds} it starts after the others; ``path``: the
    clients' (xagg.client.config.PATHS); ``wire_bits``: their lanes' width."""
    n = n_workers or len(lab.workers)
    sizes = size if isinstance(size, (list, tuple)) else [size]
    job_id, cookie = random.randrange(1, 2**31), random.randrange(2**32)
    results = resolve(lab, aggs.hosts, n, fanout, result_group, routes)
    fanout, result_group = results.fanout, results.group
    aggs.register(job_id, cookie, n, max(sizes), fanout, weights=weights, result_port=result_port,
                  result_group=result_group, routes=routes)
    agg_addrs = ",".join(h.ip for h in aggs.hosts)
    start = time.time() + 1.0 + 0.1 * n
    procs = [lab.spawn(f"w{w}", [sys.executable, "-m", "xagg.lab.traffic", "--job-id", str(job_id), "--cookie",
                                 str(cookie), "--worker", str(w), "--workers", str(n), "--aggregators",
                                 agg_addrs, "--fanout", Fanout.parse(fanout).label, "--sizes", ",".join(map(str, sizes)), "--rounds",
                                 str(rounds), "--seed", str(seed), "--start-at", str(start + (late or {}).get(w, 0)),
                                 "--timeout", str(timeout), "--window", str(window),
                                 "--result-port", str(result_port), "--vals", str(aggs.vals), "--path", path,
                                 "--wire-bits", str(wire_bits)]
                       + (["--out", out_dir] if out_dir else [])
                       + (["--result-group", result_group] if result_group else [])
                       + (["--route", ",".join(map(str, routes[w]))] if routes else [])
                       + (["--weights", ",".join(map(repr, weights))] if weights else []),
                       stdout=-1, stderr=-1, text=True)
             for w in range(n)]
    return job_id, procs


def run_xagg(lab: Lab, aggs: Aggregators, size: int, rounds: int = 3, timeout: float = 30,
             **kw) -> Result:
    job_id, procs = start_xagg(lab, aggs, size, rounds=rounds, timeout=timeout, **kw)
    try:
        reports = collect(procs, timeout=timeout * rounds * 4 + 120)
    finally:
        aggs.remove(job_id)
    results = resolve(lab, aggs.hosts, kw.get("n_workers") or len(lab.workers), kw.get("fanout", AUTO),
                      kw.get("result_group", ""), kw.get("routes"))
    return dataclasses.replace(_summarise(f"xagg-{aggs.mode}", size, reports, rounds), results=results.model)


def run_gloo(lab: Lab, size: int, rounds: int = 3, n_workers: int | None = None, seed: int = 0) -> Result:
    n = n_workers or len(lab.workers)
    port = random.randrange(20000, 30000)
    master = f"{lab.workers[0].ip}:{port}"
    procs = [lab.spawn(f"w{w}", [sys.executable, "-m", "xagg.lab.gloo_traffic", "--rank", str(w), "--world", str(n),
                                 "--master", master, "--sizes", str(size), "--rounds", str(rounds),
                                 "--seed", str(seed)], stdout=-1, stderr=-1, text=True)
             for w in range(n)]
    reports = collect(procs, timeout=600)
    return _summarise("gloo", size, reports, rounds)

"""What the planner is given: every host's link rates and rack, each
aggregator's packet rate, the racks' uplinks, the all-reduce size, how
results go back (a ResultPath) and the CPU the job costs; and the
operator's file that says them (JSON, docs/planner.md).

Inputs are figures (bits/s, packets/s, CPU seconds per GB); where they come
from (an operator's file, a lab's state, a probe) is the caller's business.
PlanInputError names the field of anything wrong, in the file's spelling.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from xagg.wire import chunks
from xagg.wire.fanout import MODELS, Fanout, ResultPath
from xagg.wire.rates import parse_bps

# Per packet on the wire beyond the values: Ethernet 14 + IPv4 20 + UDP 8 +
# xagg header 40 (tbf counts the frame from the Ethernet header on).
DEFAULT_OVERHEAD_BYTES = 82
# Machine CPU seconds per GB of one worker's gradient, i.e. wall time x cores
# / (workers x GB): everything a call costs (client, kernel, XDP, tbf), as
# the bench measures it on the lab machine (docs/planner.md says how).
DEFAULT_XAGG_CPU_S_PER_GB = 3.4
DEFAULT_GLOO_CPU_S_PER_GB = 2.1
# Fixed cost per all-reduce call (first packet out to last result in / the
# ring's 2(N-1) steps' latencies), seconds.
DEFAULT_XAGG_LATENCY_S = 0.006
DEFAULT_GLOO_LATENCY_S = 0.004
# TCP/IP + Ethernet bytes per byte of gradient in gloo's ring (MSS 8948 at
# MTU 9000: 66 header bytes per segment, plus ACKs the other way).
DEFAULT_GLOO_WIRE_FACTOR = 1.01
# Packets/s one RX queue's core sums: the XDP multi-buffer build (MTU 9000,
# multi-queue safe) in BPF_PROG_TEST_RUN on the lab machine (docs/planner.md);
# `xaggd check` measures a host's own.
DEFAULT_AGG_PPS_PER_QUEUE = 365_000.0


class PlanInputError(ValueError):
    """A planner input that cannot be used; ``field`` names it."""

    def __init__(self, name: str, why: str):
        self.field = name
        super().__init__(f"{name}: {why}")


@dataclass
class Node:
    """A host: a worker, or an aggregator (then ``pps`` is its packet
    capacity: the build's packets/s per core x its RX queues). An aggregator
    ``on`` a worker runs on that worker's host: the link is the worker's (its
    own rates are not used), and the worker's packets for its share never
    cross it (client/local.py)."""
    name: str
    up_bps: float | None = None      # what it can send, bits/s; None = unshaped (no limit)
    down_bps: float | None = None    # what it can receive
    rack: int = 0
    pps: float | None = None         # aggregators only; None = not a limit
    on: str | None = None            # aggregators only: the worker whose host it is


@dataclass
class CpuCosts:
    """CPU seconds per GB of one worker's gradient, per all-reduce, and per-call latencies.
    ``shared_cores``: every host runs on the same this-many cores (a lab on one machine),
    so the whole job's CPU shares them; None: each host has its own."""
    xagg_s_per_gb: float = DEFAULT_XAGG_CPU_S_PER_GB
    gloo_s_per_gb: float = DEFAULT_GLOO_CPU_S_PER_GB
    shared_cores: float | None = None
    xagg_latency_s: float = DEFAULT_XAGG_LATENCY_S
    gloo_latency_s: float = DEFAULT_GLOO_LATENCY_S


@dataclass
class PlanInputs:
    workers: list[Node]
    aggregators: list[Node]
    elements: int                           # float32 values per all-reduce (the planned size)
    vals: int                               # values per packet (xaggd's, from the MTU)
    results: ResultPath = ResultPath(Fanout.BCAST)   # how results go back (the file's "fanout")
    uplinks: dict = field(default_factory=dict)   # rack -> bits/s of its uplink, each way
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    gloo_wire_factor: float = DEFAULT_GLOO_WIRE_FACTOR
    cpu: CpuCosts = field(default_factory=CpuCosts)
    trees: bool = True                      # may the planner use two-level routes
    result_choices: tuple = ()              # ResultPaths the planner may pick from ("fanouts";
                                            # default: results)

    # -- derived ----------------------------------------------------------------------
    @property
    def n_chunks(self) -> int:
        return -(-self.elements // self.vals)

    @property
    def frame_bytes(self) -> int:
        return 4 * self.vals + self.overhead_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes one worker sends for one all-reduce, meta chunks and headers included."""
        n = self.n_chunks
        return (n + chunks.meta_chunks(n, self.vals)) * self.frame_bytes

    @property
    def gradient_bytes(self) -> int:
        return 4 * self.elements

    def validate(self) -> "PlanInputs":
        def need(ok, name, why):
            if not ok:
                raise PlanInputError(name, why)

        def positive(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf

        need(len(self.workers) >= 1, "workers", "at least one worker")
        need(len(self.aggregators) >= 1, "aggregators", "at least one aggregator")
        names = [n.name for n in self.workers + self.aggregators]
        need(len(set(names)) == len(names), "hosts", f"names must be unique, got {names}")
        by_name = {w.name: w for w in self.workers}
        hosts = [a.on for a in self.aggregators if a.on is not None]
        need(len(set(hosts)) == len(hosts), "aggregators", f"at most one aggregator per worker host, got {hosts}")
        for a in self.aggregators:
            if a.on is not None:
                need(a.on in by_name, f"aggregators.{a.name}.on", f"must name a worker, got {a.on!r}")
                need(a.rack == by_name[a.on].rack, f"aggregators.{a.name}.rack",
                     f"must be its host {a.on}'s rack ({by_name[a.on].rack}), got {a.rack}")
        for kind, nodes in (("workers", self.workers), ("aggregators", self.aggregators)):
            for n in nodes:
                for attr in ("up_bps", "down_bps") + (("pps",) if kind == "aggregators" else ()):
                    v = getattr(n, attr)
                    need(v is None or positive(v), f"{kind}.{n.name}.{attr}",
                         f"must be > 0 (or absent: no limit), got {v!r}")
                need(isinstance(n.rack, int) and n.rack >= 0, f"{kind}.{n.name}.rack",
                     f"must be an integer >= 0, got {n.rack!r}")
        need(isinstance(self.elements, int) and self.elements > 0, "elements",
             f"must be a positive integer (float32 values per all-reduce), got {self.elements!r}")
        need(isinstance(self.vals, int) and 1 <= self.vals, "vals",
             f"must be a positive integer (values per packet), got {self.vals!r}")
        need(isinstance(self.results, ResultPath), "fanout", f"must be a ResultPath, got {self.results!r}")
        need(isinstance(self.result_choices, (tuple, list))
             and all(isinstance(r, ResultPath) for r in self.result_choices),
             "fanouts", f"each must be a ResultPath, got {self.result_choices!r}")
        need(isinstance(self.overhead_bytes, int) and self.overhead_bytes >= 0, "overhead_bytes",
             f"must be an integer >= 0, got {self.overhead_bytes!r}")
        need(positive(self.gloo_wire_factor) and self.gloo_wire_factor >= 1, "gloo_wire_factor",
             f"must be >= 1, got {self.gloo_wire_factor!r}")
        racks = {n.rack for n in self.workers + self.aggregators}
        for r, bps in self.uplinks.items():
            need(isinstance(r, int) and r in racks, f"uplinks.{r}", f"no host is in rack {r!r}")
            need(bps is None or positive(bps), f"uplinks.{r}", f"must be > 0 bits/s, got {bps!r}")
        c = self.cpu
        for name in ("xagg_s_per_gb", "gloo_s_per_gb", "xagg_latency_s", "gloo_latency_s"):
            v = getattr(c, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
                 f"cpu.{name}", f"must be >= 0, got {v!r}")
        need(c.shared_cores is None or positive(c.shared_cores), "cpu.shared_cores",
             f"must be > 0 (or absent: every host has its own), got {c.shared_cores!r}")
        return self




def worker_host_agg(worker: str) -> str:
    """The planner's name for the aggregator on a worker's host."""
    return f"{worker}.agg"


def offer_worker_hosts(inputs: PlanInputs) -> PlanInputs:
    """``inputs`` with every worker's host offered as an aggregator too (one RX
    queue at the built-in packet rate), after the others; a worker that
    already hosts one keeps it."""
    have = {a.on for a in inputs.aggregators}
    inputs.aggregators += [Node(worker_host_agg(w.name), rack=w.rack, pps=DEFAULT_AGG_PPS_PER_QUEUE, on=w.name)
                           for w in inputs.workers if w.name not in have]
    return inputs


# -- the file format -----------------------------------------------------------------------

def _bps(value, where: str) -> float | None:
    try:
        return parse_bps(value, where)
    except ValueError as e:
        raise PlanInputError(where, str(e).split(": ", 1)[1]) from None


def _node(d: dict, where: str, agg: bool) -> Node:
    if not isinstance(d, dict) or "name" not in d:
        raise PlanInputError(where, f"expected an object with a name, got {d!r}")
    known = {"name", "rate", "up", "down", "rack", "pps", "queues", "pps_per_queue"} | ({"on"} if agg else set())
    extra = set(d) - known
    if extra:
        raise PlanInputError(f"{where}.{sorted(extra)[0]}", f"unknown field (known: {sorted(known)})")
    if "on" in d:
        link = sorted({"rate", "up", "down"} & set(d))
        if link:
            raise PlanInputError(f"{where}.{link[0]}", f"an aggregator on worker {d['on']!r} uses that "
                                 "worker's link: give its rate there")
    rate = _bps(d.get("rate"), f"{where}.rate")
    up = _bps(d["up"], f"{where}.up") if "up" in d else rate
    down = _bps(d["down"], f"{where}.down") if "down" in d else rate
    pps = None
    if agg:
        if "pps" in d:
            pps = d["pps"]
        else:
            pps = d.get("pps_per_queue", DEFAULT_AGG_PPS_PER_QUEUE) * d.get("queues", 1)
    return Node(str(d["name"]), up, down, d.get("rack", 0), pps, d.get("on"))


def _on_its_host(n: Node, d: dict, workers: list) -> Node:
    """An aggregator on a worker's host is in that worker's rack unless the file says otherwise."""
    if n.on is not None and "rack" not in d:
        n.rack = next((w.get("rack", 0) for w in workers if isinstance(w, dict) and w.get("name") == n.on), 0)
    return n


def _results(d: dict) -> tuple[ResultPath, tuple]:
    """The file's "fanout" (a model name) and "fanouts" (the planner picks one of them)."""
    try:
        results = ResultPath.from_model(d.get("fanout", "bcast"))
    except ValueError as e:
        raise PlanInputError("fanout", str(e)) from None
    choices = d.get("fanouts", [])
    if not isinstance(choices, list) or not all(c in MODELS for c in choices):
        raise PlanInputError("fanouts", f"each must be one of {list(MODELS)}, got {choices!r}")
    return results, tuple(map(ResultPath.from_model, choices))


def _elements(d: dict) -> int:
    if "elements" in d:
        return d["elements"]
    if "mb" not in d:
        raise PlanInputError("mb", "missing (or give elements)")
    mb = d["mb"]
    if not isinstance(mb, (int, float)) or isinstance(mb, bool) or mb <= 0:
        raise PlanInputError("mb", f"must be > 0 (MB of float32 gradient), got {mb!r}")
    return int(mb * 250_000)


def _cpu(d: dict) -> CpuCosts:
    cpu_d = d.get("cpu", {})
    if not isinstance(cpu_d, dict):
        raise PlanInputError("cpu", f"expected an object, got {cpu_d!r}")
    fields = {f.name for f in dataclasses.fields(CpuCosts)}
    bad = set(cpu_d) - fields
    if bad:
        raise PlanInputError(f"cpu.{sorted(bad)[0]}", f"unknown field (known: {sorted(fields)})")
    return CpuCosts(**cpu_d)


def _uplinks(d: dict) -> dict:
    if not isinstance(d.get("uplinks", {}), dict):
        raise PlanInputError("uplinks", "expected an object {rack: rate}")
    uplinks = {}
    for r, v in d.get("uplinks", {}).items():
        try:
            rack = int(r)
        except ValueError:
            raise PlanInputError(f"uplinks.{r}", "rack numbers are integers") from None
        uplinks[rack] = _bps(v, f"uplinks.{r}")
    return uplinks


def inputs_from_dict(d: dict) -> PlanInputs:
    """PlanInputs from the operator's file format (JSON; docs/planner.md)::

        {"workers": [{"name": "w0", "rate": "1gbit"}, ...],
         "aggregators": [{"name": "a0", "rate": "4gbit", "queues": 2},
                         {"name": "w0agg", "on": "w0"}, ...],     # w0's host aggregates too
         "uplinks": {"0": "500mbit"}, "mb": 16, "vals": 2233, "fanout": "bcast",
         "fanouts": ["mcast", "unicast"],     # optional: let the planner pick one
         "cpu": {"shared_cores": 2}}

    A host's ``rate`` sets both directions; ``up``/``down`` override one.
    PlanInputError names the field of anything wrong.
    """
    if not isinstance(d, dict):
        raise PlanInputError("inputs", f"expected an object, got {type(d).__name__}")
    known = {"workers", "aggregators", "uplinks", "mb", "elements", "vals", "fanout", "fanouts",
             "overhead_bytes", "gloo_wire_factor", "cpu", "trees"}
    extra = set(d) - known
    if extra:
        raise PlanInputError(sorted(extra)[0], f"unknown field (known: {sorted(known)})")
    for need in ("workers", "aggregators", "vals"):
        if need not in d:
            raise PlanInputError(need, "missing")
    if not isinstance(d["workers"], list) or not isinstance(d["aggregators"], list):
        raise PlanInputError("workers" if not isinstance(d["workers"], list) else "aggregators",
                             "expected a list of hosts")
    elements = _elements(d)
    results, choices = _results(d)
    inputs = PlanInputs(
        workers=[_node(w, f"workers[{i}]", False) for i, w in enumerate(d["workers"])],
        aggregators=[_on_its_host(_node(a, f"aggregators[{i}]", True), a, d["workers"])
                     for i, a in enumerate(d["aggregators"])],
        elements=elements, vals=d["vals"], results=results, result_choices=choices, uplinks=_uplinks(d),
        overhead_bytes=d.get("overhead_bytes", DEFAULT_OVERHEAD_BYTES),
        gloo_wire_factor=d.get("gloo_wire_factor", DEFAULT_GLOO_WIRE_FACTOR),
        cpu=_cpu(d), trees=d.get("trees", True))
    return inputs.validate()


def inputs_to_dict(inputs: PlanInputs) -> dict:
    """The file format again (rates in bits/s), so a plan's inputs can be saved and replayed."""
    def node(n: Node, agg: bool) -> dict:
        out = {"name": n.name, "rack": n.rack}
        if n.up_bps is not None:
            out["up"] = n.up_bps
        if n.down_bps is not None:
            out["down"] = n.down_bps
        if agg and n.pps is not None:
            out["pps"] = n.pps
        if agg and n.on is not None:
            out = {"name": n.name, "on": n.on, "rack": n.rack, **({"pps": n.pps} if n.pps is not None else {})}
        return out
    return {"workers": [node(w, False) for w in inputs.workers],
            "aggregators": [node(a, True) for a in inputs.aggregators],
            "uplinks": {str(r): v for r, v in inputs.uplinks.items() if v is not None},
            "elements": inputs.elements, "vals": inputs.vals, "fanout": inputs.results.model,
            "fanouts": [r.model for r in inputs.result_choices],
            "overhead_bytes": inputs.overhead_bytes, "gloo_wire_factor": inputs.gloo_wire_factor,
            "cpu": dataclasses.asdict(inputs.cpu), "trees": inputs.trees}

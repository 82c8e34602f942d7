"""What the lab cannot hold: all-reduce times for hundreds of ranks over
hosts of several ranks in oversubscribed racks, from the planner's model.

A cluster (``Cluster``) is hosts of ``ranks_per_host`` ranks, each host one
NIC, ``hosts_per_rack`` hosts behind a top-of-rack switch whose uplink is
their NICs' sum over ``oversub``, and ``aggs_per_rack`` dedicated
aggregator hosts in each rack. Each algorithm's time is the planner's
(planner_model.py: every host link, rack uplink and aggregator packet rate,
whichever is busiest) with the terms a many-rank host adds:

* xagg, ranks as workers (today): every rank is a worker of the job, so a
  host's NIC sends one gradient per rank; it receives one per rank with
  unicast results, one in all with a group frame (every local socket hears
  the same frame). The planner's model runs on one worker per rank and
  the ranks' link terms are added up per host (``host_links``).
* xagg, hosts as workers (reduce inside the host first): a host is one
  worker; its L ranks reduce-scatter and all-gather in shared memory and
  each sends 1/L of the host's sum, so a process handles 1/L of the packets.
* gloo's ring over the ranks ordered by host: one ring edge per host's NIC
  each way (the others stay inside the host), one per rack boundary.
* a hierarchical ring: reduce inside the host, a ring across hosts,
  broadcast inside the host.

Beyond the planner's terms (``Costs``): the packets one client process
sends and receives per second, the host memory the in-host reduce moves,
and a latency per network hop (2(N-1) of them for a ring; 2 for xagg flat,
4 through a tree). Trees are the rack tree (planner_model.rack_tree_routes,
ALEPH's): a worker sends another rack's root's chunks through its own
rack's aggregator, which sends one partial up. The planner (make_plan)
scores the rack tree among its candidates, so its plan is never predicted
slower; it is not run here because a table of 32-128 aggregators would take
it minutes (docs/scaling.md).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from xagg.wire.fanout import ResultPath
from xagg.wire.planner_inputs import CpuCosts, Node, PlanInputError, PlanInputs
from xagg.wire.planner_model import (
    chunk_counts,
    flat_closed_form,
    flat_routes,
    floors,
    gloo_predict,
    loads,
    rack_tree_routes,
)
from xagg.wire.proto import max_vals

# Packets/s one core's XDP program sums, multi-queue safe (with the slot
# lock): README's XDP test-run figures, 451 ns at MTU 1500 and 1463 ns at MTU
# 9000 (multi-buffer), test-run overhead included, so a floor.
XDP_PPS_PER_CORE = {1500: 1e9 / 451, 9000: 1e9 / 1463}
# Packets/s one client process sends (UDP GSO) and receives: the low end of
# the 580-900 kpps ../shared/BRIEF.md measured for one Python sender.
DEFAULT_CLIENT_PPS = 580_000.0
# One network hop's latency, software included (a ring step's, a worker's
# packet to its aggregator): a kernel TCP/UDP round trip on a datacenter
# network is 20-50 us.
DEFAULT_HOP_S = 25e-6
# Bits/s the in-host reduce-scatter and all-gather move through a host's
# memory: a two-socket DDR5 server's copy bandwidth, well below its peak.
DEFAULT_HOST_MEM_BPS = 200e9 * 8

ALGORITHMS = ("gloo ring", "hier. ring", "xagg flat", "xagg tree", "xagg flat/host", "xagg tree/host")


@dataclass(frozen=True)
class Costs:
    """What a many-rank cluster costs beyond the planner's link and
    aggregator terms; None: not a limit (the lab: its shared-CPU floor and
    per-call latencies stand for them)."""
    hop_s: float = DEFAULT_HOP_S
    client_pps: float | None = DEFAULT_CLIENT_PPS
    host_mem_bps: float | None = DEFAULT_HOST_MEM_BPS


LAB_COSTS = Costs(hop_s=0.0, client_pps=None, host_mem_bps=None)


@dataclass(frozen=True)
class Cluster:
    ranks: int
    ranks_per_host: int = 8
    nic_bps: float = 100e9
    hosts_per_rack: int = 4              # dense GPU hosts: a rack's power holds few
    oversub: float = 4.0                 # a rack's hosts' NIC bandwidth / its uplink's
    aggs_per_rack: int = 1               # dedicated aggregator hosts (spare CPU hosts)
    agg_nic_bps: float | None = None     # default: the workers' NIC
    agg_cores: int = 8                   # RX queues, each a core running the program
    mtu: int = 9000
    mb: float = 25.0                     # all-reduce size: DDP's default bucket
    agg_pps_per_core: float | None = None   # default: XDP_PPS_PER_CORE at the MTU

    def check(self) -> "Cluster":
        def need(ok, name, why):
            if not ok:
                raise PlanInputError(name, why)
        for name in ("ranks", "ranks_per_host", "hosts_per_rack", "aggs_per_rack", "agg_cores"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, name, f"must be an integer >= 1, got {v!r}")
        need(self.ranks % self.ranks_per_host == 0, "ranks",
             f"{self.ranks} ranks do not fill hosts of {self.ranks_per_host}")
        for name in ("nic_bps", "oversub", "mb"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and v > 0, name, f"must be > 0, got {v!r}")
        need(self.oversub >= 1, "oversub", f"must be >= 1 (1: no oversubscription), got {self.oversub!r}")
        need(self.agg_pps_per_core is not None or self.mtu in XDP_PPS_PER_CORE, "agg_pps_per_core",
             f"no measured packet rate for MTU {self.mtu} (known: {sorted(XDP_PPS_PER_CORE)}): give one")
        return self

    @property
    def hosts(self) -> int:
        return self.ranks // self.ranks_per_host

    @property
    def racks(self) -> int:
        return -(-self.hosts // self.hosts_per_rack)

    @property
    def uplink_bps(self) -> float:
        return self.hosts_per_rack * self.nic_bps / self.oversub

    def inputs(self, hosts_as_workers: bool, results: ResultPath) -> PlanInputs:
        """The planner's inputs: one worker per rank (or per host), the racks'
        uplinks (none for one rack), the dedicated aggregators; no CPU floor
        (each host has its own cores: Costs charges them per packet)."""
        self.check()
        pps = (self.agg_pps_per_core or XDP_PPS_PER_CORE[self.mtu]) * self.agg_cores
        per_host = 1 if hosts_as_workers else self.ranks_per_host
        workers = [Node(f"h{h}" if hosts_as_workers else f"h{h}r{r}", self.nic_bps, self.nic_bps,
                        h // self.hosts_per_rack)
                   for h in range(self.hosts) for r in range(per_host)]
        agg_nic = self.agg_nic_bps or self.nic_bps
        aggs = [Node(f"a{k}.{rack}", agg_nic, agg_nic, rack, pps)
                for k in range(self.aggs_per_rack) for rack in range(self.racks)]
        uplinks = {r: self.uplink_bps for r in range(self.racks)} if self.racks > 1 else {}
        return PlanInputs(workers, aggs, elements=int(self.mb * 250_000), vals=max_vals(self.mtu),
                          results=results, uplinks=uplinks,
                          cpu=CpuCosts(0.0, 0.0, None, 0.0, 0.0)).validate()


@dataclass
class Prediction:
    algorithm: str
    seconds: float
    bound: str                          # the binding term ("h0 out", "rack1 uplink in", "latency", ...)
    results: str = ""                   # xagg: the result path it ran with
    terms: dict = field(default_factory=dict, repr=False)


def _pick(algorithm: str, terms: dict, latency_s: float, results: str = "") -> Prediction:
    name = max(terms, key=terms.get)
    total = terms[name] + latency_s
    return Prediction(algorithm, total, "latency" if latency_s > terms[name] else name, results, terms)


def host_links(terms: dict, host_of: dict, one_frame: bool) -> dict:
    """The planner's per-worker link terms added up per host: ranks sharing a
    NIC send every rank's packets through it; they receive every rank's
    unicast copies, but a group frame once (each local socket hears it).
    Exact where nothing but results enters a worker host (dedicated
    aggregators)."""
    out = {k: v for k, v in terms.items() if not k.endswith((" in", " out")) or k.split(" ")[0] not in host_of}
    for k, v in terms.items():
        w, _, way = k.partition(" ")
        if w in host_of and way in ("in", "out"):
            key = f"{host_of[w]} {way}"
            out[key] = max(out.get(key, 0.0), v) if (way == "in" and one_frame) else out.get(key, 0.0) + v
    return out


def xagg(inputs: PlanInputs, costs: Costs, tree: bool = False, ranks_per_host: int = 1,
         hosts_as_workers: bool = False, name: str = "") -> Prediction:
    """xagg under the planner's exact model (the closed-form flat split, or the
    rack tree), with ``ranks_per_host`` ranks on each worker host (ranks as
    workers: worker names "h{host}r{rank}") or hosts as workers."""
    routes = rack_tree_routes(inputs) if tree else flat_routes(len(inputs.workers), len(inputs.aggregators))
    weights = flat_closed_form(inputs)
    terms = {**loads(inputs, chunk_counts(inputs, weights), routes), **floors(inputs)}
    if ranks_per_host > 1 and not hosts_as_workers:
        terms = host_links(terms, {w.name: w.name.partition("r")[0] for w in inputs.workers},
                           inputs.results.one_frame)
    packets = inputs.wire_bytes / inputs.frame_bytes          # each way, per worker
    per_process = packets / (ranks_per_host if hosts_as_workers else 1)
    if costs.client_pps:
        terms["client packets"] = per_process / costs.client_pps
    if hosts_as_workers and ranks_per_host > 1 and costs.host_mem_bps:
        terms["host memory"] = _host_memory_s(inputs, ranks_per_host, costs)
    latency = inputs.cpu.xagg_latency_s + (4 if tree else 2) * costs.hop_s
    return _pick(name or ("xagg tree" if tree else "xagg flat"), terms, latency, inputs.results.model)


def _host_memory_s(inputs: PlanInputs, ranks_per_host: int, costs: Costs) -> float:
    """The in-host reduce reads every rank's bucket, the all-gather writes every rank's back."""
    return 2 * ranks_per_host * inputs.gradient_bytes * 8 / costs.host_mem_bps


def ring(inputs: PlanInputs, costs: Costs, name: str = "gloo ring", ranks_per_host: int = 1) -> Prediction:
    """gloo's ring over ``inputs.workers`` in order (the planner's gloo_predict:
    a worker's link carries 2(N-1)/N x G each way, a rack boundary as much),
    2(N-1) hops; ranks_per_host > 1: the workers are hosts and each reduces
    and broadcasts inside itself first (the hierarchical ring)."""
    n = len(inputs.workers)
    base = dataclasses.replace(inputs.cpu, gloo_latency_s=0.0)
    seconds, bound = gloo_predict(dataclasses.replace(inputs, cpu=base))
    terms = {re.sub(r"^(h\d+)r\d+ ", r"\1 ", bound): seconds}     # a rank's ring edge is its host's NIC
    if ranks_per_host > 1 and costs.host_mem_bps:
        terms["host memory"] = _host_memory_s(inputs, ranks_per_host, costs)
    return _pick(name, terms, inputs.cpu.gloo_latency_s + 2 * (n - 1) * costs.hop_s)


def predict_all(cluster: Cluster, costs: Costs = Costs(), results=("mcast", "unicast")) -> list[Prediction]:
    """Every algorithm of ALGORITHMS on ``cluster``; xagg with the fastest of
    ``results`` (planner model names), as the planner picks among "fanouts"."""
    L = cluster.ranks_per_host
    paths = [ResultPath.from_model(r) for r in results]
    out = [ring(cluster.inputs(False, paths[0]), costs),
           ring(cluster.inputs(True, paths[0]), costs, "hier. ring", ranks_per_host=L)]
    for hosts in (False, True):
        for tree in (False, True):
            name = ("xagg tree" if tree else "xagg flat") + ("/host" if hosts else "")
            out.append(min((xagg(cluster.inputs(hosts, p), costs, tree, L, hosts, name) for p in paths),
                           key=lambda pr: pr.seconds))
    return out

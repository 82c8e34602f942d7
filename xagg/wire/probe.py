"""Measured planner inputs: what a short active probe says about each link.

The planner needs each host's link rate and each aggregator's. Where nobody
gives the figures, a probe measures them through the data path itself:
short all-reduces through one aggregator at a time (the lab's runner is
xagg/lab/probe.py). Two kinds of sample:

* **solo**: one worker alone through aggregator ``a``. Its gradient goes up
  the worker's link and the aggregator's down link, the result comes back
  the other way: the rate is min(worker, aggregator, and the uplinks in
  between). A one-chunk call's time is the path's round trip (``rtt_s``).
* **together**: the aggregator's rack's workers at once through ``a``: its
  down link carries all their gradients, so the rate it sustained is at
  least (workers x bytes) / time. A probe can only show as much as the
  workers can drive: an aggregator faster than its workers together is
  reported at their sum (an underestimate the plan cannot suffer from: the
  plan never sends it more than those workers send).

Estimates (``estimate``): a worker's rate is its best solo sample; an
aggregator's the best of its together sample and its solo samples; a rack's
uplink, where a solo sample crossed racks and was slower than both ends'
estimates, that sample's rate (the slowest such). Every rate is taken as
the same both ways (the probe measures a round trip).

Each aggregator's packet capacity is no probe's: its xaggd measures its
program as built at start and reports it (``packet_rate`` of its status);
``estimate`` takes those figures along.

``apply`` puts the estimates into PlanInputs, except for the hosts (and
uplinks) whose figures an operator gave: those win.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from xagg.wire import chunks
from xagg.wire.planner_inputs import DEFAULT_OVERHEAD_BYTES, PlanInputs


@dataclass
class Sample:
    aggregator: str
    workers: list            # names of the workers that sent at once (one: solo)
    wire_bytes: float        # bytes each worker sent (headers and meta chunks included)
    seconds: float           # the call's time (steady rounds' median, the slowest worker)
    rtt_s: float = 0.0       # a one-chunk call's time over the same path (solo samples)

    @property
    def solo(self) -> bool:
        return len(self.workers) == 1

    @property
    def bps(self) -> float:
        """Bits/s into the aggregator, the round trip's fixed time taken off."""
        busy = max(self.seconds - self.rtt_s, 1e-9)
        return 8 * self.wire_bytes * len(self.workers) / busy


@dataclass
class Estimates:
    rates: dict              # host name -> bits/s (both ways)
    uplinks: dict            # rack -> bits/s (both ways), where a probe saw one bind
    rtt_s: dict              # (worker, aggregator) -> seconds
    pps: dict = field(default_factory=dict)     # aggregator name -> packets/s its xaggd measured

    def to_dict(self) -> dict:
        return {"rates": self.rates, "uplinks": {str(k): v for k, v in self.uplinks.items()},
                "rtt_ms": {f"{w}->{a}": s * 1e3 for (w, a), s in self.rtt_s.items()}, "pps": self.pps}


def packet_rate(status: dict) -> float | None:
    """An aggregator's packets/s from its xaggd's status: the rate it measured
    per core at start x its RX queues (None: not measured, a userspace one)."""
    pps = status.get("pps_per_queue")
    return pps * (status.get("rx_queues") or 1) if pps else None


def estimate(inputs: PlanInputs, samples: list[Sample], slack: float = 0.9, pps: dict | None = None) -> Estimates:
    """Host and uplink rates from probe samples (racks from ``inputs``), and
    the aggregators' packet rates in ``pps`` (name -> packets/s, from their
    daemons). ``slack``: a cross-rack sample counts as the uplink's rate only
    when it is below this fraction of both ends' estimates (else the ends
    explain it)."""
    rack = {n.name: n.rack for n in inputs.workers + inputs.aggregators}
    rates: dict = {}
    for s in samples:
        if s.solo:
            rates[s.workers[0]] = max(rates.get(s.workers[0], 0.0), s.bps)
        rates[s.aggregator] = max(rates.get(s.aggregator, 0.0), s.bps)
    uplinks: dict = {}
    for s in samples:
        w = s.workers[0]
        if s.solo and rack[w] != rack[s.aggregator] and s.bps < slack * min(rates[w], rates[s.aggregator]):
            for r in (rack[w], rack[s.aggregator]):
                uplinks[r] = min(uplinks.get(r, s.bps), s.bps)
    rtt = {(s.workers[0], s.aggregator): s.rtt_s for s in samples if s.solo and s.rtt_s}
    return Estimates(rates, uplinks, rtt, {k: v for k, v in (pps or {}).items() if v})


def apply(inputs: PlanInputs, est: Estimates, given=(), given_uplinks=()) -> PlanInputs:
    """``inputs`` with the measured rates, but for the hosts named in
    ``given`` and the racks in ``given_uplinks`` (an operator's figures win)."""
    def node(n):
        if n.name in given:
            return n
        if n.name in est.pps:
            n = dataclasses.replace(n, pps=est.pps[n.name])
        bps = est.rates.get(n.name)
        if bps is None or n.on is not None:         # a worker host's aggregator: its worker's link
            return n
        return dataclasses.replace(n, up_bps=bps, down_bps=bps)

    uplinks = dict(inputs.uplinks)
    for r, bps in est.uplinks.items():
        if r not in given_uplinks:
            uplinks[r] = bps
    return dataclasses.replace(inputs, workers=[node(n) for n in inputs.workers],
                               aggregators=[node(n) for n in inputs.aggregators],
                               uplinks=uplinks).validate()


def wire_bytes(elements: int, vals: int) -> float:
    """Bytes one worker sends for an all-reduce of ``elements`` float32:
    data and meta chunks, each a frame with its headers."""
    n = -(-elements // vals)
    return (n + chunks.meta_chunks(n, vals)) * (4 * vals + DEFAULT_OVERHEAD_BYTES)


def steady_seconds(times: list[float]) -> float:
    """A probe call's time: the median of the calls after the first (the first
    one has no exponent history and takes two rounds, and warms the path)."""
    return statistics.median(times[1:] or times)


def drifted(base: PlanInputs, samples: list[Sample], me: str | None = None, tol: float = 0.1) -> PlanInputs | None:
    """``base`` with the figures that solo samples (from worker ``me`` only,
    or from every worker that sent some) show wrong, or None if none is. A
    solo sample sees at most min(worker, aggregator). An aggregator is proven
    slower than ``base`` says when its best sample is below both its figure
    and that sample's worker's by more than ``tol`` (every worker saw it
    slow, the fastest included); faster, up to the fastest sampling worker's
    rate, when its best sample is above its figure by more than ``tol`` while
    that figure is below the worker's. A worker likewise from its best sample
    over the aggregators. Nothing else is concluded (a 4 Gbit/s aggregator
    seen only from 1 Gbit/s workers stays 4 Gbit/s)."""
    nodes = {n.name: n for n in base.workers + base.aggregators}
    solo = [s for s in samples if s.solo and (me is None or s.workers[0] == me) and s.workers[0] in nodes
            and s.aggregator in nodes]
    changed = {}

    def judge(name: str, seen: list[tuple[float, str]]):
        """``name``'s samples as (rate, the other end). Slower: its best
        sample is below its figure and that sample's other end's. Faster:
        some sample, capped at its other end's figure (which it cannot show
        past), is above its figure; then the largest such."""
        if not seen:
            return
        figure = nodes[name].down_bps or float("inf")
        ends = [(bps, nodes[other].up_bps or float("inf")) for bps, other in seen]
        bps, end = max(ends)
        faster = max(min(b, e) for b, e in ends)
        if bps < (1 - tol) * min(end, figure):
            changed[name] = bps
        elif faster > (1 + tol) * figure:
            changed[name] = faster

    for a in base.aggregators:
        judge(a.name, [(s.bps, s.workers[0]) for s in solo if s.aggregator == a.name])
    for w in base.workers:
        judge(w.name, [(s.bps, s.aggregator) for s in solo if s.workers[0] == w.name])
    if not changed:
        return None

    def node(n):
        return dataclasses.replace(n, up_bps=changed[n.name], down_bps=changed[n.name]) if n.name in changed else n
    return dataclasses.replace(base, workers=[node(n) for n in base.workers],
                               aggregators=[node(n) for n in base.aggregators]).validate()

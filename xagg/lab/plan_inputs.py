"""A lab as the planner sees it (`xagg plan --lab NAME`, the hetero bench):
every host's shaped rate, its rack, the racks' uplinks, xaggd's values per
packet at the lab's MTU, each aggregator's packet rate and the machine's
cores, which every host of the lab shares; or the same rates measured by a
probe through the lab's own data path (xagg.lab.probe)."""
from __future__ import annotations

import os

from xagg.lab.probe import probe_lab
from xagg.wire import probe
from xagg.wire.fanout import Fanout, ResultPath
from xagg.wire.planner_inputs import DEFAULT_AGG_PPS_PER_QUEUE, CpuCosts, Node, PlanInputs, offer_worker_hosts
from xagg.wire.proto import max_vals
from xagg.wire.rates import parse_bps


def lab_inputs(lab, mb: float = 16, results: ResultPath = ResultPath(Fanout.BCAST), cpu: CpuCosts | None = None,
               choices: tuple = (), worker_hosts: bool = False) -> PlanInputs:
    """The planner's inputs for a lab (a Lab, loaded or built). Each
    aggregator's packet rate is the XDP build's figure per queue x the lab's
    queues; ``choices``: the result paths the planner may pick from;
    ``worker_hosts``: every worker's host offered as an aggregator too, after
    the lab's (one RX queue each)."""
    spec = lab.spec
    cpu = cpu or CpuCosts()
    if cpu.shared_cores is None:
        cpu.shared_cores = float(os.cpu_count() or 1)
    pps = DEFAULT_AGG_PPS_PER_QUEUE * spec.agg_queues
    uplink = parse_bps(spec.uplink, "uplink") if spec.racks > 1 else None
    inputs = PlanInputs(
        workers=[Node(h.name, h.rate, h.rate, h.rack) for h in lab.workers],
        aggregators=[Node(h.name, h.rate, h.rate, h.rack, pps) for h in lab.aggregators],
        elements=int(mb * 250_000), vals=max_vals(spec.mtu), results=results,
        uplinks={r: uplink for r in range(spec.racks)} if uplink else {}, cpu=cpu,
        result_choices=tuple(choices))
    return (offer_worker_hosts(inputs) if worker_hosts else inputs).validate()


def probed(lab, inputs: PlanInputs, mb: float, measured: dict, log=None) -> PlanInputs:
    """``inputs`` with the rates a probe of ``mb`` MB calls measured on the lab;
    its estimates go into ``measured``, its progress to ``log``."""
    pps: dict = {}
    est = probe.estimate(inputs, probe_lab(lab, mb, log=log, pps=pps), pps=pps)
    measured.update(est.to_dict())
    return probe.apply(inputs, est)

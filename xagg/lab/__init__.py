"""A virtual cluster on one machine, and what runs on it: a dev tool for
tests, ``make demo`` and ``make bench`` (``xagg lab`` on the command line).

    cluster.py           Lab: network namespaces on a bridge, shaping (tbf), loss (nftables)
    cli.py               `xagg lab up/down/status/exec/loss/rate` (the `xagg` command, xagg.cli, adds them)
    plan_inputs.py       a lab as the planner sees it: its shaped rates, racks, cores (`xagg plan --lab`)
    probe.py             `xagg plan --lab NAME --probe`: a lab's links measured through xaggd
    experiment.py        all-reduce experiments: xaggd on the aggregator hosts, xagg vs gloo
    traffic.py           one worker's all-reduce calls as a process (the traffic generator)
    gloo_traffic.py      the same inputs through torch.distributed gloo (the peer we measure against)
    training.py          examples/train_digits.py on the lab, one rank per host, xagg or gloo
    convergence.py       the compression methods trained against dense DDP (reference MLP)
    convergence_rank.py  one rank of that run on a lab host, its sums through xagg
    cpustat.py           whole-machine CPU time, what experiments charge to a transport
    xdp_pass.py          the pass program on aggregator ports (veth needs it for XDP_TX)

May import anything of xagg and xaggd; outside lab, bench and examples
only the `xagg` command (xagg.cli) imports it. Needs root, and scikit-learn for the training runs
(the test extra).
"""
from xagg.lab.cluster import Lab, LabError, LabExists, LabNotFound, LabSpec

__all__ = ["Lab", "LabError", "LabExists", "LabNotFound", "LabSpec"]

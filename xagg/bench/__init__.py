"""`make bench`: the project's benchmarks, each against its peer in the same run.

    __main__.py   the runner: `python -m xagg.bench [--quick] [--only SECTION,...]`
    xdp.py        the XDP program's cost per packet (test-run), vs the userspace aggregator
    allreduce.py  lab all-reduces, xagg (XDP, userspace) vs torch.distributed gloo
    train.py      DDP step time of the digits example on the lab, xagg vs gloo
    loss.py       xagg steps under 1% random loss vs lossless ones, sums checked
    compress.py   compression methods: throughput, bytes on the wire, MSTopK vs torch.topk
    hetero.py     the planner on heterogeneous labs: planned vs equal split vs gloo, and predicted
    local_reduce.py  a host's ranks summed in shared memory first vs every rank a worker vs gloo's ring
                  (`python -m xagg.bench.local_reduce`, not in `make bench`: 8 ranks on the lab)
    scaling.py    predicted all-reduce times at 16-1,024 ranks (xagg.wire.scaling), and the model vs the lab
    plan_speed.py the planner's wall time at 64-1,024 workers x 4-16 aggregators, its plan vs the rack tree
                  (`python -m xagg.bench.plan_speed`, not in `make bench`)

A dev tool like xagg.lab: may import anything. Results go to bench-out/
(``XAGG_BENCH_OUT``).
"""
import os
from pathlib import Path

OUT = Path(os.environ.get("XAGG_BENCH_OUT", "bench-out"))

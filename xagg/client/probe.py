"""Solo probe samples from this host through real aggregators: the figures
xagg.wire.probe turns into planner inputs (`xagg plan --probe` on a real
cluster, and the re-planner's drift check). It lives in the client because
it runs the client's all-reduce; the estimators stay in the wire.
"""
from __future__ import annotations

import random
import time

import numpy as np

from xagg.client.allreduce import Client
from xagg.client.config import ClientConfig
from xagg.wire.control import ControlClient
from xagg.wire.fanout import Fanout
from xagg.wire.probe import Sample, steady_seconds, wire_bytes
from xagg.wire.registration import worker_source_ips

PROBE_CALLS = 4      # calls per size; the first is dropped (steady_seconds)


def probe_from_here(aggregators: list, controls: list, token: str | None, names: list, me: str,
                    mb: float = 4, timeout: float = 10.0) -> list[Sample]:
    """Solo samples from this host (worker ``me``) to each aggregator
    (``aggregators``: "HOST:PORT" data addresses, ``controls``: their daemons'
    control endpoints, ``names``: their names in the plan's inputs): a
    one-worker probe job registered at that aggregator alone (a random job
    id, removed after), a one-chunk call for the round trip, then calls of
    ``mb`` MB. Rates from one host show min(this host, the aggregator, the
    path); run it on each worker host for the figures of all."""
    out = []
    ips = worker_source_ips(aggregators)
    for addr, control, name, ip in zip(aggregators, controls, names, ips):
        job_id, cookie = random.randrange(1, 2**31), random.randrange(2**32)
        big = int(mb * 250_000)
        with ControlClient(control, token=token) as cc:
            vals = cc.register(job_id, cookie=cookie, max_elements=big, workers=[ip],
                               aggregators=[{"addr": addr, "weight": 1.0}], agg_index=0, fanout=Fanout.UNICAST,
                               replace=True)["vals"]
            try:
                cfg = ClientConfig(job_id=job_id, cookie=cookie, worker_id=0, n_workers=1, aggregators=[addr],
                                   fanout=Fanout.UNICAST.label, vals=vals, timeout=timeout)
                seconds = {}
                with Client(cfg) as c:
                    for n in (vals, big):
                        x = np.ones(n, np.float32)
                        times = []
                        for _ in range(PROBE_CALLS):
                            t0 = time.perf_counter()
                            c.allreduce(x)
                            times.append(time.perf_counter() - t0)
                        seconds[n] = steady_seconds(times)
            finally:
                cc.remove(job_id)
        out.append(Sample(name, [me], wire_bytes(big, vals), seconds[big], rtt_s=seconds[vals]))
    return out

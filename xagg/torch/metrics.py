"""A rank's counters for a Prometheus scraper (HookConfig.metrics,
XAGG_METRICS): what `xagg-client status` reads from the status files.

    xagg_client_steps_total{rank,job_id}                training steps
    xagg_client_buckets_total{rank,job_id,path}         buckets summed by xagg / gloo
    xagg_client_bytes_total{rank,job_id}                bytes summed through the aggregators
    xagg_client_packets_sent_total, _retransmits_total, _results_total, _redone_total
    xagg_client_fallbacks_total, _retries_total, _recoveries_total
    xagg_client_comm_seconds_total{rank,job_id}         time from a step's first bucket to its last sum
    xagg_client_last_step_comm_seconds{rank,job_id}     the same, last step
    xagg_client_mode{rank,job_id,mode}                  1 for the mode it is in, 0 for the other
    xagg_client_planned_out{rank,job_id}                aggregators planned out (dead ones)

plus xagg_build_info and the library's process_*/python_* (xagg/wire/metrics.py).
"""
from __future__ import annotations

import os

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xagg.torch.fallback import MODES
from xagg.wire.addresses import parse_addr
from xagg.wire.metrics import MetricsServer

COUNTERS = ("packets_sent", "retransmits", "results", "redone", "fallbacks", "retries", "recoveries")
WHO = ["rank", "job_id"]


class RankCollector:
    """The families of one rank's XaggState, read when scraped."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        s = self.state.snapshot()
        who = [str(s["rank"]), str(s["job_id"])]

        def counter(name, help_, value):
            family = CounterMetricFamily(name, help_, labels=WHO)
            family.add_metric(who, value)
            return family

        def gauge(name, help_, value):
            family = GaugeMetricFamily(name, help_, labels=WHO)
            family.add_metric(who, value)
            return family

        yield counter("xagg_client_steps", "Training steps.", s["steps"])
        buckets = CounterMetricFamily("xagg_client_buckets", "Buckets summed, by path.", labels=[*WHO, "path"])
        buckets.add_metric([*who, "xagg"], s["buckets_xagg"])
        buckets.add_metric([*who, "gloo"], s["buckets_gloo"])
        yield buckets
        yield counter("xagg_client_bytes", "Bytes summed through the aggregators.", s["bytes_xagg"])
        for k in COUNTERS:
            yield counter(f"xagg_client_{k}", f"{k.replace('_', ' ').capitalize()}.", s[k])
        yield counter("xagg_client_comm_seconds", "From a step's first bucket to its last sum.", s["seconds_comm"])
        yield gauge("xagg_client_last_step_comm_seconds", "The last step's communication time.",
                    s["last_step_comm"])
        mode = GaugeMetricFamily("xagg_client_mode", "1 for the mode this rank is in, 0 for the other.",
                                 labels=[*WHO, "mode"])
        for m in MODES:
            mode.add_metric([*who, m], 1 if m == s["mode"] else 0)
        yield mode
        yield gauge("xagg_client_planned_out", "Aggregators planned out (their daemons unreachable).",
                    len(s.get("planned_out") or []))


def serve(state, address: str, rank: int) -> MetricsServer:
    """Serve ``state`` at HOST:PORT+L, L the local rank (LOCAL_RANK under
    torchrun, else ``rank``), so the ranks of one host do not collide."""
    host, port = parse_addr(address)
    local = int(os.environ.get("LOCAL_RANK", rank))
    return MetricsServer((host, port + local), RankCollector(state), name=f"xagg-metrics-r{rank}")

"""A rank's counters as Prometheus text (HookConfig.metrics, XAGG_METRICS):
what `xagg-client status` reads from the status files, for a scraper.

    xagg_client_steps_total{rank,job}                training steps
    xagg_client_buckets_total{rank,job,path}         buckets summed by xagg / gloo
    xagg_client_bytes_total{rank,job}                bytes summed through the aggregators
    xagg_client_packets_sent_total, _retransmits_total, _results_total, _redone_total
    xagg_client_fallbacks_total, _retries_total, _recoveries_total
    xagg_client_comm_seconds_total{rank,job}         time from a step's first bucket to its last sum
    xagg_client_last_step_comm_seconds{rank,job}     the same, last step
    xagg_client_mode{rank,job,mode}                  1 for the mode it is in (xagg, gloo)
    xagg_client_planned_out{rank,job}                aggregators planned out (dead ones)
"""
from __future__ import annotations

import os

from xagg.wire.addresses import parse_addr
from xagg.wire.metrics import Exposition, MetricsServer

COUNTERS = ("packets_sent", "retransmits", "results", "redone", "fallbacks", "retries", "recoveries")


def render(state) -> str:
    s = state.snapshot()
    who = {"rank": s["rank"], "job": s["job_id"]}
    ex = Exposition()
    ex.metric("xagg_client_steps_total", "counter", "Training steps.", [(who, s["steps"])])
    ex.metric("xagg_client_buckets_total", "counter", "Buckets summed, by path.",
              [({**who, "path": "xagg"}, s["buckets_xagg"]), ({**who, "path": "gloo"}, s["buckets_gloo"])])
    ex.metric("xagg_client_bytes_total", "counter", "Bytes summed through the aggregators.",
              [(who, s["bytes_xagg"])])
    for k in COUNTERS:
        ex.metric(f"xagg_client_{k}_total", "counter", f"{k.replace('_', ' ').capitalize()}.", [(who, s[k])])
    ex.metric("xagg_client_comm_seconds_total", "counter", "From a step's first bucket to its last sum.",
              [(who, s["seconds_comm"])])
    ex.metric("xagg_client_last_step_comm_seconds", "gauge", "The last step's communication time.",
              [(who, s["last_step_comm"])])
    ex.metric("xagg_client_mode", "gauge", "1 for the mode this rank is in.", [({**who, "mode": s["mode"]}, 1)])
    ex.metric("xagg_client_planned_out", "gauge", "Aggregators planned out (their daemons unreachable).",
              [(who, len(s.get("planned_out") or []))])
    return ex.text()


def serve(state, address: str, rank: int) -> MetricsServer:
    """Start serving ``state`` at HOST:PORT+L, L the local rank (LOCAL_RANK
    under torchrun, else ``rank``), so the ranks of one host do not collide."""
    host, port = parse_addr(address)
    local = int(os.environ.get("LOCAL_RANK", rank))
    server = MetricsServer((host, port + local), lambda: render(state), name=f"xagg-metrics-r{rank}")
    server.serve_in_thread()
    return server

"""Prometheus text exposition of a running daemon (``--metrics HOST:PORT``,
off by default): GET /metrics answers what ``xaggd stats`` and ``status``
read, rendered at scrape time. Read-only and without secrets (no cookies, no
tokens), so it asks for no credential: bind it where your scraper lives.

    xagg_packets_total{verdict}            every verdict counter of the data plane
    xagg_job_<stat>_total{job}             aggregated, completed, retransmits, dropped
    xagg_slots_used / xagg_slots_total     chunk slots held by jobs / in the pool
    xagg_jobs                              jobs registered
    xagg_dataplane_info{backend,mode}      1; mode: xdp, xdpgeneric, userspace, ...
    xagg_healthy                           0 while the data plane has a problem
"""
from __future__ import annotations

from xagg.wire import metrics as exposition

JOB_STATS = ("aggregated", "completed", "retransmits", "dropped")


def render(daemon) -> str:
    """The exposition text for ``daemon`` (a Server)."""
    ex = exposition.Exposition()
    metric = ex.metric
    counters = daemon.backend.counters()
    metric("xagg_packets_total", "counter", "Packets on the xagg port by verdict.",
           [({"verdict": v}, n) for v, n in counters.items()])
    stats = daemon.jobs.stats()
    for k in JOB_STATS:
        metric(f"xagg_job_{k}_total", "counter", f"Per job: {k} (since it was last registered or reset).",
               [({"job": j}, s.get(k, 0)) for j, s in stats.items()])
    mem = daemon.jobs.memory()
    metric("xagg_slots_used", "gauge", "Chunk slots held by jobs.", [({}, mem["used_slots"])])
    metric("xagg_slots_total", "gauge", "Chunk slots in the pool.", [({}, mem["max_slots"])])
    metric("xagg_jobs", "gauge", "Jobs registered.", [({}, mem["jobs"])])
    d = daemon.backend.describe()
    metric("xagg_dataplane_info", "gauge", "The data plane and its attach mode.",
           [({"backend": d["backend"], "mode": d.get("mode") or "detached"}, 1)])
    metric("xagg_healthy", "gauge", "1 unless the data plane has a problem (see xaggd status).",
           [({}, 0 if daemon.health_message else 1)])
    return ex.text()


class MetricsServer(exposition.MetricsServer):
    """The daemon's: renders ``daemon`` at every scrape."""

    def __init__(self, addr: tuple[str, int], daemon):
        super().__init__(addr, lambda: render(daemon), name="xaggd-metrics")

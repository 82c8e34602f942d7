"""What a running daemon tells a Prometheus scraper (``--metrics HOST:PORT``,
off by default): what ``xaggd stats`` and ``status`` read, collected at
scrape time. Read-only and without secrets (no cookies, no tokens), so it
asks for no credential: bind it where your scraper lives.

    xagg_packets_total{verdict}                   every verdict counter of the data plane
    xagg_job_<stat>_total{job_id}                 aggregated, completed, retransmits, dropped
    xagg_slots_used / xagg_slots_capacity         chunk slots held by jobs / in the pool
    xagg_jobs                                     jobs registered
    xagg_dataplane_info{backend}                  1: xdp or userspace
    xagg_dataplane_mode{mode}                     1 for the attach mode it is in, 0 for the others
    xagg_healthy                                  0 while the data plane has a problem

plus xagg_build_info and the library's process_*/python_* (xagg/wire/metrics.py).
Per-job labels say ``job_id``: Prometheus puts its own ``job`` on every series.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from xagg.wire import metrics
from xaggd.dataplane.attach import MODE_FLAGS

JOB_STATS = ("aggregated", "completed", "retransmits", "dropped")
# every state xagg_dataplane_mode shows: XDP's attach modes, the userspace
# aggregator, and an XDP data plane not attached (yet, or any more)
DATAPLANE_MODES = (*MODE_FLAGS, "userspace", "detached")


class DaemonCollector:
    """The families of ``daemon`` (a Server), read when scraped."""

    def __init__(self, daemon):
        self.daemon = daemon

    def describe(self):
        return []                   # the families depend on the jobs of the moment

    def collect(self):
        daemon = self.daemon
        packets = CounterMetricFamily("xagg_packets", "Packets on the xagg port by verdict.", labels=["verdict"])
        for verdict, n in daemon.backend.counters().items():
            packets.add_metric([verdict], n)
        yield packets
        stats = daemon.jobs.stats()
        for k in JOB_STATS:
            family = CounterMetricFamily(f"xagg_job_{k}", f"Per job: {k} (since it was last registered or reset).",
                                         labels=["job_id"])
            for job_id, s in stats.items():
                family.add_metric([str(job_id)], s.get(k, 0))
            yield family
        mem = daemon.jobs.memory()
        yield GaugeMetricFamily("xagg_slots_used", "Chunk slots held by jobs.", value=mem["used_slots"])
        yield GaugeMetricFamily("xagg_slots_capacity", "Chunk slots in the pool.", value=mem["max_slots"])
        yield GaugeMetricFamily("xagg_jobs", "Jobs registered.", value=mem["jobs"])
        d = daemon.backend.describe()
        yield InfoMetricFamily("xagg_dataplane", "The data plane.", value={"backend": d["backend"]})
        mode = GaugeMetricFamily("xagg_dataplane_mode", "1 for the data plane's attach mode, 0 for the others.",
                                 labels=["mode"])
        now = d.get("mode") or "detached"
        for m in DATAPLANE_MODES:
            mode.add_metric([m], 1 if m == now else 0)
        yield mode
        yield GaugeMetricFamily("xagg_healthy", "1 unless the data plane has a problem (see xaggd status).",
                                value=0 if daemon.health_message else 1)


class MetricsServer(metrics.MetricsServer):
    """The daemon's endpoint, serving from its own thread once built."""

    def __init__(self, addr: tuple[str, int], daemon):
        super().__init__(addr, DaemonCollector(daemon), name="xaggd-metrics")

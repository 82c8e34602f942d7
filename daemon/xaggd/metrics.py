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

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("xaggd.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_STATS = ("aggregated", "completed", "retransmits", "dropped")


def _label(value) -> str:
    """A label value, escaped as the text format wants."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(daemon) -> str:
    """The exposition text for ``daemon`` (a Server)."""
    out = []

    def metric(name, kind, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

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
    return "\n".join(out) + "\n"


class _Handler(BaseHTTPRequestHandler):
    daemon_ref = None             # set per server class

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = render(self.daemon_ref).encode()
        except Exception as e:  # noqa: BLE001 - a scrape must never take the daemon down
            log.warning("rendering metrics: %s", e)
            self.send_error(500, "metrics unavailable; see the daemon's log")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):       # scrapes are not worth a log line each
        pass


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], daemon):
        handler = type("Handler", (_Handler,), {"daemon_ref": daemon})
        super().__init__(addr, handler)
        self.thread = None

    @property
    def bound(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def serve_in_thread(self) -> None:
        self.thread = threading.Thread(target=self.serve_forever, name="xaggd-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()

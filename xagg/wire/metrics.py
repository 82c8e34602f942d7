"""Prometheus text exposition (format 0.0.4) and the small HTTP server that
serves it: GET /metrics renders at scrape time. What xaggd (``--metrics``)
and each xagg-client rank (``XAGG_METRICS``) answer a scraper with."""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger("xagg.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value) -> str:
    """A label value, escaped as the text format wants."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    """The lines of one scrape: ``metric()`` per family, then ``text()``."""

    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        """A family: ``samples`` are (labels dict, value) pairs."""
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    render = None                 # set per server: () -> str

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = type(self).render().encode()
        except Exception as e:  # noqa: BLE001 - a scrape must never take its host process down
            log.warning("rendering metrics: %s", e)
            self.send_error(500, "metrics unavailable; see the log")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):       # scrapes are not worth a log line each
        pass


class MetricsServer(ThreadingHTTPServer):
    """Serves ``render()`` at http://ADDR/metrics from a daemon thread."""
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], render: Callable[[], str], name: str = "xagg-metrics"):
        handler = type("Handler", (_Handler,), {"render": staticmethod(render)})
        super().__init__(addr, handler)
        self.name, self.thread = name, None

    @property
    def bound(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def serve_in_thread(self) -> None:
        self.thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()

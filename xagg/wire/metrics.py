"""The Prometheus endpoint that xaggd (``--metrics``) and each xagg-client
rank (``XAGG_METRICS``) answer a scraper from, served by prometheus_client.

Each endpoint has a registry of its own, so that several in one process
(tests, a lab) do not clash: the library's process, platform and GC
collectors, ``xagg_build_info{version}``, and the caller's collector, which
reads its host's counters at scrape time (the counters live in the data
plane or the hook; copying them into library objects would only lag)."""
from __future__ import annotations

import threading
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import InfoMetricFamily


def package_version() -> str:
    try:
        return metadata.version("xagg")
    except metadata.PackageNotFoundError:     # run from a checkout that was never installed
        return "unknown"


class BuildInfo:
    """``xagg_build_info{version}`` 1: which release a scraped process runs."""

    def describe(self):
        return self.collect()

    def collect(self):
        yield InfoMetricFamily("xagg_build", "The xagg release this process runs.",
                               value={"version": package_version()})


def registry_for(collector) -> CollectorRegistry:
    """A registry holding ``collector`` and what every endpoint serves."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(BuildInfo())
    registry.register(collector)
    return registry


class MetricsServer:
    """Serves ``collector`` (an object with ``collect()`` yielding metric
    families; ``describe()`` returning [] keeps the registry from collecting
    at registration) at http://ADDR/metrics, from a daemon thread started
    here. Binding errors (OSError) are raised here, for the caller to word."""

    def __init__(self, addr: tuple[str, int], collector, name: str = "xagg-metrics"):
        self.registry = registry_for(collector)
        self.httpd, self.thread = start_http_server(addr[1], addr=addr[0], registry=self.registry)
        self.thread.name = name

    @property
    def bound(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)

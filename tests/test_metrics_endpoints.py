"""The Prometheus endpoints as a scraper sees them: a rank's (XAGG_METRICS)
and the daemon's (--metrics), fetched over loopback with a real HTTP client
and read by prometheus_client's own parser. Per-job series say ``job_id``
(Prometheus owns ``job``), no gauge is named like a counter, every mode
state is a series, and the library's process metrics and the build's
version come along."""
from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from xagg.wire.control import ControlClient
from xagg.wire.metrics import package_version

pytest.importorskip("torch")


def scrape(bound: str) -> dict:
    """{family name: family} of http://BOUND/metrics."""
    with urllib.request.urlopen(f"http://{bound}/metrics", timeout=10) as r:
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def samples_of(families: dict) -> list:
    return [s for f in families.values() for s in f.samples]


def check_conventions(families: dict) -> None:
    for name, f in families.items():
        assert not (f.type == "gauge" and name.endswith("_total")), f"gauge {name} is named like a counter"
        for s in f.samples:
            assert "job" not in s.labels, f"{s.name} uses Prometheus's own label 'job'"
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["python_info"].samples
    build = families["xagg_build_info"].samples     # an info family: in text format, a gauge of 1
    assert [(b.labels, b.value) for b in build] == [({"version": package_version()}, 1)]


class FakeState:
    """What the hook's XaggState.snapshot() gives, for a rank in back-off."""

    def snapshot(self):
        return dict(rank=3, job_id=41, steps=7, buckets_xagg=5, buckets_gloo=2, bytes_xagg=4096,
                    packets_sent=11, retransmits=1, results=10, redone=0, fallbacks=1, retries=0,
                    recoveries=0, seconds_comm=0.5, last_step_comm=0.25, mode="gloo", planned_out=["a1"])


def test_a_ranks_endpoint_parses_with_every_mode_and_job_id(monkeypatch):
    from xagg.torch.fallback import MODES
    from xagg.torch.metrics import serve
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    server = serve(FakeState(), "127.0.0.1:0", rank=0)
    try:
        families = scrape(server.bound)
    finally:
        server.close()
    check_conventions(families)
    got = {(s.name, s.labels.get("path") or s.labels.get("mode")): s.value for s in samples_of(families)
           if s.labels.get("rank") == "3" and s.labels.get("job_id") == "41"}
    assert got[("xagg_client_steps_total", None)] == 7
    assert got[("xagg_client_buckets_total", "xagg")] == 5 and got[("xagg_client_buckets_total", "gloo")] == 2
    assert got[("xagg_client_fallbacks_total", None)] == 1
    assert got[("xagg_client_last_step_comm_seconds", None)] == 0.25
    assert got[("xagg_client_planned_out", None)] == 1
    assert {m: got[("xagg_client_mode", m)] for m in MODES} == {m: int(m == "gloo") for m in MODES}
    assert families["xagg_client_steps"].type == "counter"


def test_the_daemons_endpoint_parses_with_every_verdict_and_mode(tmp_path):
    from xagg.wire.proto import VERDICTS
    from xaggd.metrics import DATAPLANE_MODES
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "xaggd.cli", "start", "--userspace", "--bind", "127.0.0.1",
                          "--port", "0", "--memory", "1M", "--name", "mx", "--run-dir", str(run),
                          "--metrics", "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ControlClient(str(run / "mx.sock")) as c:
            c.wait_ready(timeout=60)
            c.register(62, cookie=3, max_elements=512, n_workers=2)
            families = scrape(c.status()["metrics"])
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    check_conventions(families)
    verdicts = {s.labels["verdict"] for s in families["xagg_packets"].samples}
    assert verdicts == set(VERDICTS)
    modes = {s.labels["mode"]: s.value for s in families["xagg_dataplane_mode"].samples}
    assert modes == {m: int(m == "userspace") for m in DATAPLANE_MODES}
    jobs = {s.labels["job_id"] for s in families["xagg_job_completed"].samples}
    assert jobs == {"62"}

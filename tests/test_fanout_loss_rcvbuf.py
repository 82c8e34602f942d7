"""Results in flight fit the worker's receive buffer (xagg/client/udp.py):
every aggregator's window of results can arrive at once, and what the
socket has no room for is lost and comes back only as a resend."""
from __future__ import annotations

import logging
import socket

from xagg.client import udp
from xagg.client.config import ClientConfig
from xagg.wire.proto import max_vals, packet_dtype

VALS = max_vals(1500)


def _cfg(n_aggs: int) -> ClientConfig:
    return ClientConfig(job_id=1, cookie=1, worker_id=0, n_workers=4, aggregators=["127.0.0.1"] * n_aggs,
                        vals=VALS)


def _holds(sock, cfg) -> int:
    """Results per aggregator the socket's receive buffer takes."""
    rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return rcvbuf // (len(cfg.aggregators) * udp.result_truesize(packet_dtype(cfg.vals).itemsize))


def test_the_default_window_fits_the_buffer_at_mtu_1500():
    """Four aggregators' default windows at once, as the client runs in the lab."""
    cfg = _cfg(4)
    window = cfg.window
    with udp.open_socket(cfg) as sock:
        assert cfg.window == window                 # nothing cut
        assert _holds(sock, cfg) >= cfg.window


def test_a_buffer_short_of_the_window_cuts_the_window(monkeypatch, caplog):
    """A buffer that stops short (unprivileged, at rmem_max) takes a window
    it holds, and the log says so."""
    monkeypatch.setattr(udp, "RCVBUF", 256 << 10)
    cfg = _cfg(1)
    window = cfg.window
    with caplog.at_level(logging.WARNING, logger="xagg.client"), udp.open_socket(cfg) as sock:
        assert udp.MIN_WINDOW <= cfg.window < window
        assert cfg.window == _holds(sock, cfg)
    assert "window cut" in caplog.text

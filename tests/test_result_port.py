"""The broadcast result port belongs to the worker that bound it (issue 13,
minor): with SO_REUSEADDR another local user's socket could bind the same
UDP port and read (or race for) every result."""
from __future__ import annotations

import errno
import socket

import pytest

from xagg.client import Client, ClientConfig


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_other_socket_can_co_bind_the_result_port():
    port = free_udp_port()
    c = Client(ClientConfig(job_id=1, cookie=2, worker_id=0, n_workers=2, aggregators=["127.0.0.1:9"],
                            fanout="bcast", result_port=port, bind_ip="127.0.0.1", fast=False))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as thief:
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as e:
                thief.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
    finally:
        c.close()

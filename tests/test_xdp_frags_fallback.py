"""A kernel without multi-buffer XDP: on an MTU-9000 interface xaggd builds
the multi-buffer program (loaded with BPF_F_XDP_HAS_FRAGS), and where the
kernel refuses that flag it logs a warning and loads the linear build,
which still sums jumbo frames (where the driver takes no linear program at
that MTU, in generic mode, which linearises the skb).

This kernel has multi-buffer XDP, so the refusal is simulated where the
kernel gives it: the BPF_PROG_LOAD call with BPF_F_XDP_HAS_FRAGS fails with
EINVAL, as on a kernel before 5.18. Everything else is real: the backend
compiles, loads and attaches to a veth at MTU 9000 in a namespace this
module creates, and jumbo frames sent from the peer namespace are summed.

    netns fbPIDa: fb0 10.96.0.1 (xaggd's backend)  <-- veth, MTU 9000 -->  netns fbPIDb: fb1 10.96.0.2
"""
from __future__ import annotations

import errno
import logging
import os
import socket

import numpy as np
import pytest
from pyroute2 import netns
from veth_pair import sh, veth_pair

import xaggd.dataplane.program as program
from xagg.lab.xdp_pass import attach_pass
from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C, make_packets, max_vals
from xagg.wire.syscalls import BPF_F_XDP_HAS_FRAGS
from xaggd.backends import XdpBackend
from xaggd.config import Config
from xaggd.dataplane.attach import xdp_program
from xaggd.dataplane.frames import split_frame, udp_frame

MTU = 9000
VALS = max_vals(MTU)
TAG = f"fb{os.getpid() % 100000}"
NS_A, NS_B, IF_A, IF_B = f"{TAG}a", f"{TAG}b", "fb0", "fb1"
IP_A, IP_B = "10.96.0.1", "10.96.0.2"
ETH_P_ALL, PACKET_OUTGOING = 0x0003, 4
RESULT_PORT = 9321


@pytest.fixture(scope="module")
def jumbo_link():
    with veth_pair((NS_A, IF_A, IP_A), (NS_B, IF_B, IP_B)):
        for ns, ifname in ((NS_A, IF_A), (NS_B, IF_B)):
            sh("ip", "-n", ns, "link", "set", ifname, "mtu", str(MTU))
        attach_pass(IF_B, NS_B)             # a veth takes its peer's XDP_TX frames only with XDP on
        yield


@pytest.fixture
def backend(jumbo_link, tmp_path):
    cfg = Config(name=TAG, iface=IF_A, netns=NS_A, vals=VALS, max_slots=64, max_jobs=2, run_dir=str(tmp_path))
    b = XdpBackend(cfg)
    yield b
    b.close()


@pytest.fixture
def no_multi_buffer(monkeypatch):
    """The kernel's answer to BPF_F_XDP_HAS_FRAGS before Linux 5.18; every
    other load goes through. Returns the flags of each load refused."""
    refused, real = [], program.prog_load

    def prog_load(*args, prog_flags=0, **kw):
        if prog_flags & BPF_F_XDP_HAS_FRAGS:
            refused.append(prog_flags)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(*args, prog_flags=prog_flags, **kw)

    monkeypatch.setattr(program, "prog_load", prog_load)
    return refused


def mac_of(ns, ifname):
    return sh("ip", "-n", ns, "-o", "link", "show", ifname).split("link/ether ")[1].split()[0]


def sum_two_jumbo_frames(b: XdpBackend) -> np.ndarray:
    """Two workers on the peer each send a full jumbo packet of one chunk;
    the values of the result that comes back to the peer."""
    spec = JobSpec(job_id=950, cookie=0xFAB, n_workers=2, n_chunks=1, fanout="bcast", bcast_ip=IP_B,
                   result_port=RESULT_PORT, worker_ips=[IP_B, IP_B])
    b.set_job(spec, slot_base=0, job_index=0)
    netns.pushns(NS_B)
    try:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    finally:
        netns.popns()
    sock.bind((IF_B, 0))
    sock.settimeout(5)
    try:
        for w in range(2):
            vals = np.arange(VALS, dtype=np.int32)[None] * (w + 1)
            payload = make_packets(job_id=spec.job_id, cookie=spec.cookie, worker_id=w, round_=0,
                                   chunks=np.array([0]), values=vals).tobytes()
            frame = udp_frame(payload, src_ip=IP_B, dst_ip=IP_A, sport=40000 + w,
                              src_mac=mac_of(NS_B, IF_B), dst_mac=mac_of(NS_A, IF_A))
            assert len(frame) > 4096 and len(frame) - 14 <= MTU      # a jumbo frame, past one page
            sock.send(frame)
        while True:                         # socket.timeout: no result came back
            frame, addr = sock.recvfrom(65536)
            if addr[2] == PACKET_OUTGOING or frame[12:14] != b"\x08\x00":
                continue
            f = split_frame(frame)
            if f["sport"] == C.XAGG_PORT and f["dport"] == RESULT_PORT:
                return np.frombuffer(f["payload"][40:], "<i4")
    finally:
        sock.close()


def test_the_multi_buffer_build_where_the_kernel_has_it(backend):
    """Without the refusal the same interface gets the multi-buffer build:
    the fallback below is not the default path."""
    backend.start()
    assert backend.describe()["frames"] == "multi-buffer" and backend.prog.config.multi_buffer
    np.testing.assert_array_equal(sum_two_jumbo_frames(backend), 3 * np.arange(VALS))


def test_a_kernel_without_multi_buffer_gets_the_linear_build_and_a_warning(backend, no_multi_buffer, caplog):
    with caplog.at_level(logging.WARNING, logger="xaggd"):
        backend.start()
    assert no_multi_buffer == [BPF_F_XDP_HAS_FRAGS]         # the multi-buffer build was tried first
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("multi-buffer XDP unavailable, falling back to linear frames" in m and "5.18" in m
               for m in warnings), warnings
    d = backend.describe()
    assert d["frames"] == "linear" and not backend.prog.config.multi_buffer
    assert d["attached"] and xdp_program(IF_A, NS_A)["id"] == d["prog_id"]     # the linear build runs
    # and it sums the MTU's jumbo packets
    before = backend.counters()["completed"]
    np.testing.assert_array_equal(sum_two_jumbo_frames(backend), 3 * np.arange(VALS))
    assert backend.counters()["completed"] == before + 1

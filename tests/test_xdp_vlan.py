"""Unicast fan-out behind a VLAN tag (issue 13, item 6): the XDP program and
its tc fan-out attached to a veth in a network namespace this module
creates (and deletes); the workers' tagged frames come from a packet
socket in the peer namespace, and their results are read there.

    netns xvPIDa: xv0 10.97.0.1 (XDP + tc)  <-- veth -->  netns xvPIDb: xv1 10.97.0.2 (packet socket)

XDP sees the frame as it came off the wire, tag included. tc sees it after
the stack pulled the tag out into the skb (always, before ingress), so each
program has to find the IP header in its own view of the frame. (This
kernel has no 8021q module for VLAN sub-interfaces: the tag is written into
the frames by hand, as a sender with tx VLAN offload off does.)
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from pyroute2 import netns
from veth_pair import sh, veth_pair

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C, make_packets
from xaggd.dataplane.frames import split_frame, udp_frame

TAG = f"xv{os.getpid() % 100000}"
NS_A, NS_B = f"{TAG}a", f"{TAG}b"
IF_A, IF_B, VID = "xv0", "xv1", 10
IP_A, IP_B = "10.97.0.1", "10.97.0.2"
ETH_P_ALL, PACKET_OUTGOING = 0x0003, 4


def mac_of(ns, ifname):
    return sh("ip", "-n", ns, "-o", "link", "show", ifname).split("link/ether ")[1].split()[0]


@pytest.fixture(scope="module")
def veth():
    with veth_pair((NS_A, IF_A, IP_A), (NS_B, IF_B, IP_B)):
        yield mac_of(NS_A, IF_A), mac_of(NS_B, IF_B)


def packet_socket(ns, ifname):
    netns.pushns(ns)
    try:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((ifname, 0))
        s.settimeout(3)
        return s
    finally:
        netns.popns()


def results(sock, n):
    """The next n xagg results arriving (tags, if any, already pulled out)."""
    out = []
    try:
        while len(out) < n:
            frame, addr = sock.recvfrom(65536)
            if addr[2] == PACKET_OUTGOING:
                continue
            etype = frame[16:18] if frame[12:14] == b"\x81\x00" else frame[12:14]
            if etype != b"\x08\x00":
                continue                    # ARP, IPv6 neighbour discovery
            f = split_frame(frame)
            if f["sport"] == C.XAGG_PORT:
                out.append(f)
    except socket.timeout:
        pass
    return out


@pytest.mark.parametrize("vlan", [None, VID])
def test_unicast_results_reach_workers_behind_a_vlan_tag(xdp_program, veth, vlan):
    """Two workers on the link each get the right sum back on their own port."""
    mac_a, mac_b = veth
    job = JobSpec(job_id=300 + bool(vlan), cookie=0xBEEF, n_workers=2, n_chunks=2, fanout="unicast",
                  worker_ips=[IP_B, IP_B])
    xdp_program.set_job(job, slot_base=0, job_index=0)
    before = xdp_program.counters()
    sock = packet_socket(NS_B, IF_B)
    try:
        with xdp_program.attached(IF_A, netns=NS_A, mode="auto"):
            for w in range(2):
                vals = np.full((1, C.XAGG_VALS), 10 * (w + 1), np.int32)
                payload = make_packets(job_id=job.job_id, cookie=job.cookie, worker_id=w, round_=0,
                                       chunks=np.array([0]), values=vals).tobytes()
                sock.send(udp_frame(payload, src_ip=IP_B, dst_ip=IP_A, sport=40000 + w,
                                    src_mac=mac_b, dst_mac=mac_a, vlan=vlan))
            got = results(sock, 2)
    finally:
        sock.close()
    c = {k: v - before[k] for k, v in xdp_program.counters().items() if v != before[k]}
    assert c.get("completed") == 1 and "malformed" not in c, c
    assert sorted(f["dport"] for f in got) == [40000, 40001], got
    for f in got:
        assert f["dst_ip"] == IP_B and f["src_ip"] == IP_A and f["ip_csum_ok"]
        assert f["dst_mac"] == bytes.fromhex(mac_b.replace(":", ""))
        assert (np.frombuffer(f["payload"][40:], "<i4") == 30).all()

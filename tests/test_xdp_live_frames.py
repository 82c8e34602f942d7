"""What issue 14's "aggregators on worker hosts" would stand on: the kernel's
BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES (docs/planner.md, worker
hosts as aggregators). A host's own contribution can be run through its XDP
program without passing loopback: a frame injected this way that the
program answers with XDP_TX leaves through the given ingress interface (so a
completion's result reaches the wire), and one it passes reaches the
host's sockets. Without the flag nothing leaves. Real veths in a private
network namespace, raw BPF programs."""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import time

import pytest

from xagg.wire import syscalls as S

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, BPF)")

BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
NS = f"i14live{os.getpid() % 10000}"


class XdpMd(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint32) for f in
                ("data", "data_end", "data_meta", "ingress_ifindex", "rx_queue_index", "egress_ifindex")]


def returns(action: int) -> int:
    """An XDP program that only returns ``action`` (mov r0, action; exit)."""
    insns = struct.pack("<BBhi", 0xB7, 0, 0, action) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    return S.prog_load(S.BPF_PROG_TYPE_XDP, insns, f"ret{action}")


def run_live(prog_fd: int, frame: bytes, ifindex: int, repeat: int = 1) -> None:
    buf = ctypes.create_string_buffer(frame, len(frame))
    ctx = XdpMd(0, len(frame), 0, ifindex, 0, 0)
    attr = S._TestRunAttr(prog_fd=prog_fd, data_size_in=len(frame), data_in=ctypes.addressof(buf),
                          repeat=repeat, ctx_size_in=ctypes.sizeof(ctx), ctx_in=ctypes.addressof(ctx),
                          flags=BPF_F_TEST_XDP_LIVE_FRAMES)
    S.bpf(S.BPF_PROG_TEST_RUN, attr, "BPF_PROG_TEST_RUN (live frames)")


def udp_frame(dst_mac: bytes, src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    c = sum(struct.unpack("!10H", ip))
    c = (c & 0xFFFF) + (c >> 16)
    ip = ip[:10] + struct.pack("!H", ~(c + (c >> 16)) & 0xFFFF) + ip[12:]
    return dst_mac + b"\x02\x00\x00\x00\x00\x02" + b"\x08\x00" + ip + udp


@pytest.fixture
def netns():
    """This thread in a fresh namespace with veth va <-> vb (vb: an XDP_PASS
    program, so veth delivers XDP frames to it); back to ours afterwards."""
    from pyroute2 import IPRoute
    subprocess.run(["ip", "netns", "add", NS], check=True)
    # no IPv6: its router solicitations and MLD reports leave va on their own
    # and would be counted as frames the program sent
    subprocess.run(["ip", "netns", "exec", NS, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1"], check=True)
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{NS}", os.O_RDONLY)
    fds = []
    try:
        assert libc.setns(there, 0x40000000) == 0       # CLONE_NEWNET
        ipr = IPRoute()
        ipr.link("add", ifname="va", kind="veth", peer="vb")
        va, vb = ipr.link_lookup(ifname="va")[0], ipr.link_lookup(ifname="vb")[0]
        ipr.addr("add", index=va, address="10.99.0.1", prefixlen=24)
        for i in (va, vb):
            ipr.link("set", index=i, state="up")
        fds.append(returns(S.XDP_PASS))
        ipr.link("set", index=vb, xdp_fd=fds[0])
        yield ipr, va, vb
        ipr.close()
    finally:
        libc.setns(home, 0x40000000)
        for fd in fds + [home, there]:
            os.close(fd)
        subprocess.run(["ip", "netns", "del", NS], check=True)


def packets(ipr, index: int, what: str) -> int:
    return ipr.link("get", index=index)[0].get_attr("IFLA_STATS64")[what]


def wait_for(pred, timeout=2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_live_frames_xdp_tx_leaves_through_the_ingress_interface(netns):
    ipr, va, vb = netns
    tx = returns(S.XDP_TX)
    try:
        frame = b"\xff" * 6 + b"\x02\x00\x00\x00\x00\x01" + b"\x88\xb5" + bytes(100)   # local-experimental type
        sent0, got0 = packets(ipr, va, "tx_packets"), packets(ipr, vb, "rx_packets")
        run_live(tx, frame, va, repeat=5)
        assert wait_for(lambda: packets(ipr, vb, "rx_packets") - got0 >= 5)
        assert packets(ipr, va, "tx_packets") - sent0 >= 5
        # the same frames, test run without live frames: the verdict comes back, no frame leaves
        out = ctypes.create_string_buffer(4096)
        buf = ctypes.create_string_buffer(frame, len(frame))
        sent1 = packets(ipr, va, "tx_packets")
        attr = S._TestRunAttr(prog_fd=tx, data_size_in=len(frame), data_in=ctypes.addressof(buf), repeat=5,
                              data_size_out=4096, data_out=ctypes.addressof(out))
        S.bpf(S.BPF_PROG_TEST_RUN, attr, "BPF_PROG_TEST_RUN")
        assert attr.retval == S.XDP_TX
        time.sleep(0.1)
        assert packets(ipr, va, "tx_packets") == sent1
    finally:
        os.close(tx)


def test_a_live_frames_xdp_pass_reaches_the_hosts_socket(netns):
    ipr, va, _ = netns
    mac = bytes.fromhex(ipr.link("get", index=va)[0].get_attr("IFLA_ADDRESS").replace(":", ""))
    pas = returns(S.XDP_PASS)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("10.99.0.1", 5555))
        s.settimeout(2)
        run_live(pas, udp_frame(mac, "10.99.0.2", "10.99.0.1", 4444, 5555, b"own contribution"), va)
        assert s.recvfrom(100) == (b"own contribution", ("10.99.0.2", 4444))
    finally:
        s.close()
        os.close(pas)

"""Build and read Ethernet/IPv4/UDP frames around xagg payloads.

For BPF_PROG_TEST_RUN tests and the packet fuzzer; real traffic goes
through ordinary UDP sockets.
"""
from __future__ import annotations

import socket
import struct

ETH_P_IP = 0x0800
ETH_P_8021Q = 0x8100


def ipv4_checksum(hdr: bytes) -> int:
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def udp_frame(payload: bytes, *, src_ip="10.77.0.1", dst_ip="10.77.0.101",
              sport=40000, dport=9977, src_mac="02:00:00:00:00:01",
              dst_mac="02:00:00:00:01:01", vlan: int | None = None,
              udp_len: int | None = None, ihl: int = 5, frag_off: int = 0,
              proto: int = socket.IPPROTO_UDP) -> bytes:
    """An Ethernet frame carrying one UDP datagram; knobs to break it."""
    udp = struct.pack("!HHHH", sport, dport, udp_len if udp_len is not None else 8 + len(payload), 0)
    opts = b"\x01" * (4 * (ihl - 5))     # NOP options when ihl > 5
    total = 20 + len(opts) + len(udp) + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", (4 << 4) | ihl, 0, total, 0, frag_off, 64, proto, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip)) + opts
    ip = ip[:10] + struct.pack("!H", ipv4_checksum(ip[:20])) + ip[12:]
    eth = mac_bytes(dst_mac) + mac_bytes(src_mac)
    if vlan is not None:
        eth += struct.pack("!HH", ETH_P_8021Q, vlan)
    eth += struct.pack("!H", ETH_P_IP)
    return eth + ip + udp + payload


def split_frame(frame: bytes) -> dict:
    """Parse a frame the program emitted: addresses, ports and UDP payload."""
    off = 12
    (etype,) = struct.unpack_from("!H", frame, off)
    vlan = None
    if etype == ETH_P_8021Q:
        vlan = struct.unpack_from("!H", frame, off + 2)[0]
        off += 4
        (etype,) = struct.unpack_from("!H", frame, off)
    off += 2
    ihl = (frame[off] & 0xF) * 4
    ip = frame[off:off + ihl]
    sport, dport, ulen, ucsum = struct.unpack_from("!HHHH", frame, off + ihl)
    return {
        "dst_mac": frame[0:6], "src_mac": frame[6:12], "vlan": vlan,
        "src_ip": socket.inet_ntoa(ip[12:16]), "dst_ip": socket.inet_ntoa(ip[16:20]),
        "ip_csum_ok": ipv4_checksum(ip[:20]) == 0,     # a correct header sums to 0xffff
        "sport": sport, "dport": dport, "udp_len": ulen, "udp_csum": ucsum,
        "payload": frame[off + ihl + 8: off + ihl + ulen],
    }

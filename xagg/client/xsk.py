"""What an AF_XDP client needs from its host, found before any packet flows:
the AF_XDP build of the compiled library and the worker's XDP program
(built on first use into the cache, as native.py builds the round loop),
the interface and next hop that reach the aggregators, and each
aggregator's Ethernet/IPv4/UDP header. Anything missing is an
``XskUnavailable`` whose message says why; the client then runs its UDP
path (exchange_afxdp.py)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import socket
import struct
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from xagg.client import native

SOURCES = (*native.SOURCES, native.CSRC / "xsk.c", native.CSRC / "xsk_rings.c")
HEADERS = (*native.LOCAL_HEADERS, native.CSRC / "xsk.h")
LIBS = ("-lxdp", "-lbpf")
LIB_PREFIX = "xagg-xsk-"
PROG_SRC = Path(__file__).resolve().parent / "bpf" / "xsk_redirect.c"
HDR = 42                   # Ethernet + IPv4 without options + UDP: csrc/xsk.h's XSK_HDR
XDP_HEADROOM = 256         # the kernel keeps this much of an RX frame in front of the packet
FRAME_SIZES = (2048, 4096)  # a power of two per UMEM frame; jumbo packets need multi-buffer: not here
ARP_WAIT = 1.0             # seconds for the kernel to resolve a missing next hop
DISCARD_PORT = 9           # where the resolving datagram goes: nothing of ours listens there


class XskUnavailable(Exception):
    """AF_XDP cannot run for this client; the message says why."""


@lru_cache(maxsize=None)
def _built() -> tuple:
    """(library, XDP object path) or (None, reason): built once per process."""
    cc = native.compiler()
    if cc is None:
        return None, "no C compiler"
    try:
        dll = ctypes.CDLL(str(native.build(cc, LIB_PREFIX, SOURCES, HEADERS, LIBS)))
        native.check_layout(dll)
        obj = _build_prog()
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"AF_XDP build failed (libxdp-dev, libbpf-dev and clang are needed): {str(e)[-300:]}"
    native.declare(dll)
    p, i32, i64, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32
    dll.xagg_xsk_open.argtypes = [ctypes.c_char_p, i32, u32, ctypes.c_char_p, ctypes.c_uint16, p, i64, u32, i32,
                                  ctypes.c_char_p, ctypes.c_size_t]
    dll.xagg_xsk_open.restype = p
    dll.xagg_xsk_close.argtypes = [p]
    dll.xagg_xsk_close.restype = None
    dll.xagg_xsk_info.argtypes = [p, p, i64]
    dll.xagg_xsk_info.restype = i64
    return dll, obj


def load():
    """The AF_XDP build of the library and the XDP object's path."""
    dll, obj = _built()
    if dll is None:
        raise XskUnavailable(obj)
    return dll, obj


def _build_prog() -> str:
    """bpf/xsk_redirect.c compiled with clang -target bpf into the cache."""
    multiarch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
    cmd = ["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{multiarch or 'x86_64-linux-gnu'}", "-c"]
    h = hashlib.sha256(" ".join(cmd).encode() + PROG_SRC.read_bytes()).hexdigest()[:16]
    obj = native.CACHE / f"xagg-xsk-prog-{h}.o"
    if obj.exists():
        return str(obj)
    native.CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=native.CACHE)
    os.close(fd)
    try:
        r = subprocess.run([*cmd, str(PROG_SRC), "-o", tmp], capture_output=True, text=True)
        if r.returncode:
            raise OSError(f"clang -target bpf failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, obj)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(obj)


def frame_size(pkt_size: int) -> int:
    for size in FRAME_SIZES:
        if HDR + pkt_size <= size - XDP_HEADROOM:
            return size
    raise XskUnavailable(f"{pkt_size}-byte packets do not fit one UMEM frame (AF_XDP here is single-buffer)")


def route(ip: str) -> tuple[str, str]:
    """(interface, next hop IPv4) of the kernel's route to ``ip`` (longest prefix)."""
    dst = struct.unpack("<I", socket.inet_aton(ip))[0]
    best = None
    with open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            iface, d, gw, flags, _, _, metric, mask = line.split()[:8]
            d, gw, mask, flags = int(d, 16), int(gw, 16), int(mask, 16), int(flags, 16)
            if flags & 1 and dst & mask == d and (best is None or (mask, -int(metric)) > best[0]):
                best = ((mask, -int(metric)), iface, gw if flags & 2 else dst)
    if best is None:
        raise XskUnavailable(f"no route to {ip} in this namespace's main table")
    return best[1], socket.inet_ntoa(struct.pack("<I", best[2]))


def is_local(ip: str) -> bool:
    """``ip`` is one of this host's addresses (only those can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def neighbour_mac(ip: str, iface: str) -> bytes | None:
    with open("/proc/net/arp") as f:
        for line in f.readlines()[1:]:
            f_ip, _, flags, mac, _, dev = line.split()[:6]
            if f_ip == ip and dev == iface and int(flags, 16) & 2:
                return bytes.fromhex(mac.replace(":", ""))
    return None


def resolve_mac(ip: str, iface: str, sock: socket.socket) -> bytes:
    """The next hop's MAC from the kernel's neighbour table; where it has
    none, one ordinary datagram (to the discard port) has the kernel ARP
    for it first."""
    mac = neighbour_mac(ip, iface)
    deadline = time.monotonic() + ARP_WAIT
    if mac is None:
        sock.sendto(b"", (ip, DISCARD_PORT))
    while mac is None and time.monotonic() < deadline:
        time.sleep(0.01)
        mac = neighbour_mac(ip, iface)
    if mac is None:
        raise XskUnavailable(f"next hop {ip} on {iface} did not resolve (ARP)")
    return mac


def headers(src: tuple[str, int], dsts: list, iface: str, sock: socket.socket, pkt_size: int) -> bytes:
    """Per destination (ip, port): its frame's Ethernet/IPv4/UDP header
    (DF, TTL 64, UDP checksum 0: IPv4 lets UDP go without one)."""
    own = bytes.fromhex(Path(f"/sys/class/net/{iface}/address").read_text().strip().replace(":", ""))
    out = b""
    for ip, port in dsts:
        dev, hop = route(ip)
        if dev != iface:
            raise XskUnavailable(f"aggregator {ip} is reached through {dev}, not {iface}")
        ip_hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + pkt_size, 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                             socket.inet_aton(src[0]), socket.inet_aton(ip))
        ip_hdr = ip_hdr[:10] + struct.pack("!H", _checksum(ip_hdr)) + ip_hdr[12:]
        out += (resolve_mac(hop, iface, sock) + own + struct.pack("!H", 0x0800) + ip_hdr
                + struct.pack("!HHHH", src[1], port, 8 + pkt_size, 0))
    return out


def _checksum(b: bytes) -> int:
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def rx_queues(iface: str) -> int:
    return max(1, len(list(Path(f"/sys/class/net/{iface}/queues").glob("rx-*"))))

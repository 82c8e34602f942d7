"""A worker whose own host is one of its job's aggregators.

Its packets for that aggregator's chunks cannot take the network: a datagram
to one's own address goes through loopback, where XDP never runs. So the
worker puts each through the aggregator's XDP program itself, with
BPF_PROG_TEST_RUN, as if it had arrived on the interface (``ingress_ifindex``),
and the program sums it like any other. When one completes a chunk the verdict
is XDP_TX with the result frame in the output, which the worker transmits on
the interface through an AF_PACKET socket: a test run outside live-frame mode
sends nothing, and live frames are refused for jumbo frames.

The results of that aggregator's chunks never come back to this worker (the
broadcast leaves the interface and does not return), so it reads them where
the program keeps them: a slot of this job's generation and this round that
is done holds the sum, and it stays so until this worker itself has finished
the round (the slot is reused two rounds later; see xagg_maps.h).

xaggd hands the program's and maps' file descriptors over its Unix control
socket (op ``dataplane``): root only, and only where the daemon runs the slot
lock (the worker's CPU sums beside the NIC's).

The C round loop does the same through ``Local`` (csrc/local.c); ``inject``
and ``poll`` here are its reference, used by the numpy loop.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xagg.client.config import XaggError
from xagg.wire import syscalls
from xagg.wire.proto import C, struct_dtype

RUN_DIR = os.environ.get("XAGG_RUN_DIR", "/run/xaggd")     # where xaggd's NAME.sock live
ETH_P_IP = 0x0800
FRAME_HDR_MAX = 64                                        # struct xagg_local.hdr


class LocalError(XaggError):
    """This host is the aggregator, but its data plane cannot be used from here
    (an XaggError: the caller falls back as for any aggregator's failure)."""


def is_own_address(ip: str) -> bool:
    """Whether ``ip`` is an address of this host (this network namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def netns_inode() -> int:
    """This process's network namespace, as xaggd compares it with its interface's."""
    return os.stat("/proc/self/ns/net").st_ino


def _ask(path: Path, addr: str, port: int, timeout: float = 5.0) -> tuple[dict, list[int]]:
    req = {"op": "dataplane", "addr": addr, "port": port, "netns": netns_inode()}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(req).encode() + b"\n")
        msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 8)
        while msg and not msg.endswith(b"\n"):
            more = s.recv(1 << 16)
            if not more:
                break
            msg += more
    try:
        resp = json.loads(msg)
    except ValueError:
        resp = {"ok": False, "error": f"not a JSON answer: {msg[:80]!r}"}
    if not resp.get("ok") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise LocalError(resp.get("error") or f"{len(fds)} file descriptors, not 3")
    return resp, fds


@dataclass
class LocalDataplane:
    """The aggregator on this host, as its worker uses it."""
    ip: str
    port: int
    info: dict                  # the daemon's answer: iface, ifindex, mac, vals, frames
    prog_fd: int
    slots_fd: int
    jobs_fd: int
    tx: socket.socket = field(init=False)

    def __post_init__(self):
        self.vals = int(self.info["vals"])
        self.ifindex = int(self.info["ifindex"])
        self.slot_dtype = struct_dtype("xagg_slot", "xagg_maps.h", XAGG_VALS=self.vals)
        self.job_dtype = struct_dtype("xagg_job", "xagg_maps.h")
        self.key_dtype = struct_dtype("xagg_job_key", "xagg_maps.h")
        # protocol 0: transmit only, this socket hears nothing
        self.tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        self.tx.bind((self.info["iface"], 0))

    @classmethod
    def find(cls, ip: str, port: int, run_dir: str = RUN_DIR) -> tuple["LocalDataplane | None", list[str]]:
        """Ask each xaggd under ``run_dir`` for the XDP data plane serving
        ``ip``:``port`` in this network namespace: (it, []) or (None, why
        each said no). None is right for a userspace xaggd, which hears a
        worker on its host over loopback like any other."""
        why = []
        for path in sorted(Path(run_dir).glob("*.sock")):
            try:
                info, fds = _ask(path, ip, port)
            except (OSError, LocalError) as e:
                why.append(f"{path.name}: {e}")
                continue
            return cls(ip, port, info, *fds), []
        return None, why

    def close(self) -> None:
        self.tx.close()
        for fd in (self.prog_fd, self.slots_fd, self.jobs_fd):
            os.close(fd)

    def frame_header(self, src_port: int, pkt_size: int) -> bytes:
        """Ethernet + IPv4 + UDP in front of one packet from this worker to its
        host's aggregator, as the interface would have received it."""
        mac = bytes.fromhex(self.info["mac"].replace(":", ""))
        ip = socket.inet_aton(self.ip)
        udp_len = 8 + pkt_size
        iph = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0x4000, 64, socket.IPPROTO_UDP, 0, ip, ip)
        csum = sum(struct.unpack("!10H", iph))
        csum = (csum & 0xFFFF) + (csum >> 16)
        csum = ~((csum & 0xFFFF) + (csum >> 16)) & 0xFFFF
        iph = iph[:10] + struct.pack("!H", csum) + iph[12:]
        hdr = mac + mac + struct.pack("!H", ETH_P_IP) + iph + struct.pack("!HHHH", src_port, self.port, udp_len, 0)
        assert len(hdr) <= FRAME_HDR_MAX
        return hdr

    def job_slots(self, job_id: int) -> tuple[int, int]:
        """(generation, first slot) of the job's main entry here; LocalError if none."""
        key = np.zeros(1, self.key_dtype)
        key["job_id"], key["agg_id"] = job_id, C.XAGG_AGG_MAIN
        raw = syscalls.map_lookup(self.jobs_fd, key.tobytes(), self.job_dtype.itemsize)
        if raw is None:
            raise LocalError(f"job {job_id} is not registered at the aggregator on this host "
                             f"({self.ip}:{self.port})")
        job = np.frombuffer(raw, self.job_dtype)[0]
        return int(job["gen"]), int(job["slot_base"])

    # -- the reference path (numpy loop) --------------------------------------
    def inject(self, frame: bytes) -> bool:
        """One frame through the program; what it transmits goes out here
        (then True)."""
        r = syscalls.prog_test_run(self.prog_fd, frame, out_size=len(frame) + 256, ingress_ifindex=self.ifindex)
        if r.action != syscalls.XDP_TX:
            return False
        self.transmit(r.data)
        return True

    def transmit(self, frame: bytes) -> None:
        while True:
            try:
                self.tx.send(frame)
                return
            except (BlockingIOError, InterruptedError):
                time.sleep(0.0001)
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                time.sleep(0.0001)

    def poll(self, gen: int, slot: int, rnd: int) -> np.ndarray | None:
        """Slot ``slot``'s values once it holds round ``rnd``'s finished sum, else None."""
        raw = syscalls.map_lookup(self.slots_fd, struct.pack("<I", slot), self.slot_dtype.itemsize)
        if raw is None:
            return None
        s = np.frombuffer(raw, self.slot_dtype)[0]
        if s["gen"] != gen or s["round"] != rnd or not s["done"]:
            return None
        return s["vals"].copy()

    # -- the C round loop's view ----------------------------------------------
    def c_struct(self, src_port: int, pkt_size: int) -> "Local":
        """struct xagg_local for csrc/local.c (slot_base and gen are set per round)."""
        hdr = self.frame_header(src_port, pkt_size)
        sd = self.slot_dtype
        loc = Local(prog_fd=self.prog_fd, slots_fd=self.slots_fd, tx_fd=self.tx.fileno(), ifindex=self.ifindex,
                    slot_size=sd.itemsize, off_gen=sd.fields["gen"][1], off_round=sd.fields["round"][1],
                    off_done=sd.fields["done"][1], off_vals=sd.fields["vals"][1], hdr_len=len(hdr))
        loc.hdr[:len(hdr)] = hdr
        return loc


class Local(ctypes.Structure):
    """struct xagg_local (csrc/local.c); its layout is checked on load (native.py)."""
    _fields_ = [("agg", ctypes.c_int32), ("prog_fd", ctypes.c_int32), ("slots_fd", ctypes.c_int32),
                ("tx_fd", ctypes.c_int32), ("ifindex", ctypes.c_int32), ("slot_base", ctypes.c_uint32),
                ("gen", ctypes.c_uint32), ("slot_size", ctypes.c_uint32), ("off_gen", ctypes.c_uint32),
                ("off_round", ctypes.c_uint32), ("off_done", ctypes.c_uint32), ("off_vals", ctypes.c_uint32),
                ("hdr_len", ctypes.c_uint32), ("hdr", ctypes.c_uint8 * FRAME_HDR_MAX),
                ("injected", ctypes.c_int64), ("transmitted", ctypes.c_int64), ("polls", ctypes.c_int64)]

"""The worker's UDP socket: set up for bursts of results, bound where they
come back, and a sender that batches a run of packets with UDP GSO where
the kernel has it (csrc/exchange.c sends the same way)."""
from __future__ import annotations

import errno
import logging
import select
import socket
import struct

import numpy as np

from xagg.client.config import MIN_WINDOW, ClientConfig, XaggError
from xagg.wire.fanout import Fanout
from xagg.wire.proto import packet_dtype

log = logging.getLogger("xagg.client")

UDP_SEGMENT = 103
SO_RCVBUFFORCE = 33
GSO_MAX_BYTES = 65000      # one UDP GSO send must stay under 64 KiB
GSO_MAX_SEGS = 64          # and under the kernel's segment limit
RCVBUF = 16 << 20          # results arrive in bursts
PAGE = 4096
# a modest send buffer: a shaped link then pushes back on the sender
# (EAGAIN) instead of overflowing its qdisc and losing datagrams
SNDBUF = 1 << 20


def open_socket(cfg: ClientConfig) -> socket.socket:
    """A non-blocking socket for one client's rounds. A broadcast fan-out
    sends results to the job's result port, so it is bound there; unicast
    answers whatever port the packets came from. cfg.window is cut to what
    its receive buffer holds (fit_window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        try:        # past rmem_max, as root
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        fit_window(cfg, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        port = cfg.result_port if Fanout.parse(cfg.fanout) is Fanout.BCAST else 0
        sock.bind((cfg.bind_ip, port))
        if cfg.result_group:
            _join(sock, cfg.result_group, cfg.aggregators[0])
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def result_truesize(pkt_size: int) -> int:
    """Receive buffer one result takes: the kernel charges a datagram's
    whole buffer (a page, or the power of two holding a jumbo frame and the
    skb around it), not its length."""
    return max(PAGE, 1 << (pkt_size + 1024 - 1).bit_length())


def fit_window(cfg: ClientConfig, rcvbuf: int) -> None:
    """Every aggregator's window of results can arrive at once, into one
    socket: past its receive buffer they are dropped in bursts and each
    comes back only as a resend. Unprivileged, the buffer stops at
    net.core.rmem_max; the window is cut to what it holds (MIN_WINDOW at
    the least), and the log says how to keep it."""
    holds = rcvbuf // (len(cfg.aggregators) * result_truesize(packet_dtype(cfg.vals).itemsize))
    if holds >= cfg.window:
        return
    window = max(MIN_WINDOW, holds)
    log.warning("the receive buffer (%d B) holds %d results per aggregator, the window %d: window cut "
                "to %d (raise net.core.rmem_max or give the client CAP_NET_ADMIN)",
                rcvbuf, holds, cfg.window, window)
    cfg.window = window


def _join(sock: socket.socket, group: str, aggregator: tuple) -> None:
    """Join the results' multicast group on the interface that reaches the
    first aggregator (a group has no route of its own to pick one by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(aggregator)
        local = probe.getsockname()[0]
    mreq = socket.inet_aton(group) + socket.inet_aton(local)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)


class GsoSender:
    """Sends runs of fixed-size packets to one address: GSO batches, or one
    datagram per call once the kernel has refused GSO. A full send buffer
    waits for room and retries. Counts every packet sent in ``stats``."""

    def __init__(self, sock: socket.socket, pkt_size: int, stats):
        self.sock, self.size, self.stats = sock, pkt_size, stats
        self.gso = True

    def send(self, pk: np.ndarray, addr) -> None:
        buf = memoryview(np.ascontiguousarray(pk)).cast("B")
        size = self.size
        i = 0
        while i < len(buf):
            segs = min(GSO_MAX_SEGS, GSO_MAX_BYTES // size, (len(buf) - i) // size)
            chunk = buf[i:i + segs * size]
            try:
                if self.gso and segs > 1:
                    self.sock.sendmsg([chunk], [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("H", size))], 0, addr)
                else:
                    for s in range(segs):
                        self.sock.sendto(chunk[s * size:(s + 1) * size], addr)
            except BlockingIOError:
                select.select([], [self.sock], [], 0.01)
                continue        # retry the same batch once the buffer drains
            except OSError as e:
                if e.errno in (errno.EIO, errno.EINVAL, errno.ENOPROTOOPT) and self.gso:
                    log.info("UDP GSO unavailable (%s): sending one datagram per call", e)
                    self.gso = False
                    continue
                raise XaggError(f"send to {addr} failed: {e}") from e
            self.stats.packets_sent += segs
            i += segs * size

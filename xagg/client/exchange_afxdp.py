"""The round loop of csrc/exchange.c over an AF_XDP socket (csrc/xsk.c): the
same NativeExchange, its C struct given a transport that reads results
straight from the RX ring, with the worker's XDP program
(bpf/xsk_redirect.c) steering this client's results to it, and writes
requests into UMEM frames for the TX ring where the socket is zero-copy (in
copy mode requests leave through the UDP socket with GSO, cheaper there;
XAGG_AFXDP_TX=ring or socket overrides, for tests and measurements). The
round protocol, the codec in the loop and the retransmit rules are the UDP
path's, unchanged.

One XSK per (interface, queue) and one XDP program per interface: the
first client on an interface takes its first queue that no socket holds,
and its program; a second client (another lane, another rank on the host)
finds the program there and runs the UDP path, saying so. Results that
land on another queue pass the program and reach the client's UDP socket,
which stays bound (it owns the port) and is drained with the ring.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket

from xagg.client import xsk
from xagg.client.config import ClientConfig
from xagg.client.exchange_native import NativeExchange
from xagg.client.stats import ClientStats

log = logging.getLogger("xagg.client")

INFO = ("zerocopy", "attach_mode", "kicks", "rx_frames", "rx_dropped", "rx_invalid_descs", "tx_invalid_descs",
        "rx_ring_full", "rx_fill_ring_empty_descs", "tx_ring_empty_descs", "tx_ring")
# Where requests leave: the TX ring or the UDP socket (GSO). Unset: the ring
# where the socket is zero-copy (csrc/xsk.c says why not in copy mode).
TX_ENV = "XAGG_AFXDP_TX"
TX_CHOICES = {"": -1, "socket": 0, "ring": 1}
ATTACH_MODES = {1: "native", 2: "skb", 3: "hw"}     # the kernel's XDP_ATTACHED_*


class AfxdpExchange(NativeExchange):
    def __init__(self, cfg: ClientConfig, stats: ClientStats, dll, obj: str):
        super().__init__(cfg, stats, dll)
        self._xsk = None
        try:
            self._xsk, where = self._open(obj)
        except BaseException:
            super().close()
            raise
        self._cx.transport = self._xsk
        info = self.info()
        stats.path = "afxdp"
        stats.path_reason = (f"{where}, {'zero-copy' if info['zerocopy'] else 'copy mode'}, "
                             f"XDP {ATTACH_MODES.get(info['attach_mode'], '?')}, requests from the "
                             f"{'TX ring' if info['tx_ring'] else 'UDP socket (GSO)'}")

    def _open(self, obj: str) -> tuple[int, str]:
        """The XSK on the first free queue of the interface that reaches the aggregators."""
        cfg = self.cfg
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(self.send_to[0])
            src_ip = probe.getsockname()[0]
        port = self.sock.getsockname()[1]
        if any(xsk.is_local(ip) for ip, _ in self.send_to):
            raise xsk.XskUnavailable("an aggregator on this host (its packets never cross the interface)")
        iface, _ = xsk.route(self.send_to[0][0])
        hdrs = xsk.headers((src_ip, port), self.send_to, iface, self.sock, self.pkt_size)
        frame = xsk.frame_size(self.pkt_size)
        ifindex = socket.if_nametoindex(iface)
        tx = TX_CHOICES.get(os.environ.get(TX_ENV, ""))
        if tx is None:
            raise xsk.XskUnavailable(f"{TX_ENV} must be ring or socket, got {os.environ[TX_ENV]!r}")
        err = ctypes.create_string_buffer(512)
        busy = []
        for q in range(xsk.rx_queues(iface)):
            p = self.dll.xagg_xsk_open(iface.encode(), ifindex, q, obj.encode(), socket.htons(port), hdrs,
                                       len(self.send_to), frame, tx, err, len(err))
            if p:
                return p, f"{iface} queue {q}"
            why = err.value.decode(errors="replace")
            if why.startswith(f"XSK socket: {os.strerror(errno.EBUSY)}"):
                busy.append(q)
                continue
            if why.startswith(f"XDP program: {os.strerror(errno.EBUSY)}"):
                why = f"another XDP program runs on {iface} (another AF_XDP client or rank, an aggregator)"
            raise xsk.XskUnavailable(f"{iface} queue {q}: {why}")
        raise xsk.XskUnavailable(f"every queue of {iface} ({', '.join(map(str, busy))}) has an AF_XDP "
                                 f"socket already (another client or rank)")

    def info(self) -> dict:
        out = (ctypes.c_int64 * len(INFO))()
        n = self.dll.xagg_xsk_info(self._xsk, out, len(out))
        return dict(zip(INFO, list(out)[:n]))

    def _count(self, x) -> None:
        super()._count(x)
        self.stats.extra["afxdp"] = self.info()

    def close(self) -> None:
        self._cx.transport = None
        if self._xsk:
            self.dll.xagg_xsk_close(self._xsk)
            self._xsk = None
        super().close()


def open_afxdp(cfg: ClientConfig, stats: ClientStats) -> AfxdpExchange | None:
    """The AF_XDP exchange, or None with the reason in ``stats.path_reason``
    (logged: a warning where AF_XDP was asked for by name)."""
    try:
        dll, obj = xsk.load()
        return AfxdpExchange(cfg, stats, dll, obj)
    except (xsk.XskUnavailable, OSError) as e:
        stats.path_reason = f"AF_XDP unavailable: {e}"
    (log.warning if cfg.path == "afxdp" else log.info)("%s; using the UDP path", stats.path_reason)
    return None

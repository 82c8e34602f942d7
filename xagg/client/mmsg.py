"""recvmmsg(2) from Python: a burst of datagrams in one system call.

Python's socket module has no recvmmsg. Results come back in bursts of
dozens of fixed-size datagrams per all-reduce, and one ``recv_into`` per
datagram costs a system call plus interpreter work each time. Here the
rows of a numpy structured array are the receive buffers: one datagram per
row, read with one call. Where libc has no recvmmsg, ``recv_into`` per row.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket

import numpy as np

MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_Iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _Msghdr), ("msg_len", ctypes.c_uint)]


def _libc_recvmmsg():
    try:
        fn = ctypes.CDLL(None, use_errno=True).recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Mmsghdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_recvmmsg = _libc_recvmmsg()


class BatchReceiver:
    """Reads datagrams of exactly ``rows.itemsize`` bytes into ``rows`` (a 1-D
    numpy array, kept alive by this object); anything else is skipped."""

    def __init__(self, sock: socket.socket, rows: np.ndarray):
        if rows.ndim != 1 or not rows.flags.c_contiguous:
            raise ValueError("rows: a contiguous 1-D array, one datagram per row")
        self.sock, self.rows, self.size = sock, rows, rows.itemsize
        n = len(rows)
        self._msgs = (_Mmsghdr * n)()
        self._iov = (_Iovec * n)()
        base = rows.ctypes.data
        for i in range(n):
            self._iov[i].iov_base = base + i * self.size
            self._iov[i].iov_len = self.size
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
        # msg_len and msg_flags of every entry, as strided numpy views
        raw = np.frombuffer(self._msgs, dtype=np.uint8).reshape(n, ctypes.sizeof(_Mmsghdr))
        self._lens = raw[:, _Mmsghdr.msg_len.offset:][:, :4].view(np.uint32)[:, 0]
        flags_at = _Mmsghdr.msg_hdr.offset + _Msghdr.msg_flags.offset
        self._flags = raw[:, flags_at:][:, :4].view(np.int32)[:, 0]
        self._mv = memoryview(rows).cast("B")

    def receive(self) -> int:
        """Datagrams waiting now, up to len(rows): returns how many good ones
        fill rows[:count]."""
        if _recvmmsg is None:
            return self._one_by_one()
        got = _recvmmsg(self.sock.fileno(), self._msgs, len(self.rows), MSG_DONTWAIT, None)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            raise OSError(err, os.strerror(err))
        good = (self._lens[:got] == self.size) & ((self._flags[:got] & MSG_TRUNC) == 0)
        if good.all():
            return got
        keep = np.flatnonzero(good)
        self.rows[: keep.size] = self.rows[keep]
        return int(keep.size)

    def _one_by_one(self) -> int:
        size, i = self.size, 0
        while i < len(self.rows):
            try:
                nbytes = self.sock.recv_into(self._mv[i * size:(i + 1) * size], size, socket.MSG_TRUNC)
            except BlockingIOError:
                break
            if nbytes == size:
                i += 1
        return i

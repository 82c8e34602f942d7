"""BPF_PROG_TEST_RUN: feed a crafted frame to a loaded program, no network.

Used by the packet-level tests, ``xaggd check`` and the benchmark. A raw
bpf(2) call through ctypes: bcc 0.26 has no wrapper and this avoids a
dependency on a particular libbpf soname.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

_SYS_bpf = 321          # x86_64
_BPF_PROG_TEST_RUN = 10

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
XDP_ACTIONS = {0: "ABORTED", 1: "DROP", 2: "PASS", 3: "TX", 4: "REDIRECT"}


class _TestAttr(ctypes.Structure):
    # union bpf_attr, the anonymous `test` member (include/uapi/linux/bpf.h)
    _fields_ = [
        ("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


@dataclass
class RunResult:
    action: int         # XDP_* verdict
    data: bytes         # the frame as the program left it
    duration_ns: int    # kernel-measured mean time per repetition

    @property
    def action_name(self) -> str:
        return XDP_ACTIONS.get(self.action, str(self.action))


def prog_test_run(prog_fd: int, frame: bytes, repeat: int = 1, out_size: int = 4096) -> RunResult:
    """Run ``prog_fd`` once (or ``repeat`` times) on ``frame``."""
    inbuf = ctypes.create_string_buffer(bytes(frame), len(frame))
    outbuf = ctypes.create_string_buffer(out_size)
    attr = _TestAttr(prog_fd=prog_fd, data_size_in=len(frame), data_size_out=out_size,
                     data_in=ctypes.addressof(inbuf), data_out=ctypes.addressof(outbuf),
                     repeat=repeat)
    rc = _libc.syscall(_SYS_bpf, _BPF_PROG_TEST_RUN, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_PROG_TEST_RUN failed: {os.strerror(err)}")
    return RunResult(attr.retval, outbuf.raw[:attr.data_size_out], attr.duration)

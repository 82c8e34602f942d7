"""A two-instruction XDP program that passes every frame.

A veth only accepts frames its peer sends with XDP_TX when the receiving
end runs NAPI, which in practice means an XDP program is attached to it;
the lab puts this one on the switch side of aggregator links. Loaded with
a raw bpf(2) call, so it needs neither bcc nor kernel headers.
"""
from __future__ import annotations

import ctypes
import os
import struct

from .testrun import _SYS_bpf, _libc

_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_XDP = 6
XDP_PASS = 2


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * 16),
                ("_rest", ctypes.c_uint8 * 64)]


def load_xdp_pass() -> int:
    """fd of a loaded `return XDP_PASS` program (caller closes it)."""
    # r0 = XDP_PASS (BPF_ALU64|BPF_MOV|BPF_K = 0xb7); exit (0x95)
    insns = struct.pack("<BBhi", 0xB7, 0, 0, XDP_PASS) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    ibuf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(prog_type=_BPF_PROG_TYPE_XDP, insn_cnt=2, insns=ctypes.addressof(ibuf),
                         license=ctypes.addressof(lic), prog_name=b"xagg_pass")
    fd = _libc.syscall(_SYS_bpf, _BPF_PROG_LOAD, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"loading the XDP pass program failed: {os.strerror(err)}")
    return fd


def attach_pass(ifname: str, netns: str | None = None) -> None:
    """Attach the pass program to ``ifname`` (a veth peer of an aggregator)
    unless some XDP program is already there."""
    from .loader import XDP_FLAGS_DRV_MODE, _iproute, _set_xdp, xdp_attached
    if xdp_attached(ifname, netns):
        return
    fd = load_xdp_pass()
    try:
        with _iproute(netns) as ipr:
            _set_xdp(ipr, ipr.link_lookup(ifname=ifname)[0], fd, XDP_FLAGS_DRV_MODE)
    finally:
        os.close(fd)       # the attachment holds its own reference

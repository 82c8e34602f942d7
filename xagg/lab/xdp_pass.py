"""A two-instruction XDP program that passes every frame.

A veth only accepts frames its peer sends with XDP_TX when the receiving
end runs NAPI, which in practice means an XDP program is attached to it;
the lab puts this one on the switch side of aggregator links. Loaded from
raw instructions, so it needs neither bcc nor kernel headers. It declares
multi-buffer support (it reads nothing), so jumbo-MTU links take it too.
"""
from __future__ import annotations

import os
import struct

from xaggd.dataplane.attach import XDP_FLAGS_DRV_MODE, ifindex, iproute, set_xdp, xdp_attached
from xagg.wire.syscalls import BPF_F_XDP_HAS_FRAGS, BPF_PROG_TYPE_XDP, BPF_XDP, XDP_PASS, prog_load

# r0 = XDP_PASS (BPF_ALU64|BPF_MOV|BPF_K = 0xb7); exit (0x95)
PASS_INSNS = struct.pack("<BBhi", 0xB7, 0, 0, XDP_PASS) + struct.pack("<BBhi", 0x95, 0, 0, 0)


def attach_pass(ifname: str, netns: str | None = None) -> None:
    """Attach the pass program to ``ifname`` (a veth peer of an aggregator)
    unless some XDP program is already there."""
    if xdp_attached(ifname, netns):
        return
    try:
        fd = prog_load(BPF_PROG_TYPE_XDP, PASS_INSNS, "xagg_pass", prog_flags=BPF_F_XDP_HAS_FRAGS,
                       expected_attach_type=BPF_XDP)
    except OSError:         # a kernel before 5.18: linear frames only
        fd = prog_load(BPF_PROG_TYPE_XDP, PASS_INSNS, "xagg_pass")
    try:
        with iproute(netns) as ipr:
            set_xdp(ipr, ifindex(ipr, ifname, netns), fd, XDP_FLAGS_DRV_MODE)
    finally:
        os.close(fd)       # the attachment holds its own reference

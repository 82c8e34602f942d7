"""Attaching the data plane to an interface, with pyroute2 (netlink).

XDP in driver mode where the driver has it (generic mode otherwise, with a
warning), and the tc ingress program that unicasts results. Only what xagg
attached is removed: other tools' tc filters stay, and another XDP program
is reported, not replaced, unless the caller asks (backends.XdpBackend).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from xaggd.dataplane import LoaderError
from xaggd.dataplane.syscalls import prog_name

log = logging.getLogger("xaggd.dataplane")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
TC_INGRESS_PARENT = "ffff:fff2"
TC_PRIO = 0x4147       # our filter's priority: what detach removes, and nothing else
XAGG_PROG_NAME = "xagg_xdp"          # the XDP function's name, as the kernel keeps it


@dataclass
class Attachment:
    ifname: str
    netns: str | None
    ifindex: int
    mode: str            # "driver" or "generic"
    tc: bool

    def detach(self) -> None:
        detach(self.ifname, self.netns)


def iproute(netns: str | None = None):
    """A netlink socket in ``netns`` (None: this process's namespace); use with ``with``."""
    from pyroute2 import IPRoute, NetNS
    return NetNS(netns) if netns else IPRoute()


def ifindex(ipr, ifname: str, netns: str | None = None) -> int:
    """The index of ``ifname``, or LoaderError that says where it was looked for."""
    idx = ipr.link_lookup(ifname=ifname)
    if not idx:
        where = f" in netns {netns}" if netns else ""
        raise LoaderError(f"interface {ifname!r} not found{where} (see `ip link`)")
    return idx[0]


def set_xdp(ipr, idx: int, fd: int, flags: int) -> None:
    """Attach XDP program ``fd`` (-1: detach) to interface ``idx`` with ``flags``."""
    ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]})


def attach(ifname: str, xdp_fd: int, tc_fd: int | None = None, *, netns: str | None = None,
           mode: str = "auto") -> Attachment:
    """Attach XDP program ``xdp_fd`` in driver mode, falling back to generic
    mode with a warning, and tc program ``tc_fd`` (the unicast fan-out) on
    ingress when given. A program left attached by a crashed run is
    replaced, not stacked.
    """
    if mode not in ("auto", "driver", "generic"):
        raise LoaderError(f"attach mode must be auto, driver or generic, got {mode!r}")
    with iproute(netns) as ipr:
        idx = ifindex(ipr, ifname, netns)
        used = None
        errors = []
        for m, flag in (("driver", XDP_FLAGS_DRV_MODE), ("generic", XDP_FLAGS_SKB_MODE)):
            if mode not in ("auto", m):
                continue
            try:
                _clear_xdp(ipr, idx)
                set_xdp(ipr, idx, xdp_fd, flag)
                used = m
                break
            except Exception as e:  # NetlinkError
                errors.append(f"{m}: {e}")
        if used is None:
            raise LoaderError(f"could not attach XDP to {ifname}: {'; '.join(errors)}")
        if used == "generic" and mode == "auto":
            log.warning("%s: driver-mode XDP refused (%s); running in generic mode, which is "
                        "slower", ifname, errors[0] if errors else "?")
        if tc_fd is not None:
            try:
                _attach_tc(ipr, idx, tc_fd)
            except Exception as e:
                _clear_xdp(ipr, idx)
                raise LoaderError(f"could not attach the tc fan-out program to {ifname}: {e}") from None
    log.info("attached xagg to %s%s (%s mode%s)", ifname, f" in netns {netns}" if netns else "",
             used, ", tc unicast fan-out" if tc_fd is not None else "")
    return Attachment(ifname, netns, idx, used, tc_fd is not None)


def _clear_xdp(ipr, idx: int) -> None:
    for flag in (XDP_FLAGS_DRV_MODE, XDP_FLAGS_SKB_MODE):
        try:
            set_xdp(ipr, idx, -1, flag)
        except Exception:
            pass


def _del_tc_filter(ipr, idx: int) -> None:
    try:
        ipr.tc("del-filter", "bpf", idx, ":1", parent=TC_INGRESS_PARENT, prio=TC_PRIO)
    except Exception:
        pass            # not there


def _attach_tc(ipr, idx: int, fd: int) -> None:
    """Our filter on the ingress hook; other tools' tc filters stay."""
    try:
        ipr.tc("add", "clsact", idx)
    except Exception:
        pass            # clsact already there (ours from a crash, or someone else's)
    _del_tc_filter(ipr, idx)
    ipr.tc("add-filter", "bpf", idx, ":1", fd=fd, name="xagg_tc_fanout",
           parent=TC_INGRESS_PARENT, classid=1, direct_action=True, prio=TC_PRIO)


def detach(ifname: str, netns: str | None = None) -> None:
    """Remove xagg's XDP and tc programs from ``ifname`` (idempotent)."""
    try:
        with iproute(netns) as ipr:
            idx = ipr.link_lookup(ifname=ifname)
            if not idx:
                return
            _clear_xdp(ipr, idx[0])
            _del_tc_filter(ipr, idx[0])
    except Exception as e:
        log.warning("detach %s: %s", ifname, e)
    log.info("detached xagg from %s", ifname)


def xdp_program(ifname: str, netns: str | None = None) -> dict | None:
    """The XDP program attached to ``ifname``: {"id", "name", "mode"}, or None."""
    with iproute(netns) as ipr:
        idx = ifindex(ipr, ifname, netns)
        xdp = ipr.get_links(idx)[0].get_attr("IFLA_XDP")
    if not xdp or not xdp.get_attr("IFLA_XDP_ATTACHED"):
        return None
    pid = (xdp.get_attr("IFLA_XDP_PROG_ID") or xdp.get_attr("IFLA_XDP_DRV_PROG_ID")
           or xdp.get_attr("IFLA_XDP_SKB_PROG_ID") or 0)
    return {"id": pid, "name": prog_name(pid) if pid else None,
            "mode": xdp.get_attr("IFLA_XDP_ATTACHED")}


def xdp_attached(ifname: str, netns: str | None = None) -> str | None:
    """How an XDP program is attached to ``ifname`` (its IFLA_XDP_ATTACHED mode), or None."""
    prog = xdp_program(ifname, netns)
    return prog["mode"] if prog else None


def link_mtu(ifname: str, netns: str | None = None) -> int:
    """The MTU of ``ifname``: what bounds the values per packet (one frame each)."""
    with iproute(netns) as ipr:
        return int(ipr.get_links(ifindex(ipr, ifname, netns))[0].get_attr("IFLA_MTU"))


def is_xagg(prog: dict | None) -> bool:
    """Whether ``xdp_program()``'s answer is xagg's program."""
    return bool(prog) and prog.get("name") == XAGG_PROG_NAME

"""Attaching the data plane to an interface, with pyroute2 (netlink).

XDP in driver mode where the driver has it (generic mode otherwise, with a
warning), and the tc ingress program that unicasts results. Only what xagg
attached is removed: other tools' tc filters stay, and another XDP program
is reported, not replaced, unless the caller asks (backends.XdpBackend).

A daemon removes only the programs it attached itself, by program id: the
XDP one with the kernel's compare-and-swap (IFLA_XDP_EXPECTED_FD), the tc
filter after checking its id. ``problems()`` tells a daemon whether its
programs are still the ones attached; ``holders()`` whether a program on
an interface belongs to a live process (a running daemon) or was left
behind by a dead one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from xaggd.dataplane import LoaderError
from xagg.wire.syscalls import prog_fd_by_id, prog_id, prog_name

log = logging.getLogger("xaggd.dataplane")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
XDP_FLAGS_REPLACE = 1 << 4     # with IFLA_XDP_EXPECTED_FD: only if that program is attached
TC_INGRESS_PARENT = "ffff:fff2"
TC_PRIO = 0x4147       # our filter's priority: what detach removes, and nothing else
XAGG_PROG_NAME = "xagg_xdp"          # the XDP function's name, as the kernel keeps it
MODE_FLAGS = {"driver": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}


@dataclass
class Attachment:
    ifname: str
    netns: str | None
    ifindex: int
    mode: str            # "driver" or "generic"
    tc: bool
    xdp_id: int = 0      # the ids of what we attached: what detach removes, and nothing else
    tc_id: int = 0
    xdp_fd: int = -1     # ours, for the kernel's compare-and-swap on detach

    def detach(self) -> None:
        detach(self.ifname, self.netns, xdp_id=self.xdp_id, tc_id=self.tc_id if self.tc else None,
               xdp_fd=self.xdp_fd, mode=self.mode)

    def problems(self) -> str | None:
        """None while our XDP program and tc filter are the ones attached;
        else what changed (another program replaced ours, the filter went)."""
        where = self.ifname + (f" in netns {self.netns}" if self.netns else "")
        prog = xdp_program(self.ifname, self.netns)
        if prog is None or prog["id"] != self.xdp_id:
            now = (f"replaced by prog id {prog['id']} ({prog['name']!r}{holders_text(prog['id'])})"
                   if prog else "detached")
            return (f"our XDP program (prog id {self.xdp_id}) on {where} was {now}: this daemon's jobs "
                    "get no packets; stop whoever took the interface, then restart this xaggd")
        if self.tc and shutil.which("tc"):       # iproute2's tc reads the filter's program id
            tc = tc_program(self.ifname, self.netns)
            if tc is None or tc["id"] != self.tc_id:
                now = f"replaced by prog id {tc['id']}" if tc else "removed"
                return (f"our tc fan-out filter (prog id {self.tc_id}, ingress pref {TC_PRIO}) on {where} "
                        f"was {now}: unicast results are not sent; restart this xaggd")
        return None


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
            if not _has_queue(ipr, idx):
                log.warning("%s has no qdisc (noqueue): the unicast fan-out's result copies go straight "
                            "to the driver, and a virtual one (veth) drops what its peer cannot take at "
                            "once, each loss a resend; give it one (tc qdisc add dev %s root pfifo_fast) "
                            "or use bcast fan-out", ifname, ifname)
    log.info("attached xagg to %s%s (%s mode%s)", ifname, f" in netns {netns}" if netns else "",
             used, ", tc unicast fan-out" if tc_fd is not None else "")
    return Attachment(ifname, netns, idx, used, tc_fd is not None, xdp_id=prog_id(xdp_fd),
                      tc_id=prog_id(tc_fd) if tc_fd is not None else 0, xdp_fd=xdp_fd)


def has_queue(ifname: str, netns: str | None = None) -> bool:
    """Whether ``ifname`` has a root qdisc that queues (not noqueue, a
    veth's default)."""
    with iproute(netns) as ipr:
        return _has_queue(ipr, ifindex(ipr, ifname, netns))


def _has_queue(ipr, idx: int) -> bool:
    # the tc fan-out clones each result once per worker in one burst: with a
    # queue, a device that cannot take them all (a veth whose peer's ring is
    # full) holds the rest back; without one it drops them
    return any(q["parent"] == 0xFFFFFFFF and q.get_attr("TCA_KIND") != "noqueue"
               for q in ipr.get_qdiscs(index=idx))


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


def detach(ifname: str, netns: str | None = None, *, xdp_id: int | None = None, tc_id: int | None = None,
           xdp_fd: int = -1, mode: str | None = None) -> None:
    """Remove xagg's XDP and tc programs from ``ifname`` (idempotent).

    With ``xdp_id`` only that XDP program is removed (atomically, with its
    fd ``xdp_fd`` or one got from the id); with ``tc_id`` only a filter
    running that program. Another program found in their place is logged
    and left attached. Without ids, whatever is there is removed (``xaggd
    cleanup --force``)."""
    where = ifname + (f" in netns {netns}" if netns else "")
    removed = False
    try:
        with iproute(netns) as ipr:
            idx = ipr.link_lookup(ifname=ifname)
            if not idx:
                return
            if xdp_id is None:
                _clear_xdp(ipr, idx[0])
                removed = True
            else:
                removed = _clear_xdp_if(ipr, idx[0], xdp_id, xdp_fd, mode, where)
            if tc_id is None:
                _del_tc_filter(ipr, idx[0])
            else:
                tc = tc_program(ifname, netns) if shutil.which("tc") else {"id": tc_id}
                if tc is not None and tc["id"] == tc_id:
                    _del_tc_filter(ipr, idx[0])
                elif tc is not None:
                    log.warning("%s: the tc filter at pref %d is not ours (prog id %s): left attached "
                                "(ours was prog id %s)", where, TC_PRIO, tc["id"], tc_id)
    except Exception as e:
        log.warning("detach %s: %s", ifname, e)
    if removed:
        log.info("detached xagg from %s", ifname)


def _clear_xdp_if(ipr, idx: int, xdp_id: int, fd: int, mode: str | None, where: str) -> bool:
    """Detach XDP program ``xdp_id`` and nothing else: the kernel refuses
    (EEXIST) when another program is attached by the time it acts. Whether
    it was detached."""
    now = xdp_program_at(ipr, idx)
    if now is None:
        return False
    if now["id"] != xdp_id:
        log.warning("%s: the XDP program attached is not ours (prog id %s): left attached "
                    "(ours was prog id %s)", where, now["id"], xdp_id)
        return False
    own = fd < 0
    if own:
        fd = prog_fd_by_id(xdp_id)
    try:
        flags = [MODE_FLAGS[mode]] if mode in MODE_FLAGS else list(MODE_FLAGS.values())
        for flag in flags:
            try:
                ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", -1), ("IFLA_XDP_EXPECTED_FD", fd),
                                                          ("IFLA_XDP_FLAGS", flag | XDP_FLAGS_REPLACE)]})
                return True
            except Exception as e:  # NetlinkError: EEXIST (replaced meanwhile) or the other mode
                err = e
        log.warning("%s: XDP program %s not detached: %s", where, xdp_id, err)
        return False
    finally:
        if own:
            os.close(fd)


def tc_program(ifname: str, netns: str | None = None) -> dict | None:
    """The program of the tc ingress filter at xagg's pref on ``ifname``:
    {"id", "name"}, or None. (iproute2's ``tc -j``: pyroute2 does not decode
    TCA_BPF_ID.)"""
    cmd = ["tc"] + (["-n", netns] if netns else []) + ["-j", "filter", "show", "dev", ifname, "ingress"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LoaderError(f"`{' '.join(cmd)}` failed: {e} (tc is in iproute2)") from None
    if r.returncode != 0:
        raise LoaderError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
    for f in json.loads(r.stdout or "[]"):
        prog = (f.get("options") or {}).get("prog")
        if f.get("pref") == TC_PRIO and f.get("kind") == "bpf" and prog:
            return {"id": prog.get("id"), "name": prog.get("name")}
    return None


def holders(prog_id_: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process holding an fd to BPF program
    ``prog_id_``: a running daemon holds its program; one a killed daemon
    left attached is held by nobody."""
    out = []
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") != "anon_inode:bpf-prog":
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    held = any(line.split() == ["prog_id:", str(prog_id_)] for line in f)
            except OSError:
                continue
            if held and int(pid) != me:
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    comm = "?"
                out.append((int(pid), comm))
                break
    return out


def holders_text(prog_id_: int) -> str:
    """", in use by pid N (comm)" for messages, or ""."""
    try:
        hs = holders(prog_id_)
    except OSError:
        return ""
    return (", in use by " + ", ".join(f"pid {p} ({c})" for p, c in hs)) if hs else ""


def xdp_program(ifname: str, netns: str | None = None) -> dict | None:
    """The XDP program attached to ``ifname``: {"id", "name", "mode"}, or None."""
    with iproute(netns) as ipr:
        return xdp_program_at(ipr, ifindex(ipr, ifname, netns))


def xdp_program_at(ipr, idx: int) -> dict | None:
    """xdp_program() of interface ``idx`` through the netlink socket ``ipr``."""
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


def rx_queues(ifname: str, netns: str | None = None) -> int:
    """The receive queues ``ifname`` has in use (the kernel's
    real_num_rx_queues: sysfs lists rx-0, rx-1, ... for each), which may be
    fewer than it allocated (a veth gets one per CPU, uses one unless told;
    `ethtool -L` cuts a NIC's). sysfs shows the namespace it was mounted
    in, so another namespace's is read through `ip netns exec`. Where that
    fails, the allocated count (IFLA_NUM_RX_QUEUES): an upper bound."""
    path = f"/sys/class/net/{ifname}/queues"
    try:
        if netns is None:
            names = os.listdir(path)
        else:
            names = subprocess.run(["ip", "netns", "exec", netns, "ls", path], check=True, timeout=10,
                                   capture_output=True, text=True).stdout.split()
        n = sum(1 for x in names if x.startswith("rx-"))
        if n:
            return n
    except (OSError, subprocess.SubprocessError):
        pass
    with iproute(netns) as ipr:
        return int(ipr.get_links(ifindex(ipr, ifname, netns))[0].get_attr("IFLA_NUM_RX_QUEUES") or 0)


def is_xagg(prog: dict | None) -> bool:
    """Whether ``xdp_program()``'s answer is xagg's program."""
    return bool(prog) and prog.get("name") == XAGG_PROG_NAME


def next_hop_mac(ip: str, netns: str | None = None, timeout: float = 1.0) -> str | None:
    """The MAC of the next hop towards ``ip`` from ``netns`` (the gateway's
    when routed), from the neighbour table; one UDP datagram to port 9
    (discard) makes the kernel resolve it first when it is not known. None
    when it cannot be resolved within ``timeout`` seconds. XDP sends a child
    aggregator's partials to this MAC; the parent's results refresh it."""
    import socket
    import time
    with iproute(netns) as ipr:
        routes = ipr.route("get", dst=ip)
        if not routes:
            return None
        hop = routes[0].get_attr("RTA_GATEWAY") or ip
        deadline = time.monotonic() + timeout
        probed = False
        while True:
            for n in ipr.get_neighbours(family=socket.AF_INET, dst=hop):
                mac = n.get_attr("NDA_LLADDR")
                if mac and n["state"] not in (0x20, 0x01):      # NUD_FAILED, NUD_INCOMPLETE
                    return mac
            if time.monotonic() > deadline:
                return None
            if not probed:
                _probe(hop, netns)
                probed = True
            time.sleep(0.02)


def _probe(ip: str, netns: str | None) -> None:
    """One empty UDP datagram to ip:9 (discard), sent from ``netns``."""
    import socket
    pushed = False
    try:
        if netns:
            from pyroute2 import netns as nsmod
            nsmod.pushns(netns)
            pushed = True
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"", (ip, 9))
    except OSError as e:
        log.debug("probing %s for its MAC: %s", ip, e)
    finally:
        if pushed:
            from pyroute2 import netns as nsmod
            nsmod.popns()

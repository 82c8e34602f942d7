"""The two data planes behind one interface, ``Backend``.

``XdpBackend`` compiles and attaches bpf/xagg_xdp.c (dataplane/program.py,
dataplane/attach.py); ``UserspaceBackend`` runs the same protocol in Python
(dataplane/userspace.py) where XDP cannot run. The job table (jobs.py), the
control API and the server call only what ``Backend`` declares.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket

from xagg.wire.jobspec import JobSpec
from xagg.wire.proto import C
from xaggd.settings import format_size
from xaggd.dataplane import LoaderError
from xaggd.dataplane.attach import attach, holders, iproute, is_xagg, link_mtu, rx_queues, xdp_program
from xaggd.dataplane.program import ProgramConfig, XaggProgram, preflight
from xaggd.dataplane.userspace import UserspaceAggregator, UserspaceServer

log = logging.getLogger("xaggd")


class Backend:
    """What the daemon needs of a data plane. The first group every data
    plane implements; the capabilities after it have defaults that describe
    a data plane that hears every packet sent to this host (loopback
    included) and answers workers with plain datagrams, as the userspace
    one does, so a data plane overrides only where it differs."""
    kind = "?"                  # "xdp", "userspace": what status and metrics report

    def start(self) -> None:
        """Load and attach (or bind); raises what stops it, with what to do."""
        raise NotImplementedError

    def close(self) -> None:
        """Detach; safe to call twice and after a failed start."""
        raise NotImplementedError

    def set_job(self, spec: JobSpec, *, slot_base: int, job_index: int) -> None:
        """Install or replace a job's entry: its main one, or (``spec.is_child``)
        its child entry for aggregator ``spec.agg_id``'s chunks."""
        raise NotImplementedError

    def remove_job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> None:
        """A job's main entry, or its child entry for ``agg``'s chunks."""
        raise NotImplementedError

    def counters(self) -> dict:
        """{verdict: packets} since start."""
        raise NotImplementedError

    def job_stats(self, job_id: int, job_index: int, agg: int = C.XAGG_AGG_MAIN) -> dict:
        """{aggregated, completed, retransmits, dropped} of one job entry."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What `xaggd status` shows of the data plane: backend, mode, port, ..."""
        raise NotImplementedError

    # -- capabilities, with the defaults of a data plane that needs none ----------
    def health(self) -> str | None:
        """A problem worth logging and refusing new jobs for, or None."""
        return None

    def unicast_problem(self) -> str | None:
        """Why unicast fan-out cannot work here, or None."""
        return None

    def own_addresses(self) -> set:
        """Addresses of this host whose packets never reach the data plane."""
        return set()

    def local_worker_problem(self) -> str | None:
        """Why a worker on this host cannot be in a job here, or None."""
        return None

    def next_hop_mac(self, ip: str) -> str | None:
        """The MAC a child aggregator's partial sums for parent ``ip`` go to;
        None when it cannot be resolved. "" : this data plane sends them by
        address through the host's stack, and needs none."""
        return ""

    def dataplane(self, addr: str, port: int, netns: int) -> tuple[dict, list[int]]:
        """(facts, [program fd, slots fd, jobs fd]) for a worker on this host
        that puts its packets through the data plane itself; ValueError where
        it cannot."""
        raise ValueError(f"a {self.kind} xaggd has no program to hand over: a worker on this host "
                         "reaches it over loopback like any other")


def slot_lock(setting: str, queues: int, mode: str) -> tuple[bool, str]:
    """Whether the program takes its per-slot spin lock, and why.

    XDP runs in the NAPI poll of the queue a frame arrived on, and one NAPI
    instance never runs on two CPUs at once: with a single RX queue in driver
    mode no two packets are summed concurrently, and the lock would only cost
    time (an interrupt-disabling lock/unlock pair per packet). Generic mode
    runs XDP wherever the stack receives the skb (any CPU's backlog), so it
    always needs the lock. ``mode`` is the configured attach mode: auto may
    still end in generic, which the caller handles by rebuilding with the
    lock."""
    if setting == "on":
        return True, "on (--lock on)"
    if setting == "off":
        return False, "off (--lock off: safe only with one RX queue in driver mode)"
    if mode == "generic":
        return True, "on (generic mode runs XDP on any CPU)"
    if queues != 1:
        return True, f"on ({queues} RX queues: several CPUs may sum into one slot)"
    return False, "off (one RX queue in driver mode: XDP runs on one CPU at a time)"


class XdpBackend(Backend):
    kind = "xdp"

    def __init__(self, cfg, owner_of=None):
        self.cfg = cfg
        self.owner_of = owner_of or (lambda prog_id: None)   # prog id -> "xaggd NAME (pid N)"
        self.prog = None
        self.attachment = None
        self.prog_id = None
        self.lock_reason = None
        self.queues = None
        self.pps_per_queue = None       # measured at start: the planner's packet capacity input

    def start(self) -> None:
        cfg = self.cfg
        preflight(cfg.netns)
        where = f"{cfg.iface}" + (f" in netns {cfg.netns}" if cfg.netns else "")
        old = xdp_program(cfg.iface, cfg.netns)      # also: the interface exists
        if old is not None:
            owner = None
            if is_xagg(old):        # a live process holds it: a running daemon, in any run dir
                users = holders(old["id"])
                owner = (self.owner_of(old["id"]) or ", ".join(f"pid {p} ({c})" for p, c in users)
                         if users else None)
            if owner:
                raise LoaderError(f"{where} is served by {owner}, which is running; "
                                         "stop it first (`xaggd stop --name NAME`)")
            if is_xagg(old):
                log.warning("replacing a stale xagg program on %s (prog id %s, %s mode): "
                            "left by an xaggd that did not exit cleanly", where, old["id"], old["mode"])
            elif old["name"] is None:       # reading a program by id takes CAP_SYS_ADMIN
                raise LoaderError(
                    f"{where} already runs XDP program id {old['id']}, whose name this process may not "
                    "read (that takes CAP_SYS_ADMIN): if an xaggd was killed there, `sudo xaggd cleanup "
                    f"--iface {cfg.iface}` removes its program (xaggd.service's ExecStopPost does)")
            elif cfg.replace_foreign:
                log.warning("replacing XDP program %r (prog id %s) on %s: replace_foreign is set",
                            old["name"], old["id"], where)
            else:
                raise LoaderError(
                    f"{where} already runs XDP program {old['name']!r} (prog id {old['id']}), "
                    f"which is not xagg's; detach it (`ip link set dev {cfg.iface} xdp off`) "
                    "or start with --replace-foreign")
        queues = rx_queues(cfg.iface, cfg.netns)
        lock, self.lock_reason = slot_lock(cfg.lock, queues, cfg.mode)
        if not lock and cfg.lock == "off" and (queues != 1 or cfg.mode == "generic"):
            log.warning("--lock off on %s with %d RX queues in %s mode: concurrent packets of one chunk "
                        "can lose updates unless every xagg packet reaches one queue (`ethtool -L %s "
                        "combined 1`, or an ntuple rule)", where, queues, cfg.mode, cfg.iface)
        pc = ProgramConfig(vals=cfg.vals, max_workers=cfg.max_workers, max_jobs=cfg.max_jobs,
                           max_slots=cfg.max_slots, port=cfg.port, mtu=link_mtu(cfg.iface, cfg.netns),
                           lock=lock)
        log.info("compiling the XDP program: %d values/packet, %d jobs x %d workers, %d slots "
                 "(%s), UDP port %d, %s frames, slot lock %s", cfg.vals, cfg.max_jobs, cfg.max_workers,
                 cfg.max_slots, format_size(cfg.max_slots * pc.slot_bytes), cfg.port,
                 "multi-buffer (jumbo)" if pc.multi_buffer else "linear", self.lock_reason)
        try:
            self.prog = XaggProgram(pc)
        except LoaderError as e:
            if not pc.multi_buffer:
                raise
            # an older kernel: a linear build still runs, in generic mode
            # where the driver refuses this MTU (the skb is linearised)
            log.warning("multi-buffer XDP unavailable, falling back to linear frames (%s)", e)
            self.prog = XaggProgram(dataclasses.replace(pc, frags=False))
        self.attachment = self._attach(lock_free_auto=not lock and cfg.lock == "auto")
        self.prog_id = self.attachment.xdp_id
        self.queues = queues
        self.pps_per_queue = self._measure_pps()

    def _measure_pps(self) -> float | None:
        """Packets per second one core sums with the program as built (what
        `xaggd check` prints), measured in BPF_PROG_TEST_RUN on 4 workers'
        traffic before any job is registered; the counters are cleared
        after. None (logged) where it cannot run."""
        from xaggd.dataplane.cost import measure
        cfg = self.cfg
        chunks = min(64, cfg.max_slots // 2)
        try:
            r = measure(self.prog, n_workers=min(4, cfg.max_workers), n_chunks=chunks, rounds=2,
                        job_index=cfg.max_jobs - 1, slot_base=0)
        except Exception as e:  # noqa: BLE001 - a figure for the planner, not a reason to stop
            log.warning("could not measure the program's packet rate: %s", e)
            return None
        finally:
            self.prog.counters_map.clear()
            self.prog.job_stats_map.clear()
        log.info("the program sums %.2f Mpps per core (%.0f ns/packet, %d-value packets)",
                 r["mpps"], r["ns_per_packet"], self.prog.config.vals)
        return r["mpps"] * 1e6

    def _attach(self, lock_free_auto: bool):
        """Attach in the configured mode. A build that left the lock out
        because the interface has one queue is attached in driver mode only:
        where the driver refuses, the program is rebuilt with the lock and
        attached as usual (generic mode runs XDP on any CPU)."""
        cfg = self.cfg
        if not lock_free_auto:
            return attach(cfg.iface, self.prog.xdp_fn.fd, self.prog.tc_fn.fd, netns=cfg.netns, mode=cfg.mode)
        try:
            return attach(cfg.iface, self.prog.xdp_fn.fd, self.prog.tc_fn.fd, netns=cfg.netns, mode="driver")
        except LoaderError as e:
            if cfg.mode == "driver":
                raise
            log.info("driver mode refused (%s): rebuilding with the slot lock for generic mode", e)
        pc = dataclasses.replace(self.prog.config, lock=True)
        self.prog.close()
        self.prog = XaggProgram(pc)
        self.lock_reason = slot_lock(cfg.lock, 1, "generic")[1]
        return attach(cfg.iface, self.prog.xdp_fn.fd, self.prog.tc_fn.fd, netns=cfg.netns, mode=cfg.mode)

    def close(self) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None
        if self.prog is not None:
            try:
                self.prog.close()
            except Exception:  # noqa: BLE001 - best effort while exiting
                pass
            self.prog = None

    def set_job(self, spec: JobSpec, *, slot_base: int, job_index: int) -> None:
        self.prog.set_job(spec, slot_base=slot_base, job_index=job_index)

    def remove_job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> None:
        self.prog.remove_job(job_id, agg)

    def next_hop_mac(self, ip: str) -> str | None:
        """Where XDP sends a child aggregator's partials for parent ``ip``."""
        from xaggd.dataplane.attach import next_hop_mac
        return next_hop_mac(ip, self.cfg.netns) or None

    def counters(self) -> dict:
        return self.prog.counters()

    def job_stats(self, job_id: int, job_index: int, agg: int = C.XAGG_AGG_MAIN) -> dict:
        return self.prog.job_stats(job_index)

    def own_addresses(self) -> set:
        """The IPv4 addresses of this host (in the interface's namespace): a
        worker there reaches us over loopback, where XDP never sees a packet."""
        with iproute(self.cfg.netns) as ipr:
            return {a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
                    for a in ipr.get_addr(family=socket.AF_INET)}

    def local_worker_problem(self) -> str | None:
        """Why a worker on this host cannot be in a job here, or None. Its
        packets reach the program through BPF_PROG_TEST_RUN (client/local.py)
        on the worker's CPU, while the NIC's packets are summed on another:
        only the slot lock keeps the two from losing an update."""
        if self.prog is not None and self.prog.config.lock:
            return None
        return (f"the slot lock is off on {self.cfg.iface} ({self.lock_reason}); a worker on this host "
                "sums through the program from its own CPU: restart xaggd with --lock on")

    def dataplane(self, addr: str, port: int, netns: int) -> tuple[dict, list[int]]:
        """What a worker on this host needs to go through the program without
        the network: (facts about the interface, [program fd, slots fd, jobs
        fd]). ValueError when ``addr``:``port`` is not served here, or the
        worker (in network namespace inode ``netns``) is not beside the
        interface: its index and address mean something else there."""
        cfg = self.cfg
        ours = os.stat(f"/run/netns/{cfg.netns}" if cfg.netns else "/proc/self/ns/net").st_ino
        if netns != ours:
            raise ValueError(f"netns: the worker is not in {cfg.iface}'s network namespace")
        if port != cfg.port:
            raise ValueError(f"port: this xaggd serves UDP port {cfg.port}, not {port}")
        with iproute(cfg.netns) as ipr:
            idx = ipr.link_lookup(ifname=cfg.iface)[0]
            mine = {a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
                    for a in ipr.get_addr(family=socket.AF_INET, index=idx)}
            mac = ipr.get_links(idx)[0].get_attr("IFLA_ADDRESS")
        if addr not in mine:
            raise ValueError(f"addr: {addr} is not an address of {cfg.iface} (it has {', '.join(sorted(mine))})")
        problem = self.local_worker_problem()
        if problem:
            raise ValueError(problem)
        p = self.prog
        info = {"iface": cfg.iface, "ifindex": idx, "mac": mac, "vals": p.config.vals, "port": cfg.port,
                "frames": "multi-buffer" if p.config.multi_buffer else "linear"}
        return info, [p.xdp_fn.fd, p.slots.map_fd, p.jobs.map_fd]

    def unicast_problem(self) -> str | None:
        """Why unicast fan-out cannot work on this interface, or None. It hands
        each result to tc in XDP metadata, which some drivers lack in driver
        mode: known from the config, or learnt from the first completion that
        found none (verdict no_meta)."""
        fix = "register the job with fanout bcast, or restart xaggd with --mode generic"
        if not self.cfg.xdp_meta:
            return f"{self.cfg.iface}: xdp_meta is off (its driver has no XDP metadata); {fix}"
        if self.prog is None or self.attachment is None:
            return None
        n = self.prog.counters().get("no_meta", 0)
        if n:
            return (f"{self.cfg.iface}: its driver has no XDP metadata in {self.attachment.mode} mode "
                    f"({n} unicast completions could not reach tc); {fix}")
        return None

    def describe(self) -> dict:
        att = self.attachment
        return {"backend": self.kind, "iface": self.cfg.iface, "netns": self.cfg.netns,
                "mode": att.mode if att else None, "attached": att is not None,
                "frames": ("multi-buffer" if self.prog.config.multi_buffer else "linear") if self.prog else None,
                "slot_lock": self.lock_reason, "rx_queues": self.queues, "pps_per_queue": self.pps_per_queue,
                "port": self.cfg.port, "prog_id": self.prog_id, "unicast_problem": self.unicast_problem()}

    def health(self) -> str | None:
        if self.attachment is None:
            return None
        try:
            return self.attachment.problems()
        except Exception as e:  # noqa: BLE001 - the interface went away
            return f"cannot inspect {self.cfg.iface}: {e}"


class UserspaceBackend(Backend):
    kind = "userspace"

    def __init__(self, cfg):
        self.cfg = cfg
        self.agg = None
        self.server = None

    def start(self) -> None:
        cfg = self.cfg
        self.agg = UserspaceAggregator(vals=cfg.vals, max_workers=cfg.max_workers)
        pushed = False
        try:
            if cfg.netns:
                from pyroute2 import netns
                netns.pushns(cfg.netns)     # the socket lives in that namespace
                pushed = True
            self.server = UserspaceServer(self.agg, cfg.bind, cfg.port)
        except OSError as e:
            raise OSError(e.errno, f"userspace aggregator cannot bind UDP {cfg.bind}:{cfg.port}: "
                                   f"{e.strerror}") from None
        finally:
            if pushed:
                from pyroute2 import netns
                netns.popns()
        self.server.start()
        log.info("userspace aggregator listening on UDP %s:%d%s", cfg.bind, self.server.port,
                 f" in netns {cfg.netns}" if cfg.netns else "")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def set_job(self, spec: JobSpec, *, slot_base: int, job_index: int) -> None:
        self.agg.set_job(spec)

    def remove_job(self, job_id: int, agg: int = C.XAGG_AGG_MAIN) -> None:
        self.agg.remove_job(job_id, agg)

    def counters(self) -> dict:
        return dict(self.agg.counters)

    def job_stats(self, job_id: int, job_index: int, agg: int = C.XAGG_AGG_MAIN) -> dict:
        try:
            return self.agg.job_stats(job_id, agg)
        except KeyError:
            return {"aggregated": 0, "completed": 0, "retransmits": 0, "dropped": 0}

    def describe(self) -> dict:
        return {"backend": self.kind, "iface": self.cfg.iface, "netns": self.cfg.netns,
                "mode": "userspace", "attached": self.server is not None,
                "port": self.server.port if self.server else self.cfg.port, "bind": self.cfg.bind,
                "unicast_problem": None}

    def health(self) -> str | None:
        if self.server is not None and not self.server.running:
            return "the userspace aggregator thread has stopped; restart xaggd"
        return None


def make_backend(cfg, owner_of=None) -> Backend:
    return UserspaceBackend(cfg) if cfg.userspace else XdpBackend(cfg, owner_of)

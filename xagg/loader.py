"""Compile, load and attach the xagg data plane (bcc + pyroute2).

The flow follows bcc's tools: build, load, attach, run, detach in
``finally``. Errors a user can act on are raised as ``LoaderError`` with
the command or cause that fixes them.
"""
from __future__ import annotations

import logging
import os
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

from .job import FANOUTS, JobSpec
from .proto import BPF_DIR, C, VERDICTS

log = logging.getLogger("xagg.loader")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
TC_INGRESS_PARENT = "ffff:fff2"


class LoaderError(RuntimeError):
    """Something stops the data plane from loading; the message says what to do."""


@dataclass(frozen=True)
class ProgramConfig:
    """Compile-time specialisation (bcc -D flags)."""
    vals: int = C.XAGG_VALS
    max_workers: int = C.XAGG_MAX_WORKERS
    max_jobs: int = C.XAGG_MAX_JOBS
    max_slots: int = C.XAGG_MAX_SLOTS
    port: int = C.XAGG_PORT
    lock: bool = True
    mtu: int = 1500           # of the aggregator's link: bounds vals (one frame per packet)

    def validate(self) -> "ProgramConfig":
        from .proto import MAX_VALS_FOR_MTU
        checks = [
            (1 <= self.vals <= MAX_VALS_FOR_MTU(self.mtu), "vals",
             f"1..{MAX_VALS_FOR_MTU(self.mtu)} (what fits a {self.mtu}-byte MTU)"),
            (1 <= self.max_workers <= 64, "max_workers", "1..64 (worker bitmap is 64 bits)"),
            (1 <= self.max_jobs <= 4096, "max_jobs", "1..4096"),
            (2 <= self.max_slots <= 1 << 26, "max_slots", "2..67108864"),
            (0 < self.port < 65536, "port", "a UDP port"),
        ]
        for ok, name, rng in checks:
            if not ok:
                raise LoaderError(f"program.{name}={getattr(self, name)!r}: must be {rng}")
        return self

    def cflags(self) -> list[str]:
        return [f"-I{BPF_DIR}", f"-DXAGG_VALS={self.vals}", f"-DXAGG_MAX_WORKERS={self.max_workers}",
                f"-DXAGG_MAX_JOBS={self.max_jobs}", f"-DXAGG_MAX_SLOTS={self.max_slots}",
                f"-DXAGG_PORT={self.port}", f"-DXAGG_LOCK={int(self.lock)}",
                "-Wno-unused-value", "-Wno-pointer-sign", "-Wno-compare-distinct-pointer-types"]

    @property
    def slot_bytes(self) -> int:
        from .proto import slot_bytes
        return slot_bytes(self.vals)


def _import_bcc():
    try:
        from bcc import BPF  # noqa: WPS433 (optional dependency)
        return BPF
    except ImportError as e:
        raise LoaderError(
            "bcc is not importable: install Debian's python3-bpfcc and run `make setup` "
            f"(it links bcc into the venv). ({e})") from None


def preflight() -> None:
    """Raise LoaderError for the things that stop any XDP program loading."""
    if os.geteuid() != 0:
        raise LoaderError("XDP needs root (CAP_BPF + CAP_NET_ADMIN): run with sudo, "
                          "or use the userspace aggregator (`xaggd start --userspace`).")
    _import_bcc()
    kdir = f"/lib/modules/{os.uname().release}"
    if not os.path.exists(f"{kdir}/build/include"):
        raise LoaderError(f"kernel headers missing: {kdir}/build does not exist. "
                          "Run `make setup` (installs linux-headers-amd64 and links it there).")


def _ip_to_be32(ip: str) -> int:
    """An IPv4 address as the u32 the kernel stores (network byte order)."""
    return int.from_bytes(socket.inet_aton(ip), "little") if ip else 0


class XaggProgram:
    """The compiled data plane and its maps. One per aggregator interface."""

    def __init__(self, config: ProgramConfig = ProgramConfig()):
        self.config = config.validate()
        preflight()
        BPF = _import_bcc()
        self._BPF = BPF
        src = (BPF_DIR / "xagg_xdp.c").read_bytes()
        try:
            self.bpf = BPF(text=src, cflags=self.config.cflags())
        except Exception as e:  # bcc raises bare Exception on compile errors
            raise LoaderError(f"compiling bpf/xagg_xdp.c failed: {e}") from None
        self.xdp_fn = self._load("xagg_xdp", BPF.XDP)
        self.tc_fn = self._load("xagg_tc_fanout", BPF.SCHED_CLS)
        self.jobs = self.bpf[b"jobs"]
        self.workers = self.bpf[b"workers"]
        self.slots = self.bpf[b"slots"]
        self.counters_map = self.bpf[b"counters"]
        self.job_stats_map = self.bpf[b"job_stats"]
        self._gen = 0
        self._job_at = {}           # job_index -> job_id installed there

    def _load(self, name: str, kind):
        # bcc writes the verifier log straight to fd 2; keep it so the error
        # can show its tail (the reason) instead of pages of register state
        with tempfile.TemporaryFile() as logf:
            saved = os.dup(2)
            os.dup2(logf.fileno(), 2)
            try:
                return self.bpf.load_func(name.encode(), kind)
            except Exception as e:
                os.dup2(saved, 2)
                logf.seek(0)
                tail = logf.read().decode(errors="replace").strip().splitlines()[-12:]
                raise LoaderError(f"the kernel verifier rejected {name}: {e}\n"
                                  "verifier log (tail):\n  " + "\n  ".join(tail)) from None
            finally:
                os.dup2(saved, 2)
                os.close(saved)

    # -- jobs -------------------------------------------------------------
    def set_job(self, spec: JobSpec, *, slot_base: int, job_index: int) -> None:
        """Install or replace a job. Its slots reset lazily (new generation)."""
        spec.validate(self.config.max_workers)
        if not 0 <= job_index < self.config.max_jobs:
            raise LoaderError(f"job_index {job_index} outside 0..{self.config.max_jobs - 1}")
        if slot_base + spec.n_slots > self.config.max_slots:
            raise LoaderError(f"job {spec.job_id} needs slots {slot_base}..{slot_base + spec.n_slots} "
                              f"but the program has {self.config.max_slots}")
        old = self._job_at.get(job_index)
        if old is not None and old != spec.job_id:
            self.remove_job(old)
        self._job_at[job_index] = spec.job_id
        for wid in range(self.config.max_workers):
            w = self.workers.Leaf()
            if wid < spec.n_workers:
                w.ip = _ip_to_be32(spec.worker_ip(wid))
            self.workers[self.workers.Key(job_index * self.config.max_workers + wid)] = w
        self._gen = (self._gen + 1) & 0xFFFFFFFF or 1
        j = self.jobs.Leaf()
        j.cookie, j.gen, j.slot_base, j.n_chunks = spec.cookie, self._gen, slot_base, spec.n_chunks
        j.full_mask, j.job_index, j.n_workers = spec.full_mask, job_index, spec.n_workers
        j.bcast_ip = _ip_to_be32(spec.bcast_ip)
        j.result_port = socket.htons(spec.result_port)
        j.fanout = FANOUTS[spec.fanout]
        self.jobs[self.jobs.Key(spec.job_id)] = j
        self.job_stats_map.clearitem(self.job_stats_map.Key(job_index))

    def remove_job(self, job_id: int) -> None:
        self._job_at = {i: j for i, j in self._job_at.items() if j != job_id}
        try:
            del self.jobs[self.jobs.Key(job_id)]
        except KeyError:
            pass

    # -- reading state ----------------------------------------------------
    def job(self, job_id: int) -> dict | None:
        try:
            j = self.jobs[self.jobs.Key(job_id)]
        except KeyError:
            return None
        return {f: getattr(j, f) for f, _ in j._fields_}

    def counters(self) -> dict[str, int]:
        """Per-verdict counters summed over CPUs."""
        return {name: int(self.counters_map.sum(self.counters_map.Key(i)).value)
                for i, name in enumerate(VERDICTS)}

    def job_stats(self, job_index: int) -> dict[str, int]:
        per_cpu = self.job_stats_map[self.job_stats_map.Key(job_index)]
        out = {f: 0 for f, _ in self.job_stats_map.sLeaf._fields_}
        for cpu_val in per_cpu:
            for f in out:
                out[f] += getattr(cpu_val, f)
        return out

    def slot(self, index: int) -> dict:
        s = self.slots[self.slots.Key(index)]
        return {"gen": s.gen, "round": s.round, "done": s.done, "mask": s.mask,
                "vals": list(s.vals)}

    # -- attaching --------------------------------------------------------
    @contextmanager
    def attached(self, ifname: str, netns: str | None = None, mode: str = "auto",
                 unicast: bool = True):
        """Attach XDP (and the tc fan-out) to ``ifname``; always detach."""
        att = attach(self, ifname, netns=netns, mode=mode, unicast=unicast)
        try:
            yield att
        finally:
            att.detach()


@dataclass
class Attachment:
    ifname: str
    netns: str | None
    ifindex: int
    mode: str            # "driver" or "generic"
    tc: bool

    def detach(self) -> None:
        detach(self.ifname, self.netns)


def _iproute(netns):
    from pyroute2 import IPRoute, NetNS
    return NetNS(netns) if netns else IPRoute()


def _ifindex(ipr, ifname: str, netns) -> int:
    idx = ipr.link_lookup(ifname=ifname)
    if not idx:
        where = f" in netns {netns}" if netns else ""
        raise LoaderError(f"interface {ifname!r} not found{where} (see `ip link`)")
    return idx[0]


def _set_xdp(ipr, idx: int, fd: int, flags: int) -> None:
    ipr.link("set", index=idx, xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]})


def attach(prog: XaggProgram, ifname: str, *, netns: str | None = None,
           mode: str = "auto", unicast: bool = True) -> Attachment:
    """Attach in driver mode, falling back to generic mode with a warning.

    A program left attached by a crashed run is replaced, not stacked.
    """
    if mode not in ("auto", "driver", "generic"):
        raise LoaderError(f"attach mode must be auto, driver or generic, got {mode!r}")
    with _iproute(netns) as ipr:
        idx = _ifindex(ipr, ifname, netns)
        used = None
        errors = []
        for m, flag in (("driver", XDP_FLAGS_DRV_MODE), ("generic", XDP_FLAGS_SKB_MODE)):
            if mode not in ("auto", m):
                continue
            try:
                _clear_xdp(ipr, idx)
                _set_xdp(ipr, idx, prog.xdp_fn.fd, flag)
                used = m
                break
            except Exception as e:  # NetlinkError
                errors.append(f"{m}: {e}")
        if used is None:
            raise LoaderError(f"could not attach XDP to {ifname}: {'; '.join(errors)}")
        if used == "generic" and mode == "auto":
            log.warning("%s: driver-mode XDP refused (%s); running in generic mode, which is "
                        "slower", ifname, errors[0] if errors else "?")
        if unicast:
            try:
                _attach_tc(ipr, idx, prog.tc_fn.fd)
            except Exception as e:
                _clear_xdp(ipr, idx)
                raise LoaderError(f"could not attach the tc fan-out program to {ifname}: {e}") from None
    log.info("attached xagg to %s%s (%s mode%s)", ifname, f" in netns {netns}" if netns else "",
             used, ", tc unicast fan-out" if unicast else "")
    return Attachment(ifname, netns, idx, used, unicast)


def _clear_xdp(ipr, idx: int) -> None:
    for flag in (XDP_FLAGS_DRV_MODE, XDP_FLAGS_SKB_MODE):
        try:
            _set_xdp(ipr, idx, -1, flag)
        except Exception:
            pass


TC_PRIO = 0x4147       # our filter's priority: what detach removes, and nothing else


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
        with _iproute(netns) as ipr:
            idx = ipr.link_lookup(ifname=ifname)
            if not idx:
                return
            _clear_xdp(ipr, idx[0])
            _del_tc_filter(ipr, idx[0])
    except Exception as e:
        log.warning("detach %s: %s", ifname, e)
    log.info("detached xagg from %s", ifname)


def xdp_attached(ifname: str, netns: str | None = None) -> str | None:
    """The XDP mode attached to ``ifname`` ('xdp', 'xdpgeneric'), or None."""
    with _iproute(netns) as ipr:
        idx = _ifindex(ipr, ifname, netns)
        link = ipr.get_links(idx)[0]
        xdp = link.get_attr("IFLA_XDP")
        if not xdp:
            return None
        return xdp.get_attr("IFLA_XDP_ATTACHED")
